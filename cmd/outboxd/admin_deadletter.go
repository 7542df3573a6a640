package main

// The dead-letter commands: aggregates, attempts, bulk-retry, bulk-skip and
// republish.

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// filterFlags build an AggregateFilter.
type filterFlags struct {
	stream        string
	states        []string
	errorContains string
	pendingBefore time.Time
	stalled       bool
}

func (f *filterFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&f.stream, "stream", "", `only this stream, or streams with a prefix ("billing.*"), or "*" for every stream; `+
		`SOURCE/... in a source other than default ("orders/*"), "*/..." in every source ("*/*")`)
	fl.StringSliceVar(&f.states, "state", nil, "only aggregates in these states: ready, leased, backoff, parked, gap (repeatable)")
	fl.StringVar(&f.errorContains, "error", "", "only aggregates whose last error contains this text (ignoring case)")
	fl.Var(&timeValue{t: &f.pendingBefore}, "pending-before",
		"only aggregates whose oldest pending event was created before this time (RFC 3339, or a duration ago: 1h)")
	fl.BoolVar(&f.stalled, "stalled", false, "only stalled aggregates (deliveries keep expiring or failing)")
}

func (f *filterFlags) filter() (*outboxv1.AggregateFilter, error) {
	pf := &outboxv1.AggregateFilter{Stream: f.stream, ErrorContains: f.errorContains, StalledOnly: f.stalled}
	for _, s := range f.states {
		st, ok := outboxv1.AggregateState_value["AGGREGATE_STATE_"+strings.ToUpper(strings.TrimSpace(s))]
		if !ok || st == 0 || s == "idle" {
			return nil, usageError("--state %q: want ready, leased, backoff, parked or gap", s)
		}
		pf.States = append(pf.States, outboxv1.AggregateState(st))
	}
	if !f.pendingBefore.IsZero() {
		pf.PendingBefore = timestamppb.New(f.pendingBefore)
	}
	return pf, nil
}

func (f *filterFlags) empty() bool {
	return f.stream == "" && len(f.states) == 0 && f.errorContains == "" && f.pendingBefore.IsZero() && !f.stalled
}

func aggregatesCommand() *cobra.Command {
	var (
		f     adminFlags
		ff    filterFlags
		limit int
		token string
	)
	cmd := adminCommand("aggregates", "List aggregates with pending work, oldest first", `
aggregates lists aggregates with pending work, oldest pending first: their
state, pending events, attempts and failures of the next event, whether they
are stalled, and the last error. Filter by stream (exact, "billing.*" for a
prefix), state, error text, age and stalled; the same filter flags select
what bulk-retry and bulk-skip act on. It follows pages until --limit
aggregates are listed (0: all) and then prints the token that continues the
listing with --page-token.

On a server with several source databases, without --stream (or with
--stream '*/...') it lists every source's aggregates, source after source
in name order, each stream as SOURCE/STREAM outside default; a source that
cannot be read, or of which the token may see only some streams, is named
on stderr with the reason and left out. Errors are cut at 160 characters; --wide, --json
and 'outboxd aggregate STREAM KEY' show them whole.`, cobra.NoArgs)
	f.register(cmd)
	ff.register(cmd.Flags())
	cmd.Flags().IntVar(&limit, "limit", 100, "list at most this many aggregates, following pages (0: all)")
	cmd.Flags().StringVar(&token, "page-token", "", "continue a previous listing")
	wide := cmd.Flags().Bool("wide", false, fmt.Sprintf("print errors whole (the table cuts them at %d characters)", errorCellWidth))
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		filter, err := ff.filter()
		if err != nil {
			return err
		}
		if limit < 0 {
			return usageError("--limit must not be negative")
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			aggs, skipped, next, err := pageThrough(token, limit, maxPageSize, true,
				func(token string, n int) (*outboxv1.ListAggregatesResponse, []*outboxv1.Aggregate, error) {
					resp, err := call(ctx, c, "ListAggregates", c.rpc.ListAggregates,
						&outboxv1.ListAggregatesRequest{Filter: filter, PageSize: uint32(n), PageToken: token})
					return resp, resp.GetAggregates(), err
				})
			if err != nil {
				return err
			}
			all := &outboxv1.ListAggregatesResponse{Aggregates: aggs, SkippedSources: skipped, NextPageToken: next}
			if f.json {
				return writeJSON(c.out, all)
			}
			width := errorCellWidth
			if *wide {
				width = 0
			}
			if err := printAggregates(c.out, all.GetAggregates(), time.Now(), width); err != nil {
				return err
			}
			noteCutErrors(c.errOut, width, all.GetAggregates(), (*outboxv1.Aggregate).GetLastError)
			noteSkippedSources(c.errOut, "aggregates", all.GetSkippedSources())
			if all.NextPageToken != "" {
				fmt.Fprintf(c.out, "\nmore aggregates remain; continue with --page-token %s\n", all.NextPageToken)
			}
			return nil
		})
	}
	return cmd
}

