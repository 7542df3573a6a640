package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

func purgeCommand() *cobra.Command {
	var (
		f         adminFlags
		olderThan time.Duration
		before    time.Time
		stream    string
		batchSize int
		dryRun    bool
		yes       bool
	)
	cmd := adminCommand("purge --older-than DURATION | --before TIME", "Delete published events older than a cut-off", `
purge deletes events published before a cut-off (--older-than 30d, or
--before an RFC 3339 time or a duration ago), in batches that are each a short
transaction. It never deletes a pending or skipped event.

It first counts what would be deleted (that is all --dry-run does), then asks
for confirmation on the terminal unless --yes is given; when stdin is not a
terminal and --yes is not given, it refuses (exit 6). Progress is shown on
stderr when it is a terminal; a summary line ends the output. --timeout bounds
the wait for each batch's progress report, not the whole purge.

On a server with several source databases, --stream SOURCE/STREAM purges a
stream of a source other than default; without --stream every source the
token may purge is purged, one after another, and the summary has a line per
source. A token limited to some streams of a source must name a stream.`, cobra.NoArgs)
	f.register(cmd)
	fl := cmd.Flags()
	fl.Var(&ageValue{d: &olderThan}, "older-than", "delete events published longer ago than this (e.g. 30d, 12h)")
	fl.Var(&timeValue{t: &before}, "before", "delete events published before this time (RFC 3339, or a duration ago)")
	fl.StringVar(&stream, "stream", "", "purge only this stream, SOURCE/STREAM for a source other than default (default all, of every source)")
	fl.IntVar(&batchSize, "batch-size", 0, "rows deleted per transaction (default: the server's, 1000; at most 10000)")
	fl.BoolVar(&dryRun, "dry-run", false, "count what would be deleted; delete nothing")
	fl.BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		var cutoff time.Time
		switch ot, bf := cmd.Flags().Changed("older-than"), cmd.Flags().Changed("before"); {
		case ot && bf:
			return usageError("give --older-than or --before, not both")
		case ot:
			cutoff = time.Now().Add(-olderThan)
		case bf:
			cutoff = before
		default:
			return usageError("purge needs --older-than DURATION or --before TIME")
		}
		if batchSize < 0 {
			return usageError("--batch-size must not be negative")
		}
		req := &outboxv1.PurgeRequest{
			PublishedBefore: timestamppb.New(cutoff), BatchSize: uint32(batchSize), Stream: stream,
		}
		return f.run(cmd, func(ctx context.Context, c *adminClient) error {
			return purge(ctx, c, req, dryRun, yes)
		})
	}
	return cmd
}

func purge(ctx context.Context, c *adminClient, req *outboxv1.PurgeRequest, dryRun, yes bool) error {
	what := "events published before " + fmtTime(req.GetPublishedBefore())
	if req.GetStream() != "" {
		what += " in stream " + cell(req.GetStream(), 0)
	}

	count := &outboxv1.PurgeRequest{
		PublishedBefore: req.GetPublishedBefore(), BatchSize: req.GetBatchSize(), Stream: req.GetStream(), DryRun: true,
	}
	var counted *outboxv1.PurgeResponse
	err := purgeStream(ctx, c, count, func(r *outboxv1.PurgeResponse) error {
		counted = r
		if dryRun && c.flags.json {
			return writeJSON(c.out, r)
		}
		return nil
	})
	if err != nil {
		return err
	}
	n := counted.GetDeleted()
	if dryRun {
		if !c.flags.json {
			fmt.Fprintf(c.out, "dry run: would delete %d %s%s\n", n, what, perSource(counted, false))
		}
		return nil
	}
	if n == 0 {
		if c.flags.json {
			return writeJSON(c.out, counted)
		}
		fmt.Fprintf(c.out, "nothing to purge: no %s\n", what)
		return nil
	}
	if !yes {
		if err := confirm(ctx, c, fmt.Sprintf("Delete %d %s? [y/N] ", n, what)); err != nil {
			return err
		}
	}

	var bar *progressbar.ProgressBar
	if !c.flags.json && isTerminal(c.errOut) {
		bar = progressbar.NewOptions64(n,
			progressbar.OptionSetWriter(c.errOut),
			progressbar.OptionSetDescription("purging"),
			progressbar.OptionShowCount(),
			progressbar.OptionSetWidth(30),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish(),
		)
	}
	var last *outboxv1.PurgeResponse
	// A purge over several sources reports each source's figures in turn,
	// then their sum: done holds the sources finished before the current.
	var done, doneBatches int64
	start := time.Now()
	err = purgeStream(ctx, c, req, func(r *outboxv1.PurgeResponse) error {
		if last != nil && !r.GetDone() && r.GetSource() != last.GetSource() {
			done += last.GetDeleted()
			doneBatches += last.GetBatches()
		}
		if r.GetDone() && len(r.GetSources()) > 0 {
			done, doneBatches = 0, 0 // the sum
		}
		last = r
		if bar != nil {
			if total := done + r.GetDeleted() + r.GetRemaining(); total > bar.GetMax64() {
				bar.ChangeMax64(total)
			}
			_ = bar.Set64(done + r.GetDeleted())
		}
		if c.flags.json {
			return writeJSON(c.out, r)
		}
		return nil
	})
	if bar != nil {
		if err == nil {
			_ = bar.Finish() // and clear it: the summary line follows
		} else {
			_ = bar.Exit()
			fmt.Fprintln(c.errOut)
		}
	}
	elapsed := time.Since(start)
	if last.GetElapsed() != nil {
		elapsed = last.GetElapsed().AsDuration()
	}
	if err != nil {
		if last != nil {
			err = fmt.Errorf("%w (after deleting %d events in %s)", err, done+last.GetDeleted(),
				plural(doneBatches+last.GetBatches(), "batch", "batches"))
		}
		return err
	}
	if !c.flags.json {
		fmt.Fprintf(c.out, "deleted %d %s in %s in %s%s\n",
			last.GetDeleted(), what, plural(last.GetBatches(), "batch", "batches"), fmtAge(elapsed), perSource(last, true))
	}
	return nil
}

