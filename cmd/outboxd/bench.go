package main

import (
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"strings"

	"github.com/spf13/cobra"

	"github.com/outboxd/outboxd/internal/bench"
)

func benchCommand(g *globalFlags) *cobra.Command {
	var (
		cfg        bench.Config
		jsonPath   string
		plotPath   string
		serverMode string
		cpuProfile string
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmark outboxd against PostgreSQL's own ceilings and a naive poller",
		Long: `bench runs the benchmark of BENCH.md against the PostgreSQL server named by
--database-url (default: $DATABASE_URL, else the local server). It creates a
database per arm (outboxd_bench_*), drops them all when it ends, and needs a
role that may CREATE DATABASE.

Arms: ceiling-insert and ceiling-insert-mark (the database's own floor cost),
naive-poller (the chapter's SQL protocol, publishing inside the transaction)
and outboxd (outbox.emit, the real server, K relays over loopback gRPC).
Workloads: steady, latency, drain, hot. Every delivering arm publishes to an
in-process sink that checks order and counts lost and duplicated events; a run
that loses or reorders an event fails.

The server runs as a child process (this binary's serve command, default
settings) so its CPU and memory are measured on their own; --server in-process
runs it inside this process instead (then --cpuprofile covers it).

The standard set (make bench) takes 5 to 10 minutes on 2 cores; --quick runs
a reduced set in about a minute. Timings on a shared machine are noisy:
compare arms of the same run.`,
		Example: `  outboxd bench --quick
  outboxd bench --json docs/bench.json --plot docs/bench.svg
  outboxd bench --workload steady --arms ceiling-insert,outboxd --duration 20s`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			// The server's and relays' info logs (a line per relay session)
			// would drown the progress lines; warnings still show.
			if !cmd.Flag("log-level").Changed {
				g.logLevel = "warn"
			}
			log, err := g.logger(os.Stderr)
			if err != nil {
				return err
			}
			switch serverMode {
			case "child":
				exe, err := os.Executable()
				if err != nil {
					return fmt.Errorf("--server child: cannot find this binary to run `serve`: %w", err)
				}
				cfg.ServerBinary = exe
			case "in-process":
			default:
				return fmt.Errorf("--server %q: want child or in-process", serverMode)
			}
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
			cfg.DatabaseURL = g.dbURL()
			cfg.Logger = log
			cfg.Progress = cmd.ErrOrStderr()
			cfg.Command = "outboxd " + strings.Join(os.Args[1:], " ")

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
				fmt.Fprintln(cmd.ErrOrStderr(), "\n!!! BENCHMARK FAILED: events were lost or reordered; the figures above are not valid !!!")
			}
			return runErr
		},
	}
	fl := cmd.Flags()
	fl.StringSliceVar(&cfg.Workloads, "workload", nil, "workloads to run: steady, latency, drain, hot (default all)")
	fl.StringSliceVar(&cfg.Arms, "arms", nil, "arms to run: ceiling-insert, ceiling-insert-mark, naive-poller, outboxd (default all)")
	fl.DurationVar(&cfg.Duration, "duration", 0, "measured window per arm (default 10s; 3s with --quick)")
	fl.DurationVar(&cfg.Warmup, "warmup", 0, "warm-up before each window (default 2s; 1s with --quick)")
	fl.IntVar(&cfg.Producers, "producers", 8, "producer connections P, one event per transaction")
	fl.IntVar(&cfg.Relays, "relays", 4, "outboxd relay connections and naive poller workers K")
	fl.IntVar(&cfg.MaxInFlight, "max-in-flight", 64, "each relay's credit (drain keeps at least 1,000 in flight across all relays)")
	fl.IntVar(&cfg.Aggregates, "aggregates", 10_000, "aggregates the steady and latency workloads spread events over")
	fl.DurationSliceVar(&cfg.SinkLatencies, "sink-latency", nil, "sink publish latencies standing in for a broker round trip; steady runs each, the rest use the first (default 0,1ms,5ms; 0,1ms with --quick)")
	fl.IntSliceVar(&cfg.DrainSizes, "drain-sizes", nil, "backlogs the drain workload empties (default 10000,100000,1000000; 10000,50000 with --quick)")
	fl.BoolVar(&cfg.Quick, "quick", false, "run the reduced set (about a minute)")
	fl.StringVar(&jsonPath, "json", "", "write every figure to this JSON file")
	fl.StringVar(&plotPath, "plot", "", "draw throughput per arm and the latency CDF to this .svg or .png file")
	fl.StringVar(&serverMode, "server", "child", "where the server runs: child (outboxd serve in a child process) or in-process")
	fl.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of this process (with --server in-process it covers the server) to this file")
	return cmd
}
