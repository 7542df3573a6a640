package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// ackFault stands in for the server's answer to one ack request: it gets
// the request and send, which passes a request on to the real server and
// returns the answer, and returns what the runner is to see.
type ackFault func(req *outboxv1.AckRequest, send func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error)

// withAckFault applies f to every ack request the runner sends, alike
// whether it goes as a message on an AckStream or as an Ack call. An error
// from f is what the runner sees of that request: the call's error, or the
// stream's (on which the runner then opens a new stream).
func withAckFault(f ackFault) []grpc.DialOption {
	unary := func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		r, ok := req.(*outboxv1.AckRequest)
		if !ok {
			return invoker(ctx, m, req, reply, cc, opts...)
		}
		res, err := f(r, func(r *outboxv1.AckRequest) (*outboxv1.AckResponse, error) {
			out := new(outboxv1.AckResponse)
			return out, invoker(ctx, m, r, out, cc, opts...)
		})
		if err != nil {
			return err
		}
		reply.(*outboxv1.AckResponse).Results = res.GetResults()
		return nil
	}
	stream := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil || method != outboxv1.RelayService_AckStream_FullMethodName {
			return cs, err
		}
		return &faultyAckStream{ClientStream: cs, f: f}, nil
	}
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(unary), grpc.WithChainStreamInterceptor(stream)}
}

// faultyAckStream is an AckStream whose every request goes through f
// (withAckFault): SendMsg runs it, RecvMsg returns what it answered.
type faultyAckStream struct {
	grpc.ClientStream
	f   ackFault
	res *outboxv1.AckResponse
	err error
}

func (s *faultyAckStream) SendMsg(m any) error {
	req, ok := m.(*outboxv1.AckStreamRequest)
	if !ok {
		return s.ClientStream.SendMsg(m)
	}
	s.res, s.err = s.f(&outboxv1.AckRequest{Acks: req.GetAcks()}, func(r *outboxv1.AckRequest) (*outboxv1.AckResponse, error) {
		err := s.ClientStream.SendMsg(&outboxv1.AckStreamRequest{Acks: r.GetAcks()})
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		out := new(outboxv1.AckStreamResponse)
		if err := s.ClientStream.RecvMsg(out); err != nil {
			return nil, err
		}
		return &outboxv1.AckResponse{Results: out.GetResults()}, nil
	})
	return nil
}

func (s *faultyAckStream) RecvMsg(m any) error {
	res, ok := m.(*outboxv1.AckStreamResponse)
	if !ok {
		return s.ClientStream.RecvMsg(m)
	}
	if s.err != nil {
		return s.err
	}
	res.Results = s.res.GetResults()
	return nil
}

// forEachAckPath runs test once for each way a runner's ack requests
// travel: as messages on an AckStream ("stream"), and as Ack calls
// ("calls": the connection refuses AckStream as a server that predates it
// does, so the runner falls back), with dial the options test's connection
// is to be dialled with first. The batcher's promises (retries, splits,
// giving up) hold on both; each subtest checks that its requests took its
// path.
func forEachAckPath(t *testing.T, test func(t *testing.T, dial []grpc.DialOption)) {
	refuseStream := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method == outboxv1.RelayService_AckStream_FullMethodName {
			return nil, status.Error(codes.Unimplemented, "injected: unknown method AckStream for service outbox.v1.RelayService")
		}
		return streamer(ctx, desc, cc, method, opts...)
	})
	for _, calls := range []bool{false, true} {
		name := "stream"
		if calls {
			name = "calls"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var rpcs ackRPCs
			dial := rpcs.options()
			if calls {
				dial = append(dial, refuseStream)
			}
			test(t, dial)
			if n := rpcs.calls.Load(); calls != (n > 0) {
				t.Errorf("%d Ack calls on the %s path", n, name)
			}
		})
	}
}

// poisonAcks fails every ack request that carries the poison event with
// code, as a server does whose group commit cannot take one item; requests
// without it reach the real server.
type poisonAcks struct {
	poison string
	code   codes.Code
	mu     sync.Mutex
	sizes  []int // sizes of the requests that carried the poison
}

func (p *poisonAcks) options() []grpc.DialOption {
	return withAckFault(func(r *outboxv1.AckRequest, send func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error) {
		for _, it := range r.GetAcks() {
			if it.GetEventId() == p.poison {
				p.mu.Lock()
				p.sizes = append(p.sizes, len(r.GetAcks()))
				p.mu.Unlock()
				return nil, status.Errorf(p.code, "injected: the batch holding %s fails", p.poison)
			}
		}
		return send(r)
	})
}

