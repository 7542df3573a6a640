// Package app composes a runnable outboxd replica exactly as `outboxd serve`
// runs it: the gRPC server with its interceptor chain (metrics, logging,
// authentication, panic recovery), transport limits and keepalive, the
// health service driven by readiness checks, reflection, OpenTelemetry
// tracing of every RPC but health checks, and the graceful shutdown
// sequence. Both cmd/outboxd and internal/servertest build their
// replicas here, so tests exercise the server users run rather than a bare
// grpc.NewServer.
package app

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc/filters"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/server"
)

// Transport limits of the gRPC listener.
const (
	// MaxRecvMsgSize bounds one request: the largest is an Ack of 1000 items
	// (about 200 KiB); anything bigger is refused before it is decoded.
	MaxRecvMsgSize = 1 << 20
	// MaxConcurrentStreams bounds the RPCs in flight on one connection.
	MaxConcurrentStreams = 1024
)

// Defaults of Config.
const (
	DefaultShutdownTimeout = 15 * time.Second
	DefaultHealthInterval  = 2 * time.Second
	// gracefulStopTimeout bounds waiting for the calls still running once
	// every relay stream has ended (acks, admin calls) before connections
	// are closed under them.
	gracefulStopTimeout = 5 * time.Second
	// drainTimeout bounds waiting, after connections are closed, for the
	// last streams to give their leases back.
	drainTimeout = 10 * time.Second
)

// Config configures a Replica.
type Config struct {
	// Server is the configuration of the engine of the source named
	// "default" (--database-url). Its Registerer, when set, also receives
	// the gRPC metrics, and its Logger and Registerer serve every source
	// that has none of its own. With Sources, Server.Store may be nil:
	// there is then no default source, and bare stream names are refused.
	Server server.Config
	// Sources are further source databases, each served by an engine of
	// its own (its own pool, discovery, acks and health; see
	// internal/multisource), behind one gRPC server. With any, every
	// engine's metrics carry a "source" label. Default: none. Sources can
	// also be added and removed while the replica serves (AddSource,
	// RemoveSource).
	Sources []Source
	// LabelSources gives every engine's metrics a "source" label (and its
	// logs a source attribute) even when there is one source, as there are
	// with several: set it when sources may be added at run time, since a
	// metric cannot be registered both with and without the label.
	LabelSources bool
	// Authenticator, when not nil, authenticates and authorises every call
	// but health (and reflection, unless it protects it).
	Authenticator *auth.Authenticator
	// Creds are the listener's transport credentials. Default: plaintext.
	Creds credentials.TransportCredentials
	// Reflection serves gRPC server reflection (for grpcurl).
	Reflection bool
	// HealthInterval is how often readiness (database reachable, schema
	// current) is checked and published to the health service. Default 2s.
	HealthInterval time.Duration
	// IdleChecksPerSecond is the budget of discovery checks a second the
	// replica spreads over its quiet sources (see spreadIdleChecks).
	// Default DefaultIdleChecksPerSecond.
	IdleChecksPerSecond int
	// ShutdownTimeout is how long shutting down waits for outstanding
	// deliveries to be acked before ending the streams. Default 15s.
	ShutdownTimeout time.Duration
	// ServerOptions are appended to the gRPC server's options.
	ServerOptions []grpc.ServerOption
	// TracerProvider makes a server span per RPC (otelgrpc's stats
	// handler), child of the caller's W3C trace context when the request
	// carries one. Default: OpenTelemetry's global provider, a no-op unless
	// the process installs one (cmd/outboxd does from OTEL_* variables).
	TracerProvider trace.TracerProvider
}

// Source is one source database beside the default one.
type Source struct {
	// Name addresses the source's streams ("name/stream"); see
	// multisource.ValidName.
	Name string
	// Server configures its engine.
	Server server.Config
}

