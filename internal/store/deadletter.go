package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// AggregateFilter selects aggregates with pending work (a delivery row with
// pending_since set). Every set field must match.
type AggregateFilter struct {
	// Stream matches exactly; with StreamPrefix, it is a prefix instead
	// ("billing." for billing.*; "" for every stream).
	Stream       string
	StreamPrefix bool
	// States keeps aggregates in one of these delivery states.
	States []string
	// ErrorContains keeps aggregates whose last error contains it, ignoring
	// case.
	ErrorContains string
	// PendingBefore keeps aggregates whose oldest pending event was created
	// before it.
	PendingBefore time.Time
	// StalledOnly keeps only stalled aggregates (outbox.stall_reason).
	StalledOnly bool
	// WokenGaps, with "gap" among States, keeps as well the ready
	// aggregates whose next revision is missing: a discovery round that
	// finds a later event of a gap-held aggregate wakes it (the event might
	// be the missing one), and it reads ready until its next claim holds it
	// at the gap again.
	WokenGaps bool
}

// AggregatePosition is a place in ListAggregates' order: oldest pending
// first, then by stream and key.
type AggregatePosition struct {
	PendingSince         time.Time
	Stream, AggregateKey string
}

// IsZero reports the position before every aggregate.
func (p AggregatePosition) IsZero() bool { return p.PendingSince.IsZero() && p.Stream == "" }

// ListedAggregate is an aggregate with its place in the listing.
type ListedAggregate struct {
	Aggregate
	Position AggregatePosition
}

// where renders the filter as SQL predicates over outbox.delivery d.
func (f AggregateFilter) where(arg func(any) string) []string {
	// pending_since can outlive the last pending event for a moment (a skip
	// the next claim has not settled yet), so the events say.
	// (Scalar subqueries, probes by key and id, which no plan turns into a
	// scan of the events or the skips; see ConfigurePool.)
	w := []string{`d.pending_since IS NOT NULL AND (
		SELECT true FROM outbox.event e
		WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key AND e.revision > d.delivered_revision
		  AND e.published_at IS NULL
		  AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
		LIMIT 1) IS NOT NULL`}
	switch {
	case f.StreamPrefix && f.Stream != "":
		w = append(w, "starts_with(d.stream, "+arg(f.Stream)+")")
	case !f.StreamPrefix:
		w = append(w, "d.stream = "+arg(f.Stream))
	}
	switch {
	case len(f.States) > 0 && f.WokenGaps && slices.Contains(f.States, "gap"):
		w = append(w, "(d.state = ANY ("+arg(f.States)+`::text[]) OR (d.state = 'ready' AND NOT EXISTS (
			SELECT 1 FROM outbox.event e
			WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key AND e.revision = d.delivered_revision + 1)))`)
	case len(f.States) > 0:
		w = append(w, "d.state = ANY ("+arg(f.States)+"::text[])")
	}
	if f.ErrorContains != "" {
		w = append(w, "strpos(lower(d.last_error), lower("+arg(f.ErrorContains)+")) > 0")
	}
	if !f.PendingBefore.IsZero() {
		w = append(w, "d.pending_since < "+arg(f.PendingBefore))
	}
	if f.StalledOnly {
		w = append(w, "outbox.stall_reason(d.state, d.unanswered, d.failures, d.last_error) IS NOT NULL")
	}
	return w
}

// ListAggregates lists the aggregates f matches, oldest pending first,
// after the position given, at most limit of them. It walks the delivery
// rows of aggregates with pending work (delivery_pending_idx), so its cost
// follows the backlog.
func (s *Store) ListAggregates(ctx context.Context, f AggregateFilter, after AggregatePosition, limit int) ([]ListedAggregate, error) {
	return s.listAggregates(ctx, f, limit, "d.pending_since, d.stream, d.aggregate_key", func(arg func(any) string) string {
		if after.IsZero() {
			return ""
		}
		return fmt.Sprintf("(d.pending_since, d.stream, d.aggregate_key) > (%s, %s, %s)",
			arg(after.PendingSince), arg(after.Stream), arg(after.AggregateKey))
	})
}

