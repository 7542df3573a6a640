package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/credentials"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/connstring"
	"github.com/outboxd/outboxd/internal/console"
	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/tlsconfig"
	"github.com/outboxd/outboxd/server"
)

// serveFlags configure the server.
type serveFlags struct {
	listen                string
	replicaID             string
	defaultLeaseTTL       time.Duration
	maxFailures           int
	maxDeliveries         int
	backoffBase           time.Duration
	backoffCap            time.Duration
	pollInterval          time.Duration
	shutdownTimeout       time.Duration
	partitionTTL          time.Duration
	maxConns              int32
	httpListen            string
	healthInterval        time.Duration
	idleChecks            int
	retention             time.Duration
	strandedAuditInterval time.Duration
	janitorInterval       time.Duration
	reflection            bool

	tokenFile            string
	insecureNoAuth       bool
	reflectionNeedsToken bool
	tlsCert, tlsKey      string
	tlsClientCA          string
	maxSubscriptions     int
	ackCommitters        int
	ackLinger            time.Duration
	discoveryMaxEvents   int
	pprof                bool
	console              bool
	sources              []string

	// sourcesFile is the --config file the sources came from, when they
	// did (its `source:` list is then reread on SIGHUP and file change),
	// and rereadSources reads that list again.
	sourcesFile   string
	rereadSources func() ([]string, error)
	// sourcesWatched, when set (tests), is called once serve watches the
	// sources file and SIGHUP.
	sourcesWatched func()
}

func (f *serveFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.listen, "listen", "127.0.0.1:7070", "gRPC listen address")
	fl.StringVar(&f.replicaID, "replica-id", "", "unique name of this replica (default hostname-pid-random)")
	fl.DurationVar(&f.defaultLeaseTTL, "lease-ttl", 30*time.Second, "lease TTL for relays that ask for none")
	fl.IntVar(&f.maxFailures, "max-failures", 10, "failed publishes of one event before its aggregate is parked")
	fl.IntVar(&f.maxDeliveries, "max-deliveries", 25, "deliveries of one event without an ack or nack (expired lease, ended stream) before its aggregate is parked")
	fl.DurationVar(&f.backoffBase, "backoff-base", time.Second, "first retry delay after a nack (doubles per failure, with jitter)")
	fl.DurationVar(&f.backoffCap, "backoff-cap", 5*time.Minute, "longest retry delay after a nack (the same on every replica: a next attempt further ahead than twice the longest lease or backoff counts as due, see docs/design.md)")
	fl.DurationVar(&f.pollInterval, "poll-interval", time.Second, "longest pause of the fallback poll that finds work when a notification was lost: one poll per stream filter of the idle relay streams, not one per stream")
	fl.DurationVar(&f.partitionTTL, "partition-ttl", 15*time.Second, "how long this replica's ownership of its share of the aggregates' partitions lasts without a renewal (renewed every third of it): a replica killed without a shutdown keeps its partitions from the others this long")
	fl.DurationVar(&f.shutdownTimeout, "shutdown-timeout", 15*time.Second, "how long SIGTERM waits for outstanding deliveries to be acked")
	fl.Int32Var(&f.maxConns, "max-db-conns", 16, "database connection pool size, of each source (pool_max_conns=N in a source's URL overrides it for that source); each source also has a LISTEN connection, and an idle one holds 2 in all")
	fl.StringVar(&f.httpListen, "http-listen", "127.0.0.1:7071", "HTTP address for /metrics, /healthz, /readyz and the console (--console) (empty: off)")
	fl.DurationVar(&f.healthInterval, "health-interval", 2*time.Second, "how often readiness (database reachable, schema current, discovery not stopped) is checked")
	fl.IntVar(&f.idleChecks, "idle-checks-per-second", app.DefaultIdleChecksPerSecond, "discovery checks a second spread over the sources that have had no event for 10s: each checks every SOURCES/N seconds (25ms at most often), so a quiet source's first event waits up to that long; lower it to spend less CPU on many idle sources")
	fl.Var(&ageValue{d: &f.retention}, "retention", "delete events published longer ago than this, e.g. 7d or 36h (default: keep everything)")
	fl.DurationVar(&f.janitorInterval, "janitor-interval", time.Minute, "how often the retention janitor runs when --retention is set")
	fl.DurationVar(&f.strandedAuditInterval, "stranded-audit-interval", time.Minute, "how long one count of stranded events (pending events no rule will deliver: outboxd lag, the metrics, the console) serves before a reader starts the next; the count reads every aggregate of a source (about 0.25 s of PostgreSQL per 100,000), and waits at least 20 times as long as it took")
	fl.BoolVar(&f.reflection, "reflection", true, "serve gRPC server reflection (for grpcurl)")
	fl.StringVar(&f.tokenFile, "token-file", "", "bearer tokens with roles and stream limits, reloaded on change and SIGHUP (also read: $"+auth.DefaultEnvVar+")")
	fl.BoolVar(&f.insecureNoAuth, "insecure-no-auth", false, "allow serving without tokens on a non-loopback address")
	fl.BoolVar(&f.reflectionNeedsToken, "reflection-needs-token", false, "require a valid token for server reflection")
	fl.StringVar(&f.tlsCert, "tls-cert", "", "TLS certificate file (with --tls-key), reloaded when it changes")
	fl.StringVar(&f.tlsKey, "tls-key", "", "TLS private key file")
	fl.StringVar(&f.tlsClientCA, "tls-client-ca", "", "CA file for client certificates: turns on mutual TLS")
	fl.BoolVar(&f.pprof, "pprof", false, "serve Go profiles on the HTTP port under /debug/pprof/")
	fl.BoolVar(&f.console, "console", true, "serve the operator console at / on the HTTP port (login with a viewer or admin token)")
	fl.IntVar(&f.ackCommitters, "ack-committers", 1, "ack batches applied at once, each on its own database connection: more drains a backlog faster on several cores, but makes each batch smaller (more database work per ack) when load is light")
	fl.IntVar(&f.discoveryMaxEvents, "discovery-max-events", 0, "take a backlog larger than this many events in discovery rounds of whole transactions, each its own transaction: after an outage the first events are delivered within seconds instead of after one round over all of them, at more discovery work in all (0: no limit, the default)")
	fl.DurationVar(&f.ackLinger, "ack-linger", server.DefaultAckLinger, "under load (acks of several relay connections interleaving), how long an ack batch may wait for more before it commits: fewer, larger batches cost less CPU per event, at up to this much more commit→published_at; a lone ack never waits (0: off)")
	fl.IntVar(&f.maxSubscriptions, "max-subscriptions-per-relay", 64, "Subscribe streams one token (or relay id, without auth) may hold open on this replica")
	addSourceFlag(fl, &f.sources)
}

