package server_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// lingerRig is a replica whose ack batches may linger a minute (far longer
// than any test waits: a batch that ends its linger early is seen as
// answered acks, one that does not as a failed test), with one session
// holding one delivery of each of n aggregates, and two relay connections
// to ack them through.
type lingerRig struct {
	r        *replica
	pool     *pgxpool.Pool
	relays   [2]outboxv1.RelayServiceClient
	st       outboxv1.RelayService_SubscribeClient
	ds       []*outboxv1.SubscribeResponse
	entered  chan struct{} // an ack batch began (beforeAckBatch)
	queued   chan struct{} // an ack request was queued
	lingered chan int      // an ack batch began to linger, with its acks
	hold     chan struct{} // closed: batches no longer wait in beforeAckBatch
	held     bool
	answers  chan ackAnswer
}

type ackAnswer struct {
	id  string
	res *outboxv1.AckResponse
	err error
}

func newLingerRig(t *testing.T, n int) *lingerRig {
	t.Helper()
	return newLingerRigOf(t, n, time.Minute)
}

func newLingerRigOf(t *testing.T, n int, linger time.Duration) *lingerRig {
	t.Helper()
	return newLingerRigWith(t, n, func(c *server.Config) { c.AckLinger = linger })
}

// newLingerRigWith is newLingerRig with the replica's configuration set by
// configure (which sets its AckLinger too).
func newLingerRigWith(t *testing.T, n int, configure func(*server.Config)) *lingerRig {
	t.Helper()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	g := &lingerRig{
		r:        startReplica(t, url, configure),
		pool:     pool,
		entered:  make(chan struct{}, 16),
		queued:   make(chan struct{}, 16),
		lingered: make(chan int, 16),
		hold:     make(chan struct{}),
		answers:  make(chan ackAnswer, 16),
	}
	t.Cleanup(g.release) // before the replica stops, should the test fail while holding it
	conn, err := grpc.NewClient(g.r.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	g.relays = [2]outboxv1.RelayServiceClient{g.r.Relay, outboxv1.NewRelayServiceClient(conn)}
	g.r.Server.SetBeforeAckBatch(func() {
		g.entered <- struct{}{}
		<-g.hold
	})
	g.r.Server.SetAfterAckQueued(func() { g.queued <- struct{}{} })
	g.r.Server.SetAckLingering(func(acks int) { g.lingered <- acks })
	for i := range n {
		emit(t, pool, "orders", string(rune('a'+i)), 1)
	}
	waitDiscovered(t, pool, n)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	g.st = subscribe(t, ctx, g.r, &outboxv1.SubscribeRequest{MaxInFlight: uint32(n)})
	g.ds, _ = receiveN(t, g.st, n)
	return g
}

func (g *lingerRig) release() {
	if !g.held {
		g.held = true
		close(g.hold)
	}
}

// ack acks delivery i in an Ack call of its own through relay connection
// conn, and waits until the ack is queued for the committer.
func (g *lingerRig) ack(t *testing.T, conn, i int) {
	t.Helper()
	d := g.ds[i]
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		res, err := g.relays[conn].Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
			{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
		g.answers <- ackAnswer{d.GetEvent().GetEventId(), res, err}
	}()
	select {
	case <-g.queued:
	case a := <-g.answers:
		t.Fatalf("the ack of %s was answered before it was queued: %v", a.id, a.err)
	case <-time.After(20 * time.Second):
		t.Fatal("an ack was not queued within 20s")
	}
}

// answered waits for n Ack calls to be answered, each with its ack
// published (an ack that lingers its whole minute fails here instead).
func (g *lingerRig) answered(t *testing.T, n int) {
	t.Helper()
	for range n {
		a := <-g.answers
		if a.err != nil {
			t.Fatalf("ack of %s: %v", a.id, a.err)
		}
		for _, r := range a.res.GetResults() {
			if r.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
				t.Fatalf("ack of %s: %v %s", r.GetEventId(), r.GetStatus(), r.GetMessage())
			}
		}
	}
}

// lingersThenCommitsWith expects the batch of the acks just queued (held,
// acks of them) to linger, then acks delivery i through conn, and expects it
// to be committed in that one batch.
func (g *lingerRig) lingersThenCommitsWith(t *testing.T, held, conn, i int) {
	t.Helper()
	select {
	case acks := <-g.lingered:
		if acks != held {
			t.Fatalf("the batch lingered with %d acks, want %d", acks, held)
		}
	case a := <-g.answers:
		t.Fatalf("the ack of %s was committed alone, without waiting for the ack of the delivery still outstanding", a.id)
	case <-time.After(20 * time.Second):
		t.Fatal("the batch neither lingered nor committed within 20s")
	}
	batches := len(g.entered)
	g.ack(t, conn, i)
	g.answered(t, held+1)
	if got := len(g.entered) - batches; got != 1 {
		t.Fatalf("%d ack batches began for the last %d acks, want 1", got, held+1)
	}
}

