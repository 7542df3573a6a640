package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/advice"
	"github.com/outboxd/outboxd/internal/multisource"
)

// ANSI: cursor to the top left, clear the screen.
const ansiHomeClear = "\x1b[H\x1b[2J"

func lagCommand() *cobra.Command {
	var (
		f         adminFlags
		streams   []string
		watch     bool
		interval  time.Duration
		failOlder time.Duration
	)
	cmd := adminCommand("lag", "Show delivery lag per stream and connected relays", `
lag shows, per stream and in total: pending events and aggregates, how long
the oldest pending event has waited (OLDEST) and the oldest of those no relay
is offered because their aggregate is backing off, parked or held at a gap
(HELD), aggregates by delivery state, STALLED aggregates (deliveries of their
next event keep expiring or failing with no progress), STRANDED events (no
rule will deliver them; a server counts them about once a minute, and says
when it last did), IDLE RELAYS (connected, holding nothing, while the
stream's ready work waits), and events delivered per second over the last
minute; then the number of connected relays, and DISCOVERY STOPPED with the
reason and the fix if new events are not being found (a database restored
into another PostgreSQL cluster: run outboxd rescan). Every stream that has
had an event is listed, an idle one with zeros, and so is every stream
--stream names (one that has never had an event with a warning on stderr).

--watch redraws every --interval until interrupted (Ctrl-C exits 0); --timeout
then bounds each refresh. With --json every refresh is one line.

--fail-if-older-than makes lag a check for cron or alerting: it exits 5 when
the total OLDEST exceeds the given age (e.g. 15m, 2h, 1d), and 1 when a
source's lag could not be read (its database down, or not added yet), since
its pending events are then in no total.`, cobra.NoArgs)
	f.register(cmd)
	fl := cmd.Flags()
	fl.StringSliceVar(&streams, "stream", nil, `report only this stream, or streams with a prefix ("billing.*") (repeatable; default all)`)
	fl.BoolVarP(&watch, "watch", "w", false, "redraw in place every --interval until interrupted")
	fl.DurationVar(&interval, "interval", 2*time.Second, "refresh interval of --watch")
	fl.Var(&ageValue{d: &failOlder}, "fail-if-older-than",
		"exit 5 if the oldest pending event has waited longer than this (e.g. 15m, 1d)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		check := cmd.Flags().Changed("fail-if-older-than")
		if watch && check {
			return usageError("--watch and --fail-if-older-than cannot be combined")
		}
		if interval <= 0 {
			return usageError("--interval must be positive")
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			req := &outboxv1.GetLagRequest{Streams: streams}
			if watch {
				return watchLag(ctx, c, req, interval)
			}
			resp, err := call(ctx, c, "GetLag", c.rpc.GetLag, req)
			if err != nil {
				return err
			}
			if f.json {
				err = writeJSON(c.out, resp)
			} else {
				err = printLag(c.out, resp)
			}
			if err != nil {
				return err
			}
			// A mistyped --stream reads as an idle stream, and passes a
			// --fail-if-older-than check: say so where a script's mail
			// shows it.
			for _, s := range resp.GetStreams() {
				if s.GetNeverHadEvents() {
					fmt.Fprintf(c.errOut, "outboxd: stream %s has never had an event (mistyped?)\n", multisource.JoinStream(s.GetSource(), s.GetStream()))
				}
			}
			if check {
				if age := resp.GetTotal().GetOldestPendingAge().AsDuration(); age > failOlder {
					return withExitCode(exitLagExceeded, fmt.Errorf(
						"the oldest pending event has waited %s, longer than --fail-if-older-than %s",
						fmtAge(age), fmtAge(failOlder)))
				}
				// A source whose figures could not be read is not in the
				// total: passing the check would vouch for events nobody
				// looked at (its database down is when they pile up).
				if unknown := lagUnknownSources(resp); len(unknown) > 0 {
					return withExitCode(exitFailure, fmt.Errorf(
						"the lag of %s could not be read, so --fail-if-older-than %s cannot vouch for its pending events",
						strings.Join(unknown, ", "), fmtAge(failOlder)))
				}
			}
			return nil
		})
	}
	return cmd
}

