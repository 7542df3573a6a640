// Package deploy_test checks the monitoring files shipped in deploy/: the
// Prometheus alerting rules pass `promtool check rules` and their unit tests
// (`promtool test rules`), and every metric the rules and the Grafana
// dashboard query is one outboxd registers.
package deploy_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

func TestMain(m *testing.M) {
	// The cleanup replaces goleak's os.Exit, so it exits itself.
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) { removeBuilt(); os.Exit(code) }))
}

// promtool finds promtool (Debian's prometheus package has it). Locally a
// missing promtool skips the test; in CI (CI=true) it fails it.
func promtool(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("promtool")
	if err == nil {
		return path
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("promtool is not on PATH; CI must install it (apt-get install prometheus)")
	}
	t.Skip("promtool is not on PATH (apt-get install prometheus); CI runs this")
	return ""
}

func TestAlertRulesPassPromtool(t *testing.T) {
	t.Parallel()
	bin := promtool(t)
	for _, args := range [][]string{
		{"check", "rules", "prometheus/alerts.yaml"},
		{"test", "rules", "prometheus/alerts_test.yaml"},
	} {
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// recordingRegisterer notes every collector registered with it.
type recordingRegisterer struct {
	prometheus.Registerer
	mu         sync.Mutex
	collectors []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	r.mu.Lock()
	r.collectors = append(r.collectors, c)
	r.mu.Unlock()
	return r.Registerer.Register(c)
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

var fqName = regexp.MustCompile(`fqName: "([a-zA-Z0-9_:]+)"`)

// registeredMetrics starts a replica as `outboxd serve` builds it and
// returns the names of every metric it registers, histograms with their
// _bucket, _sum and _count series.
func registeredMetrics(t *testing.T) map[string]bool {
	t.Helper()
	reg := &recordingRegisterer{Registerer: prometheus.NewRegistry()}
	servertest.Start(t, testdb.New(t), servertest.Options{Configure: func(c *server.Config) { c.Registerer = reg }})
	names := map[string]bool{}
	reg.mu.Lock()
	defer reg.mu.Unlock()
	for _, c := range reg.collectors {
		ch := make(chan *prometheus.Desc, 64)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			m := fqName.FindStringSubmatch(d.String())
			if m == nil {
				t.Fatalf("cannot read a metric name from %s", d)
			}
			for _, suffix := range []string{"", "_bucket", "_sum", "_count"} {
				names[m[1]+suffix] = true
			}
		}
	}
	if !names["outboxd_stalled_aggregates"] || !names["grpc_server_handled_total"] {
		t.Fatalf("the registry looks incomplete: %v", names)
	}
	return names
}

// metricRef finds metric names in PromQL: outboxd's own and
// go-grpc-middleware's.
var ruleRe = regexp.MustCompile(`(?m)^\s*- alert: (\S+)\n(?:\s*#.*\n)*\s*expr: (.+)$`)

var metricRef = regexp.MustCompile(`\b(outboxd_[a-z0-9_]+|grpc_server_[a-z0-9_]+)\b`)

// selectorRe finds outboxd's series in PromQL with their label matchers.
var selectorRe = regexp.MustCompile(`\b(outboxd_[a-z0-9_]+)(\{[^}]*\})?`)

// maxByRe finds the label lists of "max by (...)" aggregations.
var maxByRe = regexp.MustCompile(`max by \(([^)]*)\)`)

func TestMonitoringQueriesOnlyRegisteredMetrics(t *testing.T) {
	t.Parallel()
	registered := registeredMetrics(t)
	check := func(where, expr string) {
		t.Helper()
		refs := metricRef.FindAllString(expr, -1)
		if len(refs) == 0 && !strings.Contains(expr, "label_values") {
			t.Errorf("%s: %q queries no outboxd metric", where, expr)
		}
		for _, name := range refs {
			if !registered[name] {
				t.Errorf("%s: %q queries %s, which outboxd does not export", where, expr, name)
			}
		}
		// The backlog gauges are each source database's (a source label
		// with several): a max over replicas that drops source merges the
		// same stream name of two sources, and hides a source without
		// relays behind one that has some.
		for _, m := range maxByRe.FindAllStringSubmatch(expr, -1) {
			if !slices.Contains(strings.Split(strings.ReplaceAll(m[1], " ", ""), ","), "source") {
				t.Errorf("%s: %q aggregates by (%s) without source", where, expr, m[1])
			}
		}
	}

	// The alert rules: each "- alert: X" is followed by its one-line
	// "expr: ..." (promtool above checks the YAML itself; this keeps the
	// module free of a YAML library for one test).
	b, err := os.ReadFile("prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var alerts []string
	for _, m := range ruleRe.FindAllStringSubmatch(string(b), -1) {
		alerts = append(alerts, m[1])
		if strings.HasPrefix(m[2], "|") || strings.HasPrefix(m[2], ">") {
			t.Fatalf("alert %s: keep expr on one line for this test", m[1])
		}
		check("alert "+m[1], m[2])
	}
	if n := strings.Count(string(b), "- alert:"); n != len(alerts) {
		t.Fatalf("read the expr of %d of %d alerts", len(alerts), n)
	}
	for _, want := range []string{"OutboxdStalledAggregates", "OutboxdIdleRelaysWithBacklog", "OutboxdStrandedEvents",
		"OutboxdOldestPendingTooOld", "OutboxdParkedAggregates", "OutboxdNoRelaysConnected"} {
		if !slices.Contains(alerts, want) {
			t.Errorf("alerts.yaml has no rule %s", want)
		}
	}

	// The dashboard: valid JSON, every panel's queries, and the template
	// variables' queries.
	var dash struct {
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	b, err = os.ReadFile("grafana/outboxd.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("grafana/outboxd.json: %v", err)
	}
	if dash.UID == "" || len(dash.Panels) == 0 {
		t.Fatalf("dashboard has no uid or no panels")
	}
	queried := map[string]bool{}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			check("panel "+p.Title, tg.Expr)
			for _, m := range metricRef.FindAllString(tg.Expr, -1) {
				queried[m] = true
			}
			// Every outboxd series a panel reads is the chosen sources':
			// with several, one that is not sums or maxes over all of them
			// whatever the Source variable says.
			for _, m := range selectorRe.FindAllStringSubmatch(tg.Expr, -1) {
				if !strings.Contains(m[2], `source=~"$source"`) {
					t.Errorf("panel %q: %s is read without source=~\"$source\": %q", p.Title, m[1], tg.Expr)
				}
			}
		}
	}
	var variables []string
	for _, v := range dash.Templating.List {
		variables = append(variables, v.Name)
		if v.Definition != "" {
			check("variable "+v.Name, v.Definition)
		}
		if v.Name == "stream" && !strings.Contains(v.Definition, `source=~"$source"`) {
			t.Errorf("variable stream lists the streams of every source: %q", v.Definition)
		}
	}
	// Source comes before stream: the streams offered are the chosen
	// sources'.
	if i, j := slices.Index(variables, "source"), slices.Index(variables, "stream"); i < 0 || j < i {
		t.Errorf("dashboard variables %v: want source, then stream", variables)
	}
	// The dashboard shows what the issue asks for: lag, rate, states,
	// stalled, relays.
	for _, m := range []string{"outboxd_oldest_pending_age_seconds", "outboxd_delivered_last_minute", "outboxd_pending_aggregates",
		"outboxd_stalled_aggregates", "outboxd_idle_relays", "outboxd_connected_relays", "outboxd_stranded_events"} {
		if !queried[m] {
			t.Errorf("the dashboard does not show %s", m)
		}
	}
}