// acksInTurn acks deliveries 0, 1, ... one call after another, each through
// the relay connection conns names and answered before the next is sent.
func (g *lingerRig) acksInTurn(t *testing.T, conns ...int) {
	t.Helper()
	g.release()
	for i, conn := range conns {
		g.ack(t, conn, i)
		g.answered(t, 1)
	}
}

func (g *lingerRig) lingeredNone(t *testing.T, what string) {
	t.Helper()
	select {
	case acks := <-g.lingered:
		t.Fatalf("a batch of %d acks lingered %s", acks, what)
	default:
	}
}

// Issue 25, direction 1: under load (acks of two relay connections
// interleave, and deliveries besides this batch's are outstanding) an ack
// batch waits for company, and commits as soon as every delivery outstanding
// when it began is acked, long before the linger's minute is over.
func TestAckBatchLingersForCompanyUnderLoad(t *testing.T) {
	t.Parallel()
	g := newLingerRig(t, 3)
	g.release()
	g.ack(t, 1, 0) // the first batch has no ack before it: no linger
	g.answered(t, 1)
	g.lingeredNone(t, "with no ack before it")
	g.ack(t, 0, 1) // another connection's ack came just before; delivery 2 is out
	g.lingersThenCommitsWith(t, 1, 1, 2)
}

// The same when the acks of two connections queue together while a batch
// commits: the next batch holds both, and waits for the third.
func TestAckBatchLingersWhenCallersQueueTogether(t *testing.T) {
	t.Parallel()
	g := newLingerRig(t, 4)
	g.queueTwoCallersBehindABatch(t)
	g.answered(t, 1) // the first batch: one ack, none before it
	g.lingersThenCommitsWith(t, 2, 1, 3)
}

// queueTwoCallersBehindABatch acks delivery 0 on connection 0 and, while
// the committer holds that batch, queues connection 0's ack of delivery 1
// and connection 1's of delivery 2 behind it; then lets the committer go.
func (g *lingerRig) queueTwoCallersBehindABatch(t *testing.T) {
	t.Helper()
	g.ack(t, 0, 0)
	<-g.entered // held until both acks below are queued
	g.ack(t, 0, 1)
	g.ack(t, 1, 2)
	g.release()
}

// The ack before a batch (the one the rule compares the batch's first
// with) is the last one the batch before took, not its first: after a
// batch that held connection 0's ack and then connection 1's, an ack of
// connection 1 alone follows its own caller's, and commits at once, though
// another delivery is outstanding. Were the earlier batch's first ack
// taken for the one before, the lone ack would look interleaved with
// connection 0's and wait for company that a relay acking one call at a
// time never sends.
func TestAckBatchComparesWithTheLastAckBeforeIt(t *testing.T) {
	t.Parallel()
	g := newLingerRig(t, 4)
	g.queueTwoCallersBehindABatch(t)
	g.answered(t, 1) // the first batch: one ack, none before it
	// The next batch holds connection 0's ack, then connection 1's, and
	// ends its linger with connection 1's ack of the last delivery out.
	g.lingersThenCommitsWith(t, 2, 1, 3)
	// Two deliveries more, reaching the session with the credit the acks
	// freed: one to ack, one outstanding beside it.
	emit(t, g.pool, "orders", "y", 1)
	emit(t, g.pool, "orders", "z", 1)
	more, _ := receiveN(t, g.st, 2)
	g.ds = append(g.ds, more...)
	g.ack(t, 1, 4) // after connection 1's ack, which the batch before took last
	select {
	case acks := <-g.lingered:
		t.Fatalf("a batch of %d acks of connection 1 lingered after connection 1's ack, the last taken before it", acks)
	case a := <-g.answers:
		if a.err != nil {
			t.Fatalf("ack of %s: %v", a.id, a.err)
		}
		for _, r := range a.res.GetResults() {
			if r.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
				t.Fatalf("ack of %s: %v %s", r.GetEventId(), r.GetStatus(), r.GetMessage())
			}
		}
	}
}

// batchSizes records how many acks each ack batch of g's replica applied.
func (g *lingerRig) batchSizes() func() []int {
	var mu sync.Mutex
	var sizes []int
	g.r.Server.SetAfterAck(func(res []store.AckResult, err error) ([]store.AckResult, error) {
		mu.Lock()
		defer mu.Unlock()
		sizes = append(sizes, len(res))
		return res, err
	})
	return func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(sizes)
	}
}

// Config.AckBatch is the most acks one group commit applies: a batch that
// finds more queued takes as many as fit and leaves the rest to the next.
// (One committer, so that every ack queues where the batch looks.)
func TestAckBatchTakesAtMostAckBatchQueued(t *testing.T) {
	t.Parallel()
	g := newLingerRigWith(t, 5, func(c *server.Config) {
		c.AckLinger = time.Minute
		c.AckBatch = 3
		c.AckCommitters = 1
	})
	sizes := g.batchSizes()
	g.ack(t, 0, 0)
	<-g.entered // held until the four acks below are queued
	for i := 1; i <= 4; i++ {
		g.ack(t, 1, i) // one caller: no batch lingers
	}
	g.release()
	g.answered(t, 5)
	for _, n := range sizes() {
		if n > 3 {
			t.Fatalf("ack batches of %v acks, want at most AckBatch (3) each", sizes())
		}
	}
}