// One ack the server cannot take does not hold up the others: the batch
// that carries it is split until it is alone and given up, and every other
// event is marked published, whether the server refuses the batch outright
// (INTERNAL) or keeps failing it as unavailable (after AckRetryTimeout).
// Before, the batcher retried such a batch forever and sent no other ack.
func TestRunnerSplitsAckBatchAroundBadItem(t *testing.T) {
	t.Parallel()
	for _, code := range []codes.Code{codes.Internal, codes.Unavailable} {
		t.Run(code.String(), func(t *testing.T) {
			t.Parallel()
			forEachAckPath(t, func(t *testing.T, dial []grpc.DialOption) {
				testSplitAroundBadItem(t, code, dial)
			})
		})
	}
}

func testSplitAroundBadItem(t *testing.T, code codes.Code, dial []grpc.DialOption) {
	e := newEnv(t, servertest.Options{})
	const n = 16
	var ids []string
	for i := range n {
		ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k%02d", i)))
	}
	poison := &poisonAcks{poison: ids[n/2], code: code}
	givenUp := startWithOneAckBatch(t, e.dial(t, append(dial, poison.options()...)...), n)

	var others []string
	for _, id := range ids {
		if id != poison.poison {
			others = append(others, id)
		}
	}
	e.waitPublished(t, others...)
	if k := waitSignal(t, "the bad ack to be given up", givenUp); k != 1 {
		t.Fatalf("%d acks given up together, want the bad one alone", k)
	}
	if e.published(t, poison.poison) {
		t.Fatal("the event whose ack failed is marked published")
	}
	poison.mu.Lock()
	defer poison.mu.Unlock()
	if poison.sizes[0] != n {
		t.Fatalf("first request carrying the bad ack had %d items, want one batch of %d", poison.sizes[0], n)
	}
	// Halving from 16 reaches the bad item alone in 4 splits.
	for _, want := range []int{8, 4, 2, 1} {
		if !containsInt(poison.sizes, want) {
			t.Errorf("no request of %d items carried the bad ack (requests: %v)", want, poison.sizes)
		}
	}
	select {
	case k := <-givenUp:
		t.Fatalf("%d more acks given up", k)
	default:
	}
}

// startWithOneAckBatch starts a runner over conn whose n deliveries' acks
// travel in one batch of n (every publish is held until all have started,
// and AckMaxDelay waits for a full batch) and whose failed batches are
// retried for 200 ms. The channel it returns gets the size of every group
// of acks the runner gives up.
func startWithOneAckBatch(t *testing.T, conn *grpc.ClientConn, n int) <-chan int {
	t.Helper()
	givenUp := make(chan int, n)
	pub := newPublisher()
	pub.block = make(chan struct{})
	start(t, Config{
		Conn: conn, Publisher: pub,
		MaxInFlight: n, AckMaxDelay: time.Hour, AckBatchSize: n, AckRetryTimeout: 200 * time.Millisecond,
	}, hooks{ackGivenUp: func(k int) { givenUp <- k }})
	openAtEnd(t, pub.block)
	for range n {
		waitSignal(t, "publishes to start", pub.started)
	}
	close(pub.block)
	return givenUp
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// While the server is down, a batch is retried for AckRetryTimeout, tried
// once more as two halves, and given up: two more requests, not one per
// item, and the runner goes on (here the stream is still up, so the
// events' leases stay held until they expire).
func TestRunnerGivesUpAckBatchWhenServerIsDown(t *testing.T) {
	t.Parallel()
	forEachAckPath(t, testGivesUpWhenServerIsDown)
}

func testGivesUpWhenServerIsDown(t *testing.T, dial []grpc.DialOption) {
	e := newEnv(t, servertest.Options{})
	const n = 16
	var ids []string
	for i := range n {
		ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k%02d", i)))
	}
	var mu sync.Mutex
	var sizes []int
	down := withAckFault(func(r *outboxv1.AckRequest, _ func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error) {
		mu.Lock()
		sizes = append(sizes, len(r.GetAcks()))
		mu.Unlock()
		return nil, status.Error(codes.Unavailable, "injected: connection refused")
	})
	givenUp := startWithOneAckBatch(t, e.dial(t, append(dial, down...)...), n)
	if k := waitSignal(t, "the batch to be given up", givenUp); k != n {
		t.Fatalf("%d acks given up, want the whole batch of %d at once", k, n)
	}
	mu.Lock()
	defer mu.Unlock()
	last := sizes[len(sizes)-2:]
	if last[0] != n/2 || last[1] != n/2 {
		t.Fatalf("requests %v: want retries of %d, then one try of each half", sizes, n)
	}
	for _, s := range sizes[:len(sizes)-2] {
		if s != n {
			t.Fatalf("requests %v: want retries of %d, then one try of each half", sizes, n)
		}
	}
	for _, id := range ids {
		if e.published(t, id) {
			t.Fatalf("event %s published though every Ack failed", id)
		}
	}
}

// An ack the server answers with a status asking for it again (its
// database refused that one item; ACK_STATUS_RETRY) is sent again, and
// lands. The first answer is simulated: the item is kept from the server
// and answered with status 6, as a server does whose group commit refused
// it; the retry reaches the real server.
func TestRunnerResendsAckTheServerAsksAgain(t *testing.T) {
	t.Parallel()
	forEachAckPath(t, testResendsAckTheServerAsksAgain)
}

func testResendsAckTheServerAsksAgain(t *testing.T, dial []grpc.DialOption) {
	e := newEnv(t, servertest.Options{})
	target := e.emit(t, "orders", "a")
	other := e.emit(t, "orders", "b")
	var sent atomic.Int32
	retryOnce := withAckFault(func(r *outboxv1.AckRequest, send func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error) {
		var kept []*outboxv1.AckItem
		held := -1
		for i, it := range r.GetAcks() {
			if it.GetEventId() == target && sent.Add(1) == 1 {
				held = i
				continue
			}
			kept = append(kept, it)
		}
		if held < 0 {
			return send(r)
		}
		res := &outboxv1.AckResponse{}
		if len(kept) > 0 {
			var err error
			if res, err = send(&outboxv1.AckRequest{Acks: kept}); err != nil {
				return nil, err
			}
		}
		res.Results = append(res.Results[:held:held], append([]*outboxv1.AckResult{{
			EventId: target, Status: outboxv1.AckStatus_ACK_STATUS_RETRY, Message: "injected: the database refused this ack",
		}}, res.Results[held:]...)...)
		return res, nil
	})
	givenUp := make(chan int, 10)
	start(t, Config{Conn: e.dial(t, append(dial, retryOnce...)...), Publisher: newPublisher(), LeaseTTL: time.Hour},
		hooks{ackGivenUp: func(k int) { givenUp <- k }})
	// With an hour-long lease, only a resent ack can publish it in time.
	e.waitPublished(t, target, other)
	if n := sent.Load(); n != 2 {
		t.Fatalf("the ack was sent %d times, want 2", n)
	}
	select {
	case k := <-givenUp:
		t.Fatalf("%d acks given up", k)
	default:
	}
}

// ackRPCs counts the runner's AckStream streams and Ack calls.
type ackRPCs struct{ streams, calls atomic.Int32 }

func (c *ackRPCs) options() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if m == outboxv1.RelayService_Ack_FullMethodName {
				c.calls.Add(1)
			}
			return invoker(ctx, m, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if method == outboxv1.RelayService_AckStream_FullMethodName {
				c.streams.Add(1)
			}
			return streamer(ctx, desc, cc, method, opts...)
		}),
	}
}