// Replica is a runnable outboxd replica: one engine per source database,
// behind a router registered on the production gRPC server. Create it with
// New, run it with Serve.
type Replica struct {
	// Server is the engine of the source named "default", nil when there is
	// none (see Config.Server).
	Server *server.Server
	// GRPC is the gRPC server it is registered on.
	GRPC *grpc.Server

	cfg    Config
	log    *slog.Logger
	router *multisource.Router
	// mu guards engines (in name order), runCtx (set by Serve: engines
	// added from then on start at once) and closing (set by Shutdown: no
	// engine is added from then on).
	mu        sync.Mutex
	engines   []*engine
	runCtx    context.Context
	closing   bool
	health    *health.Server
	readiness atomic.Pointer[server.Readiness]
	ready     chan struct{} // closed when first ready
	readyOnce sync.Once
	readyMu   sync.Mutex        // also serialises combining the sources' readiness
	stopping  bool              // under readyMu; set by Shutdown: readiness stays "shutting down"
	inproc    inProcessListener // see DialInProcess
}

// New builds a replica: it validates cfg.Server and loads the lease key
// (see server.New), then builds the gRPC server around it.
func New(ctx context.Context, cfg Config) (*Replica, error) {
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = DefaultHealthInterval
	}
	if cfg.IdleChecksPerSecond == 0 {
		cfg.IdleChecksPerSecond = DefaultIdleChecksPerSecond
	}
	switch {
	case cfg.ShutdownTimeout < 0:
		return nil, fmt.Errorf("app: Config.ShutdownTimeout %v must not be negative", cfg.ShutdownTimeout)
	case cfg.HealthInterval < 0:
		return nil, fmt.Errorf("app: Config.HealthInterval %v must be positive", cfg.HealthInterval)
	case cfg.IdleChecksPerSecond < 0:
		return nil, fmt.Errorf("app: Config.IdleChecksPerSecond %d must be positive", cfg.IdleChecksPerSecond)
	}
	log := cfg.Server.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// One replica id for every source's engine (those added later too)
	// unless a source names its own: one process is one replica to an
	// operator reading `outboxd relays` or an aggregate's holder.
	if cfg.Server.ReplicaID == "" {
		cfg.Server.ReplicaID = server.NewReplicaID()
	}
	r := &Replica{cfg: cfg, log: log, health: health.NewServer(), ready: make(chan struct{}),
		inproc: inProcessListener{bufconn.Listen(inProcessBuffer)}}
	if err := r.newEngines(ctx); err != nil {
		return nil, err
	}
	reg := cfg.Server.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry() // metrics nobody reads
	}
	r.GRPC = newGRPCServer(log, reg, cfg)
	r.router.Register(r.GRPC)
	healthpb.RegisterHealthServer(r.GRPC, r.health)
	if cfg.Reflection {
		reflection.Register(r.GRPC)
	}
	r.setReadiness(server.Readiness{Reason: "starting"})
	return r, nil
}

// engine is the engine of one source, with its latest readiness.
type engine struct {
	name      string
	srv       *server.Server
	readiness atomic.Pointer[server.Readiness]
	metrics   *trackedRegisterer // nil without metrics
	// cancel ends its background work (server.Server.Run and its readiness
	// checks), done is closed when that has returned with runErr; both nil
	// until Serve starts it.
	cancel context.CancelFunc
	done   chan struct{}
	runErr error
}

// trackedRegisterer remembers what it registered, so that a source removed
// at run time takes its metrics along and can be added again later.
type trackedRegisterer struct {
	prometheus.Registerer
	mu         sync.Mutex
	collectors []prometheus.Collector
}

func (t *trackedRegisterer) Register(c prometheus.Collector) error {
	if err := t.Registerer.Register(c); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.collectors = append(t.collectors, c)
	return nil
}

func (t *trackedRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := t.Register(c); err != nil {
			panic(err)
		}
	}
}

