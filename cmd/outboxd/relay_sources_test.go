package main_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// `outboxd relay --route '*/payments=...'` against serve with a --config
// source list: payments of default and of source a are both delivered
// through one route, one subscription per source (relay ids r/payments and
// r/a/payments), and a's other stream is not; source b, added to the list
// while the relay runs, gets its payments delivered without restarting the
// relay; and when a leaves the list the relay stops a's subscription and
// goes on.
func TestRelayFollowsSourcesByPattern(t *testing.T) {
	t.Parallel()
	def, a, b, cfg, aEntry, bEntry := sourcesAAndB(t)
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	serve := start(t, "serve", "--config", cfg, "--database-url", def, "--listen", grpcAddr, "--http-listen", httpAddr,
		"--health-interval", "200ms", "--shutdown-timeout", "5s")
	defer serve.signal(os.Interrupt)
	eventually(t, "the first reload", func() bool { ok, _ := sourceReloads(t, httpAddr); return ok >= 1 })

	pools := map[string]*pgxpool.Pool{"default": testdb.NewPoolURL(t, def), "a": testdb.NewPoolURL(t, a), "b": testdb.NewPoolURL(t, b)}
	emit := func(source, stream string) string {
		t.Helper()
		var id string
		if err := pools[source].QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit($1, 'k', 'T', '{}')`, stream).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	published := func(source, id string) bool {
		var ok bool
		_ = pools[source].QueryRow(t.Context(), `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, id).Scan(&ok)
		return ok
	}
	defPay, aPay, aAudit := emit("default", "payments"), emit("a", "payments"), emit("a", "audit")

	relay := start(t, "relay", "--server", grpcAddr, "--relay-id", "r", "--route", "*/payments=stdout://", "--sources-interval", "100ms")
	running := func() {
		t.Helper()
		select {
		case <-relay.done:
			t.Fatalf("relay exited with %d", relay.cmd.ProcessState.ExitCode())
		default:
		}
	}
	eventually(t, "payments of default and of a published", func() bool {
		running()
		return published("default", defPay) && published("a", aPay)
	})
	for _, id := range []string{"relay_id=r/payments source=default", "relay_id=r/a/payments source=a"} {
		if !relay.hasOutput(id) {
			t.Errorf("relay did not log a subscription with %s", id)
		}
	}

	// b joins the list while the relay runs.
	bPay := emit("b", "payments")
	okBefore, _ := sourceReloads(t, httpAddr)
	replaceFile(t, filepath.Dir(cfg), cfg, "source:\n"+aEntry+bEntry)
	eventually(t, "the reload that adds b", func() bool { ok, _ := sourceReloads(t, httpAddr); return ok > okBefore })
	eventually(t, "payments of b, added while the relay runs, published", func() bool {
		running()
		return published("b", bPay)
	})

	// a leaves the list: its subscription is stopped; the others go on.
	okBefore, _ = sourceReloads(t, httpAddr)
	replaceFile(t, filepath.Dir(cfg), cfg, "source:\n"+bEntry)
	eventually(t, "the reload that removes a", func() bool { ok, _ := sourceReloads(t, httpAddr); return ok > okBefore })
	eventually(t, "the relay to stop a's subscription", func() bool {
		running()
		return relay.hasOutput(`source no longer listed: stopping its subscription`)
	})
	bPay2, defPay2 := emit("b", "payments"), emit("default", "payments")
	eventually(t, "payments of b and default after a left, published", func() bool {
		running()
		return published("b", bPay2) && published("default", defPay2)
	})
	if published("a", aAudit) {
		t.Error("a's audit event was published; */payments must take payments only")
	}
	if code := relay.signal(os.Interrupt); code != 0 {
		t.Errorf("relay exited %d on SIGINT; want 0", code)
	}
	// It said it was draining, and when it was done.
	for _, line := range []string{"relay stopping: publishes under way may finish and be acked", "relay stopped"} {
		if !relay.hasOutput(line) {
			t.Errorf("relay did not log %q at SIGINT", line)
		}
	}
}

