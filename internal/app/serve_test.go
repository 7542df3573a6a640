package app_test

import (
	"context"
	"net"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/outboxd/outboxd/internal/app"
)

// serveLoopback serves rep on a loopback port until stop (also called at
// the end of the test) and returns the port's address. stop waits for
// Serve to return; calling it again does nothing.
func serveLoopback(t *testing.T, ctx context.Context, rep *app.Replica) (addr string, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- rep.Serve(ctx, lis) }()
	stop = sync.OnceFunc(func() { cancel(); <-served })
	t.Cleanup(stop)
	return lis.Addr().String(), stop
}

// dialPlain connects to addr without TLS (with opts besides), closing the
// connection at the end of the test.
func dialPlain(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}
