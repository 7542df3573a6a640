package main_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/internal/testdb"
)

// One source's PostgreSQL goes down and comes back while the other keeps
// delivering. `outboxd serve` serves source a (default, on the main
// cluster) and b (a throwaway cluster of its own, so stopping it touches no
// other test), with a relay for each. Cluster b is stopped in immediate
// mode with events of b pending (its relay was killed before they were
// written, so none was delivered); while it is down, events written into a
// afterwards are delivered (to a relay of a restarted meanwhile), /readyz stays 200 and says "degraded: source
// b", `outboxd lag` names b not ready, and `outboxd events` lists a's
// events with a warning that b could not be read. Once cluster b runs again, b's
// relay (restarted during the outage) delivers its pending events: each
// sink holds every event of its source, first copies in revision order,
// duplicates identical to the first (at least once, never lost), and every
// event is marked published.
func TestSourceDownAndBack(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a PostgreSQL cluster of its own and processes")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	urlA := testdb.New(t)
	poolA := testdb.NewPoolURL(t, urlA)
	b, poolB := migratedThrowaway(ctx, t)
	commitSynchronously(ctx, t, poolB) // the stop below is a crash

	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	start(t, "serve", "--database-url", urlA, "--source", "b="+b.URL, "--listen", grpcAddr, "--http-listen", httpAddr,
		"--health-interval", "200ms", "--lease-ttl", "2s", "--log-level", "warn")
	eventually(t, "/readyz 200", func() bool { code, _ := httpGet("http://" + httpAddr + "/readyz"); return code == http.StatusOK })
	jsA, streamA, prefixA := jetStreamSink(t, "DOWNA")
	jsB, streamB, prefixB := jetStreamSink(t, "DOWNB")
	relay := func(name, stream, prefix string, streams ...string) *process {
		sink := fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}&duplicates=100ms", natsURL(), stream, prefix)
		args := []string{"relay", "--server", grpcAddr, "--sink", sink, "--max-in-flight", "16", "--relay-id", name, "--log-level", "warn"}
		for _, s := range streams {
			args = append(args, "--streams", s)
		}
		return start(t, args...)
	}
	relayA := relay("ra", streamA, prefixA)
	relayB := relay("rb", streamB, prefixB, "b/orders")

	// Both sources deliver.
	const aggregates = 20
	emit := func(pool *pgxpool.Pool, from, to int) {
		t.Helper()
		if err := emitRounds(pool, from, to, aggregates); err != nil {
			t.Fatal(err)
		}
	}
	emit(poolA, 1, 5)
	emit(poolB, 1, 5)
	waitPublished(t, poolA, 5*aggregates)
	waitPublished(t, poolB, 5*aggregates)

	// b's relay dies; b gets events nobody delivers; cluster b stops.
	relayB.signal(os.Kill)
	emit(poolB, 6, 10)
	if err := b.CrashServer(ctx); err != nil {
		t.Fatal(err)
	}
	relay("rb", streamB, prefixB, "b/orders")

	// a delivers what is written after the stop, to a relay that
	// subscribes after it too.
	relayA.signal(os.Kill)
	relay("ra", streamA, prefixA)
	emit(poolA, 6, 10)
	waitPublished(t, poolA, 10*aggregates)
	eventually(t, "/readyz 200 naming b degraded", func() bool {
		code, body := httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK && strings.Contains(body, "degraded: source b")
	})
	if code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr); code != 0 || !strings.Contains(out, "source b NOT READY") ||
		!strings.Contains(out, "orders") {
		t.Errorf("outboxd lag with b down: exit %d; want a's streams and b not ready:\n%s", code, out)
	}
	if code, out := runOutboxd(t, nil, "events", "--limit", "3", "--server", grpcAddr); code != 0 ||
		!strings.Contains(out, "warning: source b left out, its events are not listed") || !strings.Contains(out, "orders") {
		t.Errorf("outboxd events with b down: exit %d; want a's events and a warning naming b:\n%s", code, out)
	}

	// b comes back: its pending events are delivered, a's keep flowing.
	if err := b.StartServer(ctx); err != nil {
		t.Fatal(err)
	}
	emit(poolA, 11, 12)
	waitPublished(t, poolB, 10*aggregates)
	waitPublished(t, poolA, 12*aggregates)
	eventually(t, "/readyz without b degraded", func() bool {
		code, body := httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK && !strings.Contains(body, "degraded")
	})
	verifySink(t, jsA, streamA, 12*aggregates)
	verifySink(t, jsB, streamB, 10*aggregates)
}

