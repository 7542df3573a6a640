package app_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

func waitReady(t *testing.T, r *servertest.Replica) {
	t.Helper()
	select {
	case <-r.App.Ready():
	case <-time.After(10 * time.Second):
		t.Fatalf("replica not ready: %q", r.App.Readiness().Reason)
	}
}

func newSource(t *testing.T, name string) app.Source {
	url := testdb.New(t)
	return app.Source{Name: name,
		Server: server.Config{Store: store.New(testdb.NewPoolURL(t, url)), DatabaseURL: url, Logger: servertest.Logger(t)}}
}

// A configured source that is not served yet (its database did not answer
// when serve started) is named in the readiness that /readyz reports, even
// beside a single served source, and without taking the replica out of
// its load balancer; once AddSource adds it, it is no longer named as
// pending. (Kills the mutants that publish a lone engine's readiness while
// a source is pending, and that keep a source pending after AddSource.)
func TestPendingSourceIsNamedUntilAdded(t *testing.T) {
	t.Parallel()
	// Made first, so that its pool is closed after the replica stops
	// (cleanups run last first).
	orders := newSource(t, "orders")
	r := servertest.Start(t, testdb.New(t), servertest.Options{})
	waitReady(t, r)
	if err := r.App.SetSourcePending("orders", "connection refused"); err != nil {
		t.Fatal(err)
	}
	if err := r.App.SetSourcePending("ghost", "no such database"); err != nil {
		t.Fatal(err)
	}
	r.App.ClearSourcePending("ghost")
	if rd := r.App.Readiness(); !rd.Ready || !strings.Contains(rd.Reason, "source orders: not added yet: connection refused") {
		t.Errorf("with orders pending the replica reports ready=%v %q; want ready, naming orders as not added yet", rd.Ready, rd.Reason)
	}
	// GetLag (outboxd lag, the console) names it too, as not ready, unless
	// the request names only streams of another source.
	lagSources := func(streams ...string) string {
		t.Helper()
		lag, err := r.App.AdminServer().GetLag(t.Context(), &outboxv1.GetLagRequest{Streams: streams})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, s := range lag.GetSources() {
			out = append(out, fmt.Sprintf("%s ready=%v %s", s.GetName(), s.GetReady(), s.GetReason()))
		}
		return strings.Join(out, "; ")
	}
	if got := lagSources(); !strings.Contains(got, "orders ready=false not added yet: connection refused") || strings.Contains(got, "ghost") {
		t.Errorf("GetLag's sources with orders pending: %q; want orders not ready, not added yet (and no ghost, cleared)", got)
	}
	if got := lagSources("sales_order"); strings.Contains(got, "orders") {
		t.Errorf("GetLag of default's sales_order names orders: %q", got)
	}
	if err := r.App.AddSource(t.Context(), orders); err != nil {
		t.Fatal(err)
	}
	if rd := r.App.Readiness(); !rd.Ready || strings.Contains(rd.Reason, "not added yet") {
		t.Errorf("once orders is added the replica reports ready=%v %q; want ready, orders no longer pending", rd.Ready, rd.Reason)
	}
	if got := lagSources(); strings.Contains(got, "not added yet") {
		t.Errorf("GetLag's sources once orders is added: %q; want it no longer pending", got)
	}
}

// Removing a source gives its share of the idle-check budget back (the
// remaining sources check as often as before it was added) and takes it
// out of the replica's readiness at once. The replica is not served, so
// no readiness check runs: every source stays "starting", and only
// removeEngine can take orders out of the reason. (Kills the mutants that
// skip re-spreading the idle checks and republishing the readiness in
// removeEngine.)
func TestRemovedSourceLeavesReadinessAndIdleBudget(t *testing.T) {
	t.Parallel()
	def := newSource(t, "default")
	rep, err := app.New(t.Context(), app.Config{Server: def.Server, LabelSources: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rep.Shutdown()
	if err := rep.AddSource(t.Context(), newSource(t, "orders")); err != nil {
		t.Fatal(err)
	}
	// 2 sources at the default 50 checks a second: every 40ms each.
	if got := rep.Server.DiscoveryQuietInterval(); got != 40*time.Millisecond {
		t.Errorf("with 2 sources default checks every %v when quiet, want 40ms", got)
	}
	if rd := rep.Readiness(); !strings.Contains(rd.Reason, "source orders: starting") {
		t.Fatalf("before removal the replica reports %q; want orders named as starting", rd.Reason)
	}
	if err := rep.RemoveSource(t.Context(), "orders", time.Second); err != nil {
		t.Fatal(err)
	}
	if got := rep.Server.DiscoveryQuietInterval(); got != 25*time.Millisecond {
		t.Errorf("once orders is removed default checks every %v when quiet, want 25ms (its idle interval)", got)
	}
	if rd := rep.Readiness(); strings.Contains(rd.Reason, "orders") {
		t.Errorf("once orders is removed the replica reports %q; want orders no longer named", rd.Reason)
	}
}
