package store

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// EventState filters ListEvents.
type EventState int

// Event states; EventAny matches all.
const (
	EventAny EventState = iota
	EventPending
	EventPublished
	EventSkipped
)

// EventPosition is a place in the (created_at, event_id) order that
// listings and purges page by.
type EventPosition struct {
	CreatedAt time.Time
	EventID   uuid.UUID
}

// IsZero reports the position before (or, for a descending listing, after)
// every event.
func (p EventPosition) IsZero() bool { return p.CreatedAt.IsZero() && p.EventID == uuid.Nil }

// ListEventsParams filters and pages a listing, newest first.
type ListEventsParams struct {
	Stream, AggregateKey string
	State                EventState
	// CreatedAfter (inclusive) and CreatedBefore (exclusive) bound
	// created_at when not zero.
	CreatedAfter, CreatedBefore time.Time
	// Before continues a listing: only events strictly older than it.
	Before EventPosition
	Limit  int
	// EventID, when set, finds that one event.
	EventID uuid.UUID
}

// EventRecord is an event with its delivery facts.
type EventRecord struct {
	Event
	PublishedAt time.Time
	Skip        *Skip
}

// ListEvents lists events newest first. Predicates are added only for the
// filters given, so each combination gets a plan of its own that walks the
// (created_at, event_id) index, or the (stream, aggregate_key, revision) key
// when an aggregate is named.
func (s *Store) ListEvents(ctx context.Context, p ListEventsParams) ([]EventRecord, error) {
	var where []string
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return fmt.Sprintf("$%d", len(args))
	}
	if p.EventID != uuid.Nil {
		where = append(where, "e.event_id = "+arg(p.EventID))
	}
	if p.Stream != "" {
		where = append(where, "e.stream = "+arg(p.Stream))
	}
	if p.AggregateKey != "" {
		where = append(where, "e.aggregate_key = "+arg(p.AggregateKey))
	}
	switch p.State {
	case EventPending:
		where = append(where, "e.published_at IS NULL AND sk.event_id IS NULL")
	case EventPublished:
		where = append(where, "e.published_at IS NOT NULL")
	case EventSkipped:
		where = append(where, "sk.event_id IS NOT NULL")
	}
	if !p.CreatedAfter.IsZero() {
		where = append(where, "e.created_at >= "+arg(p.CreatedAfter))
	}
	if !p.CreatedBefore.IsZero() {
		where = append(where, "e.created_at < "+arg(p.CreatedBefore))
	}
	if !p.Before.IsZero() {
		where = append(where, fmt.Sprintf("(e.created_at, e.event_id) < (%s, %s)", arg(p.Before.CreatedAt), arg(p.Before.EventID)))
	}
	sql := `SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type, e.payload::text,
	               e.headers, e.created_at, e.published_at, sk.reason, sk.actor, sk.skipped_at
	        FROM outbox.event e
	        LEFT JOIN LATERAL (
	            SELECT s.event_id, s.reason, s.actor, s.skipped_at FROM outbox.skipped_event s
	            WHERE s.event_id = e.event_id LIMIT 1
	        ) sk ON true`
	if len(where) > 0 {
		sql += " WHERE " + strings.Join(where, " AND ")
	}
	sql += " ORDER BY e.created_at DESC, e.event_id DESC LIMIT " + arg(p.Limit)
	// Planned for each listing's values (an unnamed statement, never a
	// generic plan): whether to walk the (created_at, event_id) index and
	// test the stream on each row, or read the stream's events by key and
	// sort them, depends on how much of the table the stream is, which a
	// plan made once for every stream (while the table was small, say)
	// cannot know.
	rows, err := s.pool.Query(ctx, sql, append([]any{pgx.QueryExecModeDescribeExec}, args...)...)
	if err != nil {
		return nil, fmt.Errorf("store: list events: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (EventRecord, error) {
		var r EventRecord
		var payload string
		var published, skippedAt *time.Time
		var reason, actor *string
		err := row.Scan(&r.ID, &r.Stream, &r.AggregateKey, &r.Revision, &r.Type, &payload,
			&r.Headers, &r.CreatedAt, &published, &reason, &actor, &skippedAt)
		r.Payload = []byte(payload)
		r.PublishedAt = deref(published)
		if reason != nil {
			r.Skip = &Skip{Reason: *reason, Actor: deref(actor), SkippedAt: deref(skippedAt)}
		}
		return r, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: list events: %w", err)
	}
	return list, nil
}

