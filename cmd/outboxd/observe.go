package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"sync/atomic"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/server"
)

// newRegistry is the process's Prometheus registry: Go runtime and process
// figures, plus what the server and the gRPC interceptors register.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Transport limits of the gRPC listener.
const (
	// maxRecvMsgSize bounds one request: the largest is an Ack of 1000 items
	// (about 200 KiB); anything bigger is refused before it is decoded.
	maxRecvMsgSize = 1 << 20
	// maxConcurrentStreams bounds the RPCs in flight on one connection.
	maxConcurrentStreams = 1024
)

// newGRPCServer builds the gRPC server with its interceptors, outermost
// first: metrics see every call's final code and duration; the log line is
// written when a call finishes; authentication (when authn is not nil)
// refuses callers before any handler or validation runs; recovery turns a
// handler's panic into INTERNAL (counted) before the others see it.
func newGRPCServer(log *slog.Logger, reg prometheus.Registerer, srv *server.Server, authn *auth.Authenticator, creds grpc.ServerOption) *grpc.Server {
	metrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets([]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10})))
	reg.MustRegister(metrics)
	rpcLog := logging.LoggerFunc(func(ctx context.Context, level logging.Level, msg string, fields ...any) {
		log.Log(ctx, slog.Level(level), msg, fields...)
	})
	logOpts := []logging.Option{
		logging.WithLogOnEvents(logging.FinishCall),
		logging.WithLevels(rpcLogLevel),
	}
	panics := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		srv.RecoveredPanic()
		log.ErrorContext(ctx, "panic in RPC handler", "panic", fmt.Sprint(p))
		return status.Error(codes.Internal, "internal error")
	})
	unary := []grpc.UnaryServerInterceptor{metrics.UnaryServerInterceptor(), logging.UnaryServerInterceptor(rpcLog, logOpts...)}
	stream := []grpc.StreamServerInterceptor{metrics.StreamServerInterceptor(), logging.StreamServerInterceptor(rpcLog, logOpts...)}
	if authn != nil {
		unary = append(unary, authn.UnaryServerInterceptor())
		stream = append(stream, authn.StreamServerInterceptor())
	}
	unary = append(unary, recovery.UnaryServerInterceptor(panics))
	stream = append(stream, recovery.StreamServerInterceptor(panics))
	g := grpc.NewServer(
		creds,
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
		grpc.MaxRecvMsgSize(maxRecvMsgSize),
		grpc.MaxConcurrentStreams(maxConcurrentStreams),
		// Relays keep one long stream open: ping idle connections so a dead
		// peer is noticed (and its leases released) within a minute, and
		// refuse clients that ping more often than every 10 s.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 20 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	)
	metrics.InitializeMetrics(g)
	return g
}

// rpcLogLevel keeps the busy path quiet: successful calls (thousands of acks
// a second) log at debug, a caller's mistakes at info, server-side failures
// at warn and error.
func rpcLogLevel(code codes.Code) logging.Level {
	switch code {
	case codes.OK:
		return logging.LevelDebug
	case codes.Canceled, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition,
		codes.Unauthenticated, codes.PermissionDenied, codes.OutOfRange:
		return logging.LevelInfo
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted:
		return logging.LevelWarn
	default:
		return logging.LevelError
	}
}

// newHTTPServer serves /metrics, /healthz (the process is up), /readyz
// (the replica can serve: database reachable, schema current, not shutting
// down) and, with profiling, /debug/pprof/.
func newHTTPServer(reg *prometheus.Registry, readiness *atomic.Pointer[server.Readiness], profiling bool) *http.Server {
	mux := http.NewServeMux()
	if profiling {
		// Off by default: profiles reveal internals and cost CPU while taken.
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		r := readiness.Load()
		if !r.Ready {
			http.Error(w, "not ready: "+r.Reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
}