// A source whose PostgreSQL is down when serve starts holds up none of the
// others, whether it is given by --source or is default (--database-url):
// serve starts, /readyz is 200 and names it degraded, and the other source
// delivers; once its PostgreSQL runs again, serve adds it and delivers the
// events written into it before the outage, to a relay that subscribed to
// it while it was down.
func TestSourceDownAtStartupIsServedOnceItAnswers(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a PostgreSQL cluster of its own and processes")
	}
	t.Parallel()
	for _, down := range []string{"b", "default"} {
		t.Run(down, func(t *testing.T) {
			t.Parallel()
			sourceDownAtStartup(t, down)
		})
	}
}

// sourceDownAtStartup runs TestSourceDownAtStartupIsServedOnceItAnswers
// with source down (b or default) on a stopped throwaway cluster and the
// other on the main one.
func sourceDownAtStartup(t *testing.T, down string) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	urlUp := testdb.New(t)
	poolUp := testdb.NewPoolURL(t, urlUp)
	d, poolDown := migratedThrowaway(ctx, t)
	const aggregates = 10
	if err := emitRounds(poolDown, 1, 3, aggregates); err != nil {
		t.Fatal(err)
	}
	if err := d.StopServer(ctx); err != nil {
		t.Fatal(err)
	}

	up := multisource.Default
	args := []string{"--database-url", urlUp, "--source", "b=" + d.URL}
	if down == multisource.Default {
		up, args = "b", []string{"--database-url", d.URL, "--source", "b=" + urlUp}
	}
	streams := func(source string) string {
		if source == multisource.Default {
			return "orders"
		}
		return source + "/orders"
	}
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	start(t, append([]string{"serve", "--listen", grpcAddr, "--http-listen", httpAddr, "--health-interval", "200ms",
		"--log-level", "warn"}, args...)...)
	eventually(t, "/readyz 200 naming "+down+" degraded", func() bool {
		code, body := httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK && strings.Contains(body, "degraded: source "+down)
	})
	for _, source := range []string{up, down} {
		start(t, "relay", "--server", grpcAddr, "--sink", "stdout://", "--streams", streams(source), "--log-level", "warn")
	}
	if err := emitRounds(poolUp, 1, 3, aggregates); err != nil {
		t.Fatal(err)
	}
	waitPublished(t, poolUp, 3*aggregates)
	// Its events written before the stop wait in no total: a cron check
	// of lag must not pass on the other source's figures.
	if code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr, "--fail-if-older-than", "1h"); code != 1 ||
		!strings.Contains(out, "the lag of source "+down+" could not be read") {
		t.Errorf("outboxd lag --fail-if-older-than 1h with %s not added yet: exit %d; want 1 naming it:\n%s", down, code, out)
	}

	if err := d.StartServer(ctx); err != nil {
		t.Fatal(err)
	}
	waitPublished(t, poolDown, 3*aggregates)
	eventually(t, "/readyz without "+down+" degraded", func() bool {
		code, body := httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK && !strings.Contains(body, "degraded")
	})
}

// A --source URL that does not parse is a mistake, not a database that is
// down: serve stops at once naming the source, rather than retrying it.
func TestServeRefusesASourceURLThatDoesNotParse(t *testing.T) {
	t.Parallel()
	code, out := runOutboxd(t, nil, "serve", "--database-url", testdb.New(t), "--source", "orders=postgres://127.0.0.1:notaport/x",
		"--listen", freeAddr(t), "--http-listen", freeAddr(t))
	if code != 1 || !strings.Contains(out, "--source orders") || !strings.Contains(out, "notaport") {
		t.Errorf("serve with an unparsable --source URL: exit %d, %q; want 1 naming --source orders and the URL's fault", code, out)
	}
}

// migratedThrowaway starts a throwaway PostgreSQL cluster of the test's own
// (so stopping it touches no other test), migrates its database and opens
// a pool on it; both go at the test's end.
func migratedThrowaway(ctx context.Context, t *testing.T) (*devdb.Database, *pgxpool.Pool) {
	t.Helper()
	d, err := devdb.StartThrowaway(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close(context.Background()) })
	if out, err := exec.Command(binary, "migrate", "--database-url", d.URL).CombinedOutput(); err != nil {
		t.Fatalf("migrate the throwaway cluster: %v\n%s", err, out)
	}
	pool, err := pgxpool.New(ctx, d.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return d, pool
}

// commitSynchronously makes a throwaway cluster's commits wait for the WAL
// flush. It commits asynchronously (it is for dev loops), so a crash could
// undo a producer's commit after it was told the commit happened, and a
// test would count a loss that is the cluster's; producers wait for their
// commit in production. (fsync stays off: an immediate-mode stop kills
// processes, not the kernel, so WAL written at commit survives it.)
func commitSynchronously(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(ctx, `ALTER SYSTEM SET synchronous_commit = on`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		t.Fatal(err)
	}
}