func (t *trackedRegisterer) unregisterAll() {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, c := range t.collectors {
		t.Registerer.Unregister(c)
	}
	t.collectors = nil
}

// newEngines builds one engine per source and the router in front of them.
func (r *Replica) newEngines(ctx context.Context) error {
	cfg := r.cfg
	sources := slices.Clone(cfg.Sources)
	if cfg.Server.Store != nil || len(sources) == 0 {
		sources = append([]Source{{Name: multisource.Default, Server: cfg.Server}}, sources...)
	}
	multi := len(sources) > 1 || cfg.LabelSources
	var routes []multisource.Engine
	for _, src := range sources {
		e, route, err := r.newEngine(ctx, src, multi)
		if err != nil {
			for _, e := range r.engines {
				e.metrics.unregisterAll()
			}
			return err
		}
		r.engines = append(r.engines, e)
		if src.Name == multisource.Default {
			r.Server = e.srv
		}
		routes = append(routes, route)
	}
	slices.SortFunc(r.engines, func(a, b *engine) int { return cmp.Compare(a.name, b.name) })
	r.spreadIdleChecks()
	router, err := multisource.New(routes)
	if err != nil {
		return fmt.Errorf("app: Config.Sources: %w", err)
	}
	r.router = router
	return nil
}

// DefaultIdleChecksPerSecond is the default budget of discovery checks a
// second a replica spreads over its quiet sources (see
// server.Config.DiscoveryQuietInterval): each source whose rounds have
// found nothing for a while checks every len(sources)/IdleChecksPerSecond,
// never more often than its idle interval (25ms: so with one source
// nothing changes). A check is one statement, so the budget bounds what
// quiet sources cost the replica and the database whatever their number;
// the price is that a quiet source's first event waits up to that interval
// (1s with 50 sources) to be found. serve --idle-checks-per-second sets
// it. 50: a check costs this project's 2-core benchmark machine about
// 0.9 ms of CPU (server and PostgreSQL, most of it two TCP writes and the
// wake-ups they cause), so 50 a second are about 4.5 % of a core.
const DefaultIdleChecksPerSecond = 50

// spreadIdleChecks gives every engine its share of the idle-check budget.
func (r *Replica) spreadIdleChecks() {
	quiet := time.Duration(len(r.engines)) * time.Second / time.Duration(r.cfg.IdleChecksPerSecond)
	for _, e := range r.engines {
		e.srv.SetDiscoveryQuietInterval(quiet)
	}
}

// newEngine builds the engine of one source (server.New: it loads the
// source's lease key) and its route, labelling its metrics and logs with
// the source when labelled.
func (r *Replica) newEngine(ctx context.Context, src Source, labelled bool) (*engine, multisource.Engine, error) {
	if err := multisource.ValidName(src.Name); err != nil {
		return nil, multisource.Engine{}, fmt.Errorf("app: Config.Sources: %w", err)
	}
	sc := src.Server
	sc.ReplicaID = cmp.Or(sc.ReplicaID, r.cfg.Server.ReplicaID)
	sc.Logger = cmp.Or(sc.Logger, r.log)
	sc.Registerer = cmp.Or(sc.Registerer, r.cfg.Server.Registerer)
	if labelled {
		sc.Logger = sc.Logger.With("source", src.Name)
		if sc.Registerer != nil {
			sc.Registerer = prometheus.WrapRegistererWith(prometheus.Labels{"source": src.Name}, sc.Registerer)
		}
	}
	var tracked *trackedRegisterer
	if sc.Registerer != nil {
		tracked = &trackedRegisterer{Registerer: sc.Registerer}
		sc.Registerer = tracked
	}
	srv, err := server.New(ctx, sc)
	if err != nil {
		tracked.unregisterAll()
		if labelled {
			return nil, multisource.Engine{}, fmt.Errorf("source %s: %w", src.Name, err)
		}
		return nil, multisource.Engine{}, err
	}
	e := &engine{name: src.Name, srv: srv, metrics: tracked}
	e.readiness.Store(&server.Readiness{Reason: "starting"})
	route := multisource.Engine{Name: src.Name, Relay: srv.RelayServer(), Admin: srv.AdminServer(),
		Readiness: func() (bool, string) { rd := e.readiness.Load(); return rd.Ready, rd.Reason }}
	return e, route, nil
}

