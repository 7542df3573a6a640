package server_test

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

const (
	relayToken   = "relay-token-0123456789abcdef"
	adminToken   = "admin-token-0123456789abcdef"
	billingToken = "billing-token-0123456789abcd"
	billingOps   = "billing-ops-token-0123456789"
	unknownToken = "unknown-token-0123456789abcd"
)

// startAuthReplica runs a replica behind the auth interceptors with four
// tokens: an unrestricted relay, an admin, a relay limited to billing.*, and
// an admin limited to billing.*.
func startAuthReplica(t *testing.T, url string) *replica {
	t.Helper()
	file := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte(
		"relay    relay  "+relayToken+"\n"+
			"ops      admin  "+auth.HashToken(adminToken)+"\n"+
			"billing  relay  "+billingToken+"  streams=billing.*\n"+
			"billing-ops  admin  "+billingOps+"  streams=billing.*\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{File: file})
	if err != nil {
		t.Fatal(err)
	}
	return servertest.Start(t, url, servertest.Options{Authenticator: a})
}

// dialAs connects to r presenting token ("" for none).
func dialAs(t *testing.T, r *replica, token string) *grpc.ClientConn {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if token != "" {
		opts = append(opts, auth.WithBearerToken(token, true))
	}
	conn, err := grpc.NewClient(r.Addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Every RPC refuses a missing or unknown token (Unauthenticated) and a token
// without the RPC's role (PermissionDenied); with the right role the call
// gets past authentication (its empty request then fails validation, or
// succeeds). Health answers without a token.
func TestEveryRPCNeedsItsRole(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	r := startAuthReplica(t, url)
	ctx := context.Background()

	relayRPCs := map[string]func(*grpc.ClientConn) error{
		"Subscribe": func(c *grpc.ClientConn) error {
			st, err := outboxv1.NewRelayServiceClient(c).Subscribe(ctx, &outboxv1.SubscribeRequest{})
			if err == nil {
				_, err = st.Recv()
			}
			return err
		},
		"Ack": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewRelayServiceClient(c).Ack(ctx, &outboxv1.AckRequest{})
			return err
		},
		"AckStream": func(c *grpc.ClientConn) error {
			st, err := outboxv1.NewRelayServiceClient(c).AckStream(ctx)
			if err == nil {
				err = st.Send(&outboxv1.AckStreamRequest{})
			}
			if err == nil || errors.Is(err, io.EOF) {
				_, err = st.Recv()
			}
			return err
		},
		"Nack": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewRelayServiceClient(c).Nack(ctx, &outboxv1.NackRequest{})
			return err
		},
		"ExtendLease": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewRelayServiceClient(c).ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{})
			return err
		},
		"ListSources": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewRelayServiceClient(c).ListSources(ctx, &outboxv1.ListSourcesRequest{})
			return err
		},
	}
	adminRPCs := map[string]func(*grpc.ClientConn) error{
		"GetLag": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewAdminServiceClient(c).GetLag(ctx, &outboxv1.GetLagRequest{})
			return err
		},
		"ListRelays": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewAdminServiceClient(c).ListRelays(ctx, &outboxv1.ListRelaysRequest{})
			return err
		},
		"GetAggregate": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewAdminServiceClient(c).GetAggregate(ctx, &outboxv1.GetAggregateRequest{})
			return err
		},
		"ListEvents": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewAdminServiceClient(c).ListEvents(ctx, &outboxv1.ListEventsRequest{PageToken: "x"})
			return err
		},
		"RetryAggregate": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewAdminServiceClient(c).RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{})
			return err
		},
		"SkipEvent": func(c *grpc.ClientConn) error {
			_, err := outboxv1.NewAdminServiceClient(c).SkipEvent(ctx, &outboxv1.SkipEventRequest{})
			return err
		},
		"Purge": func(c *grpc.ClientConn) error {
			st, err := outboxv1.NewAdminServiceClient(c).Purge(ctx, &outboxv1.PurgeRequest{})
			if err == nil {
				_, err = st.Recv()
			}
			return err
		},
	}
	none, unknown := dialAs(t, r, ""), dialAs(t, r, unknownToken)
	relayConn, adminConn := dialAs(t, r, relayToken), dialAs(t, r, adminToken)
	check := func(rpc string, call func(*grpc.ClientConn) error, right, wrong *grpc.ClientConn) {
		for name, c := range map[string]*grpc.ClientConn{"no token": none, "unknown token": unknown} {
			if code := status.Code(call(c)); code != codes.Unauthenticated {
				t.Errorf("%s with %s: %v, want Unauthenticated", rpc, name, code)
			}
		}
		if code := status.Code(call(wrong)); code != codes.PermissionDenied {
			t.Errorf("%s with the other role's token: %v, want PermissionDenied", rpc, code)
		}
		if code := status.Code(call(right)); code == codes.Unauthenticated || code == codes.PermissionDenied {
			t.Errorf("%s with the right token: %v", rpc, code)
		}
	}
	for rpc, call := range relayRPCs {
		check(rpc, call, relayConn, adminConn)
	}
	for rpc, call := range adminRPCs {
		check(rpc, call, adminConn, relayConn)
	}
	res, err := healthpb.NewHealthClient(none).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health without a token: %v, %v", res, err)
	}
}

