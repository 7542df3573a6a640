package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/multisource"
)

func relaysCommand() *cobra.Command {
	var f adminFlags
	cmd := adminCommand("relays", "List the relays connected to every replica", `
relays lists every open relay stream (Subscribe) across all replicas sharing
the database: the relay's name, its session (the lease holder shown by
'outboxd aggregate'), its address, the replica serving it, its stream filter
("all", or "all but" the streams a catch-all leaves to other relays),
deliveries outstanding against its credit, acks so far, and when it connected.
A source whose relays could not be listed (its database down) is named on
stderr with the reason and left out.`,
		cobra.NoArgs)
	f.register(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			resp, err := call(ctx, c, "ListRelays", c.rpc.ListRelays, &outboxv1.ListRelaysRequest{})
			if err != nil {
				return err
			}
			// A source whose relays could not be listed (its database
			// down) is missing from the table: say so where a script's
			// mail shows it, as the listings of events and aggregates do.
			noteSkippedSources(c.errOut, "relays", resp.GetSkippedSources())
			if f.json {
				return writeJSON(c.out, resp)
			}
			return printRelays(c.out, resp, time.Now())
		})
	}
	return cmd
}

func printRelays(w io.Writer, resp *outboxv1.ListRelaysResponse, now time.Time) error {
	if len(resp.GetRelays()) == 0 {
		_, err := fmt.Fprintln(w, "no relays connected")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "RELAY\tSESSION\tPEER\tREPLICA\tSTREAMS\tIN FLIGHT\tACKED\tCONNECTED")
	for _, r := range resp.GetRelays() {
		// A catch-all takes every stream of its source only: "all" in the
		// default source, "orders/*" in another.
		streams := "all"
		if src := r.GetSource(); src != "" {
			streams = multisource.JoinStream(src, "*")
		}
		switch {
		case len(r.GetStreams()) > 0:
			streams = strings.Join(r.GetStreams(), ",")
		case len(r.GetExcludeStreams()) > 0:
			streams += " but " + strings.Join(r.GetExcludeStreams(), ",")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d/%d\t%d\t%s\n",
			cell(r.GetRelayId(), 40), cell(r.GetSessionId(), 0), cell(r.GetPeer(), 0),
			cell(r.GetReplicaId(), 40), cell(streams, 60), r.GetInFlight(), r.GetMaxInFlight(),
			r.GetAcked(), fmtTimeAgo(r.GetConnectedAt(), now))
	}
	return tw.Flush()
}

func aggregateCommand() *cobra.Command {
	var f adminFlags
	cmd := adminCommand("aggregate STREAM KEY", "Show one aggregate's delivery state", `
aggregate shows where one aggregate is in delivery: its state (idle, ready,
leased, backoff, parked, gap), revisions committed and delivered, pending
events, the current lease, retries and errors, and then the latest operator
actions that changed it (retries, accepted gaps, skips, republishes: who,
when, what and why; 'outboxd actions --stream STREAM --key KEY' lists them
all). --json prints the aggregate's state only. Exits 3 if the aggregate has
never had an event.`, cobra.ExactArgs(2))
	f.register(cmd)
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			resp, err := call(ctx, c, "GetAggregate", c.rpc.GetAggregate,
				&outboxv1.GetAggregateRequest{Stream: args[0], AggregateKey: args[1]})
			if err != nil {
				return err
			}
			if f.json {
				return writeJSON(c.out, resp)
			}
			if err := printAggregate(c.out, resp.GetAggregate(), time.Now()); err != nil {
				return err
			}
			return printAggregateActions(ctx, c, args[0], args[1])
		})
	}
	return cmd
}

// aggregateStateName is the state's lowercase short name: "parked".
func aggregateStateName(s outboxv1.AggregateState) string {
	return enumShortName(s.String(), "AGGREGATE_STATE_")
}

func eventStateName(s outboxv1.EventState) string {
	return enumShortName(s.String(), "EVENT_STATE_")
}

func enumShortName(name, prefix string) string {
	return strings.ToLower(strings.TrimPrefix(name, prefix))
}

