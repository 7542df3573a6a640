package relay

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// gatedPublisher holds each revision's publish until its gate is closed
// (revisions without a gate pass at once), and signals each publish that
// starts.
type gatedPublisher struct {
	gates   map[int64]chan struct{}
	started chan Event
}

func (p *gatedPublisher) Publish(ctx context.Context, ev Event) error {
	p.started <- ev
	if g := p.gates[ev.Revision]; g != nil {
		select {
		case <-g:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// A stopping runner finishes the publish under way on a window's line and
// acks it, but takes no more of the line's queue: those deliveries are not
// under way, and are released with the stream for the next relay (here
// with an hour-long lease, which only the release can hand back in time).
func TestStoppingRunnerLeavesQueuedWindowUnpublished(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	var ids []string
	for range 4 {
		ids = append(ids, e.emit(t, "orders", "a"))
	}
	e.waitDiscovered(t)
	pub := &gatedPublisher{gates: map[int64]chan struct{}{1: make(chan struct{})}, started: make(chan Event, 10)}
	queued := make(chan string, 10)
	run := start(t, Config{Conn: e.srv.Conn, Publisher: pub, MaxInFlight: 4, MaxInFlightPerAggregate: 4, LeaseTTL: time.Hour, DrainTimeout: bound},
		hooks{windowQueued: func(id string) { queued <- id }})
	openAtEnd(t, pub.gates[1])
	if ev := waitSignal(t, "revision 1 to start", pub.started); ev.Revision != 1 {
		t.Fatalf("first publish is revision %d", ev.Revision)
	}
	for range 4 {
		waitSignal(t, "the window of 4 queued", queued)
	}
	// Stop, then let revision 1's publish finish during the drain.
	run.cancel()
	close(pub.gates[1])
	if err := waitSignal(t, "Run to return", run.done); err != nil {
		t.Fatalf("Run: %v", err)
	}
	run.done <- nil // for the cleanup
	select {
	case ev := <-pub.started:
		t.Fatalf("revision %d was published after the runner was told to stop", ev.Revision)
	default:
	}
	if !e.published(t, ids[0]) {
		t.Fatal("the publish that finished during the drain was not acked")
	}

	// The rest was released with the stream: another relay has it at once.
	next := newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: next}, hooks{})
	e.waitPublished(t, ids[1:]...)
}

// gapStream hides from the runner the first delivery of revision gap it
// receives, as if the server had skipped it within a lease.
type gapStream struct {
	grpc.ClientStream
	gap    int64
	hidden *atomic.Bool
}

func (s gapStream) RecvMsg(m any) error {
	for {
		err := s.ClientStream.RecvMsg(m)
		res, ok := m.(*outboxv1.SubscribeResponse)
		if err != nil || !ok || s.hidden.Load() {
			return err
		}
		hide := func(d *outboxv1.SubscribeResponse) bool {
			return d.GetEvent().GetRevision() == s.gap && s.hidden.CompareAndSwap(false, true)
		}
		if len(res.GetDeliveries()) == 0 {
			if hide(res) {
				continue
			}
			return nil
		}
		kept := res.Deliveries[:0]
		for _, d := range res.GetDeliveries() {
			if !hide(d) {
				kept = append(kept, d)
			}
		}
		res.Deliveries = kept
		if len(kept) > 0 {
			return nil
		}
	}
}

// A window never skips a revision at the broker: should a lease's
// deliveries arrive with one missing (revision 3 of 1-6 here), the runner
// publishes the revisions before the gap and drops the rest of that lease;
// they come again, from the missing one, under the next lease.
func TestWindowNeverPublishesPastAGapInItsLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	const n = 6
	var ids []string
	for range n {
		ids = append(ids, e.emit(t, "orders", "a"))
	}
	e.waitDiscovered(t)
	var hidden atomic.Bool
	gap := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, m, opts...)
		if err != nil {
			return nil, err
		}
		return gapStream{s, 3, &hidden}, nil
	})
	var leases streamLog
	pub := &orderedPublisher{inFlight: map[string]bool{}} // fails nothing
	// A short lease, so that the one left with the gap lapses soon.
	start(t, Config{Conn: e.dial(t, gap, leases.option()), Publisher: pub, MaxInFlight: n, MaxInFlightPerAggregate: n, LeaseTTL: time.Second}, hooks{})
	e.waitPublished(t, ids...)
	// The premise: the runner got revision 2 and then, revision 3 hidden,
	// revision 4 under the same lease. Under separate leases there would
	// be no gap within a lease, and nothing here would test the check.
	ds := leases.deliveries()
	i := slices.IndexFunc(ds, func(d delivered) bool { return d.revision == 3 })
	if i < 1 || i+1 >= len(ds) || ds[i-1].revision != 2 || ds[i+1].revision != 4 ||
		ds[i-1].epoch != ds[i].epoch || ds[i+1].epoch != ds[i].epoch {
		t.Fatalf("deliveries in arrival order %v: want the hidden first revision 3 between revisions 2 and 4 of its lease", ds)
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	var revs []int64
	for _, ev := range pub.attempts {
		revs = append(revs, ev.Revision)
	}
	next := int64(1)
	for _, r := range revs {
		if r > next {
			t.Fatalf("published revisions %v: %d before %d", revs, r, next)
		}
		if r == next {
			next++
		}
	}
}

