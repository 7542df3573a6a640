package main

import (
	"fmt"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outboxd/outboxd/server"
)

// newRegistry is the process's Prometheus registry: Go runtime and process
// figures, outboxd_build_info, plus what the server and the gRPC interceptors register.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		buildInfoCollector())
	return reg
}

// newHTTPServer serves /metrics, /healthz (the process is up), /readyz
// (the replica can serve: database reachable, schema current, not shutting
// down), with profiling /debug/pprof/, and the console (when not nil) at
// every other path.
func newHTTPServer(reg *prometheus.Registry, readiness func() server.Readiness, profiling bool, console http.Handler) *http.Server {
	mux := http.NewServeMux()
	if console != nil {
		mux.Handle("/", console)
	}
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
		r := readiness()
		if !r.Ready {
			http.Error(w, "not ready: "+r.Reason, http.StatusServiceUnavailable)
			return
		}
		if r.Reason != "" {
			// Several sources, some not ready: the replica still serves
			// the others.
			fmt.Fprintln(w, "ready; degraded: "+r.Reason)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
}
