package main_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"
)

// PostgreSQL itself crashes twice (pg_ctl stop -m immediate: nothing is
// flushed, the next start runs recovery) while producers write, two servers
// deliver and relays publish to JetStream. Nothing committed is lost and the
// first copies arrive in revision order; what the crash undid is simply done
// again. It runs on a throwaway cluster of its own, so the crashes touch no
// other test.
//
// Producers retry a statement whose outcome the crash hid with the same
// event ids, which the outbox records once: so the sink must hold exactly
// the events of every round, whether or not a retry was needed.
func TestPostgresCrashesLoseNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("crash test runs processes for a while")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	db, pool := migratedThrowaway(ctx, t)
	commitSynchronously(ctx, t, pool)

	js, streamName, prefix := jetStreamSink(t, "PGCRASH")
	const aggregates, rounds = 200, 30
	addrs := []string{freeAddr(t), freeAddr(t)}
	for i := range addrs {
		// Server 1 applies acks in three committers at once.
		start(t, "serve", "--database-url", db.URL, "--listen", addrs[i], "--lease-ttl", "2s", "--log-level", "warn", "--http-listen", "",
			"--ack-committers", strconv.Itoa(1+2*i))
	}
	sinkURL := fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}&duplicates=100ms", natsURL(), streamName, prefix)
	for i := range 2 { // relay 1 with a window of 8 events per aggregate
		start(t, "relay", "--server", addrs[i], "--sink", sinkURL, "--max-in-flight", "16",
			"--max-in-flight-per-aggregate", strconv.Itoa(1+7*i), "--relay-id", "r"+strconv.Itoa(i), "--log-level", "warn")
	}

	// One round: an event for every aggregate, with ids fixed by round and
	// aggregate, retried until it commits.
	emitRound := func(r int) error {
		for {
			_, err := pool.Exec(ctx, `SELECT outbox.emit('orders', 'a-' || a, 'Changed', jsonb_build_object('r', $1::int),
				event_id => md5('pgcrash/' || $1 || '/' || a)::uuid)
				FROM generate_series(1, $2::int) a ORDER BY a`, r, aggregates)
			if err == nil {
				return nil
			}
			if ctx.Err() != nil {
				return fmt.Errorf("round %d: %w", r, err)
			}
			time.Sleep(50 * time.Millisecond) // the server is down or recovering
		}
	}
	produced := make(chan error, 1)
	go func() {
		for r := 1; r <= rounds; r++ {
			if err := emitRound(r); err != nil {
				produced <- err
				return
			}
		}
		produced <- nil
	}()

	// Crash twice, each time once delivery is under way, and bring it back.
	for crash := 1; crash <= 2; crash++ {
		waitPublished(t, pool, int64(crash*aggregates*rounds/4))
		if err := db.CrashServer(ctx); err != nil {
			t.Fatalf("crash %d: %v", crash, err)
		}
		if err := db.StartServer(ctx); err != nil {
			t.Fatalf("restart %d: %v", crash, err)
		}
		t.Logf("PostgreSQL crashed and recovered (%d)", crash)
	}
	if err := <-produced; err != nil {
		t.Fatal(err)
	}
	total := int64(aggregates * rounds)
	waitPublished(t, pool, total)
	verifySink(t, js, streamName, total)
	var stranded int64
	if err := pool.QueryRow(ctx, `SELECT coalesce(sum(events), 0)::bigint FROM outbox.stranded(NULL)`).Scan(&stranded); err != nil || stranded != 0 {
		t.Fatalf("stranded events: %d, %v", stranded, err)
	}
}
