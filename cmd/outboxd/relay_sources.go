package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/multisource"
)

// DefaultSourcesInterval is how often a relay with routes of every source
// (*/payments) asks the server which sources it serves (--sources-interval).
const DefaultSourcesInterval = 15 * time.Second

// sourceFollower runs the subscriptions of the routes of source "*": one
// per route and source the server lists (RelayService.ListSources), each
// an ordinary subscription with its own credit, started when its source
// appears and stopped, draining as a relay does at shutdown, when it goes.
type sourceFollower struct {
	client outboxv1.RelayServiceClient
	fixed  []route // routes of named sources, which take precedence
	wild   []route
	every  time.Duration
	log    *slog.Logger
	// run runs one expanded route until ctx is done (relay.Runner.Run).
	run func(ctx context.Context, rt route) error
	// conn, when set, is watched: each time it becomes ready again (the
	// server restarted, perhaps with other sources) the sources are listed
	// at once instead of at the next interval.
	conn *grpc.ClientConn
	// onEnded, when set (tests), is called as each subscription's end is
	// taken in, before it is handled.
	onEnded func(source string, err error)
}

// followKey names one expanded route: a --route (its index) of a source.
type followKey struct {
	index  int
	source string
}

type following struct {
	rt     route
	cancel context.CancelFunc
}

type followEnded struct {
	key followKey
	f   *following
	err error
}

// Run follows the server's sources until ctx is done, then stops every
// subscription and waits for them to drain. It returns the error of a
// subscription whose source is still listed (the server unable to serve
// it, say: the relay must not look alive serving only some sources), or of
// a ListSources refused for the relay's credentials. A subscription refused
// PERMISSION_DENIED (a server that predates ListSourcesRequest.streams
// lists sources where the token has only other streams) is logged and left
// stopped until the listing changes: the token says what the relay may
// serve. The end of a subscription already stopped or replaced is no
// news.
func (sf *sourceFollower) Run(ctx context.Context) error {
	var (
		wg      sync.WaitGroup
		running = map[followKey]*following{}
		ended   = make(chan followEnded)
		quit    = make(chan struct{})
		denied  = map[followKey]bool{} // refused; not started again until the listing changes
		last    [][]string             // the listing denied was met under
		idle    string                 // the patterns last warned of as matching no source
	)
	stopAll := func() {
		for _, f := range running {
			f.cancel()
		}
		close(quit)
		wg.Wait()
	}
	start := func(k followKey, rt route) {
		runCtx, cancel := context.WithCancel(ctx)
		f := &following{rt: rt, cancel: cancel}
		running[k] = f
		wg.Go(func() {
			err := sf.run(runCtx, rt)
			select {
			case ended <- followEnded{k, f, err}:
			case <-quit:
			}
		})
	}
	unimplemented, failing := false, false
	timer := time.NewTimer(0)
	defer timer.Stop()
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	reconnected := whenReady(watchCtx, sf.conn)
	for {
		var failed *followEnded
		select {
		case <-ctx.Done():
			stopAll()
			return nil
		case <-reconnected:
			sf.log.Debug("connected to the server: listing its sources")
		case e := <-ended:
			if sf.onEnded != nil {
				sf.onEnded(e.key.source, e.err)
			}
			if running[e.key] != e.f {
				// Stopped (its source left the listing) or replaced since:
				// how it ended says nothing of the subscription now wanted.
				sf.log.Debug("a stopped subscription ended", "source", e.key.source, "streams", e.f.rt.label(), "err", e.err)
				continue
			}
			delete(running, e.key)
			if e.err == nil {
				continue // stopped by us
			}
			if status.Code(e.err) == codes.PermissionDenied {
				denied[e.key] = true
				sf.log.Warn("the server refused this relay's token for a subscription of a source it listed; leaving it stopped until the server's list of sources changes",
					"source", e.key.source, "streams", e.f.rt.label(), "err", e.err)
				continue
			}
			failed = &e
		case <-timer.C:
		}
		sources, err := sf.list(ctx, &unimplemented)
		switch {
		case ctx.Err() != nil:
			stopAll()
			return nil
		case status.Code(err) == codes.Unauthenticated || status.Code(err) == codes.PermissionDenied:
			stopAll()
			return fmt.Errorf("relay: ListSources refused (%s): %w", status.Code(err), err)
		case err != nil:
			// The server is away: keep what runs (its runners reconnect
			// on their own) and ask again soon.
			if !failing {
				sf.log.Warn("listing the server's sources failed; asking again every second until it answers", "err", err)
			} else {
				sf.log.Debug("listing the server's sources failed again", "err", err)
			}
			failing = true
			// A subscription that ended with an error is started again by
			// the next listing that still names its source (and then fails
			// the relay if it ends so again).
			timer.Reset(min(sf.every, time.Second))
			continue
		}
		failing = false
		if failed != nil {
			if slices.Contains(sources[sf.wildOf(failed.key.index)], failed.key.source) {
				stopAll()
				return failed.err
			}
			sf.log.Info("subscription of a source no longer listed ended", "source", failed.key.source, "err", failed.err)
		}
		if !slices.EqualFunc(sources, last, slices.Equal) {
			clear(denied)
			last = sources
		}
		want := map[followKey]route{}
		for _, rt := range expandRoutes(sf.fixed, sf.wild, sources) {
			want[followKey{rt.index, rt.source}] = rt
		}
		if i := sf.unmatched(want); i != idle {
			if i != "" {
				sf.log.Warn("no source matched these patterns, so nothing of theirs is relayed: the server lists no source where the relay's token allows their streams, or routes naming a source take them",
					"patterns", i)
			}
			idle = i
		}
		for k, f := range running {
			if _, ok := want[k]; !ok {
				sf.log.Info("source no longer listed: stopping its subscription (publishes under way are acked first)", "source", k.source, "streams", f.rt.label())
				f.cancel()
				delete(running, k)
			}
		}
		for k, rt := range want {
			if running[k] == nil && !denied[k] {
				start(k, rt)
			}
		}
		if failed == nil {
			timer.Reset(sf.every)
		}
	}
}

