package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

func retryCommand() *cobra.Command {
	var (
		f         adminFlags
		acceptGap bool
		reason    string
		actor     string
	)
	cmd := adminCommand("retry STREAM KEY", "Make a parked or backing-off aggregate deliverable now", `
retry makes a parked or backing-off aggregate deliverable now, with a fresh
set of attempts, and prints its new state. A ready aggregate is left as it is.

An aggregate held at a gap (a revision is missing) is released only with
--accept-gap and a --reason, which gives up on the missing revisions for good:
delivery resumes at the next revision that exists, and the decision is
recorded like a skip.

A retry that changes the aggregate is recorded as an operator action, with
--actor and --reason (optional without --accept-gap): 'outboxd actions' and
'outboxd aggregate' show it.

Exits 3 if the aggregate has never had an event, 4 if it is idle, leased, or
held at a gap without --accept-gap.`, cobra.ExactArgs(2))
	f.register(cmd)
	fl := cmd.Flags()
	fl.BoolVar(&acceptGap, "accept-gap", false, "give up on missing revisions of a gap-held aggregate (needs --reason)")
	fl.StringVar(&reason, "reason", "", "why; recorded with the retry (required with --accept-gap)")
	fl.StringVar(&actor, "actor", defaultActor(), "who is asking, when the credential does not say so")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if acceptGap && strings.TrimSpace(reason) == "" {
			return usageError("--accept-gap needs a --reason")
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			resp, err := call(ctx, c, "RetryAggregate", c.rpc.RetryAggregate, &outboxv1.RetryAggregateRequest{
				Stream: args[0], AggregateKey: args[1], AcceptGap: acceptGap, Reason: reason, Actor: actor,
			})
			if err != nil {
				return err
			}
			if f.json {
				return writeJSON(c.out, resp)
			}
			a := resp.GetAggregate()
			fmt.Fprintf(c.out, "aggregate %s/%s is %s\n\n", cell(a.GetStream(), 0), cell(a.GetAggregateKey(), 0),
				aggregateStateName(a.GetState()))
			return printAggregate(c.out, a, time.Now())
		})
	}
	return cmd
}

func skipCommand() *cobra.Command {
	var (
		f      adminFlags
		reason string
		actor  string
	)
	cmd := adminCommand("skip EVENT_ID --reason REASON", "Abandon one pending event, with a reason", `
skip abandons one pending event: it is never delivered nor marked published,
stays listed by 'outboxd events --state skipped' with the reason, who skipped
it and when, and later revisions of its aggregate may proceed. Use it for an
event no broker will ever accept. The skip is recorded as an operator action
('outboxd actions'). To deliver a skipped event after all, once delivery has
passed it: 'outboxd republish STREAM KEY --from-revision N --include-skipped'.
On a server with several source databases, an event of a source other than
default is SOURCE/EVENT_ID (orders/0190a8c2-...), the message id its sinks
gave it and the id 'outboxd events' prints.

To skip an aggregate's next event, 'outboxd aggregate STREAM KEY' names it
(next pending event); 'outboxd bulk-skip' skips the next event of every
aggregate a filter matches.

Exits 2 without --reason, 4 if the event is already published or skipped.`,
		func(cmd *cobra.Command, args []string) error {
			if len(args) == 2 {
				// "skip STREAM KEY", the shape of retry and aggregate.
				return fmt.Errorf("skip takes one EVENT_ID, not a stream and key: 'outboxd aggregate %s %s' names the aggregate's next pending event", args[0], args[1])
			}
			return cobra.ExactArgs(1)(cmd, args)
		})
	f.register(cmd)
	fl := cmd.Flags()
	fl.StringVar(&reason, "reason", "", "why the event is abandoned (required; recorded)")
	fl.StringVar(&actor, "actor", defaultActor(), "who is asking, when the credential does not say so")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if strings.TrimSpace(reason) == "" {
			return usageError("skip needs a --reason; it is recorded with the skipped event")
		}
		if err := parseEventID(args[0]); err != nil {
			return err
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			resp, err := call(ctx, c, "SkipEvent", c.rpc.SkipEvent, &outboxv1.SkipEventRequest{
				EventId: args[0], Reason: reason, Actor: actor,
			})
			if err != nil {
				return err
			}
			if f.json {
				return writeJSON(c.out, resp)
			}
			s := resp.GetSkip()
			_, err = fmt.Fprintf(c.out, "skipped event %s at %s by %s: %s\n",
				args[0], fmtTime(s.GetSkippedAt()), cell(s.GetActor(), 0), cell(s.GetReason(), 0))
			return err
		})
	}
	return cmd
}
