package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Errors of the admin operations; the server maps each to a gRPC status.
var (
	// ErrNotFound: no such event or aggregate.
	ErrNotFound = errors.New("store: not found")
	// ErrAlreadyPublished: the event was published; there is nothing to skip.
	ErrAlreadyPublished = errors.New("store: event is already published")
	// ErrAlreadySkipped: the event was skipped before.
	ErrAlreadySkipped = errors.New("store: event is already skipped")
)

// StateError says an aggregate is in a state the operation does not apply
// to. Message is meant for the operator.
type StateError struct{ Message string }

func (e *StateError) Error() string { return e.Message }

// StreamLag is the delivery backlog of one stream (or, with an empty Stream,
// of several summed).
type StreamLag struct {
	Stream            string
	PendingEvents     int64
	PendingAggregates int64
	// OldestPending is the created_at of the oldest pending event; zero when
	// nothing is pending.
	OldestPending time.Time
	// OldestHeld is the created_at of the oldest pending event of a parked,
	// backing-off or gap-held aggregate; zero when there is none.
	OldestHeld time.Time
	// Aggregates with pending events, by delivery state.
	Ready, Leased, Backoff, Parked, Gap int64
	// DeliveredLastMinute counts events published in the last minute.
	DeliveredLastMinute int64
	// Stranded counts pending events that no rule will deliver (see
	// outbox.stranded): 0 unless a producer inserted a revision delivery had
	// already passed, or delivery has a bug. Such events are not in
	// PendingEvents. Lag leaves it 0: the audit that counts them reads every
	// aggregate, so it runs on its own schedule (Stranded, Lag.SetStranded).
	Stranded int64
	// Stalled counts aggregates whose deliveries keep ending without
	// progress (outbox.stall_reason).
	Stalled int64
	// IdleRelays are the sessions of connected relays that may take this
	// stream's work, hold no delivery, and have been connected for
	// outbox.settings.idle_relay_after while a ready aggregate of the stream
	// has waited that long for a relay.
	IdleRelays []uuid.UUID
}

// Lag is a snapshot of delivery lag.
type Lag struct {
	// Now is the database clock when the snapshot was taken; ages are
	// measured from it so that clock skew between hosts does not show.
	Now     time.Time
	Streams []StreamLag
	// ConnectedRelays counts live Subscribe streams across replicas.
	ConnectedRelays int64
	// StrandedAt is when the audit whose counts the streams' Stranded hold
	// began (SetStranded); zero when they hold none.
	StrandedAt time.Time
	// XminHorizon is what holds the database's xmin horizon furthest back
	// (outbox.xmin_horizon_holders); zero when nothing holds it.
	XminHorizon XminHorizon
}

// XminHorizon is the oldest holder of a database's xmin horizon:
// while it holds it, every row version written since is kept, and
// delivery slows as they pile up.
type XminHorizon struct {
	// Age is how many transactions ago the held horizon was; 0: none is
	// older than the read itself.
	Age int64
	// Holder names it: a session's pid, database, user, application and
	// state, a prepared transaction, a replication slot or a standby.
	Holder string
	// Since is when its transaction began (or it was prepared); zero where
	// PostgreSQL does not show it to the server's role.
	Since time.Time
}

// SetStranded fills in each stream's Stranded from the counts of an audit
// that began at (Store.Stranded). Every stream the audit can name has
// aggregates, so the report already lists it (KnownStreams) when its filter
// lets it in.
func (l *Lag) SetStranded(counts map[string]int64, at time.Time) {
	l.StrandedAt = at
	for i := range l.Streams {
		l.Streams[i].Stranded = counts[l.Streams[i].Stream]
	}
}