// With a window, one lease covers several events, and an extension made
// while one of them was published extends it for the next: that one's
// publish keeps extending from the extended expiry. Counting from its own
// receipt instead, it would find the lease long lapsed and not extend it at
// all, so that another relay could take the aggregate mid-publish.
func TestWindowCarriesAnExtendedLeaseToTheNextEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "a")
	second := e.emit(t, "orders", "a")
	// Both discovered before the runner subscribes, so that its first claim
	// leases both under one lease.
	e.waitDiscovered(t)
	watch, extended := watchExtensions()
	var leases streamLog
	stopped := make(chan string, 10)
	queued := make(chan string, 10)
	pub := &gatedPublisher{gates: map[int64]chan struct{}{1: make(chan struct{}), 2: make(chan struct{})}, started: make(chan Event, 10)}
	const ttl = 2 * time.Second
	start(t, Config{Conn: e.dial(t, watch, leases.option()), Publisher: pub, LeaseTTL: ttl, MaxInFlight: 2, MaxInFlightPerAggregate: 2},
		hooks{extendStopped: func(id string, _ bool) { stopped <- id }, windowQueued: func(id string) { queued <- id }})
	openAtEnd(t, pub.gates[1], pub.gates[2])
	if ev := waitSignal(t, "revision 1 to start", pub.started); ev.Revision != 1 {
		t.Fatalf("first publish is revision %d", ev.Revision)
	}
	began := time.Now()
	// The premise: both events came under one lease (a delivery is
	// recorded before the runner queues it). Under two, revision 2 would
	// bring its own expiry and there would be no extension to carry over.
	for range 2 {
		waitSignal(t, "both events queued", queued)
	}
	if ds := leases.deliveries(); len(ds) < 2 || ds[0].revision != 1 || ds[1].revision != 2 || ds[0].epoch != ds[1].epoch {
		t.Fatalf("deliveries in arrival order %v: want revisions 1 and 2 under one lease", ds)
	}
	// Hold revision 1 until an extension sent a whole TTL after it began:
	// the lease revision 2 was delivered with has lapsed by the relay's
	// clock, and only the extensions keep it.
	for done := false; !done; {
		select {
		case x := <-extended:
			done = x.sent.Sub(began) > ttl
		case id := <-stopped:
			t.Fatalf("extending stopped during the publish of %s", id)
		case <-time.After(bound):
			t.Fatalf("no extension a TTL into revision 1's publish within %v", bound)
		}
	}
	close(pub.gates[1])
	if ev := waitSignal(t, "revision 2 to start", pub.started); ev.ID != second {
		t.Fatalf("second publish is %s revision %d, want %s", ev.ID, ev.Revision, second)
	}
	for done := false; !done; {
		select {
		case x := <-extended:
			done = x.eventID == second
		case id := <-stopped:
			t.Fatalf("the runner did not extend the window's lease during the publish of %s: it counted from that event's receipt", id)
		case <-time.After(bound):
			t.Fatalf("revision 2's publish was not extended within %v", bound)
		}
	}
	close(pub.gates[2])
	e.waitPublished(t, second)
}
