// Command outboxd-bench runs the benchmark docs/benchmark.md specifies:
// outboxd against PostgreSQL's own ceilings, a naive SQL poller and the
// libraries users would pick instead (Watermill SQL, River), in one run on
// one machine. It is a module of its own so that the outboxd binary links
// none of its plotting code or peer libraries; `make bench` and `make
// bench-quick` run it.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/outboxd/outboxd/bench"
	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/relay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := command().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outboxd-bench:", err)
		os.Exit(1)
	}
}

func command() *cobra.Command {
	var (
		cfg          bench.Config
		databaseURL  string
		logLevel     string
		jsonPath     string
		plotPath     string
		serverBinary string
		cpuProfile   string
		replot       string
	)
	cmd := &cobra.Command{
		Use:   "outboxd-bench",
		Short: "Benchmark outboxd against PostgreSQL's ceilings, a naive poller, Watermill SQL and River",
		Long: `outboxd-bench runs the benchmark of docs/benchmark.md against the PostgreSQL
server named by --database-url (default: $DATABASE_URL, else the local
server). It creates a database per arm (outboxd_bench_*), drops them all when
it ends, and needs a role that may CREATE DATABASE.

Arms: ceiling-insert and ceiling-insert-mark (the database's own floor cost),
naive-poller (the textbook SQL protocol, publishing inside the transaction),
outboxd (outbox.emit, the real server, K relays over loopback gRPC), and the
peers as their users would build an outbox: watermill and watermill-10ms
(Watermill SQL's PostgreSQL queue adapter at its default 1s poll and at
10ms) and river (one River job per producer transaction). Workloads: steady,
latency, drain, hot, producer (the producer's cost alone), held-xmin
(steady while a transaction id stays open), many-relays (outboxd alone:
--many-relays relays idle on one server, then --many-relays-rate events/s)
and replicas (outboxd alone: steady through --replicas servers on one
database, the K relays spread over them).
Two more run only when named: sources (--sources source databases behind one
outboxd serve, one heavy at full speed and the rest light at
--sources-light-rate each, the light ones alone first) and idle-sources
(--idle-sources idle source databases, with no relay and then one each:
connections held and CPU). Every delivering arm publishes to
a sink that checks order and counts lost and duplicated events; a run in
which outboxd or the naive poller loses or reorders an event fails. Peers
promise no per-key order: they report reorders, and losses as defects of
that arm, without failing the run.

The server runs as a child process, outboxd serve with its default settings,
so that its CPU time and memory are measured apart. Without --server-binary
the benchmark builds cmd/outboxd from the main module first.

The standard set (make bench) takes about 15 minutes on 2 cores; --quick runs
a reduced set in about two minutes. Timings on a shared machine are noisy:
compare arms of the same run.`,
		Example: `  outboxd-bench --quick
  outboxd-bench --json ../docs/bench.json --plot ../docs/bench.png
  outboxd-bench --workload steady --arms ceiling-insert,outboxd,watermill-10ms,river --duration 20s
  outboxd-bench --workload steady --arms outboxd --sink nats://127.0.0.1:4222`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if replot != "" {
				rep, err := bench.ReadReport(replot)
				if err != nil {
					return err
				}
				if plotPath == "" {
					return errors.New("--replot needs --plot")
				}
				return rep.WritePlot(plotPath)
			}
			var level slog.Level
			if err := level.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level %q: want debug, info, warn or error", logLevel)
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			if cpuProfile != "" {
				f, err := os.Create(cpuProfile)
				if err != nil {
					return fmt.Errorf("--cpuprofile: %w", err)
				}
				defer f.Close()
				if err := pprof.StartCPUProfile(f); err != nil {
					return fmt.Errorf("--cpuprofile: %w", err)
				}
				defer pprof.StopCPUProfile()
			}
			if serverBinary == "" {
				dir, err := os.MkdirTemp("", "outboxd-bench-")
				if err != nil {
					return err
				}
				defer os.RemoveAll(dir)
				fmt.Fprintln(cmd.ErrOrStderr(), "building cmd/outboxd from the main module...")
				if serverBinary, err = bench.BuildServer(ctx, dir); err != nil {
					return fmt.Errorf("%w (or pass --server-binary)", err)
				}
			}
			cfg.ServerBinary = serverBinary
			cfg.DatabaseURL = databaseURL
			if cfg.DatabaseURL == "" {
				cfg.DatabaseURL = cmp.Or(os.Getenv(devdb.EnvVar), devdb.LocalURL)
			}
			cfg.Logger = log
			cfg.Progress = cmd.ErrOrStderr()
			cfg.Command = "outboxd-bench " + strings.Join(os.Args[1:], " ")

			rep, runErr := bench.Run(ctx, cfg)
			if rep != nil && len(rep.Results) > 0 {
				fmt.Fprintln(cmd.OutOrStdout())
				rep.WriteTable(cmd.OutOrStdout())
				if jsonPath != "" {
					if err := rep.WriteJSON(jsonPath); err != nil {
						return errors.Join(runErr, fmt.Errorf("--json: %w", err))
					}
					fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", jsonPath)
				}
				if plotPath != "" {
					if err := rep.WritePlot(plotPath); err != nil {
						return errors.Join(runErr, fmt.Errorf("--plot: %w", err))
					}
					fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s\n", plotPath)
				}
			}
			if errors.Is(runErr, bench.ErrIncorrect) {
				fmt.Fprintln(cmd.ErrOrStderr(), "\n!!! BENCHMARK FAILED: an arm lost, invented or (where it promises order) reordered events; that arm's figures are not valid (the table names it) !!!")
			}
			return runErr
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&databaseURL, "database-url", "", "PostgreSQL URL of a database on the server to benchmark (default: $DATABASE_URL, else "+devdb.LocalURL+")")
	fl.StringVar(&logLevel, "log-level", "warn", "log level of the server's and relays' messages: debug, info, warn, error")
	fl.StringSliceVar(&cfg.Workloads, "workload", nil, "workloads to run: "+strings.Join(bench.AllWorkloads, ", ")+" (default all but "+bench.WorkloadSources+" and "+bench.WorkloadIdleSources+", which make bench-sources runs)")
	fl.StringSliceVar(&cfg.Arms, "arms", nil, "arms to run: "+strings.Join(bench.AllArms, ", ")+" (default all)")
	fl.DurationVar(&cfg.Duration, "duration", 0, "measured window per arm (default 10s; 3s with --quick)")
	fl.DurationVar(&cfg.Warmup, "warmup", 0, "warm-up before each window (default 2s; 1s with --quick)")
	fl.IntVar(&cfg.Producers, "producers", 8, "producer connections P, one event per transaction")
	fl.IntVar(&cfg.Relays, "relays", 4, "outboxd relay connections and naive poller workers K")
	fl.IntVar(&cfg.MaxInFlight, "max-in-flight", relay.DefaultMaxInFlight, "each relay's credit, by default what outboxd relay asks for (drain keeps at least 1,000 in flight across all relays)")
	fl.IntVar(&cfg.Aggregates, "aggregates", 10_000, "aggregates the steady and latency workloads spread events over")
	fl.DurationSliceVar(&cfg.SinkLatencies, "sink-latency", nil, "sink publish latencies standing in for a broker round trip; steady runs each, the rest use the first (default 0,1ms,5ms; 0,1ms with --quick)")
	fl.IntSliceVar(&cfg.DrainSizes, "drain-sizes", nil, "backlogs the drain workload empties (default 10000,100000,1000000; 10000,50000 with --quick)")
	fl.Float64Var(&cfg.LatencyRate, "latency-rate", 0, "the latency workload's producer rate in events/s (default: half of outboxd's steady rate in the same run), to compare builds at the same load")
	fl.IntVar(&cfg.ManyRelays, "many-relays", 0, "relays the many-relays workload subscribes, each on its own connection (default 300; 100 with --quick)")
	fl.Float64Var(&cfg.ManyRelaysRate, "many-relays-rate", 0, "the many-relays workload's producer rate in events/s after its idle window (default 500)")
	fl.IntVar(&cfg.Replicas, "replicas", 0, "outboxd serve replicas the replicas workload runs on one database, the relays spread over them (default 2)")
	fl.IntVar(&cfg.Sources, "sources", 0, "source databases the sources workload serves from one server: one heavy, the rest light (default 20)")
	fl.Float64Var(&cfg.SourcesLightRate, "sources-light-rate", 0, "each light source's producer rate in events/s in the sources workload (default 20)")
	fl.BoolVar(&cfg.SourcesNamedStream, "sources-named-stream", false, "in the sources workloads, relays subscribe to SOURCE/bench by name instead of SOURCE/* (every stream of the source, as steady's relays take every stream)")
	fl.IntVar(&cfg.IdleSources, "idle-sources", 0, "idle source databases the idle-sources workload serves from one server (default 50)")
	fl.StringVar(&cfg.SinkURL, "sink", "", "publish to a real broker (a relay sink URL such as nats://127.0.0.1:4222) before counting, instead of only the in-process sink")
	fl.BoolVar(&cfg.Quick, "quick", false, "run the reduced set (about two minutes)")
	fl.StringVar(&jsonPath, "json", "", "write every figure to this JSON file")
	fl.StringVar(&plotPath, "plot", "", "draw the figures to this .png or .svg file")
	fl.StringArrayVar(&cfg.ServeFlags, "serve-flag", nil, "an extra flag for the server's serve command, such as --serve-flag=--ack-committers=2 (repeatable); the defaults are measured without")
	fl.StringVar(&serverBinary, "server-binary", "", "the outboxd binary whose serve command runs the server (default: build cmd/outboxd from the main module)")
	fl.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the benchmark process (producers, relays, peers, sink) to this file")
	fl.StringVar(&replot, "replot", "", "run nothing: draw --plot from this JSON file of an earlier run")
	return cmd
}