// errorCellWidth is where the aggregates and attempts tables cut an error
// (the last column): room for a sink's prefix and the broker's answer.
const errorCellWidth = 160

// noteCutErrors says, when the table cut an error, how to see it whole.
func noteCutErrors[T any](w io.Writer, width int, rows []T, errorOf func(T) string) {
	for _, r := range rows {
		if width > 0 && utf8.RuneCountInString(errorOf(r)) > width {
			fmt.Fprintf(w, "errors are cut at %d characters; --wide or --json prints them whole\n", width)
			return
		}
	}
}

// printAggregates prints aggregates as a table, errors cut at errWidth
// characters (0: whole); "no aggregates" when empty.
func printAggregates(w io.Writer, list []*outboxv1.Aggregate, now time.Time, errWidth int) error {
	if len(list) == 0 {
		_, err := fmt.Fprintln(w, "no aggregates")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STREAM\tKEY\tSTATE\tPENDING\tNEXT REV\tOLDEST\tATTEMPT\tFAILURES\tSTALLED\tLAST ERROR")
	for _, a := range list {
		oldest := "-"
		if ts := a.GetOldestPendingCreatedAt(); ts != nil {
			oldest = fmtAge(now.Sub(ts.AsTime()))
		}
		stalled := "-"
		if a.GetStalled() {
			stalled = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%d\t%d\t%s\t%s\n",
			cell(a.GetStream(), 0), cell(a.GetAggregateKey(), 40), aggregateStateName(a.GetState()),
			a.GetPendingEvents(), a.GetNextPendingRevision(), oldest, a.GetAttempt(), a.GetFailures(),
			stalled, cell(a.GetLastError(), errWidth))
	}
	return tw.Flush()
}

func attemptsCommand() *cobra.Command {
	var (
		f     adminFlags
		limit int
	)
	cmd := adminCommand("attempts (EVENT_ID | STREAM KEY)", "List the failed delivery attempts of an event or aggregate", `
attempts lists the recorded delivery attempts of one event (by id) or one
aggregate that did not publish, newest first: when, which revision and
attempt, how it ended (nacked, expired, released, parked), the relay and
replica, and the error. The server keeps the newest attempts of each
aggregate only (outbox.settings.attempt_history_per_aggregate, 50 by
default). Errors are cut at 160 characters; --wide and --json show them
whole. Exits 3 if the event does not exist. An event of a source other than
default is SOURCE/EVENT_ID, its stream SOURCE/STREAM.`, cobra.RangeArgs(1, 2))
	f.register(cmd)
	cmd.Flags().IntVar(&limit, "limit", 100, fmt.Sprintf("list at most this many attempts (1 to %d)", maxPageSize))
	wide := cmd.Flags().Bool("wide", false, fmt.Sprintf("print errors whole (the table cuts them at %d characters)", errorCellWidth))
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		req := &outboxv1.ListAttemptsRequest{PageSize: uint32(limit)}
		if len(args) == 1 {
			if err := parseEventID(args[0]); err != nil {
				return fmt.Errorf("%w; to name an aggregate give STREAM KEY", err)
			}
			req.EventId = args[0]
		} else {
			req.Stream, req.AggregateKey = args[0], args[1]
		}
		if limit < 1 || limit > maxPageSize {
			return usageError("--limit must be 1 to %d", maxPageSize)
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			resp, err := call(ctx, c, "ListAttempts", c.rpc.ListAttempts, req)
			if err != nil {
				return err
			}
			if f.json {
				return writeJSON(c.out, resp)
			}
			if len(resp.GetAttempts()) == 0 {
				_, err := fmt.Fprintln(c.out, "no failed attempts recorded")
				return err
			}
			width := errorCellWidth
			if *wide {
				width = 0
			}
			defer noteCutErrors(c.errOut, width, resp.GetAttempts(), (*outboxv1.Attempt).GetError)
			tw := tabwriter.NewWriter(c.out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "AT\tEVENT ID\tREV\tATTEMPT\tOUTCOME\tRELAY\tREPLICA\tERROR")
			for _, a := range resp.GetAttempts() {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\t%s\n",
					fmtTime(a.GetAt()), cell(eventAddress(sourceOf(a.GetStream()), a.GetEventId()), 0), a.GetRevision(), a.GetAttempt(),
					enumShortName(a.GetOutcome().String(), "ATTEMPT_OUTCOME_"), cell(a.GetRelayId(), 40),
					cell(a.GetReplicaId(), 40), cell(a.GetError(), width))
			}
			return tw.Flush()
		})
	}
	return cmd
}

