package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
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
// hand-over holders to pass (nil: the ack comes from another replica).
type ackCase struct {
	name  string
	setup func(t *testing.T, pool *pgxpool.Pool) (ack uuid.UUID, local []uuid.UUID)
}

// claimOne leases the oldest claimable aggregate to holder with a window
// and returns the head event's id.
func claimOne(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, window int) uuid.UUID {
	t.Helper()
	got := claimWindow(t, pool, holder, 1, window, window)
	if len(got) == 0 {
		t.Fatal("claim found nothing")
	}
	return got[0].id
}

var oneAckCases = []ackCase{
	{"next revision handed over to the local holder", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{uuid.New(), h}
	}},
	{"nothing follows: idle", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 1)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{h}
	}},
	{"holder on another replica: ready", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, uuid.New(), 1), []uuid.UUID{uuid.New()}
	}},
	{"ack from another replica, no sessions passed", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		return claimOne(t, pool, uuid.New(), 1), nil
	}},
	{"next revision skipped: ready, nothing handed over", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, h, 1)
		exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`,
			eventID(t, pool, "a", 2)))
		return id, []uuid.UUID{h}
	}},
	{"next revision missing, a later one present: ready", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 1)
		exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload) VALUES ('orders', 'a', 3, 'T', '{}')`)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{h}
	}},
	{"older claimable work: no hand-over", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 1)
		emitN(t, pool, "b", 1)
		emitN(t, pool, "a", 1)
		discover(t, pool)
		return claimOne(t, pool, h, 1), []uuid.UUID{h}
	}},
	{"not the next revision: out of order", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		claimOne(t, pool, h, 1)
		return eventID(t, pool, "a", 2), []uuid.UUID{h}
	}},
	{"already published", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, uuid.New(), 1)
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, id))
		return id, nil
	}},
	{"head event skipped under its lease", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		h := uuid.New()
		emitN(t, pool, "a", 2)
		discover(t, pool)
		id := claimOne(t, pool, h, 1)
		exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`, id))
		return id, []uuid.UUID{h}
	}},
	{"unknown event", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		return uuid.New(), nil
	}},
	{"lease covering more than the acked revision", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 3)
		discover(t, pool)
		return claimOne(t, pool, uuid.New(), 2), nil
	}},
	{"parked past the acked revision", func(t *testing.T, pool *pgxpool.Pool) (uuid.UUID, []uuid.UUID) {
		emitN(t, pool, "a", 3)
		discover(t, pool)
		ls := claimWindow(t, pool, uuid.New(), 1, 3, 3)
		if len(ls) != 3 {
			t.Fatalf("claimed %v, want a window of 3", ls)
		}
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.park('%s', %d, 'too large')`, ls[2].id, ls[2].epoch))
		return ls[0].id, nil
	}},
}

// ackOutcome is what an ack call answered for the acked event and what it
// left in the database, with what differs between two runs (ids, times,
// epochs) replaced by how it relates to the data.
func ackOutcome(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, local []uuid.UUID) string {
	t.Helper()
	ctx := context.Background()
	var ttls []string
	for range local {
		ttls = append(ttls, "30 seconds")
	}
	var holders, intervals any
	if local != nil {
		holders, intervals = local, ttls
	}
	rows, err := pool.Query(ctx, `
		SELECT a.status, a.event_id = $1, a.holder IS NULL, a.created_at IS NULL, a.claimable_in IS NULL,
		       coalesce((a.handover).aggregate_key || '/' || (a.handover).revision || ' attempt ' || (a.handover).attempt
		                || ' expires ' || ((a.handover).lease_expires_at > now() + interval '20 seconds'), '')
		FROM outbox.ack($2, 'x', $3::uuid[], $4::interval[]) a
		ORDER BY a.status, a.event_id = $1 DESC`, ids[0], ids, holders, intervals)
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
	rows, err = pool.Query(ctx, `
		SELECT format('delivery %s/%s: %s', d.stream, d.aggregate_key,
		       row(d.state, d.delivered_revision, d.claimable_at IS NULL,
		           d.pending_since IS NOT DISTINCT FROM (SELECT min(e.created_at) FROM outbox.event e
		               WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key AND e.revision > d.delivered_revision),
		           d.holder IS NULL, d.holder_relay_id, d.holder_replica_id,
		           (SELECT e.revision FROM outbox.event e WHERE e.event_id = d.leased_event_id), d.leased_through,
		           d.lease_expires_at IS NULL, d.attempt, d.failures, d.unanswered, d.last_error, d.next_attempt_at IS NULL,
		           d.parked_at IS NULL, d.parked_reason, d.parked_revision, d.gap_revision)::text)
		FROM outbox.delivery d
		UNION ALL
		SELECT format('events %s/%s: %s', e.stream, e.aggregate_key,
		       string_agg(e.revision || CASE WHEN e.published_at IS NULL THEN ' pending' ELSE ' published' END, ', ' ORDER BY e.revision))
		FROM outbox.event e GROUP BY e.stream, e.aggregate_key
		UNION ALL
		SELECT format('delivered_count %s', coalesce(sum(c.events), 0)) FROM outbox.delivered_count c
		ORDER BY 1`)
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
	return b.String()
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
			got := ackOutcome(t, alone, []uuid.UUID{id}, local)
			want := ackOutcome(t, inBatch, []uuid.UUID{id2, uuid.New()}, local2)
			if got != want {
				t.Fatalf("a lone ack decided\n%s\nthe same ack in a batch decided\n%s", got, want)
			}
			t.Logf("both decided\n%s", got)
		})
	}
}
