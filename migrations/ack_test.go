package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// outbox.ack decides a lone ack with no window in play in statements of
// its own (the one-row path), and everything else in the batch
// statements. The two must decide alike: each case below is set up twice,
// in two databases, and acked once alone and once in a batch with an id
// that names no event (which sends it down the batch path and answers
// not_found); answers, hand-overs, delivery rows and published marks must
// match.

// ackCase sets up a database and returns the event to ack and the
// hand-over holders to pass (nil: the ack comes from another replica), each
// given a TTL of its own. oneRow says whether a lone ack of it takes the
// one-row path.
type ackCase struct {
	name   string
	oneRow bool
	setup  func(t *testing.T, pool *pgxpool.Pool) (ack uuid.UUID, local []uuid.UUID)
	// want are lines (or starts of lines) the outcome must hold, whichever
	// path decided it: the two paths agreeing on a wrong answer fails too.
	want []string
}

// claimOne leases the oldest claimable aggregate to holder, as a session of
// replica x, with a window, and returns the head event's id.
func claimOne(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, window int) uuid.UUID {
	t.Helper()
	got := claimWindow(t, pool, holder, 1, window, window)
	if len(got) == 0 {
		t.Fatal("claim found nothing")
	}
	return got[0].id
}

// claimAs is claimOne for a session of another replica.
func claimAs(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, replica string) leased {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT aggregate_key, revision, event_id, epoch FROM outbox.claim($1, 'r', $2, NULL, 1, interval '30 seconds')`,
		holder, replica)
	if err != nil {
		t.Fatal(err)
	}
	got := collectLeases(t, rows)
	if len(got) != 1 {
		t.Fatalf("claimed %v, want one lease", got)
	}
	return got[0]
}

// noTTLs marks a case whose hand-over holders are passed without TTLs.
var noTTLs = uuid.MustParse("00000000-0000-0000-0000-00000000a77e")

// spareCredit marks a case whose hand-over holders all have credit to
// spare (p_handover_spare).
var spareCredit = uuid.MustParse("00000000-0000-0000-0000-0000000005fa")

// olderWorkWaits leases a/1 to a holder while b/1, older than a/2, is
// claimable in the same stream, and returns a/1 and the holder (with spare
// credit or not) to ack it with.
func olderWorkWaits(t *testing.T, pool *pgxpool.Pool, spare bool) (uuid.UUID, []uuid.UUID) {
	t.Helper()
	h := uuid.New()
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	local := []uuid.UUID{h}
	if spare {
		local = append(local, spareCredit)
	}
	return claimOne(t, pool, h, 1), local
}

var oneAckCases = []ackCase{
	{"next revision handed over to the local holder", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{uuid.New(), h}
	}, []string{"answer handed_over", "a/2 attempt 1 epoch raised t, expires in 27s", "delivery orders/a: (leased,1,", "events orders/a: 1 published, 2 pending"}},
	{"nothing follows: idle", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 1)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{h}
	}, []string{"answer published", "delivery orders/a: (idle,1,", "events orders/a: 1 published\n"}},
	{"holder on another replica: ready, the holder notified", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimAs(t, pool, uuid.New(), "elsewhere").id, []uuid.UUID{uuid.New()}
	}, []string{"answer published", "outbox_released for the holder before the ack: true", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"holder listed twice: the first TTL", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{uuid.New(), h, h}
	}, []string{"answer handed_over", "expires in 27s", "delivery orders/a: (leased,1,"}},
	{"hand-over holders without TTLs", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{noTTLs, h}
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"lease nacked, then acked by its token: backoff ends", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		l := claimAs(t, pool, uuid.New(), "x")
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.nack('%s', %d, 'broker down', NULL, interval '1 minute', interval '1 hour', 10)`, l.id, l.epoch))
		return l.id, nil
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"lease released, then acked by its token", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, h, 1)
		exec(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, h))
		return id, []uuid.UUID{h}
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"parked at the acked revision", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		l := claimAs(t, pool, uuid.New(), "x")
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.park('%s', %d, 'too large')`, l.id, l.epoch))
		return l.id, nil
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"held at a gap: a later revision's ack", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 1)
		exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload) VALUES ('orders', 'a', 3, 'T', '{}')`)
		discover(t, pool)
		id := claimOne(t, pool, uuid.New(), 1)
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, id))
		if got := claimWindow(t, pool, uuid.New(), 1, 1, 1); len(got) != 0 {
			t.Fatalf("claimed %v past a gap", got)
		}
		return eventID(t, pool, "a", 3), nil
	}, []string{"answer out_of_order", "delivery orders/a: (gap,1,", ",2)\n", "events orders/a: 1 published, 3 pending"}},
	{"ack from another replica, no sessions passed", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, uuid.New(), 1), nil
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"next revision skipped: ready, nothing handed over", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, h, 1)
		exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`,
			eventID(t, pool, "a", 2)))
		return id, []uuid.UUID{h}
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"next revision missing, a later one present: ready", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 1)
		exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload) VALUES ('orders', 'a', 3, 'T', '{}')`)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{h}
	}, []string{"answer published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 3 pending"}},
	{"older claimable work: no hand-over", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		return olderWorkWaits(t, pool, false)
	}, []string{"answer published", "delivery orders/a: (ready,1,", "delivery orders/b: (ready,0,", "events orders/a: 1 published, 2 pending"}},
	// The same with credit to spare: the holder's claims take b with it,
	// so the hand-over holds nothing b needs and goes ahead.
	{"older work claimable, the holder has credit to spare: handed over", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		return olderWorkWaits(t, pool, true)
	}, []string{"answer handed_over", "a/2 attempt 1 epoch raised t, expires in 20s", "delivery orders/a: (leased,1,"}},
	// Only older work holds a hand-over back: b/1, claimable but younger
	// than a/2, comes after a/2 in the claim order, so handing a/2 over
	// jumps nothing, and the holder without credit to spare takes it.
	{"younger work claimable: handed over", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		emitN(t, pool, "b", 1)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{h}
	}, []string{"answer handed_over", "a/2 attempt 1 epoch raised t, expires in 20s", "delivery orders/a: (leased,1,", "delivery orders/b: (ready,0,"}},
	{"not the next revision: out of order", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		claimOne(t, pool, h, 1)
		return eventID(t, pool, "a", 2), []uuid.UUID{h}
	}, []string{"answer out_of_order", "delivery orders/a: (leased,0,", "events orders/a: 1 pending, 2 pending"}},
	{"already published", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, uuid.New(), 1)
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, id))
		return id, nil
	}, []string{"answer already_published", "delivery orders/a: (ready,1,", "events orders/a: 1 published, 2 pending"}},
	{"head event skipped under its lease", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, h, 1)
		exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`, id))
		return id, []uuid.UUID{h}
	}, []string{"answer lease_lost", "delivery orders/a: (leased,0,", "events orders/a: 1 pending, 2 pending"}},
	// A skipped event answers lease_lost wherever it lies: not
	// out_of_order (which the relay is told means "delivered again once the
	// revisions before it are acked") when earlier revisions are pending,
	// for a skipped event is never delivered again.
	{"skipped event behind pending revisions", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 3)
		discover(t, pool)
		claimOne(t, pool, h, 3)
		id := eventID(t, pool, "a", 3)
		exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`, id))
		return id, []uuid.UUID{h}
	}, []string{"answer lease_lost", "delivery orders/a: (leased,0,", "events orders/a: 1 pending, 2 pending, 3 pending"}},
	{"unknown event", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		return uuid.New(), nil
	}, []string{"answer not_found", "delivered_count 0"}},
	{"lease covering more than the acked revision", false, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 3)
		discover(t, pool)
		return claimOne(t, pool, uuid.New(), 2), nil
	}, []string{"answer published", "delivery orders/a: (leased,1,", "events orders/a: 1 published, 2 pending, 3 pending"}},
	{"parked past the acked revision", true, func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 3)
		discover(t, pool)
		ls := claimWindow(t, pool, uuid.New(), 1, 3, 3)
		if len(ls) != 3 {
			t.Fatalf("claimed %v, want a window of 3", ls)
		}
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.park('%s', %d, 'too large')`, ls[2].id, ls[2].epoch))
		return ls[0].id, nil
	}, []string{"answer published", "delivery orders/a: (parked,1,", `"too large",3,)`, "events orders/a: 1 published, 2 pending, 3 pending"}},
}

// ackOutcome acks ids on a connection of its own and returns what the call
// answered for the first id and what it left in the database, with what
// differs between two runs (ids, times, epochs) replaced by how it relates
// to the data; and whether the call took the one-row path (it says so in a
// DEBUG message).
func ackOutcome(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, local []uuid.UUID) (string, bool) {
	t.Helper()
	ctx := context.Background()
	oneRow := false
	cfg := pool.Config().ConnConfig.Copy()
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if n.Message == "outbox.ack: one-row path" {
			oneRow = true
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	listener, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)
	if _, err := listener.Exec(ctx, `LISTEN outbox_released`); err != nil {
		t.Fatal(err)
	}

	// Each hand-over holder gets a TTL of its own (20, 27, 34 s ...), so
	// that taking the wrong one shows.
	var holders, ttls, spare any
	if local != nil {
		var hs []uuid.UUID
		var ts []string
		for i, h := range local {
			if h == noTTLs || h == spareCredit {
				continue
			}
			hs = append(hs, h)
			ts = append(ts, fmt.Sprintf("%d seconds", 20+7*i))
		}
		holders = hs
		if local[0] != noTTLs {
			ttls = ts
		}
		if slices.Contains(local, spareCredit) {
			all := make([]bool, len(hs))
			for i := range all {
				all[i] = true
			}
			spare = all
		}
	}
	var before struct {
		epoch   int64
		holder  *uuid.UUID
		expires *time.Time
	}
	if err := conn.QueryRow(ctx,
		`SELECT coalesce(max(d.epoch), 0), max(d.holder::text)::uuid, max(d.lease_expires_at) FROM outbox.event e
		 JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
		 WHERE e.event_id = $1`, ids[0]).Scan(&before.epoch, &before.holder, &before.expires); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SET client_min_messages = debug1`); err != nil {
		t.Fatal(err)
	}
	// A lease the ack sets expires one of the offered TTLs after the ack's
	// clock, which lies between called and the moment a statement reads the
	// expiry: the TTL that fits is printed, not the time left, which a
	// loaded machine shortens by a second between the two runs (27s against
	// 26s, seen).
	var called time.Time
	if err := conn.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&called); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, `
		SELECT a.status, a.event_id = $1, a.holder IS NULL, a.created_at IS NULL, a.claimable_in IS NULL,
		       CASE WHEN (a.handover).event_id IS NOT NULL THEN
		           format('%s/%s attempt %s epoch raised %s, expires in %ss',
		                  (a.handover).aggregate_key, (a.handover).revision, (a.handover).attempt,
		                  (a.handover).epoch > $5,
		                  (SELECT string_agg(extract(epoch FROM ttl)::int::text, ' or ') FROM unnest($4::interval[]) ttl
		                   WHERE (a.handover).lease_expires_at - ttl BETWEEN $6 AND clock_timestamp()))
		       ELSE '' END
		FROM outbox.ack($2, 'x', $3::uuid[], $4::interval[], p_handover_spare => $7::boolean[]) a
		ORDER BY a.status, a.event_id = $1 DESC`, ids[0], ids, holders, ttls, before.epoch, called, spare)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for rows.Next() {
		var status, handover string
		var acked, noHolder, noCreated, noClaimable bool
		if err := rows.Scan(&status, &acked, &noHolder, &noCreated, &noClaimable, &handover); err != nil {
			t.Fatal(err)
		}
		if !acked && status == "not_found" {
			continue // the batch run's extra id
		}
		fmt.Fprintf(&b, "answer %s (acked id %t, holder null %t, created_at null %t, claimable_in null %t) %s\n",
			status, acked, noHolder, noCreated, noClaimable, handover)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `RESET client_min_messages`); err != nil {
		t.Fatal(err)
	}

	// Notifications arrive in commit order: everything before this marker
	// was sent by the ack or earlier.
	if _, err := conn.Exec(ctx, `SELECT pg_notify('outbox_released', 'marker')`); err != nil {
		t.Fatal(err)
	}
	for {
		n, err := listener.WaitForNotification(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n.Payload == "marker" {
			break
		}
		fmt.Fprintf(&b, "outbox_released for the holder before the ack: %t\n",
			before.holder != nil && n.Payload == before.holder.String())
	}

	rows, err = conn.Query(ctx, `
		SELECT format('delivery %s/%s: %s', d.stream, d.aggregate_key,
		       row(d.state, d.delivered_revision, d.claimable_at IS NULL,
		           d.pending_since IS NOT DISTINCT FROM (SELECT min(e.created_at) FROM outbox.event e
		               WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key AND e.revision > d.delivered_revision),
		           d.epoch > $1, d.holder IS NULL, d.holder_relay_id, d.holder_replica_id,
		           (SELECT e.revision FROM outbox.event e WHERE e.event_id = d.leased_event_id), d.leased_through,
		           -- A lease the ack left alone says so: its time left depends on
		           -- when the setup claimed it, which differs between the runs.
		           CASE WHEN d.lease_expires_at = $2 THEN 'unchanged'
		                ELSE coalesce((SELECT string_agg(extract(epoch FROM ttl)::int::text || 's TTL', ' or ')
		                               FROM unnest($3::interval[]) ttl
		                               WHERE d.lease_expires_at - ttl BETWEEN $4 AND clock_timestamp()),
		                              round(extract(epoch FROM d.lease_expires_at - now()))::text) END,
		           d.claimable_at IS NOT DISTINCT FROM d.lease_expires_at,
		           d.attempt, d.failures, d.unanswered, d.last_error, d.next_attempt_at IS NULL,
		           d.parked_at IS NULL, d.parked_reason, d.parked_revision, d.gap_revision)::text)
		FROM outbox.delivery d
		UNION ALL
		SELECT format('events %s/%s: %s', e.stream, e.aggregate_key,
		       string_agg(e.revision || CASE WHEN e.published_at IS NULL THEN ' pending' ELSE ' published' END, ', ' ORDER BY e.revision))
		FROM outbox.event e GROUP BY e.stream, e.aggregate_key
		UNION ALL
		SELECT format('delivered_count %s', coalesce(sum(c.events), 0)) FROM outbox.delivered_count c
		ORDER BY 1`, before.epoch, before.expires, ttls, called)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		b.WriteString(line + "\n")
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return b.String(), oneRow
}