// security builds the listener's transport credentials (nil: plaintext)
// and the authenticator from the flags. It refuses to serve without tokens
// on an address other machines can reach, unless --insecure-no-auth.
func (f *serveFlags) security(log *slog.Logger) (credentials.TransportCredentials, *auth.Authenticator, error) {
	var creds credentials.TransportCredentials
	if f.tlsCert != "" || f.tlsKey != "" || f.tlsClientCA != "" {
		if f.tlsCert == "" || f.tlsKey == "" {
			return nil, nil, errors.New("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
		}
		tc, err := tlsconfig.NewServer(tlsconfig.ServerConfig{
			CertFile: f.tlsCert, KeyFile: f.tlsKey, ClientCAFile: f.tlsClientCA, Logger: log,
		})
		if err != nil {
			return nil, nil, err
		}
		creds = tlsconfig.ServerCredentials(tc, log)
	}
	if f.tokenFile == "" && os.Getenv(auth.DefaultEnvVar) == "" {
		if !auth.IsLoopback(f.listen) && !f.insecureNoAuth {
			return nil, nil, fmt.Errorf("refusing to serve %s without authentication: give --token-file or $%s, or --insecure-no-auth if something in front of outboxd authenticates",
				f.listen, auth.DefaultEnvVar)
		}
		// SIGHUP asks serve to reload its tokens (systemctl reload sends
		// it). With none there is nothing to reload, and Go's default for
		// a signal nobody handles is to exit, which a service manager takes
		// for a clean stop: ignore it instead.
		signal.Ignore(syscall.SIGHUP)
		return creds, nil, nil
	}
	authn, err := auth.New(auth.Config{
		File: f.tokenFile, EnvVar: auth.DefaultEnvVar, ProtectReflection: f.reflectionNeedsToken, Logger: log,
	})
	if err != nil {
		return nil, nil, err
	}
	if f.tlsCert == "" && !auth.IsLoopback(f.listen) {
		log.Warn("tokens will cross the network in plaintext: serve with --tls-cert and --tls-key", "listen", f.listen)
	}
	return creds, authn, nil
}

// newConsole builds the operator console on the replica's in-process
// connection. Without tokens it is open (no login) only on a loopback HTTP
// address and only when gRPC does not ask for client certificates: the
// in-process connection skips TLS, so an open console beside mutual TLS
// would be a way around it. --insecure-no-auth never opens it: that flag
// trusts something in front of the gRPC port, which does not guard the
// HTTP port.
func (f *serveFlags) newConsole(rep *app.Replica, authn *auth.Authenticator, log *slog.Logger) (*console.Console, func(), error) {
	conn, err := rep.DialInProcess()
	if err != nil {
		return nil, nil, fmt.Errorf("console: %w", err)
	}
	open := authn == nil && auth.IsLoopback(f.httpListen) && f.tlsClientCA == ""
	switch {
	case authn == nil && f.tlsClientCA != "":
		log.Warn("console refused: gRPC requires client certificates and the console has no tokens to stand in for them; give --token-file to use it")
	case authn == nil && !open:
		log.Warn("console refused: no tokens and --http-listen is not loopback; give --token-file to use it", "http_listen", f.httpListen)
	case authn != nil && !auth.IsLoopback(f.httpListen):
		log.Warn("console logins send tokens over plaintext HTTP: put TLS in front of --http-listen", "http_listen", f.httpListen)
	}
	con, err := console.New(console.Config{
		Conn: conn, Authenticator: authn, Open: open, Lag: rep.AdminServer().GetLag, Logger: log,
	})
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	return con, func() { conn.Close() }, nil
}

func serveCommand(g *globalFlags) *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run an outboxd server replica",
		Long: `serve runs a server replica: one engine per source database (--database-url is the
source "default", --source NAME=URL adds one), behind one gRPC listener.

Reloading: the source: list of the --config file is reread on SIGHUP and whenever
the file changes. New entries are added, entries gone are removed (their streams
get --shutdown-timeout to ack what they hold, then end UNAVAILABLE, and the source
is refused with NOT_FOUND), an entry whose URL changed is removed and added again;
the other sources' relays and leases are not touched. A list that does not parse
changes nothing (logged, counted in outboxd_source_reloads_total{result="error"});
a listed source that does not answer is retried and named by /readyz meanwhile.
Sources given by --source or $OUTBOXD_SOURCE (which win over the file) and
--database-url are fixed until a restart, as is every other setting; one of
them that does not answer at startup is retried in the same way while the
others are served (one source at least must answer). SIGHUP also
rereads the token file (--token-file).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.check(); err != nil {
				return err
			}
			log, err := g.logger(os.Stderr)
			if err != nil {
				return err
			}
			all, err := g.sources(f.sources)
			if err != nil {
				return err
			}
			if path := configFileOf(cmd.Flags(), "source"); path != "" {
				f.sourcesFile = path
				f.rereadSources = func() ([]string, error) {
					file, err := readConfigFile(path, cmd)
					if err != nil {
						return nil, err
					}
					if v, ok := file["source"]; ok {
						return fileValues(v), nil
					}
					return nil, nil
				}
			}
			return runServer(cmd.Context(), all, &f, log, nil)
		},
	}
	f.register(cmd)
	return cmd
}

func devCommand(g *globalFlags) *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a development server: find or start PostgreSQL, migrate, serve",
		Long: `dev uses --database-url or $DATABASE_URL when set, otherwise the PostgreSQL on
127.0.0.1:5432, otherwise a throwaway cluster started from the PostgreSQL server
binaries on PATH or in the distribution's usual folders (removed on exit). It
applies migrations and serves on --listen.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if err := f.check(); err != nil {
				return err
			}
			log, err := g.logger(os.Stderr)
			if err != nil {
				return err
			}
			db, err := devdb.Resolve(ctx, log, g.databaseURL)
			if err != nil {
				return err
			}
			defer func() {
				closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
				defer cancel()
				if err := db.Close(closeCtx); err != nil {
					log.Warn("stopping the throwaway database failed", "err", err)
				}
			}()
			all := []source{{multisource.Default, db.URL}}
			named, err := (&globalFlags{databaseURL: db.URL}).sources(f.sources)
			if err != nil {
				return err
			}
			all = append(all, named[1:]...)
			if err := migrateSources(ctx, all, log, func(string, ...any) {}); err != nil {
				return err
			}
			return runServer(ctx, all, &f, log, func(addr string) {
				fmt.Fprintf(cmd.OutOrStdout(), `outboxd dev: gRPC on %s, database %s (%s)
  emit an event:  psql '%s' -c "SELECT * FROM outbox.emit('sales_order', '42', 'OrderPaid', '{\"order_id\": 42}')"
  relay to stdout: go run ./cmd/outboxd relay --server %s --sink stdout://
`, addr, connstring.Redact(db.URL), db.Source, db.URL, addr)
				if f.httpListen != "" && f.console {
					fmt.Fprintf(cmd.OutOrStdout(), "  console:         http://%s/\n", f.httpListen)
				}
			})
		},
	}
	f.register(cmd)
	return cmd
}