// AddSource adds a source while the replica runs: it builds the source's
// engine (loading its lease key, so its database must answer), starts it
// when the replica is serving, and then publishes it to the router. The
// other sources' engines are not touched. It clears the source's
// SetSourcePending. Config.LabelSources should be set: an engine added to a
// replica whose metrics carry no source label cannot register its own.
func (r *Replica) AddSource(ctx context.Context, src Source) error {
	r.mu.Lock()
	exists := slices.ContainsFunc(r.engines, func(e *engine) bool { return e.name == src.Name })
	closing := r.closing
	r.mu.Unlock()
	switch {
	case closing:
		return fmt.Errorf("source %s: the replica is shutting down", src.Name)
	case exists:
		return fmt.Errorf("source %s: already served", src.Name)
	}
	e, route, err := r.newEngine(ctx, src, true)
	if err != nil {
		return err
	}
	r.mu.Lock()
	if r.closing {
		r.mu.Unlock()
		e.metrics.unregisterAll()
		return fmt.Errorf("source %s: the replica is shutting down", src.Name)
	}
	r.engines = append(r.engines, e)
	slices.SortFunc(r.engines, func(a, b *engine) int { return cmp.Compare(a.name, b.name) })
	r.spreadIdleChecks()
	if r.runCtx != nil {
		r.startLocked(e)
	}
	r.mu.Unlock()
	if err := r.router.Add(route); err != nil {
		// Only a concurrent AddSource of the same name gets here.
		_ = r.removeEngine(ctx, e, 0)
		return err
	}
	// router.Add forgot it as pending.
	r.readyMu.Lock()
	r.publishReadinessLocked()
	r.readyMu.Unlock()
	r.log.Info("source added", "source", src.Name)
	return nil
}

// RemoveSource removes a source while the replica runs, without touching
// the other sources' engines: new Subscribe streams for it are refused at
// once (NOT_FOUND, naming it as removed; see multisource.Router.Retire);
// its open streams stop claiming and end with UNAVAILABLE as soon as what
// they hold is acked, or when drain has passed (their leases released);
// then every call naming it is refused and its engine's background work
// ends. The caller closes the source's pool afterwards. The default
// source cannot be removed.
func (r *Replica) RemoveSource(ctx context.Context, name string, drain time.Duration) error {
	if name == multisource.Default {
		return errors.New("source default (--database-url) cannot be removed while serving")
	}
	var e *engine
	for _, x := range r.snapshot() {
		if x.name == name {
			e = x
		}
	}
	if e == nil {
		return fmt.Errorf("source %s: not served", name)
	}
	if err := r.router.Retire(name); err != nil {
		return err
	}
	err := r.removeEngine(ctx, e, drain)
	r.log.Info("source removed", "source", name)
	return err
}

// removeEngine stops a retired engine (see RemoveSource) and forgets it.
func (r *Replica) removeEngine(ctx context.Context, e *engine, drain time.Duration) error {
	stopCtx, cancel := context.WithTimeout(ctx, drain)
	stuck := e.srv.Stop(stopCtx)
	cancel()
	_ = r.router.Remove(e.name)
	if stuck != nil {
		waitCtx, cancel := context.WithTimeout(ctx, drainTimeout)
		if err := e.srv.Wait(waitCtx); err != nil {
			r.log.Warn("source removed with relay streams still blocked sending to relays that do not read; their leases expire by TTL",
				"source", e.name, "err", err)
		}
		cancel()
	}
	r.mu.Lock()
	r.engines = slices.DeleteFunc(r.engines, func(x *engine) bool { return x == e })
	r.spreadIdleChecks()
	r.mu.Unlock()
	if e.cancel != nil {
		e.cancel()
		<-e.done
	}
	e.metrics.unregisterAll()
	r.readyMu.Lock()
	r.publishReadinessLocked()
	r.readyMu.Unlock()
	return e.runErr
}