// The same for a batch that lingers for company: it stops waiting once it
// holds AckBatch acks, though deliveries it would wait for are still
// outstanding, and acks queued after that go to the next batch.
func TestAckBatchLingersForAtMostAckBatch(t *testing.T) {
	t.Parallel()
	g := newLingerRigWith(t, 6, func(c *server.Config) {
		c.AckLinger = time.Minute
		c.AckBatch = 3
		c.AckCommitters = 1
	})
	sizes := g.batchSizes()
	g.queueTwoCallersBehindABatch(t)
	g.answered(t, 1) // the first batch: one ack, none before it
	// The next batch holds connection 0's ack and connection 1's, with
	// deliveries 3, 4 and 5 outstanding: it lingers, and the third ack
	// fills it.
	select {
	case acks := <-g.lingered:
		if acks != 2 {
			t.Fatalf("the batch lingered with %d acks, want 2", acks)
		}
	case a := <-g.answers:
		t.Fatalf("the ack of %s was committed without waiting for the deliveries still outstanding", a.id)
	}
	for i := 3; i <= 5; i++ {
		g.ack(t, 1, i)
	}
	g.answered(t, 5)
	got := sizes()
	for _, n := range got {
		if n > 3 {
			t.Fatalf("ack batches of %v acks, want at most AckBatch (3) each", got)
		}
	}
	if len(got) < 2 || got[1] != 3 {
		t.Fatalf("ack batches of %v acks, want the lingering one (the second) to end full, at 3", got)
	}
}

// A negative Config.AckLinger turns the linger off: the batch that lingers
// in the test above commits at once. The replica's default lingers
// (DefaultAckLinger), so off must be said.
func TestAckBatchDoesNotLingerWhenOff(t *testing.T) {
	t.Parallel()
	g := newLingerRigOf(t, 4, -1)
	g.queueTwoCallersBehindABatch(t) // two callers in the next batch, delivery 3 still out
	g.answered(t, 3)
	g.lingeredNone(t, "with the linger off")
}

// A batch whose acks are all this replica has outstanding commits at once:
// there is nothing to wait for, even under load.
func TestAckBatchDoesNotLingerWithNothingOutstanding(t *testing.T) {
	t.Parallel()
	g := newLingerRig(t, 2)
	g.acksInTurn(t, 1, 0) // interleaved, but nothing else is out for the second
	g.lingeredNone(t, "with nothing else outstanding")
}

// Acks that come from one connection (one relay process, whose next call
// waits for this answer; a hot aggregate handed over ack by ack; a relay
// acking while another that holds deliveries has stalled) commit at once.
func TestAckBatchDoesNotLingerForOneCaller(t *testing.T) {
	t.Parallel()
	g := newLingerRig(t, 3)
	g.acksInTurn(t, 0, 0) // delivery 2 is still out, but no other caller acks
	g.lingeredNone(t, "for acks of one connection")
}

// Acks of two connections far apart (a trickle through two relays) are not
// load: a batch lingers only when the other caller's ack came within four
// lingers of its own.
func TestAckBatchDoesNotLingerAfterAQuietSpell(t *testing.T) {
	t.Parallel()
	const linger = 50 * time.Millisecond
	g := newLingerRigOf(t, 3, linger)
	g.acksInTurn(t, 1)
	time.Sleep(5 * linger) // the rule's own window: longer than four lingers
	g.ack(t, 0, 1)         // delivery 2 is still out
	g.answered(t, 1)
	g.lingeredNone(t, "after the other connection's ack was five lingers old")
}

// What an ack batch lingers on (the replica's outstanding deliveries)
// never counts a lease both applied, gone from the session's in-flight
// set, and still pending in the session's freed list: the session counts
// its in-flight set before it lets its lock go. Were the count stored after
// the unlock, a batch between the two would count an acked delivery twice
// and wait for an ack that never comes, up to the whole linger.
func TestOutstandingCountsAnAppliedAckOnce(t *testing.T) {
	t.Parallel()
	g := newLingerRigOf(t, 2, -1)
	g.release()
	type applied struct {
		n           int
		outstanding int64
	}
	seen := make(chan applied, 16)
	g.r.Server.SetFreedApplied(func(n int, outstanding int64) { seen <- applied{n, outstanding} })
	g.ack(t, 0, 0)
	g.answered(t, 1)
	for {
		select {
		case a := <-seen:
			if a.n == 0 {
				continue // a reconcile's turn, before the ack was in
			}
			if a.n != 1 || a.outstanding != 1 {
				t.Fatalf("after applying %d freed leases of 2 deliveries with one acked, outstanding says %d; want 1 applied, 1 outstanding", a.n, a.outstanding)
			}
			return
		case <-time.After(20 * time.Second):
			t.Fatal("the session did not apply the ack within 20s")
		}
	}
}