// printAggregate prints an aggregate as key/value lines; lease, retry, park
// and gap lines only when they say something.
func printAggregate(w io.Writer, a *outboxv1.Aggregate, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	kv := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
	kv("stream", cell(a.GetStream(), 0))
	kv("aggregate key", cell(a.GetAggregateKey(), 0))
	kv("state", aggregateStateName(a.GetState()))
	kv("last revision", fmt.Sprint(a.GetLastRevision()))
	kv("delivered revision", fmt.Sprint(a.GetDeliveredRevision()))
	kv("pending events", fmt.Sprint(a.GetPendingEvents()))
	if a.GetNextPendingRevision() != 0 {
		kv("next pending revision", fmt.Sprint(a.GetNextPendingRevision()))
	}
	if id := a.GetNextPendingEventId(); id != "" {
		// As skip takes it: SOURCE/EVENT_ID outside default, whose streams
		// come back as SOURCE/STREAM.
		source, _ := multisource.SplitStream(a.GetStream())
		kv("next pending event", eventAddress(source, id))
	}
	if a.GetOldestPendingCreatedAt() != nil {
		kv("oldest pending since", fmtTimeAgo(a.GetOldestPendingCreatedAt(), now))
	}
	// The lease lines only while there is a lease: leased_event_id also
	// names the latest lease's event after it ended (a parked aggregate's
	// is not leased), and the fencing epoch means nothing to an operator
	// (--json has both).
	if a.GetState() == outboxv1.AggregateState_AGGREGATE_STATE_LEASED {
		kv("leased event", cell(a.GetLeasedEventId(), 0))
		kv("lease holder", cell(a.GetLeaseHolder(), 0))
		kv("lease relay", cell(a.GetLeaseRelayId(), 0))
		kv("lease expires", fmtTimeAgo(a.GetLeaseExpiresAt(), now))
	}
	if a.GetAttempt() != 0 || a.GetFailures() != 0 {
		kv("attempt", fmt.Sprint(a.GetAttempt()))
		kv("failures", fmt.Sprint(a.GetFailures()))
	}
	if a.GetLastError() != "" {
		kv("last error", cell(a.GetLastError(), 0))
	}
	if a.GetNextAttemptAt() != nil {
		kv("next attempt", fmtTimeAgo(a.GetNextAttemptAt(), now))
	}
	if a.GetParkedAt() != nil {
		kv("parked at", fmtTimeAgo(a.GetParkedAt(), now))
		kv("parked reason", cell(a.GetParkedReason(), 0))
	}
	if a.GetGapRevision() != 0 {
		kv("missing revision", fmt.Sprint(a.GetGapRevision()))
	}
	if a.GetStalled() {
		kv("stalled", cell(a.GetStalledReason(), 0))
	}
	return tw.Flush()
}

// maxPageSize is the most events ListEvents returns per call.
const maxPageSize = 1000

func eventsCommand() *cobra.Command {
	var (
		f            adminFlags
		req          = &outboxv1.ListEventsRequest{}
		state        string
		since, until time.Time
		limit        int
		pageSize     int
		payload      bool
	)
	cmd := adminCommand("events", "List events, newest first", `
events lists events newest first, with their delivery state, when they were
published, and why they were skipped. It follows pages until --limit events
are listed (0: all) and then prints the token that continues the listing
with --page-token. --since and --until take an RFC 3339 time or a duration
meaning that long ago (--since 1h). --event-id finds one event, and takes no
other filter. With --json, the pages are printed as one ListEventsResponse
whose next_page_token continues the listing.

On a server with several source databases, a stream of a source other than
default is SOURCE/STREAM (--stream orders/sales_order) and an event id
SOURCE/EVENT_ID; the table prints them so (and --json sets event.source).
Without --stream or --event-id it lists every source's events (those the
token may see), source after source in name order, each newest first;
--stream orders/ lists one source's, --stream '*/sales_order' a stream in
every source. A source that cannot be read, or of which the token may see
only some streams (name one: --stream orders/STREAM), is named on stderr
with the reason and left out.`, cobra.NoArgs)
	f.register(cmd)
	fl := cmd.Flags()
	fl.StringVar(&req.Stream, "stream", "", "only this stream")
	fl.StringVar(&req.AggregateKey, "key", "", "only this aggregate key (needs --stream)")
	fl.StringVar(&state, "state", "", "only events in this state: pending, published or skipped")
	fl.Var(&timeValue{t: &since}, "since", "only events created at or after this time (RFC 3339, or a duration ago: 1h)")
	fl.Var(&timeValue{t: &until}, "until", "only events created before this time (RFC 3339, or a duration ago: 1h)")
	fl.IntVar(&limit, "limit", 100, "list at most this many events, following pages (0: all)")
	fl.IntVar(&pageSize, "page-size", 100, fmt.Sprintf("events per call to the server (at most %d)", maxPageSize))
	fl.StringVar(&req.PageToken, "page-token", "", "continue a previous listing")
	fl.BoolVar(&payload, "payload", false, "show each event's payload")
	fl.StringVar(&req.EventId, "event-id", "", "find this one event (SOURCE/EVENT_ID for a source other than default)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if req.AggregateKey != "" && req.Stream == "" {
			return usageError("--key needs --stream")
		}
		if req.EventId != "" {
			if err := parseEventID(req.EventId); err != nil {
				return err
			}
			if req.Stream != "" || state != "" || cmd.Flags().Changed("since") || cmd.Flags().Changed("until") || req.PageToken != "" {
				return usageError("--event-id finds one event: give no other filter with it")
			}
		}
		switch strings.ToLower(state) {
		case "", "any":
		case "pending":
			req.State = outboxv1.EventState_EVENT_STATE_PENDING
		case "published":
			req.State = outboxv1.EventState_EVENT_STATE_PUBLISHED
		case "skipped":
			req.State = outboxv1.EventState_EVENT_STATE_SKIPPED
		default:
			return usageError("--state %q: want pending, published or skipped", state)
		}
		if limit < 0 {
			return usageError("--limit must not be negative")
		}
		if pageSize < 1 || pageSize > maxPageSize {
			return usageError("--page-size must be 1 to %d", maxPageSize)
		}
		if !since.IsZero() {
			req.CreatedAfter = timestamppb.New(since)
		}
		if !until.IsZero() {
			req.CreatedBefore = timestamppb.New(until)
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			all, err := listEvents(ctx, c, req, limit, pageSize)
			if err != nil {
				return err
			}
			if f.json {
				return writeJSON(c.out, all)
			}
			noteSkippedSources(c.errOut, "events", all.GetSkippedSources())
			return printEvents(c.out, all, payload)
		})
	}
	return cmd
}