// A relay of */payments lists the server's sources again as soon as its
// connection comes back, not only every --sources-interval (an hour here):
// serve restarted on the same address with source b added to its --config
// list gets b's payments delivered by the relay that never stopped.
func TestRelayListsSourcesOnReconnect(t *testing.T) {
	t.Parallel()
	def, a, b, cfg, aEntry, bEntry := sourcesAAndB(t)
	grpcAddr := freeAddr(t)
	serveArgs := []string{"serve", "--config", cfg, "--database-url", def, "--listen", grpcAddr, "--http-listen", "", "--shutdown-timeout", "5s"}
	serve := start(t, serveArgs...)

	emit := func(url string) (func() bool, string) {
		t.Helper()
		pool := testdb.NewPoolURL(t, url)
		var id string
		if err := pool.QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit('payments', 'k', 'T', '{}')`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return func() bool {
			var ok bool
			_ = pool.QueryRow(t.Context(), `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, id).Scan(&ok)
			return ok
		}, id
	}
	aDone, _ := emit(a)
	relay := start(t, "relay", "--server", grpcAddr, "--relay-id", "r", "--route", "*/payments=stdout://", "--sources-interval", "1h")
	defer relay.signal(os.Interrupt)
	running := func() {
		t.Helper()
		select {
		case <-relay.done:
			t.Fatalf("relay exited with %d", relay.cmd.ProcessState.ExitCode())
		default:
		}
	}
	eventually(t, "a's payment published", func() bool { running(); return aDone() })

	if code := serve.signal(os.Interrupt); code != 0 {
		t.Fatalf("serve exited %d on SIGINT", code)
	}
	if err := os.WriteFile(cfg, []byte("source:\n"+aEntry+bEntry), 0o600); err != nil {
		t.Fatal(err)
	}
	bDone, _ := emit(b)
	serve = start(t, serveArgs...)
	defer serve.signal(os.Interrupt)
	eventually(t, "b's payment published by the relay once it reconnected", func() bool { running(); return bDone() })
}