// Stranded counts, per stream, the pending events no rule will deliver
// (outbox.stranded; streams with none are left out). It is an audit that
// trusts nothing of delivery's states: it reads every aggregate's revision
// counter against its delivery row, so its cost follows the number of
// aggregates (about a quarter of a second of PostgreSQL per 100,000), not
// the backlog. Callers ration it (server.Config.StrandedAuditInterval).
func (s *Store) Stranded(ctx context.Context) (map[string]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT stream, events FROM outbox.stranded(NULL)`)
	if err != nil {
		return nil, fmt.Errorf("store: stranded: %w", err)
	}
	counts := map[string]int64{}
	var stream string
	var events int64
	if _, err := pgx.ForEachRow(rows, []any{&stream, &events}, func() error {
		counts[stream] = events
		return nil
	}); err != nil {
		return nil, fmt.Errorf("store: stranded: %w", err)
	}
	return counts, nil
}

// Lag reports the backlog per stream, limited to streams when not nil (an
// empty list matches no stream). Every known stream is listed (KnownStreams),
// those with nothing pending and nothing delivered lately with zeros, so
// that a stream does not vanish from a report while it is idle.
// PendingEvents and OldestPending include events committed but not yet
// discovered (outbox.undiscovered); the aggregate counts cover discovered
// work. It reads the delivery rows of aggregates with pending work (an index scan)
// and their pending events beyond each cursor (the event key index), so its
// cost follows the backlog, never the table size (the stranded audit, which
// cannot, is apart: see Stranded). sessionTTL is how recently
// a relay session must have been refreshed to count as connected.
//
// Its four statements go as one pipelined batch: one round trip, one
// wake-up of the backend. A lag read is the console's sample of every
// source every 10 s and each metrics scrape, and on a quiet source each
// round trip wakes an idle backend, which costs more than these statements
// run (50 idle sources with the console: 1.65 transactions per source per
// second with five round trips a read, 1.22 with one).
func (s *Store) Lag(ctx context.Context, streams []string, sessionTTL time.Duration) (Lag, error) {
	filter := streams
	var lag Lag
	var known []string
	streamsSQL, args := streamsArg(filter)
	idle := make(map[string][]uuid.UUID)
	b := &pgx.Batch{}
	b.Queue(fmt.Sprintf(`
		WITH by_stream AS (
		    SELECT * FROM outbox.pending_by_stream(%[1]s)
		), rate AS (
		    SELECT stream, sum(events)::bigint AS delivered FROM outbox.delivered_count
		    WHERE bucket > clock_timestamp() - interval '1 minute'
		      AND (%[1]s IS NULL OR stream = ANY (%[1]s))
		    GROUP BY stream
		), undiscovered AS (
		    SELECT stream, events, oldest_created_at FROM outbox.undiscovered(%[1]s)
		)
		SELECT coalesce(b.stream, r.stream, u.stream),
		       coalesce(b.events, 0) + coalesce(u.events, 0), coalesce(b.aggregates, 0),
		       least(b.oldest, u.oldest_created_at), b.oldest_held, coalesce(b.ready, 0), coalesce(b.leased, 0),
		       coalesce(b.backoff, 0), coalesce(b.parked, 0), coalesce(b.gap, 0),
		       coalesce(r.delivered, 0), coalesce(b.stalled, 0)
		FROM by_stream b
		FULL JOIN rate r ON r.stream = b.stream
		FULL JOIN undiscovered u ON u.stream = coalesce(b.stream, r.stream)
		ORDER BY 1`, streamsSQL), args...).Query(func(rows pgx.Rows) (err error) {
		lag.Streams, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (StreamLag, error) {
			var l StreamLag
			var oldest, held *time.Time
			err := row.Scan(&l.Stream, &l.PendingEvents, &l.PendingAggregates, &oldest, &held,
				&l.Ready, &l.Leased, &l.Backoff, &l.Parked, &l.Gap, &l.DeliveredLastMinute, &l.Stalled)
			l.OldestPending, l.OldestHeld = deref(oldest), deref(held)
			return l, err
		})
		return err
	})
	b.Queue(knownStreamsSQL).Query(func(rows pgx.Rows) (err error) {
		known, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	b.Queue(idleRelaysSQL(streamsSQL, sessionTTL), args...).Query(func(rows pgx.Rows) error {
		var stream string
		var id uuid.UUID
		_, err := pgx.ForEachRow(rows, []any{&stream, &id}, func() error {
			idle[stream] = append(idle[stream], id)
			return nil
		})
		return err
	})
	b.Queue(`SELECT age, holder, since FROM outbox.xmin_horizon_holders() LIMIT 1`).Query(func(rows pgx.Rows) error {
		var since *time.Time
		_, err := pgx.ForEachRow(rows, []any{&lag.XminHorizon.Age, &lag.XminHorizon.Holder, &since},
			func() error { lag.XminHorizon.Since = deref(since); return nil })
		return err
	})
	b.Queue(`
		SELECT clock_timestamp(), count(*) FROM outbox.relay_session
		WHERE seen_at > clock_timestamp() - ` + intervalLiteral(sessionTTL)).QueryRow(func(row pgx.Row) error {
		return row.Scan(&lag.Now, &lag.ConnectedRelays)
	})
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return Lag{}, fmt.Errorf("store: lag: %w", err)
	}
	listed := make(map[string]bool, len(lag.Streams))
	for _, l := range lag.Streams {
		listed[l.Stream] = true
	}
	for _, name := range known {
		if !listed[name] && (filter == nil || slices.Contains(filter, name)) {
			lag.Streams = append(lag.Streams, StreamLag{Stream: name})
		}
	}
	slices.SortFunc(lag.Streams, func(a, b StreamLag) int { return strings.Compare(a.Stream, b.Stream) })
	for i := range lag.Streams {
		lag.Streams[i].IdleRelays = idle[lag.Streams[i].Stream]
	}
	return lag, nil
}

// streamsArg is how a lag statement names its stream filter: $1 with the
// filter as its argument, or, for every stream, NULL and no argument. The
// statements of every lag read then have no parameter, so PostgreSQL plans
// each once per connection: with $1 it planned them afresh on every call
// (their custom plans, with the filter folded away, always looked cheaper
// than the generic one), 3 ms of each console sample of an idle source.
func streamsArg(filter []string) (string, []any) {
	if filter == nil {
		return "NULL::text[]", nil
	}
	return "$1::text[]", []any{filter}
}

// intervalLiteral writes d into a statement as an interval constant, for a
// value that is the same on every call (a server's setting), so that the
// statement needs no parameter for it (see streamsArg).
func intervalLiteral(d time.Duration) string {
	return fmt.Sprintf("interval '%d microseconds'", d.Microseconds())
}

// idleRelaysSQL finds, per stream of the filter (streamsArg), the relay
// sessions that wait idle while it has ready aggregates (a stream's
// IdleRelays). Ready aggregates are found through the claim index, one
// probe per stream (outbox.waiting_streams), so the cost follows the
// streams with work, not the backlog.
func idleRelaysSQL(streamsSQL string, sessionTTL time.Duration) string {
	return fmt.Sprintf(`
		WITH waiting AS (
		    SELECT s.stream FROM outbox.waiting_streams(%[1]s) s
		)
		SELECT w.stream, r.session_id
		FROM waiting w
		JOIN outbox.relay_session r
		  ON (r.streams = '{}' AND NOT w.stream = ANY (r.exclude_streams)) OR w.stream = ANY (r.streams)
		CROSS JOIN outbox.settings st
		WHERE r.seen_at > clock_timestamp() - %[2]s AND r.in_flight = 0
		  AND r.connected_at < clock_timestamp() - st.idle_relay_after
		ORDER BY 1, 2`, streamsSQL, intervalLiteral(sessionTTL))
}

func deref[T any](p *T) (v T) {
	if p != nil {
		v = *p
	}
	return v
}

// RelaySession is one open Subscribe stream, as recorded for ListRelays.
type RelaySession struct {
	SessionID uuid.UUID
	RelayID   string
	Peer      string
	ReplicaID string
	Streams   []string
	// ExcludeStreams, with Streams empty, are the streams it does not take.
	ExcludeStreams []string
	MaxInFlight    int
	InFlight       int
	Acked          int64
	ConnectedAt    time.Time
}

// SaveRelaySessions records sessions as alive now, inserting new ones and
// refreshing the counters of known ones.
func (s *Store) SaveRelaySessions(ctx context.Context, sessions []RelaySession) error {
	if len(sessions) == 0 {
		return nil
	}
	var (
		ids                  = make([]uuid.UUID, len(sessions))
		relayIDs, peers, rep = make([]string, len(sessions)), make([]string, len(sessions)), make([]string, len(sessions))
		streams, excluded    = make([]string, len(sessions)), make([]string, len(sessions))
		maxes, inflight      = make([]int32, len(sessions)), make([]int32, len(sessions))
		acked                = make([]int64, len(sessions))
		connected            = make([]time.Time, len(sessions))
	)
	for i, r := range sessions {
		ids[i], relayIDs[i], peers[i], rep[i] = r.SessionID, r.RelayID, r.Peer, r.ReplicaID
		// Stream names cannot contain a comma (outbox.event checks them), so
		// the list travels as one string per session.
		streams[i], excluded[i] = strings.Join(r.Streams, ","), strings.Join(r.ExcludeStreams, ",")
		maxes[i], inflight[i], acked[i], connected[i] = int32(r.MaxInFlight), int32(r.InFlight), r.Acked, r.ConnectedAt
	}
	_, err := s.pool.Exec(ctx, `
		INSERT INTO outbox.relay_session AS r
		    (session_id, relay_id, peer, replica_id, streams, exclude_streams, max_in_flight, in_flight, acked, connected_at, seen_at)
		SELECT u.id, u.relay_id, u.peer, u.replica_id,
		       coalesce(string_to_array(nullif(u.streams, ''), ','), '{}'),
		       coalesce(string_to_array(nullif(u.excluded, ''), ','), '{}'),
		       u.max_in_flight, u.in_flight, u.acked, u.connected_at, clock_timestamp()
		FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[], $7::int[],
		            $8::bigint[], $9::timestamptz[], $10::text[])
		     AS u(id, relay_id, peer, replica_id, streams, max_in_flight, in_flight, acked, connected_at, excluded)
		ORDER BY u.id
		ON CONFLICT (session_id) DO UPDATE
		SET in_flight = excluded.in_flight, acked = excluded.acked, seen_at = excluded.seen_at`,
		ids, relayIDs, peers, rep, streams, maxes, inflight, acked, connected, excluded)
	if err != nil {
		return fmt.Errorf("store: save relay sessions: %w", err)
	}
	return nil
}

// DeleteRelaySession forgets an ended session.
func (s *Store) DeleteRelaySession(ctx context.Context, id uuid.UUID) error {
	if _, err := s.pool.Exec(ctx, `DELETE FROM outbox.relay_session WHERE session_id = $1`, id); err != nil {
		return fmt.Errorf("store: delete relay session: %w", err)
	}
	return nil
}

// DeleteStaleStats removes, in one statement, what crashed replicas left behind: relay sessions
// of other replicas not refreshed within sessionTTL, and delivery-rate
// buckets older than the minute the rate covers. The calling replica's own
// sessions are never stale to it (it deletes each when its stream ends), so
// a refresh delayed on a busy machine cannot make them vanish.
func (s *Store) DeleteStaleStats(ctx context.Context, sessionTTL time.Duration, replicaID string) error {
	if _, err := s.pool.Exec(ctx, `
		WITH stale_sessions AS (
		    DELETE FROM outbox.relay_session WHERE seen_at < clock_timestamp() - $1::interval AND replica_id <> $2
		)
		DELETE FROM outbox.delivered_count WHERE bucket < clock_timestamp() - interval '2 minutes'`,
		sessionTTL, replicaID); err != nil {
		return fmt.Errorf("store: delete stale relay sessions and delivery counts: %w", err)
	}
	return nil
}

// RelaySessions lists sessions refreshed within sessionTTL, oldest first.
func (s *Store) RelaySessions(ctx context.Context, sessionTTL time.Duration) ([]RelaySession, error) {
	rows, err := s.pool.Query(ctx, `
		SELECT session_id, relay_id, peer, replica_id, streams, exclude_streams, max_in_flight, in_flight, acked, connected_at
		FROM outbox.relay_session WHERE seen_at > clock_timestamp() - $1::interval
		ORDER BY connected_at, session_id`, sessionTTL)
	if err != nil {
		return nil, fmt.Errorf("store: relay sessions: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (RelaySession, error) {
		var r RelaySession
		err := row.Scan(&r.SessionID, &r.RelayID, &r.Peer, &r.ReplicaID, &r.Streams, &r.ExcludeStreams,
			&r.MaxInFlight, &r.InFlight, &r.Acked, &r.ConnectedAt)
		return r, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: relay sessions: %w", err)
	}
	return list, nil
}

// Aggregate is one aggregate's delivery state.
type Aggregate struct {
	Stream, AggregateKey string
	State                string
	LastRevision         int64
	DeliveredRevision    int64
	PendingEvents        int64
	NextPendingRevision  int64
	OldestPending        time.Time
	Holder               uuid.UUID
	HolderRelayID        string
	Epoch                int64
	LeaseExpiresAt       time.Time
	LeasedEventID        uuid.UUID
	Attempt, Failures    int
	LastError            string
	NextAttemptAt        time.Time
	ParkedAt             time.Time
	ParkedReason         string
	GapRevision          int64
	// StalledReason says why the aggregate is stalled (outbox.stall_reason);
	// empty when it is not.
	StalledReason string
	// NextPendingEventID is the event at NextPendingRevision (what a skip
	// of the aggregate's next event names); nil when nothing is pending.
	NextPendingEventID uuid.UUID
}

// querier is what a pool and a transaction have in common.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// GetAggregate returns an aggregate's delivery state, or ErrNotFound.
func (s *Store) GetAggregate(ctx context.Context, stream, key string) (Aggregate, error) {
	return getAggregate(ctx, s.pool, stream, key)
}

func getAggregate(ctx context.Context, q querier, stream, key string) (Aggregate, error) {
	a := Aggregate{Stream: stream, AggregateKey: key}
	var c aggregateCols
	err := q.QueryRow(ctx, `
		SELECT coalesce(d.state, 'ready'), coalesce(g.last_revision, 0), c.delivered_revision,
		       p.events, p.next_revision, p.oldest_created_at,
		       d.holder, d.holder_relay_id, coalesce(d.epoch, 0), d.lease_expires_at, d.leased_event_id,
		       coalesce(d.attempt, 0), coalesce(d.failures, 0), d.last_error, d.next_attempt_at,
		       d.parked_at, d.parked_reason, d.gap_revision,
		       outbox.stall_reason(d.state, d.unanswered, d.failures, d.last_error),
		       `+nextPendingEventID("k")+`
		FROM (SELECT $1::text AS stream, $2::text AS aggregate_key) k
		LEFT JOIN outbox.delivery d ON d.stream = k.stream AND d.aggregate_key = k.aggregate_key
		LEFT JOIN outbox.aggregate g ON g.stream = k.stream AND g.aggregate_key = k.aggregate_key
		-- An aggregate whose events discovery has not reached yet has no
		-- delivery row: it will start just below its first revision.
		CROSS JOIN LATERAL (
		    SELECT coalesce(d.delivered_revision, (
		        SELECT min(e.revision) - 1 FROM outbox.event e
		        WHERE e.stream = k.stream AND e.aggregate_key = k.aggregate_key), 0) AS delivered_revision
		) c
		CROSS JOIN LATERAL outbox.pending_of(k.stream, k.aggregate_key, c.delivered_revision) p
		WHERE d.stream IS NOT NULL OR g.stream IS NOT NULL`, stream, key).Scan(
		c.targets(&a)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return a, ErrNotFound
	}
	if err != nil {
		return a, fmt.Errorf("store: get aggregate: %w", err)
	}
	c.fill(&a)
	return a, nil
}

// aggregateCols receives the nullable columns of an aggregate row, in the
// order targets lists them (getAggregate's and ListAggregates' select lists).
type aggregateCols struct {
	next                                        *int64
	oldest, expires, nextAt, parkedAt           *time.Time
	holder, leased                              *uuid.UUID
	relayID, lastErr, parkedReason, stallReason *string
	gap                                         *int64
	nextID                                      *uuid.UUID
}

// nextPendingEventID selects the id of the event at p.next_revision of the
// aggregate of the row alias (stream and aggregate_key), the last column of
// every aggregate query (see aggregateCols).
func nextPendingEventID(alias string) string {
	return `(SELECT e.event_id FROM outbox.event e
		        WHERE e.stream = ` + alias + `.stream AND e.aggregate_key = ` + alias + `.aggregate_key AND e.revision = p.next_revision)`
}

func (c *aggregateCols) targets(a *Aggregate) []any {
	return []any{&a.State, &a.LastRevision, &a.DeliveredRevision,
		&a.PendingEvents, &c.next, &c.oldest,
		&c.holder, &c.relayID, &a.Epoch, &c.expires, &c.leased,
		&a.Attempt, &a.Failures, &c.lastErr, &c.nextAt, &c.parkedAt, &c.parkedReason, &c.gap, &c.stallReason, &c.nextID}
}

func (c *aggregateCols) fill(a *Aggregate) {
	next, holder, leased, gap := c.next, c.holder, c.leased, c.gap
	if next != nil {
		a.NextPendingRevision = *next
	}
	if holder != nil {
		a.Holder = *holder
	}
	if leased != nil {
		a.LeasedEventID = *leased
	}
	if gap != nil {
		a.GapRevision = *gap
	}
	if c.nextID != nil {
		a.NextPendingEventID = *c.nextID
	}
	a.OldestPending, a.LeaseExpiresAt, a.NextAttemptAt, a.ParkedAt = deref(c.oldest), deref(c.expires), deref(c.nextAt), deref(c.parkedAt)
	a.HolderRelayID, a.LastError, a.ParkedReason = deref(c.relayID), deref(c.lastErr), deref(c.parkedReason)
	a.StalledReason = deref(c.stallReason)
}

// RetryParams names the aggregate to retry and, for a gap, the operator's
// decision.
type RetryParams struct {
	Stream, AggregateKey string
	// AcceptGap gives up on the missing revisions of a gap-held aggregate;
	// Reason and Actor are then recorded in outbox.accepted_gap.
	AcceptGap     bool
	Reason, Actor string
	// ActionID is the bulk action (outbox.operator_action) the retry is part
	// of; 0 records the retry as an action of its own.
	ActionID int64
}

// RetryAggregate makes a parked or backing-off aggregate claimable now with
// a fresh set of attempts (its last error goes with its failures: the
// attempt history keeps it), or resumes a gap-held one past its missing
// revisions when p.AcceptGap. It returns the aggregate's new state, or
// ErrNotFound, or a *StateError when the state does not allow it.
func (s *Store) RetryAggregate(ctx context.Context, p RetryParams) (Aggregate, error) {
	var a Aggregate
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if p.AcceptGap {
			// Producers lock this row until they commit. Holding it, no
			// producer is between inserting a missing revision and
			// committing it, so "missing" is final for this transaction's
			// next statements. Taken before the delivery row, in the
			// producers' order, so the two cannot deadlock.
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'`); err != nil {
				return err
			}
			var one int
			err := tx.QueryRow(ctx, `SELECT 1 FROM outbox.aggregate WHERE stream = $1 AND aggregate_key = $2 FOR UPDATE`,
				p.Stream, p.AggregateKey).Scan(&one)
			if errors.Is(err, pgx.ErrNoRows) {
				return ErrNotFound
			}
			if err != nil {
				return err
			}
		}
		var state string
		var holderRelay *string
		var expires *time.Time
		var delivered int64
		err := tx.QueryRow(ctx, `
			SELECT state, holder_relay_id, lease_expires_at, delivered_revision FROM outbox.delivery
			WHERE stream = $1 AND aggregate_key = $2 FOR UPDATE`, p.Stream, p.AggregateKey).
			Scan(&state, &holderRelay, &expires, &delivered)
		if errors.Is(err, pgx.ErrNoRows) {
			// Events committed a moment ago have a counter row before
			// discovery gives them a delivery row.
			var known bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM outbox.aggregate WHERE stream = $1 AND aggregate_key = $2)`,
				p.Stream, p.AggregateKey).Scan(&known); err != nil {
				return err
			}
			if known {
				return &StateError{"aggregate's events were committed moments ago and are about to be offered to relays; there is nothing to retry"}
			}
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		var accepted [2]int64 // the revisions an accepted gap gave up, if any
		switch state {
		case "idle":
			return &StateError{"aggregate has nothing pending; there is nothing to retry"}
		case "leased":
			return &StateError{fmt.Sprintf("aggregate is leased by relay %q until %s; wait for its ack, nack or lease expiry",
				deref(holderRelay), deref(expires).UTC().Format(time.RFC3339))}
		case "ready":
			// Already offered to relays; nothing to change, unless a gap is
			// accepted: a discovery round that finds a new event of a
			// gap-held aggregate wakes it (the event might be the missing
			// revision), and if the revision is still missing its next
			// claim holds it at the gap again. The operator who saw the gap
			// gives it up all the same.
			if p.AcceptGap {
				if accepted, err = acceptGap(ctx, tx, p, delivered, false); err != nil {
					return err
				}
			}
		case "backoff", "parked":
			if _, err := tx.Exec(ctx, `
				UPDATE outbox.delivery
				SET state = 'ready', claimable_at = clock_timestamp(), next_attempt_at = NULL,
				    failures = 0, unanswered = 0, last_error = NULL, parked_at = NULL, parked_reason = NULL
				WHERE stream = $1 AND aggregate_key = $2`, p.Stream, p.AggregateKey); err != nil {
				return err
			}
		case "gap":
			if !p.AcceptGap {
				return &StateError{fmt.Sprintf(
					"aggregate is held at a gap: revision %d is missing; retry with accept_gap and a reason to deliver from the next revision that exists",
					delivered+1)}
			}
			if accepted, err = acceptGap(ctx, tx, p, delivered, true); err != nil {
				return err
			}
		default:
			return fmt.Errorf("unknown delivery state %q", state)
		}
		if state != "ready" || accepted != [2]int64{} {
			// On record in the same transaction as the change itself.
			if err := recordRetry(ctx, tx, p, state, accepted); err != nil {
				return err
			}
		}
		a, err = getAggregate(ctx, tx, p.Stream, p.AggregateKey)
		return err
	})
	if err != nil {
		var se *StateError
		if errors.Is(err, ErrNotFound) || errors.As(err, &se) {
			return a, err
		}
		return a, fmt.Errorf("store: retry aggregate: %w", err)
	}
	return a, nil
}

// acceptGap moves the cursor of an aggregate to just before its next
// existing pending revision and records the revisions given up, which it
// returns (zeros when there were none). A gap-held aggregate (held) is made
// ready whether or not its gap was filled meanwhile; a ready one is left
// as it is when nothing is missing. The caller holds the producers' order
// lock and the delivery row.
func acceptGap(ctx context.Context, tx pgx.Tx, p RetryParams, delivered int64, held bool) ([2]int64, error) {
	var accepted [2]int64
	var next *int64
	if err := tx.QueryRow(ctx, `
		SELECT min(revision) FROM outbox.event
		WHERE stream = $1 AND aggregate_key = $2 AND revision > $3`,
		p.Stream, p.AggregateKey, delivered).Scan(&next); err != nil {
		return accepted, err
	}
	if next != nil && *next > delivered+1 {
		if _, err := tx.Exec(ctx, `
			INSERT INTO outbox.accepted_gap (stream, aggregate_key, from_revision, to_revision, reason, actor)
			VALUES ($1, $2, $3, $4, $5, $6)`,
			p.Stream, p.AggregateKey, delivered+1, *next-1, p.Reason, p.Actor); err != nil {
			return accepted, err
		}
		accepted = [2]int64{delivered + 1, *next - 1}
		delivered = *next - 1
	} else if !held {
		return accepted, nil
	}
	// With nothing left after the gap (or the gap filled meanwhile), the
	// claim settles the aggregate as usual.
	_, err := tx.Exec(ctx, `
		UPDATE outbox.delivery
		SET state = 'ready', delivered_revision = $3, claimable_at = clock_timestamp(), gap_revision = NULL
		WHERE stream = $1 AND aggregate_key = $2`, p.Stream, p.AggregateKey, delivered)
	return accepted, err
}

// Skip is an operator's recorded abandonment of an event.
type Skip struct {
	Reason, Actor string
	SkippedAt     time.Time
}

// SkipEvent abandons a pending event: it is recorded in outbox.skipped_event
// and will never be delivered nor marked published. When it is its
// aggregate's next event, the aggregate is offered again at once (ending any
// lease on it, so its holder's ack gets LEASE_LOST), and the last error,
// which was that event's, is cleared. The skip is recorded as an operator
// action of its own (outbox.operator_action); SkipEventOf records it as part
// of a bulk action. Errors: ErrNotFound, ErrAlreadyPublished,
// ErrAlreadySkipped.
func (s *Store) SkipEvent(ctx context.Context, id uuid.UUID, reason, actor string) (Skip, error) {
	return s.SkipEventOf(ctx, 0, id, reason, actor)
}

// SkipEventOf is SkipEvent as part of the bulk action actionID (0: an action
// of its own).
func (s *Store) SkipEventOf(ctx context.Context, actionID int64, id uuid.UUID, reason, actor string) (Skip, error) {
	sk := Skip{Reason: reason, Actor: actor}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// Event row first, then the delivery row: the order outbox.ack
		// locks them in, so a concurrent ack and skip cannot deadlock.
		var stream, key string
		var revision int64
		var published *time.Time
		var skipped bool
		err := tx.QueryRow(ctx, `
			SELECT e.stream, e.aggregate_key, e.revision, e.published_at,
			       (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NOT NULL
			FROM outbox.event e WHERE e.event_id = $1 FOR UPDATE`, id).
			Scan(&stream, &key, &revision, &published, &skipped)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return ErrNotFound
		case err != nil:
			return err
		case published != nil:
			return ErrAlreadyPublished
		case skipped:
			return ErrAlreadySkipped
		}
		var delivered int64
		var holder *uuid.UUID
		var leasedThrough *int64 // the lease's window, while leased
		err = tx.QueryRow(ctx, `
			SELECT delivered_revision, holder, CASE WHEN state = 'leased' THEN leased_through END
			FROM outbox.delivery
			WHERE stream = $1 AND aggregate_key = $2 FOR UPDATE`, stream, key).Scan(&delivered, &holder, &leasedThrough)
		noDeliveryYet := errors.Is(err, pgx.ErrNoRows) // committed, not discovered yet
		if err != nil && !noDeliveryYet {
			return err
		}
		if err := tx.QueryRow(ctx, `
			INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ($1, $2, $3)
			RETURNING skipped_at`, id, reason, actor).Scan(&sk.SkippedAt); err != nil {
			return err
		}
		if err := recordSkip(ctx, tx, actionID, stream, key, id, revision, reason, actor); err != nil {
			return err
		}
		inWindow := leasedThrough != nil && revision > delivered && revision <= *leasedThrough
		if noDeliveryYet || (revision != delivered+1 && !inWindow) {
			// A later revision, or an aggregate discovery has not reached
			// yet: the claim steps over the skipped event when it comes.
			return nil
		}
		// The head event, or one a lease's window covers: whatever was
		// happening to it (a lease, a backoff, parking) ends, and the next
		// claim steps over it. (The acks of a window's revisions before it
		// still land: an ack with an expired-but-genuine token publishes.)
		if _, err := tx.Exec(ctx, `
			UPDATE outbox.delivery
			SET state = 'ready', claimable_at = clock_timestamp(),
			    holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL,
			    attempt = 0, failures = 0, unanswered = 0, last_error = NULL, next_attempt_at = NULL, parked_at = NULL, parked_reason = NULL
			WHERE stream = $1 AND aggregate_key = $2 AND state IN ('ready', 'leased', 'backoff', 'parked')`,
			stream, key); err != nil {
			return err
		}
		if holder != nil {
			// The holder's session frees the credit now (after commit), not
			// at its next reconciliation.
			if _, err := tx.Exec(ctx, `SELECT pg_notify('outbox_released', $1::text)`, holder.String()); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, ErrNotFound) || errors.Is(err, ErrAlreadyPublished) || errors.Is(err, ErrAlreadySkipped) {
			return sk, err
		}
		return sk, fmt.Errorf("store: skip event: %w", err)
	}
	return sk, nil
}