// listEvents follows pages until limit events (0: all) or the last page, and
// returns them as one response carrying the token of what remains.
func listEvents(ctx context.Context, c *adminClient, first *outboxv1.ListEventsRequest, limit, pageSize int) (*outboxv1.ListEventsResponse, error) {
	events, skipped, next, err := pageThrough(first.GetPageToken(), limit, pageSize, true,
		func(token string, n int) (*outboxv1.ListEventsResponse, []*outboxv1.EventInfo, error) {
			req := &outboxv1.ListEventsRequest{
				Stream: first.GetStream(), AggregateKey: first.GetAggregateKey(), State: first.GetState(),
				CreatedAfter: first.GetCreatedAfter(), CreatedBefore: first.GetCreatedBefore(),
				PageSize: uint32(n), PageToken: token, EventId: first.GetEventId(),
			}
			resp, err := call(ctx, c, "ListEvents", c.rpc.ListEvents, req)
			return resp, resp.GetEvents(), err
		})
	if err != nil {
		return nil, err
	}
	return &outboxv1.ListEventsResponse{Events: events, SkippedSources: skipped, NextPageToken: next}, nil
}

func printEvents(w io.Writer, resp *outboxv1.ListEventsResponse, payload bool) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := "EVENT ID\tSTREAM\tKEY\tREV\tTYPE\tSTATE\tCREATED\tPUBLISHED\tSKIP REASON"
	if payload {
		header += "\tPAYLOAD"
	}
	fmt.Fprintln(tw, header)
	for _, info := range resp.GetEvents() {
		e := info.GetEvent()
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s",
			cell(eventAddress(e.GetSource(), e.GetEventId()), 0), cell(multisource.JoinStream(e.GetSource(), e.GetStream()), 0), cell(e.GetAggregateKey(), 40),
			e.GetRevision(), cell(e.GetEventType(), 40), eventStateName(info.GetState()),
			fmtTime(e.GetCreatedAt()), fmtTime(info.GetPublishedAt()),
			cell(info.GetSkip().GetReason(), 60))
		if payload {
			fmt.Fprintf(tw, "\t%s", compactJSON(e.GetPayload()))
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(resp.GetEvents()) == 0 {
		fmt.Fprintln(w, "no events")
	}
	if t := resp.GetNextPageToken(); t != "" {
		fmt.Fprintf(w, "\nmore events remain; continue with --page-token %s\n", t)
	}
	return nil
}

// compactJSON puts a JSON payload on one line.
func compactJSON(b []byte) string {
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return cell(string(b), 0)
	}
	return cell(buf.String(), 0)
}
