package main

import "github.com/spf13/cobra"

// benchCommand only points at the benchmark. The benchmark is a module of its
// own (bench/, docs/benchmark.md), so that this binary links none of its
// plotting code or the peer libraries it compares outboxd with.
func benchCommand() *cobra.Command {
	return &cobra.Command{
		Use:                "bench",
		Short:              "Moved: the benchmark is its own module; run `make bench` or `make bench-quick`",
		DisableFlagParsing: true,
		RunE: func(*cobra.Command, []string) error {
			return usageError("the benchmark moved out of this binary into its own module: run `make bench` " +
				"(or `make bench-quick`) from a checkout, or `cd bench && go run ./cmd/outboxd-bench --help`; " +
				"docs/benchmark.md specifies it")
		},
	}
}