// ListAggregatesByKey lists the aggregates f matches in (stream,
// aggregate_key) order, after the aggregate afterStream/afterKey (both
// empty: from the first), at most limit of them. Bulk actions page with it:
// an aggregate's key never moves, whereas its pending_since does as relays
// deliver what the action released, which would bring an aggregate already
// acted on round again later in a pending_since order. It walks the
// delivery rows in key order (the primary key), idle ones included, so a
// whole walk costs one pass over the stream's aggregates.
func (s *Store) ListAggregatesByKey(ctx context.Context, f AggregateFilter, afterStream, afterKey string, limit int) ([]ListedAggregate, error) {
	return s.listAggregates(ctx, f, limit, "d.stream, d.aggregate_key", func(arg func(any) string) string {
		if afterStream == "" {
			return ""
		}
		return fmt.Sprintf("(d.stream, d.aggregate_key) > (%s, %s)", arg(afterStream), arg(afterKey))
	})
}

// listAggregates lists the aggregates f matches in the order given, after
// the position the keyset predicate renders ("" for none).
func (s *Store) listAggregates(ctx context.Context, f AggregateFilter, limit int, order string, keyset func(arg func(any) string) string) ([]ListedAggregate, error) {
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return fmt.Sprintf("$%d", len(args))
	}
	where := f.where(arg)
	if k := keyset(arg); k != "" {
		where = append(where, k)
	}
	rows, err := s.pool.Query(ctx, `
		SELECT d.stream, d.aggregate_key, d.pending_since,
		       d.state, coalesce(g.last_revision, 0), d.delivered_revision,
		       p.events, p.next_revision, p.oldest_created_at,
		       d.holder, d.holder_relay_id, d.epoch, d.lease_expires_at, d.leased_event_id,
		       d.attempt, d.failures, d.last_error, d.next_attempt_at,
		       d.parked_at, d.parked_reason, d.gap_revision,
		       outbox.stall_reason(d.state, d.unanswered, d.failures, d.last_error),
		       `+nextPendingEventID("d")+`
		FROM outbox.delivery d
		LEFT JOIN outbox.aggregate g ON g.stream = d.stream AND g.aggregate_key = d.aggregate_key
		CROSS JOIN LATERAL outbox.pending_of(d.stream, d.aggregate_key, d.delivered_revision) p
		WHERE `+strings.Join(where, " AND ")+`
		ORDER BY `+order+`
		LIMIT `+arg(limit), args...)
	if err != nil {
		return nil, fmt.Errorf("store: list aggregates: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ListedAggregate, error) {
		var l ListedAggregate
		var c aggregateCols
		err := row.Scan(append([]any{&l.Stream, &l.AggregateKey, &l.Position.PendingSince}, c.targets(&l.Aggregate)...)...)
		c.fill(&l.Aggregate)
		l.Position.Stream, l.Position.AggregateKey = l.Stream, l.AggregateKey
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: list aggregates: %w", err)
	}
	return list, nil
}

// CountAggregates counts the aggregates f matches.
func (s *Store) CountAggregates(ctx context.Context, f AggregateFilter) (int64, error) {
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return fmt.Sprintf("$%d", len(args))
	}
	var n int64
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery d WHERE `+
		strings.Join(f.where(arg), " AND "), args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("store: count aggregates: %w", err)
	}
	return n, nil
}

// Attempt is one recorded delivery attempt that did not publish.
type Attempt struct {
	ID                   int64
	EventID              uuid.UUID
	Stream, AggregateKey string
	Revision             int64
	Attempt              int
	// Outcome is nacked, expired, released or parked.
	Outcome            string
	Error              string
	RelayID, ReplicaID string
	At                 time.Time
}

// AttemptsParams names the event, or else the aggregate, whose attempts to
// list, newest first, before attempt id Before (0: from the newest).
type AttemptsParams struct {
	EventID              uuid.UUID
	Stream, AggregateKey string
	Before               int64
	Limit                int
}

// Attempts lists recorded attempts, newest first.
func (s *Store) Attempts(ctx context.Context, p AttemptsParams) ([]Attempt, error) {
	before := p.Before
	if before <= 0 {
		before = 1<<63 - 1
	}
	// One of two predicates, each walking its own index newest first.
	cond, args := "a.stream = $3 AND a.aggregate_key = $4", []any{before, p.Limit, p.Stream, p.AggregateKey}
	if p.EventID != uuid.Nil {
		cond, args = "a.event_id = $3", []any{before, p.Limit, p.EventID}
	}
	rows, err := s.pool.Query(ctx, `
		SELECT a.attempt_id, a.event_id, a.stream, a.aggregate_key, a.revision, a.attempt, a.outcome,
		       coalesce(a.error, ''), coalesce(a.relay_id, ''), coalesce(a.replica_id, ''), a.at
		FROM outbox.attempt a
		WHERE `+cond+` AND a.attempt_id < $1
		ORDER BY a.attempt_id DESC LIMIT $2`, args...)
	if err != nil {
		return nil, fmt.Errorf("store: attempts: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Attempt, error) {
		var a Attempt
		err := row.Scan(&a.ID, &a.EventID, &a.Stream, &a.AggregateKey, &a.Revision, &a.Attempt, &a.Outcome,
			&a.Error, &a.RelayID, &a.ReplicaID, &a.At)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: attempts: %w", err)
	}
	return list, nil
}

// EventExists reports whether an event with this id exists.
func (s *Store) EventExists(ctx context.Context, id uuid.UUID) (bool, error) {
	var ok bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM outbox.event WHERE event_id = $1)`, id).Scan(&ok); err != nil {
		return false, fmt.Errorf("store: event exists: %w", err)
	}
	return ok, nil
}