// watchLag redraws the lag report every interval until ctx is done, which
// is a normal end (nil). A failing first call ends it with that error; later
// failures are shown in place of the report and retried.
func watchLag(ctx context.Context, c *adminClient, req *outboxv1.GetLagRequest, interval time.Duration) error {
	tty := isTerminal(c.out)
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for first := true; ; first = false {
		resp, err := call(ctx, c, "GetLag", c.rpc.GetLag, req)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil && first {
			return err
		}
		var frame bytes.Buffer
		switch {
		case c.flags.json && err != nil:
			fmt.Fprintln(c.errOut, "outboxd:", err)
		case c.flags.json:
			if err := writeJSON(&frame, resp); err != nil {
				return err
			}
		default:
			if tty {
				frame.WriteString(ansiHomeClear)
			} else if !first {
				frame.WriteString("\n")
			}
			fmt.Fprintf(&frame, "outboxd %s at %s, every %v (Ctrl-C to stop)\n\n",
				c.flags.server, time.Now().Format(time.TimeOnly), interval)
			if err != nil {
				fmt.Fprintf(&frame, "error: %v\n", err)
			} else if err := printLag(&frame, resp); err != nil {
				return err
			}
		}
		// One write per frame, so the terminal never shows half a redraw.
		if _, err := c.out.Write(frame.Bytes()); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// lagUnknownSources names the sources whose lag could not be read.
func lagUnknownSources(resp *outboxv1.GetLagResponse) []string {
	var names []string
	for _, src := range resp.GetSources() {
		if src.GetLagUnknown() {
			names = append(names, "source "+src.GetName())
		}
	}
	return names
}

// printLag prints the lag table, a TOTAL row, and the relay count.
func printLag(w io.Writer, resp *outboxv1.GetLagResponse) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STREAM\tPENDING\tAGGREGATES\tOLDEST\tHELD\tREADY\tLEASED\tBACKOFF\tPARKED\tGAP\tSTALLED\tSTRANDED\tIDLE RELAYS\tDELIVERED/S")
	row := func(name string, s *outboxv1.StreamLag) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n",
			name, s.GetPendingEvents(), s.GetPendingAggregates(),
			fmtDuration(s.GetOldestPendingAge()), fmtDuration(s.GetOldestHeldAge()),
			s.GetReadyAggregates(), s.GetLeasedAggregates(), s.GetBackingOffAggregates(),
			s.GetParkedAggregates(), s.GetGapAggregates(), s.GetStalledAggregates(), s.GetStrandedEvents(),
			s.GetIdleRelays(), fmtRate(s.GetDeliveredPerSecond()))
	}
	for _, s := range resp.GetStreams() {
		row(cell(multisource.JoinStream(s.GetSource(), s.GetStream()), 0), s)
	}
	row("TOTAL", resp.GetTotal())
	if err := tw.Flush(); err != nil {
		return err
	}
	if _, err := fmt.Fprintf(w, "\nconnected relays: %d\n", resp.GetConnectedRelays()); err != nil {
		return err
	}
	// STRANDED comes from an audit a server runs about once a minute.
	stranded := "stranded events: not counted yet"
	if at := resp.GetStrandedAuditedAt(); at != nil {
		stranded = "stranded events counted at " + fmtTime(at)
	}
	if _, err := fmt.Fprintln(w, stranded); err != nil {
		return err
	}
	if srcs := resp.GetSources(); len(srcs) > 1 {
		// Several sources: say which are not ready (a source whose lag
		// could not be read is left out of the table).
		for _, src := range srcs {
			if !src.GetReady() {
				left := ""
				if src.GetLagUnknown() {
					left = " (its lag could not be read: its streams are not in the table or TOTAL)"
				}
				if _, err := fmt.Fprintf(w, "source %s NOT READY: %s%s\n", src.GetName(), src.GetReason(), left); err != nil {
					return err
				}
			}
		}
	}
	if held := advice.XminHorizon(resp.GetXminHorizon(), time.Local); held != "" {
		if _, err := fmt.Fprintf(w, "\nXMIN HORIZON HELD: %s\n", held); err != nil {
			return err
		}
	}
	if stopped := resp.GetDiscoveryStopped(); stopped != "" {
		_, err := fmt.Fprintf(w, "\nDISCOVERY STOPPED: %s\n", stopped)
		return err
	}
	return nil
}

func fmtRate(r float64) string {
	if r >= 100 {
		return strconv.FormatFloat(r, 'f', 0, 64)
	}
	return strconv.FormatFloat(r, 'f', 2, 64)
}