// whenReady signals each time conn becomes ready (connected) after it was
// not, until ctx is done; never when conn is nil.
func whenReady(ctx context.Context, conn *grpc.ClientConn) <-chan struct{} {
	ch := make(chan struct{}, 1)
	if conn == nil {
		return ch
	}
	go func() {
		state := conn.GetState()
		for conn.WaitForStateChange(ctx, state) {
			prev := state
			state = conn.GetState()
			if state == connectivity.Ready && prev != connectivity.Ready {
				select {
				case ch <- struct{}{}:
				default: // a listing is due already
				}
			}
		}
	}()
	return ch
}

// wildOf returns the index in sf.wild of the route of --route index.
func (sf *sourceFollower) wildOf(index int) int {
	return slices.IndexFunc(sf.wild, func(w route) bool { return w.index == index })
}

// unmatched names the patterns (routes of source "*") that want has no
// subscription of, for a warning: "" when each has one.
func (sf *sourceFollower) unmatched(want map[followKey]route) string {
	matched := map[int]bool{}
	for k := range want {
		matched[k.index] = true
	}
	var out []string
	for _, w := range sf.wild {
		if !matched[w.index] {
			out = append(out, w.label())
		}
	}
	return strings.Join(out, " ")
}

// list asks the server for the sources of each of sf.wild (in its order):
// those where the relay's token allows the route's streams (payments of
// */payments, every stream for */*), so that a subscription it opens is
// not refused. A server that predates ListSources (UNIMPLEMENTED) serves
// default alone.
func (sf *sourceFollower) list(ctx context.Context, unimplemented *bool) ([][]string, error) {
	out := make([][]string, len(sf.wild))
	for i, w := range sf.wild {
		var streams []string
		for _, a := range w.streams {
			_, stream := multisource.SplitStream(a)
			streams = append(streams, stream)
		}
		sources, err := sf.listOf(ctx, streams, unimplemented)
		if err != nil {
			return nil, err
		}
		out[i] = sources
	}
	return out, nil
}

func (sf *sourceFollower) listOf(ctx context.Context, streams []string, unimplemented *bool) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	res, err := sf.client.ListSources(ctx, &outboxv1.ListSourcesRequest{Streams: streams})
	if status.Code(err) == codes.Unimplemented {
		if !*unimplemented {
			sf.log.Info("the server predates ListSources: it serves source default alone")
			*unimplemented = true
		}
		return []string{multisource.Default}, nil
	}
	if err != nil {
		return nil, err
	}
	return res.GetSources(), nil
}