// engineConfig is what the flags say of every source's engine (the
// logger and the metrics registry are the caller's).
func (f *serveFlags) engineConfig() server.Config {
	return server.Config{
		ReplicaID:       f.replicaID,
		DefaultLeaseTTL: f.defaultLeaseTTL, MaxFailures: f.maxFailures, MaxDeliveries: f.maxDeliveries,
		BackoffBase: f.backoffBase, BackoffCap: f.backoffCap, PollInterval: f.pollInterval,
		Retention: f.retention, JanitorInterval: f.janitorInterval,
		StrandedAuditInterval:    f.strandedAuditInterval,
		MaxSubscriptionsPerRelay: f.maxSubscriptions, AckCommitters: f.ackCommitters, AckLinger: ackLinger(f.ackLinger),
		DiscoveryMaxEvents: f.discoveryMaxEvents, PartitionTTL: f.partitionTTL,
	}
}

// ackLinger is Config.AckLinger for --ack-linger d: 0 turns the linger
// off, which the Config says with a negative value (its zero is the
// default).
func ackLinger(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// runServer serves until ctx is done, then shuts down gracefully: stop
// claiming, let outstanding deliveries be acked (up to --shutdown-timeout),
// release leases, close streams.
func runServer(ctx context.Context, sources []source, f *serveFlags, log *slog.Logger, ready func(addr string)) error {
	stopTracing, err := startTracing(ctx, "outboxd", log)
	if err != nil {
		return err
	}
	defer stopTracing()
	reg := newRegistry()
	poolMetrics := newSourcePoolCollector(reg)
	base := f.engineConfig()
	base.Logger, base.Registerer = log, reg
	// One engine per source, each with its own pool of --max-db-conns.
	// A source that does not answer now (its database down, or not
	// migrated yet) is served once it does, when there are others to serve
	// meanwhile: one database down while serve restarts holds up none of
	// the others. The sourceSet connects it, whether it came from the
	// --config file's list (which reloads change too), from --source or
	// $OUTBOXD_SOURCE, or is default (these fixed until a restart). One
	// source at least must answer, and a URL must parse.
	defaultCfg := base
	var named []app.Source
	fromFile := f.rereadSources != nil
	alone := len(sources) == 1
	// retried is what the sourceSet connects: the file's whole list (it
	// takes over the ones opened now, in opened) and every other source
	// that did not answer.
	var retried []source
	opened := map[string]*sourcePool{}
	var firstErr error
	for _, src := range sources {
		isDefault := src.name == multisource.Default
		ofFile := fromFile && !isDefault
		if ofFile {
			retried = append(retried, src)
		} else if _, err := src.poolConfig(sources); err != nil {
			return err // a mistake, not a database that is down
		}
		openCtx, cancel := ctx, context.CancelFunc(func() {})
		if !alone || ofFile {
			openCtx, cancel = context.WithTimeout(ctx, sourceConnectTimeout)
		}
		pool, err := openSource(openCtx, src, sources, f.maxConns)
		cancel()
		if err != nil && alone {
			return err
		}
		if err != nil {
			log.Warn("source not reachable at startup; serving the others and retrying it", "source", src.name, "err", err)
			firstErr = cmp.Or(firstErr, err)
			if !ofFile {
				retried = append(retried, src)
			}
			continue
		}
		poolMetrics.add(src.name, pool)
		if ofFile {
			opened[src.name] = pool // closed by the sourceSet
		} else {
			defer pool.Close()
		}
		if isDefault {
			defaultCfg.Store, defaultCfg.DatabaseURL = store.New(pool.Pool), withoutPoolParams(src.url)
			continue
		}
		named = append(named, app.Source{Name: src.name, Server: namedSourceConfig(base, src, pool)})
	}
	if defaultCfg.Store == nil && len(named) == 0 {
		return firstErr // no source answers
	}
	var reloads *sourceSet
	if fromFile || len(retried) > 0 {
		reloads = &sourceSet{
			log: log, base: base, maxConns: f.maxConns, interval: f.healthInterval, drain: f.shutdownTimeout,
			path: f.sourcesFile, reread: f.rereadSources, fixed: map[string]bool{},
			reloads: newSourceReloadMetric(reg), poolMetrics: poolMetrics,
		}
		if slices.ContainsFunc(sources, func(s source) bool { return s.name == multisource.Default }) {
			reloads.fixed[multisource.Default] = true
		}
		defer func() {
			for _, pool := range opened {
				pool.Close() // unless the sourceSet took them over and closed them
			}
		}()
	}

	creds, authn, err := f.security(log)
	if err != nil {
		return err
	}
	rep, err := app.New(ctx, app.Config{
		Server:              defaultCfg,
		Sources:             named,
		Authenticator:       authn,
		Creds:               creds,
		Reflection:          f.reflection,
		HealthInterval:      f.healthInterval,
		IdleChecksPerSecond: f.idleChecks,
		ShutdownTimeout:     f.shutdownTimeout,
		LabelSources:        reloads != nil,
	})
	if err != nil {
		return err
	}
	poolMetrics.setReplica(rep) // and each pool follows its engine
	if reloads != nil {
		reloads.rep = rep
		reloads.start(ctx, opened, retried)
		defer reloads.close()
	}
	lis, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", f.listen, err)
	}
	var httpLis net.Listener
	if f.httpListen != "" {
		if httpLis, err = net.Listen("tcp", f.httpListen); err != nil {
			lis.Close()
			return fmt.Errorf("--http-listen %s: %w", f.httpListen, err)
		}
	}

	var eg errgroup.Group
	// The replica shuts down when ctx is done: see app.Replica.Shutdown.
	served := make(chan struct{})
	eg.Go(func() error { defer close(served); return rep.Serve(ctx, lis) })
	if reloads != nil && fromFile {
		eg.Go(func() error {
			watchCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			go func() { <-served; cancel() }()
			return reloads.Watch(watchCtx, f.sourcesWatched)
		})
	}
	var httpSrv *http.Server
	if httpLis != nil {
		var consoleHandler http.Handler
		if f.console {
			con, closeConsole, err := f.newConsole(rep, authn, log)
			if err != nil {
				lis.Close()
				httpLis.Close()
				return err
			}
			defer closeConsole()
			consoleHandler = con.Handler()
			eg.Go(func() error { return con.Run(ctx) })
		}
		httpSrv = newHTTPServer(reg, rep.Readiness, f.pprof, consoleHandler)
		eg.Go(func() error {
			if err := httpSrv.Serve(httpLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		})
		eg.Go(func() error {
			// /readyz answers "shutting down" while the replica drains;
			// the HTTP server goes last.
			<-served
			httpCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_ = httpSrv.Shutdown(httpCtx)
			return nil
		})
		log.Info("metrics and health over HTTP", "listen", httpLis.Addr().String())
	}
	log.Info("outboxd serving", "listen", lis.Addr().String(), "sources", len(sources))
	if ready != nil {
		ready(lis.Addr().String())
	}
	return eg.Wait()
}