// bulkFlags are what bulk-retry, bulk-skip and republish share.
type bulkFlags struct {
	reason string
	actor  string
	dryRun bool
	yes    bool
}

func (b *bulkFlags) register(fl *pflag.FlagSet, reasonHelp string) {
	// One call acts on every match, an aggregate at a time: give it longer
	// than an inspection's 10 s.
	if t := fl.Lookup("timeout"); t != nil {
		_ = t.Value.Set("10m")
		t.DefValue = t.Value.String()
	}
	fl.StringVar(&b.reason, "reason", "", reasonHelp)
	fl.StringVar(&b.actor, "actor", defaultActor(), "who is asking, when the credential does not say so")
	fl.BoolVar(&b.dryRun, "dry-run", false, "only count what would change, and show a sample")
	fl.BoolVarP(&b.yes, "yes", "y", false, "do not ask for confirmation")
}

// bulk runs a bulk action as dry run, confirmation, real run: dry asks the
// server what would change and prints it (the whole command, with
// --dry-run); then, unless --yes, the operator confirms on the terminal.
func (b *bulkFlags) bulk(ctx context.Context, c *adminClient, verb string, dry func() (int64, error), real func() error) error {
	n, err := dry()
	if err != nil || b.dryRun || n == 0 {
		return err
	}
	if !b.yes {
		if err := confirmAction(ctx, c, fmt.Sprintf("%s %d? [y/N] ", verb, n), "doing it", "go ahead"); err != nil {
			return err
		}
	}
	return real()
}

func bulkRetryCommand() *cobra.Command {
	var (
		f         adminFlags
		ff        filterFlags
		b         bulkFlags
		acceptGap bool
	)
	cmd := adminCommand("bulk-retry FILTERS (--stream S, --state STATE, ...)", "Retry every parked or backing-off aggregate a filter matches", `
bulk-retry applies retry to every aggregate the filter matches that is parked
or backing off (and, with --accept-gap and a --reason, held at a gap): each
is made deliverable now with a fresh set of attempts, one aggregate at a
time. It first shows how many match and a sample, then asks for
confirmation unless --yes (without a terminal on stdin it needs --yes);
--dry-run stops after the count. The filter flags are those of 'outboxd
aggregates'; at least one is required ("--stream '*'" for every stream). The
action is recorded with --actor and --reason.

On a server with several source databases, a filter without --stream (or
with --stream '*/...', "*/*" for every stream of every source) acts on every
source, once each: every source is counted first, and if any refuses or
cannot be read nothing is changed; each source records its own action.
--stream '*' alone is every stream of source default.

Exits 6 if not confirmed.`, cobra.NoArgs)
	f.register(cmd)
	ff.register(cmd.Flags())
	b.register(cmd.Flags(), "why; recorded with the action (required with --accept-gap)")
	cmd.Flags().BoolVar(&acceptGap, "accept-gap", false, "also release gap-held aggregates (and ready ones whose next revision is missing), giving up their missing revisions (needs --reason)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		filter, err := ff.filter()
		switch {
		case err != nil:
			return err
		case ff.empty():
			return usageError("bulk-retry needs a filter (--stream '*' for every stream)")
		case acceptGap && strings.TrimSpace(b.reason) == "":
			return usageError("--accept-gap needs a --reason")
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			req := &outboxv1.BulkRetryRequest{Filter: filter, AcceptGap: acceptGap, Reason: b.reason, Actor: b.actor}
			return b.bulk(ctx, c, "Retry the aggregates matched,", func() (int64, error) {
				req.DryRun = true
				resp, err := call(ctx, c, "BulkRetry", c.rpc.BulkRetry, req)
				if err != nil {
					return 0, err
				}
				return resp.GetMatched(), printBulk(c, b.dryRun, resp, resp.GetMatched(), resp.GetSample(), "aggregates would be retried")
			}, func() error {
				req.DryRun = false
				resp, err := call(ctx, c, "BulkRetry", c.rpc.BulkRetry, req)
				if err != nil {
					return err
				}
				if f.json {
					return writeJSON(c.out, resp)
				}
				_, err = fmt.Fprintf(c.out, "retried %s of %d matched\n", plural(resp.GetRetried(), "aggregate", "aggregates"), resp.GetMatched())
				return err
			})
		})
	}
	return cmd
}

