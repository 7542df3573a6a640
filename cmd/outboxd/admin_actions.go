package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/actiondetail"
)

// actionKinds are the kinds ListOperatorActions records.
var actionKinds = []string{"retry", "skip", "bulk_retry", "bulk_skip", "republish"}

// aggregateActionsShown is how many of an aggregate's actions 'outboxd
// aggregate' prints.
const aggregateActionsShown = 10

func actionsCommand() *cobra.Command {
	var (
		f        adminFlags
		req      = &outboxv1.ListOperatorActionsRequest{}
		since    time.Time
		limit    int
		pageSize int
	)
	cmd := adminCommand("actions", "List operator actions: who did what, when and why", `
actions lists the operator actions on record, newest first: retries (with
or without --accept-gap), skips, bulk retries and skips, and republishes,
each with who acted (the token's name, with --actor in parentheses), when,
the reason, the stream (or a bulk filter's stream pattern), and how many
aggregates and events it changed. With --stream and --key it lists the
actions that changed that aggregate, bulk ones included, and what each did
there (the revisions an accepted gap gave up, the event a skip abandoned,
the revisions a republish delivered again).

A token limited to some streams sees only the actions on its streams (a bulk
action over "*" needs an unlimited token). --since takes an RFC 3339 time or
a duration meaning that long ago (--since 24h). It follows pages until
--limit actions are listed (0: all); with --json, the pages are printed as
one ListOperatorActionsResponse.

Each source database keeps its own record. On a server with several,
actions of a source other than default name it (stream "orders/billing",
and the request as written); without --stream the actions of every source
are listed, source after source in name order, each newest first
(--stream orders/ for one source's). A source that cannot be read is named
on stderr and left out.`, cobra.NoArgs)
	f.register(cmd)
	fl := cmd.Flags()
	fl.StringVar(&req.Stream, "stream", "", "only actions on this stream")
	fl.StringVar(&req.AggregateKey, "key", "", "only actions that changed this aggregate (needs --stream)")
	fl.StringVar(&req.Action, "action", "", "only this kind: retry, skip, bulk_retry, bulk_skip or republish")
	fl.Var(&timeValue{t: &since}, "since", "only actions started at or after this time (RFC 3339, or a duration ago: 24h)")
	fl.IntVar(&limit, "limit", 100, "list at most this many actions, following pages (0: all)")
	fl.IntVar(&pageSize, "page-size", 100, fmt.Sprintf("actions per call to the server (at most %d)", maxPageSize))
	fl.StringVar(&req.PageToken, "page-token", "", "continue a previous listing")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		switch {
		case req.AggregateKey != "" && req.Stream == "":
			return usageError("--key needs --stream")
		case req.Action != "" && !slices.Contains(actionKinds, req.Action):
			return usageError("--action %q: want retry, skip, bulk_retry, bulk_skip or republish", req.Action)
		case limit < 0:
			return usageError("--limit must not be negative")
		case pageSize < 1 || pageSize > maxPageSize:
			return usageError("--page-size must be 1 to %d", maxPageSize)
		}
		if !since.IsZero() {
			req.Since = timestamppb.New(since)
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			all, err := listActions(ctx, c, req, limit, pageSize)
			if err != nil {
				return err
			}
			if f.json {
				return writeJSON(c.out, all)
			}
			noteSkippedSources(c.errOut, "actions", all.GetSkippedSources())
			return printActions(c.out, all, req.GetAggregateKey() != "")
		})
	}
	return cmd
}

// listActions follows pages until limit actions (0: all) or the last page.
func listActions(ctx context.Context, c *adminClient, first *outboxv1.ListOperatorActionsRequest, limit, pageSize int) (*outboxv1.ListOperatorActionsResponse, error) {
	// A page may be short, even empty, for a stream-limited token while the
	// server passes over actions it may not see: the token still continues.
	actions, skipped, next, err := pageThrough(first.GetPageToken(), limit, pageSize, false,
		func(token string, n int) (*outboxv1.ListOperatorActionsResponse, []*outboxv1.OperatorAction, error) {
			req := &outboxv1.ListOperatorActionsRequest{Stream: first.GetStream(), AggregateKey: first.GetAggregateKey(),
				Action: first.GetAction(), Since: first.GetSince(), PageSize: uint32(n), PageToken: token}
			resp, err := call(ctx, c, "ListOperatorActions", c.rpc.ListOperatorActions, req)
			return resp, resp.GetActions(), err
		})
	if err != nil {
		return nil, err
	}
	return &outboxv1.ListOperatorActionsResponse{Actions: actions, SkippedSources: skipped, NextPageToken: next}, nil
}

// printActions prints actions as a table; with perAggregate, what each did
// to the aggregate listed.
func printActions(w io.Writer, resp *outboxv1.ListOperatorActionsResponse, perAggregate bool) error {
	if len(resp.GetActions()) == 0 {
		_, err := fmt.Fprintln(w, "no operator actions on record")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := "ID\tSTARTED\tACTION\tACTOR\tSTREAM\tAGGREGATES\tEVENTS\tREASON"
	if perAggregate {
		header += "\tWHAT IT DID HERE"
	}
	fmt.Fprintln(tw, header)
	for _, a := range resp.GetActions() {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%d\t%s", a.GetActionId(), fmtTime(a.GetStartedAt()),
			actionName(a), cell(a.GetActor(), 40), cell(a.GetStream(), 40), a.GetAggregates(), a.GetEvents(),
			cell(a.GetReason(), 80))
		if perAggregate {
			fmt.Fprintf(tw, "\t%s", cell(actiondetail.Of(a), 0))
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if t := resp.GetNextPageToken(); t != "" {
		fmt.Fprintf(w, "\nmore actions remain; continue with --page-token %s\n", t)
	}
	return nil
}

// actionName is the action's kind, marked when it has not finished (a bulk
// action running, or one cut short).
func actionName(a *outboxv1.OperatorAction) string {
	if a.GetFinishedAt() == nil {
		return a.GetAction() + " (unfinished)"
	}
	return a.GetAction()
}

// printAggregateActions prints the latest operator actions that changed an
// aggregate, under its state. Reading them is best effort: the state is
// what the command is for, so a server without ListOperatorActions (or a
// token that may not call it) gets a note on stderr, not a failure.
func printAggregateActions(ctx context.Context, c *adminClient, stream, key string) error {
	resp, err := call(ctx, c, "ListOperatorActions", c.rpc.ListOperatorActions, &outboxv1.ListOperatorActionsRequest{
		Stream: stream, AggregateKey: key, PageSize: aggregateActionsShown})
	if err != nil {
		fmt.Fprintf(c.errOut, "operator actions not shown: %v\n", err)
		return nil
	}
	fmt.Fprintln(c.out, "\noperator actions (newest first):")
	if len(resp.GetActions()) == 0 {
		_, err := fmt.Fprintln(c.out, "none")
		return err
	}
	tw := tabwriter.NewWriter(c.out, 0, 0, 2, ' ', 0)
	for _, a := range resp.GetActions() {
		reason := ""
		if a.GetReason() != "" {
			reason = ": " + cell(a.GetReason(), 80)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%s\n", fmtTime(a.GetStartedAt()), actionName(a), cell(a.GetActor(), 40),
			cell(actiondetail.Of(a), 0), reason)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if resp.GetNextPageToken() != "" {
		fmt.Fprintf(c.out, "older ones: outboxd actions --stream %s --key %s\n", shellQuote(stream), shellQuote(key))
	}
	return nil
}

// shellQuote quotes s for a POSIX shell unless it needs none.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-:/@") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