func TestOneAckDecidesAsABatch(t *testing.T) {
	t.Parallel()
	for _, c := range oneAckCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			alone, inBatch := testdb.NewPool(t), testdb.NewPool(t)
			id, local := c.setup(t, alone)
			id2, local2 := c.setup(t, inBatch)
			// The same case in both databases: the hand-over holders are
			// fresh ids, so the batch run passes its own.
			got, oneRow := ackOutcome(t, alone, []uuid.UUID{id}, local)
			want, batchOneRow := ackOutcome(t, inBatch, []uuid.UUID{id2, uuid.New()}, local2)
			if got != want {
				t.Fatalf("a lone ack decided\n%s\nthe same ack in a batch decided\n%s", got, want)
			}
			if oneRow != c.oneRow || batchOneRow {
				t.Fatalf("the lone ack took the one-row path: %t, want %t; the batch took it: %t", oneRow, c.oneRow, batchOneRow)
			}
			if len(c.want) == 0 {
				t.Fatal("the case says nothing of the outcome it expects")
			}
			for _, w := range c.want {
				if !strings.Contains(got, w) {
					t.Errorf("both decided\n%s\nwhich lacks %q", got, w)
				}
			}
			t.Logf("both decided\n%s", got)
		})
	}
}

// A skip that commits while an ack waits for the event's lock wins: the
// ack answers lease_lost and the event stays unpublished. (The skip locks
// the event, then the aggregate's delivery row, records itself and
// commits; a statement that waited for the event's lock still reads the
// skip table as it was before.) For a lone ack (the one-row path) and for
// one in a batch (the batch path, which an id that names no event forces):
// a batch that did not lock the events first would lock the delivery row
// the skip needs next while waiting for the event, a deadlock.
func TestSkipWhileAnAckWaitsWins(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		ids  func(event uuid.UUID) []uuid.UUID // what the ack names
	}{
		{"lone", func(e uuid.UUID) []uuid.UUID { return []uuid.UUID{e} }},
		{"batch", func(e uuid.UUID) []uuid.UUID { return []uuid.UUID{e, uuid.New()} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testContext(t)
			pool := testdb.NewPool(t)
			h := uuid.New()
			emitN(t, pool, "a", 2)
			discover(t, pool)
			id := claimOne(t, pool, h, 1)

			skip, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer skip.Rollback(context.WithoutCancel(ctx))
			skipPID := backendPID(t, skip)
			exec := func(sql string, args ...any) {
				t.Helper()
				if _, err := skip.Exec(ctx, sql, args...); err != nil {
					t.Fatal(err)
				}
			}
			// What SkipEvent does first: lock the event row.
			exec(`SELECT 1 FROM outbox.event WHERE event_id = $1 FOR UPDATE`, id)

			ackConn, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer ackConn.Release()
			ackPID := backendPID(t, ackConn)
			type answer struct {
				status string
				err    error
			}
			answered := make(chan answer, 1)
			go func() {
				var a answer
				a.err = ackConn.QueryRow(ctx, `SELECT status FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'])
					WHERE event_id = $3`, tc.ids(id), h, id).Scan(&a.status)
				answered <- a
			}()
			waitUntilBlockedBy(t, pool, ackPID, skipPID)
			// The rest of SkipEvent (its delivery row next), then its commit.
			exec(`SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'a' FOR UPDATE`)
			exec(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ($1, 'test', 'test')`, id)
			exec(`UPDATE outbox.delivery SET state = 'ready', claimable_at = clock_timestamp(), holder = NULL,
			          holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL, attempt = 0
			      WHERE aggregate_key = 'a'`)
			if err := skip.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			a := <-answered
			if a.err != nil {
				t.Fatal(a.err)
			}
			if a.status != "lease_lost" {
				t.Fatalf("the ack answered %s, want lease_lost", a.status)
			}
			if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.event WHERE event_id = '%s' AND published_at IS NOT NULL`, id)); n != 0 {
				t.Fatal("a skipped event was marked published")
			}
		})
	}
}