// PurgeParams selects what Purge deletes: published events whose
// published_at is before PublishedBefore, optionally of one stream.
type PurgeParams struct {
	PublishedBefore time.Time
	Stream          string
	// BatchSize is the most events one batch examines.
	BatchSize int
	// DryRun counts instead of deleting.
	DryRun bool
}

// PurgeBatch is the outcome of one batch.
type PurgeBatch struct {
	// Deleted counts events deleted (or that would be, in a dry run).
	Deleted int64
	// Next is where the following batch starts.
	Next EventPosition
	// Done is set when the batch reached the end of the candidates.
	Done bool
}

// CountPurgeable counts the events Purge would delete.
func (s *Store) CountPurgeable(ctx context.Context, p PurgeParams) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `
		SELECT count(*) FROM outbox.event e
		WHERE e.created_at < $1 AND e.published_at < $1 AND ($2 = '' OR e.stream = $2)`,
		p.PublishedBefore, p.Stream).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("store: count purgeable: %w", err)
	}
	return n, nil
}

// PurgeOne runs one purge batch as its own statement, so its transaction is
// short and holds back neither vacuum nor other writers. It examines the
// next BatchSize events in (created_at, event_id) order after `after` and
// deletes those published before the cut-off. Pending and skipped events are
// only passed over: the keyset moves past them, so a batch never examines
// the same rows twice. Since published_at >= created_at, an event published
// before the cut-off was also created before it, which bounds the scan.
func (s *Store) PurgeOne(ctx context.Context, p PurgeParams, after EventPosition) (PurgeBatch, error) {
	// The attempt history of a deleted event goes with it (outbox.attempt
	// has no foreign key; see there).
	act := `DELETE FROM outbox.event e USING scan s
	        WHERE e.event_id = s.event_id AND e.published_at < $1 RETURNING e.event_id
	    ), attempts AS (
	        DELETE FROM outbox.attempt a USING act WHERE a.event_id = act.event_id`
	if p.DryRun {
		act = `SELECT s.event_id FROM scan s WHERE s.published_at < $1`
	}
	var b PurgeBatch
	var examined int64
	var lastAt *time.Time
	var lastID *uuid.UUID
	err := s.pool.QueryRow(ctx, `
		WITH scan AS (
		    SELECT e.event_id, e.created_at, e.published_at FROM outbox.event e
		    WHERE e.created_at < $1 AND (e.created_at, e.event_id) > ($2, $3)
		      AND ($4 = '' OR e.stream = $4)
		    ORDER BY e.created_at, e.event_id
		    LIMIT $5
		), act AS (`+act+`), last AS (
		    SELECT created_at, event_id FROM scan ORDER BY created_at DESC, event_id DESC LIMIT 1
		)
		SELECT (SELECT count(*) FROM scan), (SELECT count(*) FROM act),
		       (SELECT created_at FROM last), (SELECT event_id FROM last)`,
		p.PublishedBefore, after.CreatedAt, after.EventID, p.Stream, p.BatchSize,
	).Scan(&examined, &b.Deleted, &lastAt, &lastID)
	if err != nil {
		return b, fmt.Errorf("store: purge: %w", err)
	}
	b.Done = examined < int64(p.BatchSize)
	b.Next = after
	if lastAt != nil && lastID != nil {
		b.Next = EventPosition{CreatedAt: *lastAt, EventID: *lastID}
	}
	return b, nil
}