// A relay whose token is scoped to source a and to default's other
// stream ("streams=a/*,other") and routes */payments is told of a alone
// (ListSources with streams [payments]), so it subscribes to a's payments
// and never to default's, which its token would be refused. A relay of
// */* whose token has payments only ("*/payments") is told of no source:
// it warns that */* matched none and keeps running.
func TestRelayByPatternWithATokenOfOneSource(t *testing.T) {
	t.Parallel()
	def, a := testdb.New(t), testdb.New(t)
	const secret, paySecret = "a-relay-token-0123456789abcdef", "pay-relay-token-0123456789abcdef"
	tokens := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(tokens, []byte("a-relay relay "+secret+" streams=a/*,other\n"+
		"pay-relay relay "+paySecret+" streams=*/payments\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	grpcAddr := freeAddr(t)
	serve := start(t, "serve", "--database-url", def, "--source", "a="+a, "--listen", grpcAddr, "--http-listen", "", "--token-file", tokens)
	defer serve.signal(os.Interrupt)
	pools := map[string]*pgxpool.Pool{"default": testdb.NewPoolURL(t, def), "a": testdb.NewPoolURL(t, a)}
	ids := map[string]string{}
	for src, pool := range pools {
		var id string
		if err := pool.QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit('payments', 'k', 'T', '{}')`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids[src] = id
	}
	published := func(src string) bool {
		var ok bool
		_ = pools[src].QueryRow(t.Context(), `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, ids[src]).Scan(&ok)
		return ok
	}
	relay := startEnv(t, []string{"OUTBOXD_TOKEN=" + secret}, "relay", "--server", grpcAddr, "--relay-id", "r",
		"--route", "*/payments=stdout://", "--sources-interval", "100ms")
	eventually(t, "a's payment published", func() bool {
		select {
		case <-relay.done:
			t.Fatalf("relay exited with %d", relay.cmd.ProcessState.ExitCode())
		default:
		}
		return published("a")
	})
	if code := relay.signal(os.Interrupt); code != 0 {
		t.Errorf("relay exited %d on SIGINT; want 0 (it must not have met a refusal)", code)
	}
	if relay.hasOutput("source=default") || published("default") {
		t.Error("the relay subscribed to default's payments, which its token scoped to a/*,other may not access")
	}

	every := startEnv(t, []string{"OUTBOXD_TOKEN=" + paySecret}, "relay", "--server", grpcAddr, "--relay-id", "e",
		"--streams", "*/*", "--sink", "stdout://", "--sources-interval", "100ms")
	eventually(t, "the */* relay to warn that its pattern matched no source", func() bool {
		select {
		case <-every.done:
			t.Fatalf("the */* relay exited with %d", every.cmd.ProcessState.ExitCode())
		default:
		}
		return every.hasOutput(`no source matched these patterns`) && every.hasOutput(`patterns=*/*`)
	})
	if code := every.signal(os.Interrupt); code != 0 {
		t.Errorf("the */* relay exited %d on SIGINT; want 0", code)
	}
	if every.hasOutput("relay starting") {
		t.Error("the */* relay subscribed to a source although its token has payments only")
	}
}

// sourcesAAndB creates databases for default and sources a and b, and a
// --config file whose source list names a alone; aEntry and bEntry are the
// list entries to write when a test changes it.
func sourcesAAndB(t *testing.T) (def, a, b, cfg, aEntry, bEntry string) {
	t.Helper()
	def, a, b = testdb.New(t), testdb.New(t), testdb.New(t)
	cfg = filepath.Join(t.TempDir(), "outboxd.yaml")
	aEntry = "  - a=" + withoutPassword(t, a) + "\n"
	bEntry = "  - b=" + withoutPassword(t, b) + "\n"
	if err := os.WriteFile(cfg, []byte("source:\n"+aEntry), 0o600); err != nil {
		t.Fatal(err)
	}
	return def, a, b, cfg, aEntry, bEntry
}

// A relay of */payments whose subscriptions the server refuses as invalid
// (--max-in-flight above the server's limit, 10000) while it still lists
// their sources stops with that refusal, exit 2 (usage or invalid request), rather than look alive
// serving none of them: the follower returns the subscription's error
// instead of starting it again at the next listing.
func TestRelayByPatternStopsOnARefusedSubscription(t *testing.T) {
	t.Parallel()
	def, a := testdb.New(t), testdb.New(t)
	grpcAddr := freeAddr(t)
	serve := start(t, "serve", "--database-url", def, "--source", "a="+a, "--listen", grpcAddr, "--http-listen", "")
	defer serve.signal(os.Interrupt)
	relay := start(t, "relay", "--server", grpcAddr, "--relay-id", "r", "--route", "*/payments=stdout://",
		"--max-in-flight", "20000", "--sources-interval", "100ms")
	// Each subscription the follower starts says "relay starting": one of
	// each source, then the relay stops. A third means a refused one was
	// started again; "leaving it stopped", that the refusal was taken for
	// one of the token (PERMISSION_DENIED), which leaves the relay starting.
	eventually(t, "the relay to stop, or to go on after the refusal", func() bool {
		select {
		case <-relay.done:
			return true
		default:
		}
		relay.mu.Lock()
		out := relay.output.String()
		relay.mu.Unlock()
		if starts := strings.Count(out, "relay starting"); starts > 2 {
			t.Fatalf("the relay started %d subscriptions of two sources: it went on after the server refused them, instead of stopping", starts)
		}
		if strings.Contains(out, "leaving it stopped") {
			t.Fatal("the relay left a refused subscription stopped and went on, instead of stopping")
		}
		return false
	})
	if code := relay.cmd.ProcessState.ExitCode(); code != 2 || !relay.hasOutput("Subscribe refused (InvalidArgument)") || !relay.hasOutput("max_in_flight") {
		t.Errorf("relay exited %d; want 2, saying Subscribe was refused for max_in_flight", code)
	}
}