// SetSourcePending names a source that is configured but not served yet
// (its database does not answer, say) in the replica's readiness and in
// GetLag, with why, until AddSource adds it or ClearSourcePending forgets
// it. The router keeps the list (GetLag reads it there), and refuses a name
// that is not a source name or is of a source served now.
func (r *Replica) SetSourcePending(name, reason string) error {
	r.readyMu.Lock()
	defer r.readyMu.Unlock()
	if err := r.router.SetPending(name, reason); err != nil {
		return err
	}
	r.publishReadinessLocked()
	return nil
}

// ClearSourcePending forgets a pending source (removed from the
// configuration before it could be added).
func (r *Replica) ClearSourcePending(name string) {
	r.readyMu.Lock()
	defer r.readyMu.Unlock()
	r.router.ClearPending(name)
	r.publishReadinessLocked()
}

// startLocked starts e's background work under r.runCtx; r.mu is held.
func (r *Replica) startLocked(e *engine) {
	ctx, cancel := context.WithCancel(r.runCtx)
	e.cancel, e.done = cancel, make(chan struct{})
	go func() {
		defer close(e.done)
		var wg sync.WaitGroup
		wg.Go(func() {
			e.srv.WatchReadiness(ctx, r.cfg.HealthInterval, func(rd server.Readiness) { r.sourceReadiness(e, rd) })
		})
		e.runErr = e.srv.Run(ctx)
		wg.Wait()
	}()
}

// snapshot returns the engines served now.
func (r *Replica) snapshot() []*engine {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.engines)
}

// Source returns the engine of the named source, or nil.
func (r *Replica) Source(name string) *server.Server {
	for _, e := range r.snapshot() {
		if e.name == name {
			return e.srv
		}
	}
	return nil
}

// AdminServer returns the AdminService as the router implements it, called
// without the gRPC interceptors: see server.Server.AdminServer.
func (r *Replica) AdminServer() outboxv1.AdminServiceServer { return r.router.AdminServer() }

// Readiness is the replica's latest readiness: what the health service and
// /readyz report. With several sources the replica is ready while any
// source is (a source down must not take the others out of a load
// balancer), and Reason names every source that is not, even when Ready.
func (r *Replica) Readiness() server.Readiness { return *r.readiness.Load() }

// sourceReadiness records one source's readiness and publishes the
// replica's.
func (r *Replica) sourceReadiness(e *engine, rd server.Readiness) {
	r.readyMu.Lock()
	defer r.readyMu.Unlock()
	e.readiness.Store(&rd)
	r.publishReadinessLocked()
}