// OperatorAction is the audit record of an operator's action.
type OperatorAction struct {
	ID int64
	// Action is one of ActionNames.
	Action, Actor, Reason string
	// Stream is the stream the action names, or a bulk filter's stream
	// pattern (billing.*, or * for every stream).
	Stream string
	// Request is the request as the server understood it (JSON).
	Request any
}

// StartAction records an operator action before it runs, so that even one
// cut short (a crash, a cancelled call) is on record; FinishAction records
// its outcome.
func (s *Store) StartAction(ctx context.Context, a OperatorAction) (int64, error) {
	req, err := json.Marshal(a.Request)
	if err != nil {
		return 0, fmt.Errorf("store: start action: %w", err)
	}
	var id int64
	if err := s.pool.QueryRow(ctx, `
		INSERT INTO outbox.operator_action (action, actor, reason, request, stream) VALUES ($1, $2, $3, $4, coalesce(nullif($5, ''), '*'))
		RETURNING action_id`, a.Action, a.Actor, a.Reason, req, a.Stream).Scan(&id); err != nil {
		return 0, fmt.Errorf("store: start action: %w", err)
	}
	return id, nil
}

// FinishAction records how many aggregates and events an action changed.
func (s *Store) FinishAction(ctx context.Context, id, aggregates, events int64) error {
	if _, err := s.pool.Exec(ctx, `
		UPDATE outbox.operator_action SET aggregates = $2, events = $3, finished_at = clock_timestamp()
		WHERE action_id = $1`, id, aggregates, events); err != nil {
		return fmt.Errorf("store: finish action: %w", err)
	}
	return nil
}

// RepublishParams names one aggregate to rewind. FromRevision is the first
// revision to deliver again; revisions below the aggregate's lowest stored
// one start at that one (events before it were purged or never existed).
type RepublishParams struct {
	Stream, AggregateKey string
	FromRevision         int64
	// ActionID is the outbox.operator_action the rewind belongs to; 0 in a
	// dry run, or when Own is set.
	ActionID int64
	// Own, when set (and ActionID is 0), is recorded as an action of its
	// own in the rewind's transaction, once its checks have passed: a
	// refused rewind records nothing, and a recorded one did what it says.
	Own    *OperatorAction
	DryRun bool
	// IncludeSkipped delivers the skipped events of the range too: their
	// skips are withdrawn (and kept in outbox.republished.previous_skips).
	// Without it they stay skipped.
	IncludeSkipped bool
}

// RepublishResult says what a rewind did (or would do).
type RepublishResult struct {
	FromRevision, ToRevision int64
	// Events counts events made pending again: published ones, and with
	// IncludeSkipped the skipped ones (also counted in Unskipped).
	Events    int64
	Unskipped int64
	// Holder is the session whose lease the rewind ended, if any.
	Holder uuid.UUID
	// ActionID is the action the rewind was recorded under.
	ActionID int64
}