// printBulk prints a dry run's count and sample (or its JSON).
// With --json only a --dry-run prints it: stdout then holds one document,
// the final answer.
func printBulk(c *adminClient, dryRun bool, resp proto.Message, matched int64, sample []*outboxv1.Aggregate, what string) error {
	if c.flags.json {
		if dryRun {
			return writeJSON(c.out, resp)
		}
		return nil
	}
	fmt.Fprintf(c.out, "%d %s", matched, what)
	if matched == 0 {
		_, err := fmt.Fprintln(c.out)
		return err
	}
	if int64(len(sample)) < matched {
		fmt.Fprintf(c.out, "; the first %d:\n\n", len(sample))
	} else {
		fmt.Fprint(c.out, ":\n\n")
	}
	if err := printAggregates(c.out, sample, time.Now(), errorCellWidth); err != nil {
		return err
	}
	_, err := fmt.Fprintln(c.out)
	return err
}

func bulkSkipCommand() *cobra.Command {
	var (
		f  adminFlags
		ff filterFlags
		b  bulkFlags
	)
	cmd := adminCommand("bulk-skip FILTERS (--stream S, --state STATE, ...) --reason REASON", "Skip the next pending event of every aggregate a filter matches", `
bulk-skip skips the next pending event of every aggregate the filter matches,
as skip does for one event: never delivered nor marked published, recorded
with the reason and who, and later revisions proceed. An event a relay
publishes meanwhile is not skipped (nor is its successor in its place). It
first shows how many aggregates match and a sample, then asks for
confirmation unless --yes (without a terminal on stdin it needs --yes);
--dry-run stops after the count. The filter flags are those of 'outboxd
aggregates'; at least one is required ("--stream '*'" for every stream).
Across several source databases it acts as bulk-retry does: every source
without --stream or with --stream '*/...', after counting them all.

Exits 2 without --reason, 6 if not confirmed.`, cobra.NoArgs)
	f.register(cmd)
	ff.register(cmd.Flags())
	b.register(cmd.Flags(), "why the events are abandoned (required; recorded with each)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		filter, err := ff.filter()
		switch {
		case err != nil:
			return err
		case ff.empty():
			return usageError("bulk-skip needs a filter (--stream '*' for every stream)")
		case strings.TrimSpace(b.reason) == "":
			return usageError("bulk-skip needs a --reason; it is recorded with every skipped event")
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			req := &outboxv1.BulkSkipRequest{Filter: filter, Reason: b.reason, Actor: b.actor}
			return b.bulk(ctx, c, "Skip the next event of each aggregate matched,", func() (int64, error) {
				req.DryRun = true
				resp, err := call(ctx, c, "BulkSkip", c.rpc.BulkSkip, req)
				if err != nil {
					return 0, err
				}
				return resp.GetMatched(), printBulk(c, b.dryRun, resp, resp.GetMatched(), resp.GetSample(), "aggregates would have their next event skipped")
			}, func() error {
				req.DryRun = false
				resp, err := call(ctx, c, "BulkSkip", c.rpc.BulkSkip, req)
				if err != nil {
					return err
				}
				if f.json {
					return writeJSON(c.out, resp)
				}
				_, err = fmt.Fprintf(c.out, "skipped %s of %d aggregates matched\n", plural(resp.GetSkipped(), "event", "events"), resp.GetMatched())
				return err
			})
		})
	}
	return cmd
}