// Every event an ack marks published counts once in outbox.delivered_count
// (the delivery rate), on either path, also when the statement adds to a
// counter row an earlier ack of the same connection wrote: the row is keyed
// by stream, 5-second bucket and backend, so acks on one connection in one
// bucket meet on it. Two lone acks (the one-row path) and then a batch of
// three (the batch path) on one connection: five events, five counted,
// however the buckets fall.
func TestEveryAckedEventIsCountedOnce(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	for _, key := range []string{"a", "b", "c", "d", "e"} {
		emitN(t, pool, key, 1)
	}
	discover(t, pool)
	ls := claimWindow(t, pool, uuid.New(), 5, 1, 5)
	if len(ls) != 5 {
		t.Fatalf("claimed %v, want five leases", ls)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	ack := func(ids ...uuid.UUID) {
		t.Helper()
		rows, err := conn.Query(ctx, `SELECT status FROM outbox.ack($1, 'x')`, ids)
		if err != nil {
			t.Fatal(err)
		}
		statuses, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range statuses {
			if s != "published" {
				t.Fatalf("ack of %v answered %v, want every one published", ids, statuses)
			}
		}
	}
	ack(ls[0].id)
	ack(ls[1].id)
	ack(ls[2].id, ls[3].id, ls[4].id)
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`); n != 5 {
		t.Fatalf("%d events published, want 5", n)
	}
	// How the counts fell, for the log: the rows a bucket boundary split.
	rows := count(t, pool, `SELECT count(*) FROM outbox.delivered_count`)
	if n := count(t, pool, `SELECT coalesce(sum(events), 0) FROM outbox.delivered_count WHERE stream = 'orders'`); n != 5 {
		t.Fatalf("delivered_count holds %d events in %d rows for 5 acked on one connection", n, rows)
	}
	t.Logf("5 events counted in %d counter rows", rows)
}
