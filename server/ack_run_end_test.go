package server_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// An ack batch the committer has taken is committed even when the server's
// run context ends before its statement runs: the acks in it came from
// relays whose broker has the events, and dropping them would only deliver
// those events again. The replica is built by hand (servertest's ends its
// run context only after the gRPC server has stopped), so that the test can
// end the run context while the batch waits in beforeAckBatch.
func TestAnAckBatchTakenAsTheRunEndsIsCommitted(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	srv, err := server.New(ctx, server.Config{
		Store:             store.New(testdb.NewPoolURL(t, url)),
		DatabaseURL:       url,
		Logger:            servertest.Logger(t),
		PollInterval:      200 * time.Millisecond,
		ReconcileInterval: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, endRun := context.WithCancel(context.Background())
	defer endRun()
	ran := make(chan struct{})
	go func() { defer close(ran); _ = srv.Run(runCtx) }()
	g := grpc.NewServer()
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		conn.Close()
		g.Stop()
		endRun()
		<-ran
	})
	r := &replica{Server: srv, Conn: conn, Relay: outboxv1.NewRelayServiceClient(conn)}

	emit(t, pool, "orders", "a", 1)
	d := recv(t, subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1}))

	taken, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	srv.SetBeforeAckBatch(func() {
		once.Do(func() {
			close(taken)
			<-release
		})
	})
	acked := make(chan []*outboxv1.AckResult, 1)
	go func() { acked <- ack(t, r, d) }()
	select {
	case <-taken:
	case <-time.After(30 * time.Second): // a hang guard
		t.Fatal("the ack batch did not begin")
	}
	endRun() // the run context is done once this returns
	close(release)

	select {
	case res := <-acked:
		if s := res[0].GetStatus(); s != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Errorf("ack taken as the run ended: %v %q, want PUBLISHED", s, res[0].GetMessage())
		}
	case <-time.After(30 * time.Second): // a hang guard
		t.Fatal("the ack was not answered")
	}
	if publishedAt(t, pool, d.GetEvent().GetEventId()) == nil {
		t.Error("the event of an ack batch taken as the run ended is not published")
	}
}