func republishCommand() *cobra.Command {
	var (
		f              adminFlags
		b              bulkFlags
		from           int64
		since, before  time.Time
		includeSkipped bool
	)
	cmd := adminCommand("republish STREAM [KEY] --reason REASON (--from-revision N | --published-since T)",
		"Deliver already-published events again, in order, under the same ids", `
republish delivers already-published events again, for a consumer that lost
data: with KEY and --from-revision, every event of that aggregate from the
revision on; with --published-since (and optionally --published-before),
every aggregate of the stream (or only KEY) with an event published in that
range, from its first such event on. The events keep their ids and are
delivered in revision order before anything newer of their aggregate; each is
marked published again when its relay acks it. Aggregates parked, backing off
or held at a gap, or missing a revision in the range (purged), are refused.

Skipped events in the range stay skipped unless --include-skipped: then their
skips are withdrawn (the skip records are kept with the action) and they are
delivered in their place in revision order, under their own ids, payloads
and headers. A skipped event delivery has not passed yet cannot be
republished. Every republished delivery continues its event's attempt
numbers (attempt 2 after one earlier delivery, and so on), never 1 again.

It first shows what would be delivered again, then asks for confirmation
unless --yes; --dry-run stops after the count. Recorded with --actor and
--reason.

Exits 3 if the aggregate does not exist, 4 if it cannot be rewound, 6 if not
confirmed.`, cobra.RangeArgs(1, 2))
	f.register(cmd)
	b.register(cmd.Flags(), "why; recorded with the action (required)")
	fl := cmd.Flags()
	fl.Int64Var(&from, "from-revision", 0, "with KEY: the first revision to deliver again")
	fl.Var(&timeValue{t: &since}, "published-since", "events published at or after this time (RFC 3339, or a duration ago: 2h)")
	fl.Var(&timeValue{t: &before}, "published-before", "events published before this time (default: now)")
	fl.BoolVar(&includeSkipped, "include-skipped", false, "deliver the range's skipped events too, withdrawing their skips")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		req := &outboxv1.RepublishRequest{Stream: args[0], FromRevision: from, Reason: b.reason, Actor: b.actor,
			IncludeSkipped: includeSkipped}
		if len(args) == 2 {
			req.AggregateKey = args[1]
		}
		switch {
		case strings.TrimSpace(b.reason) == "":
			return usageError("republish needs a --reason; it is recorded with the action")
		case from != 0 && (!since.IsZero() || !before.IsZero()):
			return usageError("--from-revision and --published-since/--published-before exclude each other")
		case from != 0 && req.AggregateKey == "":
			return usageError("--from-revision needs KEY")
		case from < 0:
			return usageError("--from-revision must be positive")
		case from == 0 && since.IsZero():
			return usageError("say what to deliver again: KEY --from-revision N, or --published-since T")
		}
		if !since.IsZero() {
			req.PublishedAfter = timestamppb.New(since)
		}
		if !before.IsZero() {
			req.PublishedBefore = timestamppb.New(before)
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			var events int64
			return b.bulk(ctx, c, "Deliver these events again,", func() (int64, error) {
				req.DryRun = true
				resp, err := call(ctx, c, "Republish", c.rpc.Republish, req)
				if err != nil {
					return 0, err
				}
				events = resp.GetEvents()
				if f.json {
					if b.dryRun {
						return events, writeJSON(c.out, resp)
					}
					return events, nil
				}
				return events, printRepublish(c.out, resp, "would be")
			}, func() error {
				req.DryRun = false
				resp, err := call(ctx, c, "Republish", c.rpc.Republish, req)
				if err != nil {
					return err
				}
				if f.json {
					return writeJSON(c.out, resp)
				}
				return printRepublish(c.out, resp, "are")
			})
		})
	}
	return cmd
}

func printRepublish(w io.Writer, resp *outboxv1.RepublishResponse, are string) error {
	if are == "are" && resp.GetEvents() == 1 {
		are = "is"
	}
	fmt.Fprintf(w, "%s of %s %s delivered again\n", plural(resp.GetEvents(), "event", "events"),
		plural(resp.GetAggregates(), "aggregate", "aggregates"), are)
	if n := resp.GetUnskippedEvents(); n > 0 {
		fmt.Fprintf(w, "%s of them skipped before; the skips are withdrawn\n", plural(n, "event", "events"))
	}
	if n := resp.GetRefusedAggregates(); n > 0 {
		fmt.Fprintf(w, "%s refused (retry or skip, then republish them):\n", plural(n, "aggregate", "aggregates"))
		for _, r := range resp.GetRefused() {
			fmt.Fprintf(w, "  %s\n", cell(r, 0))
		}
	}
	return nil
}