// publishReadinessLocked combines the sources' readiness into the
// replica's; readyMu is held.
func (r *Replica) publishReadinessLocked() {
	engines := r.snapshot()
	pending := r.router.Pending()
	if len(engines) == 1 && len(pending) == 0 {
		r.setReadinessLocked(*engines[0].readiness.Load())
		return
	}
	var all server.Readiness
	var down []string
	for _, e := range engines {
		rd := e.readiness.Load()
		all.Ready = all.Ready || rd.Ready
		if !rd.Ready {
			down = append(down, fmt.Sprintf("source %s: %s", e.name, rd.Reason))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(pending)) {
		down = append(down, fmt.Sprintf("source %s: not added yet: %s", name, pending[name]))
	}
	all.Reason = strings.Join(down, "; ")
	r.setReadinessLocked(all)
}

// Ready is closed the first time the replica reports ready (health
// SERVING), which Serve's first readiness check does at once.
func (r *Replica) Ready() <-chan struct{} { return r.ready }

func (r *Replica) setReadiness(rd server.Readiness) {
	r.readyMu.Lock()
	defer r.readyMu.Unlock()
	r.setReadinessLocked(rd)
}

func (r *Replica) setReadinessLocked(rd server.Readiness) {
	if r.stopping {
		return // a readiness check finishing late must not undo Shutdown's
	}
	r.readiness.Store(&rd)
	if rd.Ready {
		r.readyOnce.Do(func() { close(r.ready) })
	}
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if rd.Ready {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, name := range []string{"", outboxv1.RelayService_ServiceDesc.ServiceName, outboxv1.AdminService_ServiceDesc.ServiceName} {
		r.health.SetServingStatus(name, st)
	}
}

// Serve serves on lis until ctx is done, then shuts down (see Shutdown) and
// returns. It returns early with an error if serving fails.
func (r *Replica) Serve(ctx context.Context, lis net.Listener) error {
	runCtx, cancelRun := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelRun()
	var wg sync.WaitGroup
	r.mu.Lock()
	r.runCtx = runCtx
	for _, e := range r.engines {
		r.startLocked(e)
	}
	r.mu.Unlock()
	var authErr error
	if a := r.cfg.Authenticator; a != nil {
		wg.Add(1)
		go func() { defer wg.Done(); authErr = a.Watch(runCtx) }()
	}
	served := make(chan error, 1)
	go func() { served <- r.GRPC.Serve(lis) }()
	// The in-process pipe (DialInProcess) ends with the server: Stop closes
	// every listener it serves.
	go func() { _ = r.GRPC.Serve(r.inproc) }()

	var serveErr error
	select {
	case <-ctx.Done():
		r.Shutdown()
		serveErr = <-served
	case serveErr = <-served:
		r.Shutdown()
	}
	if errors.Is(serveErr, grpc.ErrServerStopped) {
		serveErr = nil
	}
	cancelRun()
	wg.Wait()
	errs := []error{serveErr, authErr}
	for _, e := range r.snapshot() {
		<-e.done
		errs = append(errs, e.runErr)
	}
	return errors.Join(errs...)
}

// Shutdown ends serving, bounded by Config.ShutdownTimeout plus a few
// seconds whatever relays do: health turns NOT_SERVING and every relay
// stream stops claiming at once; streams end as their outstanding
// deliveries are acked, the rest when the timeout passes (their leases
// released). Then the remaining calls get a short grace before connections
// are closed, which also ends any stream still blocked sending to a relay
// that does not read.
func (r *Replica) Shutdown() {
	r.log.Info("shutting down: no new claims; waiting for outstanding acks", "timeout", r.cfg.ShutdownTimeout)
	r.setReadiness(server.Readiness{Reason: "shutting down"})
	r.readyMu.Lock()
	r.stopping = true
	r.readyMu.Unlock()
	r.mu.Lock()
	r.closing = true
	r.mu.Unlock()
	r.health.Shutdown()
	stopCtx, cancel := context.WithTimeout(context.Background(), r.cfg.ShutdownTimeout)
	stuck := r.eachEngine(func(s *server.Server) error { return s.Stop(stopCtx) })
	cancel()
	// The graceful stop below refuses new calls, Ack among them; the ack
	// streams end here as well, rather than hold that stop until their
	// relays close them.
	if r.router != nil {
		r.router.EndAckStreams()
	}
	if stuck == nil {
		stopped := make(chan struct{})
		go func() { r.GRPC.GracefulStop(); close(stopped) }()
		t := time.NewTimer(gracefulStopTimeout)
		select {
		case <-stopped:
		case <-t.C:
		}
		t.Stop()
	}
	// Closes every connection: a stream blocked sending to a relay that
	// stopped reading fails its send, ends and releases its leases.
	r.GRPC.Stop()
	drainCtx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	if err := r.eachEngine(func(s *server.Server) error { return s.Wait(drainCtx) }); err != nil {
		r.log.Warn("relay streams did not end after their connections closed; their leases expire by TTL", "err", err)
	}
	r.log.Info("outboxd stopped")
}

// eachEngine runs fn on every engine at once and joins their errors.
func (r *Replica) eachEngine(fn func(*server.Server) error) error {
	engines := r.snapshot()
	errs := make([]error, len(engines))
	var wg sync.WaitGroup
	for i, e := range engines {
		wg.Go(func() { errs[i] = fn(e.srv) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// newGRPCServer builds the gRPC server with its interceptors, outermost
// first: metrics see every call's final code and duration; the log line is
// written when a call finishes; authentication (when configured) refuses
// callers before any handler or validation runs; recovery turns a handler's
// panic into INTERNAL (counted) before the others see it. The panic counter
// is the process's, as the gRPC metrics are: a handler may panic before it
// knows its source, and the count must outlive any source removed at run
// time.
func newGRPCServer(log *slog.Logger, reg prometheus.Registerer, cfg Config) *grpc.Server {
	metrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets([]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10})))
	panicCount := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outboxd_panics_recovered_total",
		Help: "Panics in RPC handlers (of every source: the count is the process's), recovered and answered with INTERNAL.",
	})
	reg.MustRegister(metrics, panicCount)
	rpcLog := logging.LoggerFunc(func(ctx context.Context, level logging.Level, msg string, fields ...any) {
		log.Log(ctx, slog.Level(level), msg, fields...)
	})
	logOpts := []logging.Option{
		logging.WithLogOnEvents(logging.FinishCall),
		logging.WithLevels(rpcLogLevel),
	}
	panics := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		panicCount.Inc()
		log.ErrorContext(ctx, "panic in RPC handler", "panic", fmt.Sprint(p))
		return status.Error(codes.Internal, "internal error")
	})
	unary := []grpc.UnaryServerInterceptor{metrics.UnaryServerInterceptor(), logging.UnaryServerInterceptor(rpcLog, logOpts...)}
	stream := []grpc.StreamServerInterceptor{metrics.StreamServerInterceptor(), logging.StreamServerInterceptor(rpcLog, logOpts...)}
	if a := cfg.Authenticator; a != nil {
		unary = append(unary, a.UnaryServerInterceptor())
		stream = append(stream, a.StreamServerInterceptor())
	}
	unary = append(unary, recovery.UnaryServerInterceptor(panics))
	stream = append(stream, recovery.StreamServerInterceptor(panics))
	opts := []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
		grpc.MaxRecvMsgSize(MaxRecvMsgSize),
		grpc.MaxConcurrentStreams(MaxConcurrentStreams),
		// Relays keep one long stream open: ping idle connections so a dead
		// peer is noticed (and its leases released) within a minute, and
		// refuse clients that ping more often than every 10 s.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 20 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
	if cfg.Creds != nil {
		opts = append(opts, grpc.Creds(inProcessCreds{cfg.Creds}))
	}
	opts = append(opts, grpc.StatsHandler(tracingHandler(cfg.TracerProvider)))
	g := grpc.NewServer(append(opts, cfg.ServerOptions...)...)
	metrics.InitializeMetrics(g)
	return g
}

// tracingHandler traces every RPC but health checks (probes every few
// seconds would drown the rest). It reads the W3C trace context and
// baggage (traceparent, tracestate, baggage metadata), and records no
// per-message events: a relay's Subscribe stream lives for hours.
func tracingHandler(tp trace.TracerProvider) stats.Handler {
	opts := []otelgrpc.Option{
		otelgrpc.WithFilter(filters.Not(filters.HealthCheck())),
		otelgrpc.WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
	}
	if tp != nil {
		opts = append(opts, otelgrpc.WithTracerProvider(tp))
	}
	return otelgrpc.NewServerHandler(opts...)
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