// Republish rewinds one aggregate's delivery cursor to p.FromRevision-1 and
// makes its published events from there up to the cursor pending again, so
// that delivery offers them again under their own ids, in revision order,
// before anything after the old cursor; each is marked published anew by
// the ack of its new delivery. When and by which action each was published
// before is kept in outbox.republished. Skipped events in the range stay
// skipped unless p.IncludeSkipped, which withdraws their skips (kept in
// outbox.republished.previous_skips) so they are delivered in their place in
// revision order. A lease in flight on the next event ends (its ack answers
// LEASE_LOST, the event comes again after the republished ones). Each
// event's deliveries continue its attempt numbers (earlier_attempts, applied
// by outbox.continue_attempts).
//
// It refuses (a *StateError) an aggregate that is parked, backing off or
// held at a gap (retry or skip its next event first), one with nothing
// published from p.FromRevision on, and a range with a missing revision
// (purged, or given up with an accepted gap) or a stranded event, since
// delivery would stop at either. ErrNotFound if the aggregate has no
// delivery row.
func (s *Store) Republish(ctx context.Context, p RepublishParams) (RepublishResult, error) {
	var r RepublishResult
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var state string
		var delivered int64
		var holder *uuid.UUID
		err := tx.QueryRow(ctx, `
			SELECT state, delivered_revision, holder FROM outbox.delivery
			WHERE stream = $1 AND aggregate_key = $2 FOR UPDATE`, p.Stream, p.AggregateKey).Scan(&state, &delivered, &holder)
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		switch state {
		case "idle", "ready", "leased":
		default:
			return &StateError{fmt.Sprintf("aggregate %s/%s is %s; retry or skip its next event first, then republish",
				p.Stream, p.AggregateKey, stateWords[state])}
		}
		// The range as it stands: the lowest stored revision at or above
		// from, and every revision from there to the cursor, each published
		// or skipped.
		var low *int64
		var stored, published, pending, skipped int64
		err = tx.QueryRow(ctx, `
			WITH r AS (
			    SELECT e.revision, e.published_at,
			           (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NOT NULL AS skipped
			    FROM outbox.event e
			    WHERE e.stream = $1 AND e.aggregate_key = $2 AND e.revision >= $3 AND e.revision <= $4
			)
			SELECT min(revision), count(*), count(*) FILTER (WHERE published_at IS NOT NULL),
			       count(*) FILTER (WHERE published_at IS NULL AND NOT skipped), count(*) FILTER (WHERE skipped)
			FROM r`, p.Stream, p.AggregateKey, p.FromRevision, delivered).Scan(&low, &stored, &published, &pending, &skipped)
		if err != nil {
			return err
		}
		if low == nil || published == 0 && (skipped == 0 || !p.IncludeSkipped) {
			if skipped > 0 {
				return &StateError{fmt.Sprintf("aggregate %s/%s has only skipped events from revision %d on (delivered up to %d); include skipped events (include_skipped, --include-skipped) to deliver them",
					p.Stream, p.AggregateKey, p.FromRevision, delivered)}
			}
			if err := skippedAhead(ctx, tx, p, delivered); err != nil {
				return err
			}
			return &StateError{fmt.Sprintf("aggregate %s/%s has no published event from revision %d on (delivered up to %d)",
				p.Stream, p.AggregateKey, p.FromRevision, delivered)}
		}
		r.FromRevision, r.ToRevision = *low, delivered
		if missing := delivered - *low + 1 - stored; missing > 0 {
			return &StateError{fmt.Sprintf("aggregate %s/%s misses %d revisions between %d and %d (purged, or given up with an accepted gap); republish from after them",
				p.Stream, p.AggregateKey, missing, *low, delivered)}
		}
		if pending > 0 {
			return &StateError{fmt.Sprintf("aggregate %s/%s has %d stranded events between revisions %d and %d; skip them first",
				p.Stream, p.AggregateKey, pending, *low, delivered)}
		}
		r.Events = published
		if p.IncludeSkipped {
			r.Unskipped = skipped
			r.Events += skipped
		}
		if p.DryRun {
			return nil
		}
		r.ActionID = p.ActionID
		if p.Own != nil && r.ActionID == 0 {
			if r.ActionID, err = recordOwnAction(ctx, tx, *p.Own, 1, r.Events); err != nil {
				return err
			}
		}
		// published_at goes back to NULL only under this setting
		// (outbox.event_guard_published); the UPDATE's rows are the ones
		// counted above, as the delivery row lock keeps the cursor, and only
		// purge, whose DELETE skips rows made pending, could take one away.
		if _, err := tx.Exec(ctx, `SELECT set_config('outbox.republishing', 'on', true)`); err != nil {
			return err
		}
		var changed int64
		var previous []byte
		err = tx.QueryRow(ctx, `
			WITH reset AS (
			    UPDATE outbox.event e SET published_at = NULL
			    FROM outbox.event o
			    WHERE o.event_id = e.event_id AND e.stream = $1 AND e.aggregate_key = $2
			      AND e.revision >= $3 AND e.revision <= $4 AND e.published_at IS NOT NULL
			    RETURNING e.event_id, o.published_at
			)
			SELECT count(*), coalesce(jsonb_object_agg(event_id, published_at), '{}') FROM reset`,
			p.Stream, p.AggregateKey, r.FromRevision, delivered).Scan(&changed, &previous)
		if err != nil {
			return err
		}
		if changed != published {
			return &StateError{fmt.Sprintf("aggregate %s/%s changed while being rewound (%d of %d events); try again",
				p.Stream, p.AggregateKey, changed, published)}
		}
		if _, err := tx.Exec(ctx, `SELECT set_config('outbox.republishing', 'off', true)`); err != nil {
			return err
		}
		previousSkips := []byte("{}")
		if p.IncludeSkipped && skipped > 0 {
			// The skips are withdrawn, not forgotten: a skipped event is
			// never marked published, and this one is to be.
			var n int64
			err = tx.QueryRow(ctx, `
				WITH unskipped AS (
				    DELETE FROM outbox.skipped_event s
				    WHERE s.event_id = ANY (ARRAY(
				        SELECT e.event_id FROM outbox.event e
				        WHERE e.stream = $1 AND e.aggregate_key = $2 AND e.revision >= $3 AND e.revision <= $4))
				    RETURNING s.event_id, s.reason, s.actor, s.skipped_at
				)
				SELECT count(*), coalesce(jsonb_object_agg(event_id,
				           jsonb_build_object('reason', reason, 'actor', actor, 'skipped_at', skipped_at)), '{}')
				FROM unskipped`, p.Stream, p.AggregateKey, r.FromRevision, delivered).Scan(&n, &previousSkips)
			if err != nil {
				return err
			}
			if n != skipped {
				return &StateError{fmt.Sprintf("aggregate %s/%s changed while being rewound (%d of %d skipped events); try again",
					p.Stream, p.AggregateKey, n, skipped)}
			}
		}
		// How many deliveries each event had: at least one past the
		// highest attempt on record (the one that published it, or that
		// was in flight when it was skipped), and past the deliveries an
		// earlier republish counted.
		var earlier []byte
		err = tx.QueryRow(ctx, `
			SELECT coalesce(jsonb_object_agg(e.event_id, 1 + greatest(
			           (SELECT max(a.attempt) FROM outbox.attempt a WHERE a.event_id = e.event_id),
			           outbox.republished_attempts(e.stream, e.aggregate_key, e.event_id), 0)), '{}')
			FROM outbox.event e
			WHERE e.stream = $1 AND e.aggregate_key = $2 AND e.revision >= $3 AND e.revision <= $4
			  AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL`,
			p.Stream, p.AggregateKey, r.FromRevision, delivered).Scan(&earlier)
		if err != nil {
			return err
		}
		// Claimable at once, in the claim order an ack would give it (the
		// next event's created_at); a lease in flight ends. The mark covers
		// an earlier republish's events not yet leased again too: above
		// this one's range, they are still that republish's (numbered and
		// named by it), not first deliveries.
		if _, err := tx.Exec(ctx, `
			UPDATE outbox.delivery d
			SET delivered_revision = $3 - 1, state = 'ready',
			    claimable_at = x.created_at, pending_since = x.created_at,
			    holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL,
			    attempt = 0, failures = 0, unanswered = 0, last_error = NULL, next_attempt_at = NULL,
			    parked_at = NULL, parked_reason = NULL, gap_revision = NULL,
			    republished_through = greatest(d.republished_through, $4)
			FROM (SELECT min(e.created_at) AS created_at FROM outbox.event e
			      WHERE e.stream = $1 AND e.aggregate_key = $2 AND e.revision >= $3) x
			WHERE d.stream = $1 AND d.aggregate_key = $2`, p.Stream, p.AggregateKey, r.FromRevision, r.ToRevision); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `
			INSERT INTO outbox.republished (action_id, stream, aggregate_key, from_revision, to_revision, events,
			                                previous_published_at, previous_skips, earlier_attempts)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
			r.ActionID, p.Stream, p.AggregateKey, r.FromRevision, r.ToRevision, r.Events, previous, previousSkips, earlier); err != nil {
			return err
		}
		detail := map[string]any{"from_revision": r.FromRevision, "to_revision": r.ToRevision, "events": r.Events}
		if r.Unskipped > 0 {
			detail["unskipped"] = r.Unskipped
		}
		if err := linkAction(ctx, tx, r.ActionID, p.Stream, p.AggregateKey, detail); err != nil {
			return err
		}
		if holder != nil {
			r.Holder = *holder
			if _, err := tx.Exec(ctx, `SELECT pg_notify('outbox_released', $1::text)`, holder.String()); err != nil {
				return err
			}
		}
		// Idle sessions on every replica claim now.
		_, err = tx.Exec(ctx, `SELECT pg_notify('outbox_wakeup', '')`)
		return err
	})
	if err != nil {
		var se *StateError
		if errors.Is(err, ErrNotFound) || errors.As(err, &se) {
			return r, err
		}
		return r, fmt.Errorf("store: republish: %w", err)
	}
	return r, nil
}

// skippedAhead explains why a skipped event delivery has not reached yet
// cannot be republished: withdrawing its skip would let it through out of
// the operator's sight, so it is refused with what to do instead.
func skippedAhead(ctx context.Context, tx pgx.Tx, p RepublishParams, delivered int64) error {
	var rev *int64
	err := tx.QueryRow(ctx, `
		SELECT min(e.revision) FROM outbox.event e
		WHERE e.stream = $1 AND e.aggregate_key = $2 AND e.revision >= $3 AND e.revision > $4
		  AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NOT NULL`,
		p.Stream, p.AggregateKey, p.FromRevision, delivered).Scan(&rev)
	if err != nil || rev == nil {
		return err
	}
	return &StateError{fmt.Sprintf("revision %d of aggregate %s/%s is skipped but delivery has not reached it yet (delivered up to %d); republish it once delivery has passed it",
		*rev, p.Stream, p.AggregateKey, delivered)}
}

var stateWords = map[string]string{
	"parked": "parked", "backoff": "backing off after a failed publish", "gap": "held at a gap",
}

// RepublishCandidate is an aggregate with events published in a time range,
// and the first such revision.
type RepublishCandidate struct {
	Stream, AggregateKey string
	FromRevision         int64
}

// RepublishCandidates lists, for one stream, every aggregate with an event
// published in [after, before), with its first such revision, ordered by
// key, at most limit after afterKey. published_at is in no index (acks stay
// HOT), so this scans the stream's events created before `before` (an event
// is published after it is created): an operator's action, not a hot path.
func (s *Store) RepublishCandidates(ctx context.Context, stream, key string, after, before time.Time, afterKey string, limit int) ([]RepublishCandidate, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT e.stream, e.aggregate_key, min(e.revision)
		FROM outbox.event e
		WHERE e.stream = $1 AND e.created_at < $3 AND e.published_at >= $2 AND e.published_at < $3
		  AND e.aggregate_key > $4 AND ($6 = '' OR e.aggregate_key = $6)
		GROUP BY e.stream, e.aggregate_key
		ORDER BY e.aggregate_key
		LIMIT $5`, stream, after, before, afterKey, limit, key)
	if err != nil {
		return nil, fmt.Errorf("store: republish candidates: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (RepublishCandidate, error) {
		var c RepublishCandidate
		err := row.Scan(&c.Stream, &c.AggregateKey, &c.FromRevision)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: republish candidates: %w", err)
	}
	return list, nil
}
