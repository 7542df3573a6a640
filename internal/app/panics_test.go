package app_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The panic counter is the process's: a panic counted while source a (the
// first engine) serves is still counted once a is removed, and a panic
// after that is counted too, with no source label.
func TestPanicCounterOutlivesTheFirstSource(t *testing.T) {
	t.Parallel()
	source := func(name string) app.Source {
		url := testdb.New(t)
		return app.Source{Name: name,
			Server: server.Config{Store: store.New(testdb.NewPoolURL(t, url)), DatabaseURL: url, Logger: servertest.Logger(t)}}
	}
	panicking := grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if info.FullMethod == outboxv1.AdminService_ListRelays_FullMethodName {
			panic("test panic")
		}
		return h(ctx, req)
	})
	reg := prometheus.NewRegistry()
	rep, err := app.New(t.Context(), app.Config{Server: server.Config{Registerer: reg, Logger: servertest.Logger(t)},
		Sources: []app.Source{source("a"), source("b")}, ServerOptions: []grpc.ServerOption{panicking}})
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := serveLoopback(t, t.Context(), rep)
	conn := dialPlain(t, addr)
	admin := outboxv1.NewAdminServiceClient(conn)
	count := func() float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "outboxd_panics_recovered_total" {
				if m := mf.GetMetric(); len(m) == 1 && len(m[0].GetLabel()) == 0 {
					return m[0].GetCounter().GetValue()
				}
				t.Fatalf("outboxd_panics_recovered_total is %v; want one series without labels", mf)
			}
		}
		return -1
	}
	panicOnce := func() {
		t.Helper()
		if _, err := admin.ListRelays(t.Context(), &outboxv1.ListRelaysRequest{}, grpc.WaitForReady(true)); status.Code(err) != codes.Internal {
			t.Fatalf("a panicking handler answered %v; want INTERNAL", err)
		}
	}
	panicOnce()
	if n := count(); n != 1 {
		t.Fatalf("after one panic the counter is %v; want 1", n)
	}
	if err := rep.RemoveSource(t.Context(), "a", time.Second); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 1 {
		t.Errorf("after source a (the first) was removed the counter is %v; want 1", n)
	}
	panicOnce()
	if n := count(); n != 2 {
		t.Errorf("after a second panic, with a removed, the counter is %v; want 2", n)
	}
}

// A panic in a streaming handler (Subscribe, a relay's long-lived stream)
// is recovered as one in a unary handler is: the stream ends with INTERNAL,
// the panic is counted, and the replica goes on serving. Without the stream
// recovery interceptor the panic would end the process and every relay's
// stream with it. (Kills the mutant that drops the stream recovery
// interceptor.)
func TestStreamHandlerPanicIsRecovered(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	panicking := grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		if info.FullMethod == outboxv1.RelayService_Subscribe_FullMethodName {
			panic("test panic")
		}
		return h(srv, ss)
	})
	reg := prometheus.NewRegistry()
	rep, err := app.New(t.Context(), app.Config{
		Server:        server.Config{Store: store.New(testdb.NewPoolURL(t, url)), DatabaseURL: url, Registerer: reg, Logger: servertest.Logger(t)},
		ServerOptions: []grpc.ServerOption{panicking}})
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := serveLoopback(t, t.Context(), rep)
	conn := dialPlain(t, addr)
	st, err := outboxv1.NewRelayServiceClient(conn).Subscribe(t.Context(),
		&outboxv1.SubscribeRequest{RelayId: "r", Streams: []string{"s"}, MaxInFlight: 1}, grpc.WaitForReady(true))
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.Internal {
		t.Fatalf("a panicking Subscribe answered %v; want INTERNAL", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == "outboxd_panics_recovered_total" {
			n = mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	if n != 1 {
		t.Errorf("after a panic in Subscribe the counter is %v; want 1", n)
	}
	// The replica still serves.
	if _, err := outboxv1.NewAdminServiceClient(conn).GetLag(t.Context(), &outboxv1.GetLagRequest{}); err != nil {
		t.Errorf("GetLag after a recovered stream panic: %v", err)
	}
}