// A token limited to billing.* can neither subscribe to nor ack, nack or
// extend events of another stream, even holding a genuine lease token.
func TestStreamAllowList(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	emit(t, pool, "billing.invoice", "i-1", 1)
	orders := emit(t, pool, "sales_order", "o-1", 1)
	billing := outboxv1.NewRelayServiceClient(dialAs(t, r, billingToken))

	for _, streams := range [][]string{{"sales_order"}, {"billing.invoice", "sales_order"}, nil} {
		st, err := billing.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "b", Streams: streams, MaxInFlight: 1})
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("billing token subscribing to %v: %v, want PermissionDenied", streams, err)
		}
	}
	st, err := billing.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "b", Streams: []string{"billing.invoice"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	if d := recv(t, st); d.GetEvent().GetStream() != "billing.invoice" {
		t.Fatalf("billing relay got %v", d.GetEvent())
	}

	// A genuine sales_order lease, leaked to the billing relay.
	relay := outboxv1.NewRelayServiceClient(dialAs(t, r, relayToken))
	ost, err := relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "o", Streams: []string{"sales_order"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d := recv(t, ost)
	item := &outboxv1.AckItem{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}
	if _, err := billing.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{item}}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("billing token acking a sales_order event: %v", err)
	}
	if ast, err := billing.AckStream(ctx); err != nil {
		t.Fatal(err)
	} else if err := ast.Send(&outboxv1.AckStreamRequest{Acks: []*outboxv1.AckItem{item}}); err != nil {
		t.Fatal(err)
	} else if _, err := ast.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Errorf("billing token acking a sales_order event on an AckStream: %v", err)
	}
	if _, err := billing.Nack(ctx, &outboxv1.NackRequest{EventId: item.EventId, LeaseToken: item.LeaseToken, Error: "x"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("billing token nacking a sales_order event: %v", err)
	}
	if _, err := billing.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{EventId: item.EventId, LeaseToken: item.LeaseToken, Ttl: durationpb.New(time.Minute)}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("billing token extending a sales_order lease: %v", err)
	}
	if publishedAt(t, pool, orders[0].String()) != nil {
		t.Fatal("a refused ack marked the event")
	}
	res, err := relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{item}})
	if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("the holder's own ack: %v, %v", res, err)
	}

	// Operator actions are recorded under the token's name.
	later := emit(t, pool, "sales_order", "o-2", 1)
	admin := outboxv1.NewAdminServiceClient(dialAs(t, r, adminToken))
	sk, err := admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: later[0].String(), Reason: "r", Actor: "alice"})
	if err != nil || sk.GetSkip().GetActor() != "ops (alice)" {
		t.Fatalf("skip by the ops token: %v, %v; want actor %q", sk, err, "ops (alice)")
	}
}

// A relay that stops reading its stream holds at most its credit: the server
// claims nothing more however large the backlog grows, so its memory stays
// flat. The relay's connection has a fixed 64 KiB HTTP/2 window (no dynamic
// growth) and each event is 200 KB, so the server's Send really blocks.
//
// Not parallel: the heap is measured for the whole test process, and Go
// runs top-level parallel tests only after every sequential one, so nothing
// else runs while this one measures.
func TestStalledRelayHoldsOnlyItsCredit(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.ReconcileInterval = 10 * time.Millisecond })
	const credit, payload = 5, 200_000
	emitBig := func(keys string) {
		t.Helper()
		if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', 'a-' || a, 'Changed', jsonb_build_object('pad', repeat('x', $1)))
			FROM generate_series(1, 1) r, `+keys+` a ORDER BY r, a`, payload); err != nil {
			t.Fatal(err)
		}
	}
	emitBig("generate_series(1, 1)")
	conn, err := grpc.NewClient(r.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Subscribed, never read.
	if _, err := outboxv1.NewRelayServiceClient(conn).Subscribe(ctx, &outboxv1.SubscribeRequest{
		RelayId: "stalled", MaxInFlight: credit, LeaseTtl: durationpb.New(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	leased := func() int32 {
		var n int32
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE state = 'leased'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, leased)
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	// 40 MB of backlog over 200 aggregates.
	emitBig("generate_series(2, 201)")
	waitFor(t, func() int32 {
		if leased() >= credit {
			return 1
		}
		return 0
	})
	// ListRelays reads what the replica last recorded (every refresh
	// interval), so wait for the record to catch up before comparing.
	waitFor(t, func() int32 {
		res, err := r.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.GetRelays()) == 1 && res.GetRelays()[0].GetInFlight() == credit {
			return 1
		}
		return 0
	})
	// Every producer commit above woke the session, and it reconciles every
	// 10 ms; whatever it did, it may not hold more than its credit.
	for range 3 {
		res, err := r.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if n := leased(); n != credit || res.GetRelays()[0].GetInFlight() != credit {
			t.Fatalf("stalled relay holds %d leases (in flight %d), want its credit %d", n, res.GetRelays()[0].GetInFlight(), credit)
		}
	}
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	// The credit's deliveries, a few copies each (row, message, frames),
	// may be in memory; the backlog may not.
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 4*credit*payload+4<<20 {
		t.Fatalf("heap grew by %d MiB with a stalled relay and a 40 MB backlog", grew>>20)
	}
}