// perSource is the lines a purge's summary adds for each source of a purge
// over several (PurgeResponse.sources), or "" for one source.
func perSource(r *outboxv1.PurgeResponse, batches bool) string {
	var b strings.Builder
	for _, s := range r.GetSources() {
		name := s.GetSource()
		if name == "" {
			name = "default"
		}
		fmt.Fprintf(&b, "\n  source %s: %d", name, s.GetDeleted())
		if batches {
			fmt.Fprintf(&b, " in %s", plural(s.GetBatches(), "batch", "batches"))
		}
	}
	return b.String()
}

// purgeStream runs one Purge call, handing each progress report to fn, and
// fails if the stream ends without a report marked done. --timeout bounds
// the wait for each report, so a long purge is not cut short while a stalled
// one is.
func purgeStream(ctx context.Context, c *adminClient, req *outboxv1.PurgeRequest, fn func(*outboxv1.PurgeResponse) error) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var watchdog *time.Timer
	if t := c.flags.timeout; t > 0 {
		watchdog = time.AfterFunc(t, cancel)
		defer watchdog.Stop()
	}
	rpcErr := func(err error) error {
		if watchdog != nil && sctx.Err() != nil && ctx.Err() == nil {
			return withExitCode(exitFailure, fmt.Errorf(
				"no progress from outboxd at %s within --timeout %v", c.flags.server, c.flags.timeout))
		}
		return c.rpcError(ctx, "Purge", err)
	}
	stream, err := c.rpc.Purge(sctx, req)
	if err != nil {
		return rpcErr(err)
	}
	for {
		r, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return withExitCode(exitFailure, errors.New("the server ended the purge without reporting it done"))
		}
		if err != nil {
			return rpcErr(err)
		}
		if watchdog != nil {
			watchdog.Reset(c.flags.timeout)
		}
		if err := fn(r); err != nil {
			return err
		}
		if r.GetDone() {
			return nil
		}
	}
}

// confirm asks prompt on the terminal and accepts only "y" or "yes". It
// refuses outright when stdin is not a terminal: a script must say --yes.
// An interrupt while it waits is a refusal too.
func confirm(ctx context.Context, c *adminClient, prompt string) error {
	return confirmAction(ctx, c, prompt, "purging", "purge")
}

// confirmAction is confirm for any action: doing ("purging") and do
// ("purge") word its refusals.
func confirmAction(ctx context.Context, c *adminClient, prompt, doing, do string) error {
	if !isTerminal(c.in) {
		return withExitCode(exitNotConfirmed, fmt.Errorf(
			"not %s: confirmation needs a terminal on stdin; pass --yes to %s without asking", doing, do))
	}
	fmt.Fprint(c.errOut, prompt)
	type answer struct {
		line string
		err  error
	}
	answered := make(chan answer, 1)
	// The read cannot be interrupted; if ctx ends first it is left blocked
	// until the process exits.
	go func() {
		line, err := bufio.NewReader(c.in).ReadString('\n')
		answered <- answer{line, err}
	}()
	var a answer
	select {
	case <-ctx.Done():
		fmt.Fprintln(c.errOut)
		return withExitCode(exitNotConfirmed, fmt.Errorf("not %s: interrupted", doing))
	case a = <-answered:
	}
	if a.err != nil && !errors.Is(a.err, io.EOF) {
		return withExitCode(exitNotConfirmed, fmt.Errorf("not %s: reading the answer: %w", doing, a.err))
	}
	switch strings.ToLower(strings.TrimSpace(a.line)) {
	case "y", "yes":
		return nil
	}
	if errors.Is(a.err, io.EOF) {
		fmt.Fprintln(c.errOut)
	}
	return withExitCode(exitNotConfirmed, fmt.Errorf("not %s: not confirmed", doing))
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
