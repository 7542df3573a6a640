package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// listingRelayService answers ListSources with the sources a test sets,
// records the streams each request asks for, and signals every call.
type listingRelayService struct {
	outboxv1.UnimplementedRelayServiceServer
	mu      sync.Mutex
	sources []string
	asked   [][]string
	calls   chan struct{}
}

func (s *listingRelayService) ListSources(_ context.Context, req *outboxv1.ListSourcesRequest) (*outboxv1.ListSourcesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked = append(s.asked, req.GetStreams())
	select {
	case s.calls <- struct{}{}:
	default:
	}
	return &outboxv1.ListSourcesResponse{Sources: s.sources}, nil
}

func (s *listingRelayService) set(sources ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sources = sources
}

// followerAgainst serves svc on loopback and returns a follower of routes
// against it, listing every millisecond.
func followerAgainst(t *testing.T, svc *listingRelayService, routes ...string) *sourceFollower {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	outboxv1.RegisterRelayServiceServer(g, svc)
	go func() { _ = g.Serve(l) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	rs, err := parseRoutes(routes)
	if err != nil {
		t.Fatal(err)
	}
	fixed, wild := spansSources(rs)
	return &sourceFollower{client: outboxv1.NewRelayServiceClient(conn), fixed: fixed, wild: wild, every: time.Millisecond,
		log: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))}
}

// tWriter routes log lines to t.Log.
type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// drain forgets ListSources calls signalled so far.
func drain(svc *listingRelayService) {
	select {
	case <-svc.calls:
	default:
	}
}

// waitCalls waits for n more ListSources calls, or for done (the follower
// returned), reporting which.
func waitCalls(t *testing.T, svc *listingRelayService, n int, done <-chan error) {
	t.Helper()
	for range n {
		select {
		case <-svc.calls:
		case err := <-done:
			t.Fatalf("the follower returned %v; want it to go on", err)
		case <-time.After(time.Minute): // a hang guard
			t.Fatal("no ListSources call within a minute")
		}
	}
}

// A subscription of */payments refused PERMISSION_DENIED (a server that
// lists sources where the token has other streams only) does not stop the
// relay: the follower asks for the route's streams (payments), leaves the
// refused subscription stopped while the listing stays as it is (default's
// other subscriptions, a's, go on), and tries it again once the listing
// changes.
func TestFollowerLeavesARefusedSubscriptionStopped(t *testing.T) {
	t.Parallel()
	svc := &listingRelayService{calls: make(chan struct{}, 1)}
	svc.set("default", "a")
	sf := followerAgainst(t, svc, "*/payments=stdout://")
	var (
		mu      sync.Mutex
		started = map[string]int{}
	)
	refusals := make(chan struct{}, 10)
	sf.onEnded = func(source string, err error) {
		if source == "default" && status.Code(err) == codes.PermissionDenied {
			refusals <- struct{}{}
		}
	}
	sf.run = func(ctx context.Context, rt route) error {
		mu.Lock()
		started[rt.source]++
		mu.Unlock()
		if rt.source == "default" {
			return status.Error(codes.PermissionDenied, `token "t" may not access stream "payments"`)
		}
		<-ctx.Done()
		return nil
	}
	count := func(source string) int { mu.Lock(); defer mu.Unlock(); return started[source] }
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- sf.Run(ctx) }()

	select {
	case <-refusals:
	case err := <-done:
		t.Fatalf("the follower returned %v on a refused subscription; want it to go on", err)
	}
	// Two listings after the refusal: the loop went past the first
	// listing's starts.
	drain(svc)
	waitCalls(t, svc, 2, done)
	if n := count("default"); n != 1 {
		t.Errorf("default's refused subscription started %d times under an unchanged listing; want once", n)
	}
	if n := count("a"); n != 1 {
		t.Errorf("a's subscription started %d times; want once, running on", n)
	}
	// The listing changes (default leaves, then comes back): it is tried again.
	svc.set("a")
	waitCalls(t, svc, 2, done)
	svc.set("default", "a")
	select {
	case <-refusals:
	case err := <-done:
		t.Fatalf("the follower returned %v; want it to go on", err)
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("default's subscription was not tried again after the listing changed")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("follower stopped with %v; want nil", err)
	}
	svc.mu.Lock()
	defer svc.mu.Unlock()
	if !slices.Equal(svc.asked[0], []string{"payments"}) {
		t.Errorf("ListSources asked for streams %q; want [payments], the streams of */payments", svc.asked[0])
	}
}

// A subscription stopped because its source left the listing, which ends
// with an error only after the source is listed again (and a new
// subscription of it runs), does not stop the relay: its end is no news.
func TestFollowerIgnoresTheEndOfAStoppedSubscription(t *testing.T) {
	t.Parallel()
	svc := &listingRelayService{calls: make(chan struct{}, 1)}
	svc.set("default")
	sf := followerAgainst(t, svc, "*/payments=stdout://")
	var (
		starts    = make(chan int, 2)
		cancelled = make(chan struct{})
		release   = make(chan struct{})
		handled   = make(chan struct{})
		n         atomic.Int32
	)
	sf.onEnded = func(string, error) { handled <- struct{}{} }
	sf.run = func(ctx context.Context, _ route) error {
		i := int(n.Add(1))
		starts <- i
		<-ctx.Done()
		if i == 1 {
			close(cancelled)
			<-release
			return errors.New("publish under way failed while stopping")
		}
		return nil
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- sf.Run(ctx) }()
	if i := <-starts; i != 1 {
		t.Fatalf("start %d; want 1", i)
	}
	svc.set()
	<-cancelled
	svc.set("default")
	if i := <-starts; i != 2 {
		t.Fatalf("start %d; want 2", i)
	}
	close(release)
	<-handled
	drain(svc)
	// Two listings after the end was taken in: the follower went on past
	// the listing that still names default.
	waitCalls(t, svc, 2, done)
	cancel()
	if err := <-done; err != nil {
		t.Errorf("follower stopped with %v; want nil", err)
	}
}