// ackEachAlone runs a runner with one delivery in flight over opts, so that
// each of n events is acked in a request of its own, and returns, once all
// are published, how many ack requests were sent (on a stream or not).
func ackEachAlone(t *testing.T, e *env, n int, opts ...grpc.DialOption) int32 {
	t.Helper()
	var ids []string
	for i := range n {
		ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k%d", i)))
	}
	var requests atomic.Int32
	count := withAckFault(func(r *outboxv1.AckRequest, send func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error) {
		requests.Add(1)
		return send(r)
	})
	start(t, Config{Conn: e.dial(t, append(opts, count...)...), Publisher: newPublisher(), MaxInFlight: 1}, hooks{})
	e.waitPublished(t, ids...)
	return requests.Load()
}

// The runner sends its ack requests as messages on one AckStream, not as a
// call each (a hot aggregate's every event is an ack request of its own).
func TestRunnerAcksOnOneStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	var rpcs ackRPCs
	n := ackEachAlone(t, e, 3, rpcs.options()...)
	if s, c := rpcs.streams.Load(), rpcs.calls.Load(); s != 1 || c != 0 || n != 3 {
		t.Fatalf("%d ack requests went on %d AckStream streams and in %d Ack calls, want three on one stream and no call", n, s, c)
	}
}

// Against a server that predates AckStream (it answers UNIMPLEMENTED), the
// runner acks by Ack calls, and does not try the stream again for each.
func TestRunnerAcksByCallsWhenTheServerPredatesAckStream(t *testing.T) {
	t.Parallel()
	old := grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if info.FullMethod == outboxv1.RelayService_AckStream_FullMethodName {
			return status.Error(codes.Unimplemented, "unknown method AckStream for service outbox.v1.RelayService")
		}
		return handler(srv, ss)
	})
	e := newEnv(t, servertest.Options{ServerOptions: []grpc.ServerOption{old}})
	var rpcs ackRPCs
	ackEachAlone(t, e, 3, rpcs.options()...)
	if s, c := rpcs.streams.Load(), rpcs.calls.Load(); s != 1 || c != 3 {
		t.Fatalf("acks tried %d AckStream streams and made %d Ack calls, want the stream tried once and three calls", s, c)
	}
}

