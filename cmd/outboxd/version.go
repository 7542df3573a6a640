package main

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
)

// buildInfo is what `outboxd version`, `outboxd --version` and the
// outboxd_build_info metric report. Everything comes from the build info
// the Go toolchain embeds (no -ldflags -X), so a binary built with
// `go install`, `go build` or `make release` describes itself the same way:
// the module version is the git tag (or a pseudo-version) when the build
// stamped version control information, the commit and its time come from
// vcs.revision and vcs.time. The build date is the commit's time, not the
// clock's, which keeps `make release` reproducible.
type buildInfo struct {
	Version   string
	Commit    string
	Date      string
	Modified  bool
	GoVersion string
}

func readBuildInfo() buildInfo {
	b := buildInfo{Version: "(devel)", Commit: "unknown", Date: "unknown", GoVersion: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	if bi.Main.Version != "" {
		b.Version = bi.Main.Version
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Commit = s.Value
		case "vcs.time":
			b.Date = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	return b
}

// String is the one line both `outboxd version` and `--version` print.
func (b buildInfo) String() string {
	commit := b.Commit
	if b.Modified {
		commit += " (modified)"
	}
	return fmt.Sprintf("outboxd %s, commit %s, built %s, %s %s/%s",
		b.Version, commit, b.Date, b.GoVersion, runtime.GOOS, runtime.GOARCH)
}

func versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit and build date of this binary",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintln(cmd.OutOrStdout(), readBuildInfo())
			return nil
		},
	}
}

// addVersion gives root the version command and the --version flag.
func addVersion(root *cobra.Command) {
	root.Version = readBuildInfo().String()
	root.SetVersionTemplate("{{.Version}}\n")
	root.AddCommand(versionCommand())
}

// buildInfoCollector exports outboxd_build_info, constant 1, with the
// build's version, commit and date as labels: dashboards join on it to show
// which build each replica runs.
func buildInfoCollector() prometheus.Collector {
	b := readBuildInfo()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outboxd_build_info",
		Help: "Always 1; the labels say which build of outboxd this process runs.",
		ConstLabels: prometheus.Labels{
			"version": b.Version, "commit": b.Commit, "build_date": b.Date, "go_version": b.GoVersion,
		},
	})
	g.Set(1)
	return g
}
