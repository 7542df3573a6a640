package server_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/server"
)

// emitTimeout bounds each emit of the helpers below, so that a producer
// blocked by a bug fails the test instead of hanging it.
const emitTimeout = 30 * time.Second

func emit(t testing.TB, pool *pgxpool.Pool, stream, key string, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	ctx, cancel := context.WithTimeout(context.Background(), emitTimeout)
	defer cancel()
	for i := range n {
		e, err := client.Emit(ctx, pool, client.Event{
			Stream: stream, AggregateKey: key, Type: "Changed",
			Payload: []byte(fmt.Sprintf(`{"i":%d}`, i)), Headers: map[string]string{"trace": "t-" + key},
		})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = e.ID
	}
	return ids
}

// emitAt emits one event with an explicit revision.
func emitAt(t testing.TB, pool *pgxpool.Pool, stream, key string, rev int64) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), emitTimeout)
	defer cancel()
	e, err := client.Emit(ctx, pool, client.Event{
		Stream: stream, AggregateKey: key, Type: "T", Payload: []byte(`{}`), Revision: rev})
	if err != nil {
		t.Fatal(err)
	}
	return e.ID.String()
}

func subscribe(t *testing.T, ctx context.Context, r *replica, req *outboxv1.SubscribeRequest) outboxv1.RelayService_SubscribeClient {
	t.Helper()
	if req.RelayId == "" {
		req.RelayId = "test-relay"
	}
	st, err := r.Relay.Subscribe(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// recv receives one delivery or fails the test after a generous bound (a
// hang guard, not a timing assertion).
func recv(t *testing.T, st outboxv1.RelayService_SubscribeClient) *outboxv1.SubscribeResponse {
	t.Helper()
	return recvWithin(t, st, 30*time.Second, "recv")
}

// recvWithin receives one delivery within d, or fails with what: the
// deadline on a promise (a session keeps delivering while work is there),
// not a timing assertion.
func recvWithin(t *testing.T, st outboxv1.RelayService_SubscribeClient, d time.Duration, what string) *outboxv1.SubscribeResponse {
	t.Helper()
	type res struct {
		d   *outboxv1.SubscribeResponse
		err error
	}
	c := make(chan res, 1)
	go func() { d, err := st.Recv(); c <- res{d, err} }()
	select {
	case r := <-c:
		if r.err != nil {
			t.Fatalf("recv: %v", r.err)
		}
		return r.d
	case <-time.After(d):
		t.Fatalf("%s: no delivery within %v", what, d)
		return nil
	}
}

func ack(t *testing.T, r *replica, ds ...*outboxv1.SubscribeResponse) []*outboxv1.AckResult {
	t.Helper()
	req := &outboxv1.AckRequest{}
	for _, d := range ds {
		req.Acks = append(req.Acks, &outboxv1.AckItem{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()})
	}
	res, err := r.Relay.Ack(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return res.GetResults()
}

// ackPublished acks ds in one Ack call, as ack does, and fails the test
// unless every one of them published its event, naming each that did not.
func ackPublished(t *testing.T, r *replica, ds ...*outboxv1.SubscribeResponse) {
	t.Helper()
	res := ack(t, r, ds...)
	if len(res) != len(ds) {
		t.Fatalf("ack of %d deliveries: %d results", len(ds), len(res))
	}
	var failed []string
	for i, d := range ds {
		if s := res[i].GetStatus(); s != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			ev := d.GetEvent()
			failed = append(failed, fmt.Sprintf("%s/%s revision %d (event %s): %v %q",
				ev.GetStream(), ev.GetAggregateKey(), ev.GetRevision(), ev.GetEventId(), s, res[i].GetMessage()))
		}
	}
	if len(failed) > 0 {
		t.Fatalf("ack not PUBLISHED: %s", strings.Join(failed, "; "))
	}
}

func publishedAt(t *testing.T, pool *pgxpool.Pool, id string) *time.Time {
	t.Helper()
	var p *time.Time
	if err := pool.QueryRow(context.Background(), `SELECT published_at FROM outbox.event WHERE event_id = $1`, id).Scan(&p); err != nil {
		t.Fatal(err)
	}
	return p
}

// clockSlack allows for the database's and the test's clocks (the same host)
// and for rounding to microseconds.
const clockSlack = 100 * time.Millisecond

// grantedAt is when the server says it granted d's lease: its expiry minus
// the TTL the relay asked for.
func grantedAt(d *outboxv1.SubscribeResponse, ttl time.Duration) time.Time {
	return d.GetLeaseExpiresAt().AsTime().Add(-ttl)
}

// checkGranted fails unless d's lease was granted for ttl at a moment
// between from and to: a server that read the TTL in the wrong unit, or
// ignored it, fails here.
func checkGranted(t *testing.T, d *outboxv1.SubscribeResponse, ttl time.Duration, from, to time.Time) {
	t.Helper()
	at := grantedAt(d, ttl)
	if at.Before(from.Add(-clockSlack)) || at.After(to.Add(clockSlack)) {
		t.Fatalf("lease expires at %v: granted at %v for %v, which is not between %v and %v",
			d.GetLeaseExpiresAt().AsTime(), at, ttl, from, to)
	}
}

// Invariants 3 and 5: revisions of one aggregate are handed out one at a
// time, in order, and published_at is set by the ack and nothing else.
func TestDeliversOneAggregateInOrderAndMarksOnlyOnAck(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "o-1", 3)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 10})
	for i, id := range ids {
		d := recv(t, st)
		ev := d.GetEvent()
		if ev.GetEventId() != id.String() || ev.GetRevision() != int64(i+1) || d.GetAttempt() != 1 {
			t.Fatalf("delivery %d = %s rev %d attempt %d, want %s rev %d attempt 1", i, ev.GetEventId(), ev.GetRevision(), d.GetAttempt(), id, i+1)
		}
		if string(ev.GetPayload()) != fmt.Sprintf(`{"i": %d}`, i) || ev.GetHeaders()["trace"] != "t-o-1" || ev.GetEventType() != "Changed" {
			t.Fatalf("delivery %d carries payload %s headers %v", i, ev.GetPayload(), ev.GetHeaders())
		}
		// Until the ack, the event is not published and the next revision
		// is not leased to anyone.
		if p := publishedAt(t, pool, id.String()); p != nil {
			t.Fatalf("event %d published before its ack", i)
		}
		if i+1 < len(ids) {
			var state string
			var leased *uuid.UUID
			if err := pool.QueryRow(ctx, `SELECT state, leased_event_id FROM outbox.delivery WHERE aggregate_key = 'o-1'`).Scan(&state, &leased); err != nil {
				t.Fatal(err)
			}
			if state != "leased" || leased == nil || *leased != id {
				t.Fatalf("aggregate is %s on %v while revision %d is out, want leased on it", state, leased, i+1)
			}
		}
		ackPublished(t, r, d)
		if publishedAt(t, pool, id.String()) == nil {
			t.Fatalf("event %d not published after its ack", i)
		}
		// A repeated ack is idempotent.
		if res := ack(t, r, d); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED {
			t.Fatalf("second ack %d: %v", i, res[0])
		}
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox.delivery WHERE aggregate_key = 'o-1'`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "idle" {
		t.Fatalf("drained aggregate is %s, want idle", state)
	}
	// An event emitted now, after the aggregate went idle, still arrives.
	late := emit(t, pool, "orders", "o-1", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != late[0].String() || d.GetEvent().GetRevision() != 4 {
		t.Fatalf("late event: got %v", d.GetEvent())
	}
}

// Invariants 2 and 6: a relay that never acks leaves published_at NULL, and
// after the TTL the same event comes again, identical, with attempt 2.
func TestUnackedLeaseExpiresAndRedeliversSameEvent(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "o-ttl", 2)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const ttl = time.Second
	before := time.Now()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 5, LeaseTtl: durationpb.New(ttl)})
	first := recv(t, st)
	checkGranted(t, first, ttl, before, time.Now())
	again := recv(t, st) // only after the lease expires
	if again.GetEvent().GetEventId() != ids[0].String() || again.GetAttempt() != 2 {
		t.Fatalf("redelivery = %s attempt %d, want %s attempt 2", again.GetEvent().GetEventId(), again.GetAttempt(), ids[0])
	}
	// Not before the first lease expired, by the server's own clock.
	if expired := first.GetLeaseExpiresAt().AsTime(); grantedAt(again, ttl).Before(expired) {
		t.Fatalf("redelivered at %v, before the first lease expired at %v", grantedAt(again, ttl), expired)
	}
	checkGranted(t, again, ttl, first.GetLeaseExpiresAt().AsTime(), time.Now())
	if string(again.GetEvent().GetPayload()) != string(first.GetEvent().GetPayload()) ||
		again.GetEvent().GetHeaders()["trace"] != first.GetEvent().GetHeaders()["trace"] ||
		!again.GetEvent().GetCreatedAt().AsTime().Equal(first.GetEvent().GetCreatedAt().AsTime()) {
		t.Fatal("redelivery differs from the first delivery")
	}
	if again.GetLeaseToken() == first.GetLeaseToken() {
		t.Fatal("redelivery reused the expired lease's token")
	}
	if publishedAt(t, pool, ids[0].String()) != nil {
		t.Fatal("unacked event was marked published")
	}
	// The old lease is fenced: it can neither nack nor extend...
	_, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: ids[0].String(), LeaseToken: first.GetLeaseToken(), Error: "late"})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("nack with expired lease: %v, want FailedPrecondition", err)
	}
	_, err = r.Relay.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{EventId: ids[0].String(), LeaseToken: first.GetLeaseToken(), Ttl: durationpb.New(time.Minute)})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("extend with expired lease: %v, want FailedPrecondition", err)
	}
	// ...but its ack is still the truth about the broker: it publishes.
	ackPublished(t, r, first)
	if res := ack(t, r, again); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED {
		t.Fatalf("ack of the redelivery: %v", res[0])
	}
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[1].String() {
		t.Fatalf("after the ack got %s, want revision 2", d.GetEvent().GetEventId())
	}
}

// The credit is a hard bound: with max_in_flight 2 and 5 ready aggregates,
// exactly 2 leases exist until one is acked, however many reconciliations
// and producer wake-ups pass, and no extra delivery arrives.
func TestCreditBoundsOutstandingDeliveries(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const reconcile = 10 * time.Millisecond
	r := startReplica(t, url, func(c *server.Config) { c.ReconcileInterval = reconcile })
	for i := range 5 {
		emit(t, pool, "orders", fmt.Sprintf("c-%d", i), 1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2})
	got, next := receive(t, st)
	leased := func() int64 {
		var n int64
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE state = 'leased'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// holds checks, over 30 reconcile intervals with a producer wake-up in
	// the middle, that exactly 2 leases exist and nothing more arrives.
	holds := func(when string) {
		t.Helper()
		end := time.Now().Add(30 * reconcile)
		emit(t, pool, "orders", "wake-"+when, 1)
		for time.Now().Before(end) {
			if n := leased(); n != 2 {
				t.Fatalf("%s: %d leased with credit 2", when, n)
			}
			select {
			case d := <-got:
				t.Fatalf("%s: extra delivery %s beyond the credit", when, d.GetEvent().GetAggregateKey())
			case <-time.After(reconcile):
			}
		}
	}
	a, b := next(), next()
	holds("before any ack")
	ack(t, r, a)
	c := next()
	holds("after one ack")
	ack(t, r, b, c)
	next()
	next()
}

// receive reads st in the background: got has every delivery, and next
// returns the next one (failing the test after 30 s, or if the stream ends).
func receive(t *testing.T, st outboxv1.RelayService_SubscribeClient) (got <-chan *outboxv1.SubscribeResponse, next func() *outboxv1.SubscribeResponse) {
	c := make(chan *outboxv1.SubscribeResponse, 64)
	go func() {
		for {
			d, err := st.Recv()
			if err != nil {
				close(c)
				return
			}
			c <- d
		}
	}()
	return c, func() *outboxv1.SubscribeResponse {
		t.Helper()
		select {
		case d, ok := <-c:
			if !ok {
				t.Fatal("stream ended")
			}
			return d
		case <-time.After(30 * time.Second):
			t.Fatal("no delivery within 30s")
			return nil
		}
	}
}

func TestAckThroughAnotherReplica(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	// Reconciliation is slow here, so the next delivery can only come fast
	// through B's notification.
	a := startReplica(t, url, func(c *server.Config) { c.ReconcileInterval = time.Hour; c.PollInterval = time.Hour })
	b := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "x", 3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, a, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	for i, id := range ids {
		d := recv(t, st)
		if d.GetEvent().GetEventId() != id.String() {
			t.Fatalf("delivery %d = %s, want %s", i, d.GetEvent().GetEventId(), id)
		}
		if res := ack(t, b, d); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Fatalf("ack on B: %v", res[0])
		}
	}
}

// A nack through replica B tells the session on replica A that held the
// lease, as an ack does: its credit is free at once, not at its next
// reconciliation.
func TestNackThroughAnotherReplica(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startReplica(t, url, func(c *server.Config) { c.ReconcileInterval = time.Hour; c.PollInterval = time.Hour })
	b := startReplica(t, url, func(c *server.Config) { c.BackoffBase, c.BackoffCap = time.Hour, time.Hour })
	emit(t, pool, "orders", "x", 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, a, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	d := recv(t, st)
	// Committed while A's only credit is taken: A claims it only once it
	// learns the nack freed that credit.
	emit(t, pool, "orders", "y", 1)
	nack(t, b, d)
	if next := recv(t, st); next.GetEvent().GetAggregateKey() != "y" {
		t.Fatalf("after the nack on B, A delivered %v", next.GetEvent())
	}
}

// Error text a relay sends with a nack never makes the nack fail: NUL bytes
// (which PostgreSQL text cannot hold) are replaced and text over 4 KiB is
// cut; the aggregate shows what was kept.
func TestNackErrorTextIsSanitized(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	emit(t, pool, "orders", "nul", 1)
	emit(t, pool, "orders", "long", 1)
	emit(t, pool, "orders", "exact", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3})
	texts := map[string]string{
		"nul":   "broker\x00said\x00no",
		"long":  strings.Repeat("é", 100_000), // 200 KB of two-byte characters
		"exact": strings.Repeat("x", 4096),    // as much as is kept: kept whole
	}
	for range 3 {
		d := recv(t, st)
		key := d.GetEvent().GetAggregateKey()
		if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{
			EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Error: texts[key]}); err != nil {
			t.Fatalf("nack with %s error text: %v", key, err)
		}
	}
	get := func(key string) string {
		agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: key})
		if err != nil {
			t.Fatal(err)
		}
		if agg.GetAggregate().GetFailures() != 1 {
			t.Errorf("%s: %d failures recorded, want 1", key, agg.GetAggregate().GetFailures())
		}
		return agg.GetAggregate().GetLastError()
	}
	if got := get("nul"); got != "broker\uFFFDsaid\uFFFDno" {
		t.Errorf("last error %q", got)
	}
	if got := get("exact"); got != texts["exact"] {
		t.Errorf("error text of exactly 4096 bytes kept as %d bytes ending %q", len(got), got[max(0, len(got)-8):])
	}
	if got := get("long"); len(got) > 4096 || !utf8.ValidString(got) || !strings.HasPrefix(got, "éé") || !strings.HasSuffix(got, "é…") {
		t.Errorf("long error kept as %d bytes (valid UTF-8: %v)", len(got), utf8.ValidString(got))
	}
}

// A claim that committed but failed before the session read its rows (a
// timeout, say) leaves no orphaned lease: the session gives back what it
// does not know it holds, and the event is delivered at once, not after its
// one-hour TTL. (Dispatch off, so that the event takes the claim path;
// TestDispatchWithLostAnswerLeavesNoOrphan is the same for a round.)
func TestFailedClaimOrphansNoLease(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	var dropped atomic.Bool
	r.Server.SetAfterClaim(func(leases []store.Lease, err error) ([]store.Lease, error) {
		if err == nil && len(leases) > 0 && dropped.CompareAndSwap(false, true) {
			return nil, context.DeadlineExceeded // committed, never read
		}
		return leases, err
	})
	ids := emit(t, pool, "orders", "o-1", 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)
	if !dropped.Load() || d.GetEvent().GetEventId() != ids[0].String() || d.GetAttempt() != 2 {
		t.Fatalf("after a dropped claim: %s attempt %d (dropped %v); want %s attempt 2",
			d.GetEvent().GetEventId(), d.GetAttempt(), dropped.Load(), ids[0])
	}
}

// Bad input gets a clear status, nothing is marked wrongly, and the server
// keeps serving.
func TestBadRelayInput(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "k1", 2)
	emit(t, pool, "orders", "k2", 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	badSubs := []struct {
		req   *outboxv1.SubscribeRequest
		code  codes.Code
		field string
	}{
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 0}, codes.InvalidArgument, "max_in_flight"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1 << 30}, codes.InvalidArgument, "max_in_flight"},
		{&outboxv1.SubscribeRequest{RelayId: "", MaxInFlight: 1}, codes.InvalidArgument, "relay_id"},
		{&outboxv1.SubscribeRequest{RelayId: "r\x7f", MaxInFlight: 1}, codes.InvalidArgument, "relay_id"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1, Streams: []string{"Bad Name"}}, codes.InvalidArgument, "streams[0]"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1, LeaseTtl: durationpb.New(time.Millisecond)}, codes.InvalidArgument, "lease_ttl"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1, Streams: []string{"no_such_stream"}}, codes.NotFound, ""},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1, Streams: []string{"orders", "orders"}}, codes.InvalidArgument, "streams[1]"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1, Streams: []string{"orders"}, ExcludeStreams: []string{"orders"}}, codes.InvalidArgument, "exclude_streams[0]"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1, ExcludeStreams: []string{"orders", "orders"}}, codes.InvalidArgument, "exclude_streams[1]"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 4, MaxInFlightPerAggregate: 5}, codes.InvalidArgument, "max_in_flight_per_aggregate"},
		{&outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 5000, MaxInFlightPerAggregate: 1001}, codes.InvalidArgument, "max_in_flight_per_aggregate"},
	}
	for _, c := range badSubs {
		st, err := r.Relay.Subscribe(ctx, c.req)
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != c.code {
			t.Errorf("Subscribe(%v) = %v, want %v", c.req, err, c.code)
			continue
		}
		if c.field != "" && !hasFieldViolation(err, c.field) {
			t.Errorf("Subscribe(%v) = %v, want a violation on %s", c.req, err, c.field)
		}
	}

	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2})
	d1, d2 := recv(t, st), recv(t, st)
	forged := d1.GetLeaseToken()[:len(d1.GetLeaseToken())-2] + "AA"
	if forged == d1.GetLeaseToken() {
		forged = d1.GetLeaseToken()[:len(d1.GetLeaseToken())-2] + "BB"
	}
	res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: d1.GetEvent().GetEventId(), LeaseToken: forged},             // forged
		{EventId: d1.GetEvent().GetEventId(), LeaseToken: "garbage"},          // garbled
		{EventId: d1.GetEvent().GetEventId(), LeaseToken: d2.GetLeaseToken()}, // another aggregate's token
		{EventId: "not-a-uuid", LeaseToken: d1.GetLeaseToken()},               // garbled id
		{EventId: uuid.NewString(), LeaseToken: d1.GetLeaseToken()},           // unknown id
		{EventId: d2.GetEvent().GetEventId(), LeaseToken: d2.GetLeaseToken()}, // fine
		{EventId: d2.GetEvent().GetEventId(), LeaseToken: d2.GetLeaseToken()}, // the same ack twice
	}})
	if err != nil {
		t.Fatal(err)
	}
	want := []outboxv1.AckStatus{
		outboxv1.AckStatus_ACK_STATUS_INVALID, outboxv1.AckStatus_ACK_STATUS_INVALID,
		outboxv1.AckStatus_ACK_STATUS_INVALID, outboxv1.AckStatus_ACK_STATUS_INVALID,
		outboxv1.AckStatus_ACK_STATUS_INVALID,
		outboxv1.AckStatus_ACK_STATUS_PUBLISHED, outboxv1.AckStatus_ACK_STATUS_PUBLISHED,
	}
	for i, w := range want {
		if got := res.GetResults()[i].GetStatus(); got != w {
			t.Errorf("ack item %d: %v (%s), want %v", i, got, res.GetResults()[i].GetMessage(), w)
		}
	}
	if publishedAt(t, pool, d1.GetEvent().GetEventId()) != nil {
		t.Fatal("event marked published by a bad ack")
	}
	for _, req := range []*outboxv1.AckRequest{{}, {Acks: make([]*outboxv1.AckItem, 1001)}} {
		if _, err := r.Relay.Ack(ctx, req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("Ack with %d items: %v, want InvalidArgument", len(req.GetAcks()), err)
		}
	}
	if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d1.GetEvent().GetEventId(), LeaseToken: "x"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Nack with garbled token: %v", err)
	}
	// An extension must say for how long: without ttl it is refused, and
	// the lease is left as it was (d1 acks below).
	if _, err := r.Relay.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{EventId: d1.GetEvent().GetEventId(), LeaseToken: d1.GetLeaseToken()}); status.Code(err) != codes.InvalidArgument || !hasFieldViolation(err, "ttl") {
		t.Errorf("ExtendLease without ttl: %v, want InvalidArgument on ttl", err)
	}
	// The server still serves: d1 acks fine and its next revision comes.
	ackPublished(t, r, d1)
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "k1" || d.GetEvent().GetRevision() != 2 {
		t.Fatalf("next delivery %v, want k1 revision 2", d.GetEvent())
	}
}

func hasFieldViolation(err error, field string) bool {
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				if v.GetField() == field {
					return true
				}
			}
		}
	}
	return false
}

// Nacks back off, and after MaxFailures the aggregate parks: its later
// revisions wait while other aggregates go on.
func TestNackBacksOffThenParks(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const base, backoffCap, ttl = 200 * time.Millisecond, 300 * time.Millisecond, 30 * time.Second
	r := startReplica(t, url, func(c *server.Config) {
		c.BackoffBase, c.BackoffCap, c.MaxFailures = base, backoffCap, 3
	})
	emit(t, pool, "orders", "poison", 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(ttl)})
	var first string
	var retryAt time.Time // when the server said the next attempt may come
	for i := 1; i <= 3; i++ {
		d := recv(t, st)
		if first == "" {
			first = d.GetEvent().GetEventId()
		}
		if d.GetEvent().GetEventId() != first || d.GetAttempt() != uint32(i) {
			t.Fatalf("delivery %d: %s attempt %d, want %s attempt %d", i, d.GetEvent().GetEventId(), d.GetAttempt(), first, i)
		}
		if at := grantedAt(d, ttl); at.Before(retryAt) {
			t.Fatalf("attempt %d came at %v, before the backoff ended at %v", i, at, retryAt)
		}
		before := time.Now()
		res, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: first, LeaseToken: d.GetLeaseToken(), Error: "broker says no"})
		if err != nil {
			t.Fatal(err)
		}
		after := time.Now()
		if res.GetParked() != (i == 3) || res.GetFailures() != uint32(i) {
			t.Fatalf("nack %d: %v", i, res)
		}
		if i < 3 {
			// Equal jitter: between half and all of min(cap, base*2^(i-1)).
			full := min(backoffCap, base<<(i-1))
			retryAt = res.GetNextAttemptAt().AsTime()
			if retryAt.Before(before.Add(full/2-clockSlack)) || retryAt.After(after.Add(full+clockSlack)) {
				t.Fatalf("nack %d: next attempt at %v, want %v to %v after %v", i, retryAt, full/2, full, before)
			}
		}
	}
	var state, reason string
	if err := pool.QueryRow(ctx, `SELECT state, parked_reason FROM outbox.delivery WHERE aggregate_key = 'poison'`).Scan(&state, &reason); err != nil {
		t.Fatal(err)
	}
	if state != "parked" || !strings.Contains(reason, "broker says no") {
		t.Fatalf("after 3 failures: %s %q", state, reason)
	}
	// Other aggregates still flow.
	emit(t, pool, "orders", "healthy", 1)
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "healthy" {
		t.Fatalf("got %v while poison is parked", d.GetEvent())
	}
	if publishedAt(t, pool, first) != nil {
		t.Fatal("parked event marked published")
	}
}

// When a relay's stream ends its leases are released at once, and the events
// go to the next relay with no TTL wait.
func TestStreamEndReleasesLeases(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "rel", 1)
	ctx1, cancel1 := context.WithCancel(context.Background())
	before := time.Now()
	st1 := subscribe(t, ctx1, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	first := recv(t, st1)
	checkGranted(t, first, time.Hour, before, time.Now()) // an hour-long lease indeed
	cancel1()
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	st2 := subscribe(t, ctx2, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st2) // so this arrives only through release
	if d.GetEvent().GetEventId() != ids[0].String() || d.GetAttempt() != 2 {
		t.Fatalf("after release got %s attempt %d", d.GetEvent().GetEventId(), d.GetAttempt())
	}
	checkGranted(t, d, time.Hour, before, time.Now())
}

// Order under concurrency: 1,000 aggregates x 20 revisions through 4 relays
// with max_in_flight 16. Every aggregate's first deliveries reach the sink in
// revision order and nothing is lost.
func TestOrderAcrossFourRelays(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const aggregates, revisions = 1000, 20
	_, err := pool.Exec(context.Background(), `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'orders', 'a-' || a, 'Changed', jsonb_build_object('r', r)
		FROM generate_series(1, $2) r, generate_series(1, $1) a ORDER BY r, a`, aggregates, revisions)
	if err != nil {
		t.Fatal(err)
	}
	r := startReplica(t, url, nil)
	sink := newOrderSink()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i := range 4 {
		runner, err := relay.NewRunner(relay.Config{
			Conn: r.Conn, Publisher: sink, RelayID: fmt.Sprintf("r%d", i), MaxInFlight: 16,
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = runner.Run(ctx) }()
	}
	sink.waitFor(t, aggregates*revisions)
	// Every event reached the sink; the last acks may still be in flight.
	waitPending(t, pool, 0)
	cancel()
	wg.Wait()
	if sink.reordered > 0 {
		t.Fatalf("%d first deliveries out of revision order", sink.reordered)
	}
	t.Logf("duplicates: %d", sink.duplicates)
}

// orderSink records first deliveries per aggregate and counts reorders.
type orderSink struct {
	mu         sync.Mutex
	seen       map[string]bool
	last       map[string]int64
	unique     int
	reordered  int
	duplicates int
	changed    chan struct{}
}

func newOrderSink() *orderSink {
	return &orderSink{seen: map[string]bool{}, last: map[string]int64{}, changed: make(chan struct{}, 1)}
}

// Publish implements relay.Publisher.
func (s *orderSink) Publish(_ context.Context, ev relay.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen[ev.ID] {
		s.duplicates++
		return nil
	}
	s.seen[ev.ID] = true
	s.unique++
	if ev.Revision != s.last[ev.AggregateKey]+1 {
		s.reordered++
	}
	s.last[ev.AggregateKey] = ev.Revision
	select {
	case s.changed <- struct{}{}:
	default:
	}
	return nil
}

// waitPending waits until the number of pending events is want (a bounded
// wait on a condition, checked after each short pause).
func waitPending(t *testing.T, pool *pgxpool.Pool, want int64) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		var n int64
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d events pending, want %d", n, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (s *orderSink) waitFor(t *testing.T, n int) {
	t.Helper()
	deadline := time.After(3 * time.Minute)
	for {
		s.mu.Lock()
		u := s.unique
		s.mu.Unlock()
		if u >= n {
			return
		}
		select {
		case <-s.changed:
		case <-deadline:
			t.Fatalf("only %d of %d events delivered", u, n)
		}
	}
}

// A subscription to a stream no event has used is refused with NOT_FOUND
// naming the streams that exist, so that a typo shows next to the name it
// missed.
func TestSubscribeToUnknownStreamNamesKnownOnes(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ctx := t.Context()
	recvErr := func() error {
		st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"ordres"}, MaxInFlight: 1})
		_, err := st.Recv()
		return err
	}
	err := recvErr()
	wantCode(t, err, codes.NotFound, "")
	if msg := status.Convert(err).Message(); !strings.Contains(msg, `"ordres"`) || !strings.Contains(msg, "no stream has events yet") {
		t.Errorf("with no events at all: %q, want it to name ordres and say no stream has events", msg)
	}
	emit(t, pool, "orders", "o-1", 2)
	emit(t, pool, "orders", "o-2", 1)
	emit(t, pool, "billing", "b-1", 1)
	err = recvErr()
	wantCode(t, err, codes.NotFound, "")
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "known streams: billing, orders;") {
		t.Errorf("got %q, want it to list the known streams billing, orders", msg)
	}
}