// firstShort is an ack request's timeout for the two tests of a request
// that gets no answer: 200 ms for the relay's first request (the one that
// gets none), then bound, so that the retry's answer counts however loaded
// the machine is. With 200 ms for the retry too, a loaded machine's retry
// timed out now and then, and a third stream opened.
type firstShort struct{ calls atomic.Int32 }

func (f *firstShort) get() time.Duration {
	if f.calls.Add(1) == 1 {
		return 200 * time.Millisecond
	}
	return bound
}

// A request the server never answers on the AckStream fails after the
// call's timeout, as an Ack call would (DEADLINE_EXCEEDED, retried), and
// its retry goes on a new stream: here the server's first ack stream takes
// requests and answers none, and only the retry can publish the event (its
// lease lasts an hour).
func TestAckStreamWithoutAnswerIsRetriedOnANewStream(t *testing.T) {
	t.Parallel()
	var streams atomic.Int32
	silent := grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if info.FullMethod != outboxv1.RelayService_AckStream_FullMethodName || streams.Add(1) > 1 {
			return handler(srv, ss)
		}
		for {
			if err := ss.RecvMsg(new(outboxv1.AckStreamRequest)); err != nil {
				return err
			}
		}
	})
	e := newEnv(t, servertest.Options{ServerOptions: []grpc.ServerOption{silent}})
	publishAfterOneFailedStream(t, e, e.dial(t), &streams, "the silent one")
}

// publishAfterOneFailedStream emits an event and runs a runner over conn
// until it is published, its first ack request timing out after 200 ms
// and the rest after bound (firstShort); it fails the test unless opens
// counted two AckStream opens (first, then the retry's) and no ack was
// given up. An hour-long lease: only an ack can publish the event in time.
func publishAfterOneFailedStream(t *testing.T, e *env, conn *grpc.ClientConn, opens *atomic.Int32, first string) {
	t.Helper()
	var timeout firstShort
	id := e.emit(t, "orders", "a")
	givenUp := make(chan int, 10)
	start(t, Config{Conn: conn, Publisher: newPublisher(), LeaseTTL: time.Hour, AckRetryTimeout: time.Minute},
		hooks{ackGivenUp: func(k int) { givenUp <- k }, ackCallTimeout: timeout.get})
	e.waitPublished(t, id)
	if n := opens.Load(); n != 2 {
		t.Fatalf("%d ack streams opened, want 2 (%s, then the retry's)", n, first)
	}
	select {
	case k := <-givenUp:
		t.Fatalf("%d acks given up", k)
	default:
	}
}

// Opening the stream counts against the request's timeout, as connecting
// does for an Ack call: an open that hangs (a connection that waits for
// ready, say) fails the request, which is retried on a new stream, instead
// of holding every ack of the relay for good. Here the first open hangs
// until its context ends.
func TestAckStreamOpenIsBoundedByTheTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	var opens atomic.Int32
	hang := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method == outboxv1.RelayService_AckStream_FullMethodName && opens.Add(1) == 1 {
			<-ctx.Done()
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return streamer(ctx, desc, cc, method, opts...)
	})
	publishAfterOneFailedStream(t, e, e.dial(t, hang), &opens, "the one that hung")
}

// An answer that comes as its request's timer fires counts, and the timer,
// which cancelled the stream as it fired, has ended that stream for good:
// the next request goes on a new stream at once instead of failing first
// on the cancelled one (a CANCELED error, retried 50 ms later). Here the
// first request's timer fires just before it is stopped, after the answer.
func TestAckStreamAnsweredAsItsTimerFiredIsNotUsedAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	var rpcs ackRPCs
	var requests, failed atomic.Int32
	count := withAckFault(func(r *outboxv1.AckRequest, send func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error) {
		requests.Add(1)
		res, err := send(r)
		if err != nil {
			failed.Add(1)
		}
		return res, err
	})
	var timers atomic.Int32
	firesAtStop := func(d time.Duration, f func()) func() bool {
		if timers.Add(1) > 1 {
			return time.AfterFunc(d, f).Stop
		}
		return func() bool {
			f()
			return false
		}
	}
	ids := []string{e.emit(t, "orders", "a"), e.emit(t, "orders", "b")}
	start(t, Config{Conn: e.dial(t, append(rpcs.options(), count...)...), Publisher: newPublisher(), MaxInFlight: 1,
		LeaseTTL: time.Hour}, hooks{ackTimer: firesAtStop})
	e.waitPublished(t, ids...)
	if f, n, s := failed.Load(), requests.Load(), rpcs.streams.Load(); f != 0 || n != 2 || s != 2 {
		t.Fatalf("%d of %d ack requests failed, on %d streams; want two requests, none failed, on two streams "+
			"(the second opened for the request after the late answer)", f, n, s)
	}
}
