// Package store holds every SQL statement the outboxd server runs. It calls
// the delivery functions of the outbox schema (migrations/00001_outbox.sql)
// and maps PostgreSQL errors to the domain errors below; callers never see
// SQL.
package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	pgxuuid "github.com/vgarvardt/pgx-google-uuid/v5"

	"github.com/outboxd/outboxd/migrations"
)

// ErrLeaseLost means the lease a Nack or ExtendLease named is not the
// aggregate's current one: acked, expired and claimed again, or released.
var ErrLeaseLost = errors.New("store: lease is not current")

// Store runs outboxd's queries on a pool.
type Store struct {
	pool *pgxpool.Pool
}

// New returns a Store on pool. The pool's connections should be configured
// with ConfigurePool.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// MaxConnLifetime is how long a server connection lives at least (at most
// a fifth more), and so about the longest a plan it cached lasts; see
// ConfigurePool.
const MaxConnLifetime = 10 * time.Minute

// pgxpoolDefaultMaxConnLifetime is what pgxpool.ParseConfig sets when the URL
// says nothing.
const pgxpoolDefaultMaxConnLifetime = time.Hour

// PingAfterIdle is how long a pool connection may sit idle before it is
// pinged when acquired (pgxpool's default is a second; see ConfigurePool).
const PingAfterIdle = 30 * time.Second

// ConfigurePool prepares a pool configuration for the server's connections.
// The delivery functions read committed state in a statement after taking
// their locks, which needs a fresh snapshot per statement: READ COMMITTED,
// whatever the database's default_transaction_isolation says (the functions
// refuse to run otherwise, with SQLSTATE 25000). JIT compilation, which
// PostgreSQL starts on cost estimates alone, takes longer than any of the
// server's short statements runs.
func ConfigurePool(cfg *pgxpool.Config) {
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "read committed"
	cfg.ConnConfig.RuntimeParams["jit"] = "off"
	// Index plans, whatever the statistics, as in the delivery functions
	// (migrations/00001_outbox.sql): pgx keeps each statement prepared for
	// the connection's life, and PostgreSQL settles on a generic plan after
	// a statement's fifth run. Made while the tables were small (or
	// statistics an early ANALYZE took say so), a lookup by key or id would
	// then scan the whole table on every run, an operator's skip, retry or
	// listing, and a bulk action runs thousands. Every statement the server
	// sends reaches rows through an index; the stranded audit, which reads
	// every aggregate by design, reads them through the primary keys.
	cfg.ConnConfig.RuntimeParams["enable_seqscan"] = "off"
	// A cached plan lasts as long as its connection, unless an ANALYZE
	// plans it again; where autovacuum is off or behind, one made while a
	// table was small could last for good. So connections are also
	// replaced every 10 minutes or so (pgxpool's default is an hour), in
	// case a plan slips through that the statements' forms and settings
	// were not written against: their successors plan for the tables as
	// they are then (the planner scales the row counts the statistics give
	// by the table's size now). A lifetime set in the URL
	// (pool_max_conn_lifetime) is kept, unless it is pgxpool's default of
	// an hour, which cannot be told from none.
	if cfg.MaxConnLifetime == pgxpoolDefaultMaxConnLifetime {
		cfg.MaxConnLifetime = MaxConnLifetime
		cfg.MaxConnLifetimeJitter = MaxConnLifetime / 5
	}
	// uuid.UUID is a driver.Valuer that returns a string, so without this
	// pgx encodes every uuid parameter by failing a binary encode (an error
	// built with fmt), scanning the string back and encoding again: 2.8 us
	// per uuid, 39 us for an array of 16, against 0.1 and 1.6 us through
	// pgtype.UUID. Every ack batch, claim and dispatch passes them. (Only
	// parameters gain: pgx prefers uuid.UUID's sql.Scanner when scanning,
	// which costs a fraction of a microsecond.)
	// pgxpool pings a connection idle for over a second before handing it
	// out: one more round trip for nearly every statement of a quiet
	// source, whose checks come every half second to few seconds (a fifth
	// of an idle replica's CPU in a profile of 50 idle sources). A
	// connection that broke meanwhile (the database restarted) fails its
	// statement instead and is dropped, and every caller already handles a
	// failed statement (the discovery loop retries, an ack answers
	// UNAVAILABLE and the relay retries); one idle for longer than
	// PingAfterIdle is still pinged.
	if cfg.ShouldPing == nil {
		cfg.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool { return p.IdleDuration > PingAfterIdle }
	}
	afterConnect := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		pgxuuid.Register(conn.TypeMap())
		if afterConnect != nil {
			return afterConnect(ctx, conn)
		}
		return nil
	}
}

// Discovery is what one discovery round found and did.
type Discovery struct {
	// Events is how many newly committed events the round found, and
	// Aggregates how many delivery rows it created or woke as ready (for a
	// claim to take).
	Events, Aggregates int64
	// Found are the aggregates the round found pending events of, at most
	// the round's maxFound, the oldest first (the round makes the others
	// claimable all the same), dispatched or not.
	Found []FoundAggregate
	// Dispatched are the leases the round gave straight to sessions (see
	// Store.Discover).
	Dispatched []DispatchedLease
	// LastHolder is the session the round gave its last idle aggregate to
	// (uuid.Nil: none); the next round's turns begin after it.
	LastHolder uuid.UUID
}

// FoundAggregate is an aggregate a discovery round found pending events of.
type FoundAggregate struct {
	Stream, AggregateKey string
}

// Offer is the credit a session lends a discovery round: the round may
// lease it up to Credit idle aggregates of the streams its StreamFilter
// takes, for relay RelayID, each for TTL.
type Offer struct {
	Holder  uuid.UUID
	RelayID string
	TTL     time.Duration
	Credit  int
	StreamFilter
}

// DispatchedLease is a lease a discovery round gave to session Holder.
type DispatchedLease struct {
	Holder uuid.UUID
	Lease  Lease
}

// Discover runs one discovery round (outbox.discover_round), one statement
// and one round trip: it finds the events committed since the previous
// round, leases idle aggregates found to the sessions offered (each in
// turn, from the first, that takes the aggregate's stream and has credit
// left), and makes the rest claimable. A round takes at most about
// maxEvents events, whole transactions in xid order, and leaves the rest of
// a larger backlog to the next rounds (see outbox.discover_scan); 0: no
// bound. A round that another replica is running at the same moment finds
// nothing.
//
// The offer goes with the round, rather than a choice made between its scan
// and its apply, so that a round is one round trip rather than two: on a
// source with a trickle of events each one lands on a backend that sat idle
// since the last, which costs the host far more than the statements' work.
//
// applying, when not nil, is called with the process id of the round's
// database backend before the round is sent: the NOTIFY outbox_wakeup of a
// round that made rows ready comes from that backend.
//
// When Discover returns an error wrapping ErrAnswerLost the round may still
// have committed: leases it dispatched are then held by sessions that never
// hear of them, and the caller must have those sessions sweep. It returns
// ErrDiscoveryStopped when the database's discovery state is not this
// cluster's (see DiscoveryStopped).
func (s *Store) Discover(ctx context.Context, replicaID string, maxFound, maxEvents int, offers []Offer, applying func(pid uint32)) (Discovery, error) {
	var d Discovery
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return d, fmt.Errorf("store: discover: %w", err)
	}
	defer conn.Release()
	holders := make([]uuid.UUID, len(offers))
	relays := make([]string, len(offers))
	ttls := make([]time.Duration, len(offers))
	credits := make([]int32, len(offers))
	type filter struct {
		Streams []string `json:"streams,omitempty"`
		Exclude []string `json:"exclude,omitempty"`
	}
	filters := make([]filter, len(offers))
	for i, o := range offers {
		holders[i], relays[i], ttls[i] = o.Holder, o.RelayID, o.TTL
		credits[i] = int32(min(max(o.Credit, 0), math.MaxInt32))
		filters[i] = filter{Streams: o.Streams, Exclude: o.ExcludeStreams}
	}
	if applying != nil {
		applying(conn.Conn().PgConn().PID())
	}
	rows, err := conn.Query(ctx, `SELECT r.events, r.woken, r.last_holder, r.stream, r.aggregate_key, r.holder, `+leaseColumns("r.lease")+`
		FROM outbox.discover_round($1, $2, $3, $4, $5, $6, $7, $8) r`,
		sqlLimit(maxFound), sqlLimit(maxEvents), holders, relays, ttls, credits, filters, replicaID)
	if err != nil {
		return d, roundError(err)
	}
	defer rows.Close()
	for rows.Next() {
		var events, woken *int64
		var last, holder *uuid.UUID
		var stream, key *string
		var l nullableLease
		if err := rows.Scan(append([]any{&events, &woken, &last, &stream, &key, &holder}, l.dest()...)...); err != nil {
			return d, roundError(err)
		}
		switch {
		case events != nil:
			d.Events = *events
			if woken != nil {
				d.Aggregates = *woken
			}
			if last != nil {
				d.LastHolder = *last
			}
		case stream != nil:
			d.Found = append(d.Found, FoundAggregate{Stream: *stream, AggregateKey: *key})
		default:
			if lease := l.lease(); lease != nil && holder != nil {
				d.Dispatched = append(d.Dispatched, DispatchedLease{Holder: *holder, Lease: *lease})
			}
		}
	}
	// The statement's transaction commits after its rows are sent: a
	// failed commit is reported here, after rows that then never were.
	if err := rows.Err(); err != nil {
		return d, roundError(err)
	}
	return d, nil
}

// ErrAnswerLost means a discovery round failed after it was sent, in a way
// that leaves open whether it committed (the connection broke, or its
// answer could not be read): leases it dispatched may be held by sessions
// that never hear of them. A round PostgreSQL refused or rolled back (an
// error it reported), and one never sent, wrap no ErrAnswerLost.
var ErrAnswerLost = errors.New("store: the discovery round's answer was lost; it may have committed")

// roundError is err, from a discovery round's statement, as Discover
// returns it: ErrDiscoveryStopped for a stopped discovery, and wrapping
// ErrAnswerLost unless the round surely did not commit.
func roundError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) || pgconn.SafeToRetry(err) {
		return discoverError(err)
	}
	return fmt.Errorf("%w: %w", ErrAnswerLost, discoverError(err))
}

// sqlLimit is n as a limit argument of the delivery functions: NULL (no
// limit) for 0, at most the largest integer.
func sqlLimit(n int) *int32 {
	if n <= 0 {
		return nil
	}
	v := int32(min(n, math.MaxInt32))
	return &v
}

// leaseColumns selects the fields of an outbox.lease value (as nullableLease
// scans them).
func leaseColumns(v string) string {
	cols := []string{"event_id", "stream", "aggregate_key", "revision", "event_type", "payload", "headers",
		"created_at", "epoch", "attempt", "lease_expires_at", "republish_action"}
	for i, c := range cols {
		cols[i] = "(" + v + ")." + c
	}
	return strings.Join(cols, ", ")
}

// nullableLease scans the columns leaseColumns selects, any of which may be
// NULL (no lease).
type nullableLease struct {
	id                        *uuid.UUID
	stream, key, typ, payload *string
	rev, epoch, republish     *int64
	headers                   map[string]string
	created, expires          *time.Time
	attempt                   *int
}

func (h *nullableLease) dest() []any {
	return []any{&h.id, &h.stream, &h.key, &h.rev, &h.typ, &h.payload, &h.headers, &h.created,
		&h.epoch, &h.attempt, &h.expires, &h.republish}
}

// lease returns the scanned lease, or nil when there was none.
func (h *nullableLease) lease() *Lease {
	if h.id == nil {
		return nil
	}
	return &Lease{
		Event: Event{ID: *h.id, Stream: *h.stream, AggregateKey: *h.key, Revision: *h.rev,
			Type: *h.typ, Payload: []byte(*h.payload), Headers: h.headers, CreatedAt: *h.created},
		Epoch: *h.epoch, Attempt: *h.attempt, ExpiresAt: *h.expires, RepublishAction: deref(h.republish),
	}
}

// Event is an event row as delivered.
type Event struct {
	ID           uuid.UUID
	Stream       string
	AggregateKey string
	Revision     int64
	Type         string
	Payload      []byte
	Headers      map[string]string
	CreatedAt    time.Time
}

// Lease is one claimed aggregate's next event and the lease covering it.
type Lease struct {
	Event     Event
	Epoch     int64
	Attempt   int
	ExpiresAt time.Time
	// RepublishAction is the operator action whose republish this lease
	// delivers (outbox.republish_action); 0 for every other lease.
	RepublishAction int64
}

// ClaimParams says who claims what.
type ClaimParams struct {
	Holder    uuid.UUID
	RelayID   string
	ReplicaID string
	// Streams limits the claim; nil means every stream.
	Streams []string
	// ExcludeStreams are never claimed; nil excludes nothing.
	ExcludeStreams []string
	// Limit is the most aggregates leased.
	Limit int
	// Window is the most events of one aggregate one lease covers (0 or 1:
	// just the next one), and Credit the most events leased in all (0: one
	// per aggregate). Credit must be at least Limit.
	Window, Credit int
	TTL            time.Duration
	// MaxAttempts parks an aggregate instead of leasing its event again once
	// that event has been delivered this many times without an ack or a
	// nack; 0 means no limit.
	MaxAttempts int
	// MaxDue is the longest lease or backoff any replica sets: a lease
	// expiry or next attempt further ahead of the database clock than this
	// is taken as claimable now (only a clock that stepped back puts it
	// there; see outbox.claim_ranges). 0: no bound, such a row waits for
	// the clock.
	MaxDue time.Duration
}

// PendingMigrations says how many of the schema migrations this binary
// embeds are not applied. It only reads, in one statement (readiness runs
// it every few seconds for every source): a database without the version
// table has every migration pending.
func (s *Store) PendingMigrations(ctx context.Context) (int, error) {
	rows, _ := s.pool.Query(ctx, migrations.AppliedVersionsSQL)
	applied := map[int64]bool{}
	var version int64
	var ok bool
	_, err := pgx.ForEachRow(rows, []any{&version, &ok}, func() error {
		applied[version] = ok
		return nil
	})
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table: never migrated
		clear(applied)
	case errors.As(err, &pgErr):
		return 0, fmt.Errorf("reading schema version: %w", err)
	case err != nil:
		// Not an answer of the server: it was not reached.
		return 0, fmt.Errorf("database unreachable: %w", err)
	}
	return migrations.PendingOf(applied)
}

// LeaseKey returns the key lease tokens are signed with.
func (s *Store) LeaseKey(ctx context.Context) ([]byte, error) {
	var key []byte
	if err := s.pool.QueryRow(ctx, `SELECT key FROM outbox.lease_key`).Scan(&key); err != nil {
		return nil, fmt.Errorf("store: read lease key: %w", err)
	}
	return key, nil
}

// Claim leases up to p.Limit aggregates, oldest claimable first.
func (s *Store) Claim(ctx context.Context, p ClaimParams) ([]Lease, error) {
	var streams []string
	if len(p.Streams) > 0 {
		streams = p.Streams
	}
	var exclude []string
	if len(p.ExcludeStreams) > 0 {
		exclude = p.ExcludeStreams
	}
	var maxAttempts *int
	if p.MaxAttempts > 0 {
		maxAttempts = &p.MaxAttempts
	}
	rows, err := s.pool.Query(ctx,
		`SELECT event_id, stream, aggregate_key, revision, event_type, payload, headers, created_at,
		        epoch, attempt, lease_expires_at, republish_action
		 FROM outbox.claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)`,
		p.Holder, p.RelayID, p.ReplicaID, streams, p.Limit, p.TTL, maxAttempts, exclude,
		max(p.Window, 1), max(p.Credit, p.Limit), maxDue(p.MaxDue))
	if err != nil {
		return nil, fmt.Errorf("store: claim: %w", err)
	}
	leases, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Lease, error) {
		var l Lease
		var payload string
		err := row.Scan(&l.Event.ID, &l.Event.Stream, &l.Event.AggregateKey, &l.Event.Revision,
			&l.Event.Type, &payload, &l.Event.Headers, &l.Event.CreatedAt,
			&l.Epoch, &l.Attempt, &l.ExpiresAt, &l.RepublishAction)
		l.Event.Payload = []byte(payload)
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: claim: %w", err)
	}
	return leases, nil
}

// AckStatus is the outcome of one ack.
type AckStatus int

// Ack outcomes; see outbox.v1.AckStatus for their meaning.
const (
	AckPublished AckStatus = iota + 1
	AckAlreadyPublished
	AckLeaseLost
	// AckOutOfOrder: an earlier revision of the event's aggregate is still
	// pending, so this ack was not applied (acks apply in revision order).
	AckOutOfOrder
	AckNotFound
	// AckFailed: the database refused this ack on its own (the rest of its
	// batch was applied); Err says why. The relay may retry it.
	AckFailed
)

// AckResult is the outcome for one event id.
type AckResult struct {
	EventID uuid.UUID
	Status  AckStatus
	// Holder is the session whose lease this ack ended, if any.
	Holder uuid.UUID
	// PublishLag is how long the event waited from created_at to this
	// commit, by the database clock; set for AckPublished.
	PublishLag time.Duration
	// Err is set for AckFailed.
	Err error
	// HandOver holds the leases on the aggregate's next events that the
	// same statement gave to Holder (see AckParams.HandOver), in revision
	// order: a new lease when this ack ended Holder's, or the window of a
	// lease that goes on sliding forward. Set on the aggregate's last
	// published ack of the batch.
	HandOver []Lease
	// Claimable is, for AckPublished, what the batch saw of claimable work
	// once it had applied.
	Claimable ClaimHint
}

// maxDue is d as outbox.claim and outbox.ack take it: NULL for no bound.
func maxDue(d time.Duration) *time.Duration {
	if d <= 0 {
		return nil
	}
	return &d
}

// ClaimHint is what an ack batch saw of claimable work once it had applied,
// in the streams the holder's session takes (outbox.ack's claimable_in).
// The zero value knows nothing: claim.
type ClaimHint struct {
	// Seen says the batch looked; without it nothing is known.
	Seen bool
	// None says no aggregate was claimable, nor would become so without a
	// change (an event, a nack, a release, an operator's action), which
	// wakes sessions or reaches them through a later batch.
	None bool
	// In is otherwise how long until the first aggregate becomes claimable
	// (a lease expiring, a backoff ending): zero when one already was.
	In time.Duration
}

// ClaimAt says when credit freed by the acks h came from is to be claimed
// with: now, or by a time (zero: no bound but a session's poll).
func (h ClaimHint) ClaimAt(now time.Time) (claimNow bool, by time.Time) {
	switch {
	case !h.Seen || (!h.None && h.In <= 0):
		return true, time.Time{}
	case h.None:
		return false, time.Time{}
	default:
		return false, now.Add(h.In)
	}
}

// Earliest is the hint that claims no later than either h or o would.
func (h ClaimHint) Earliest(o ClaimHint) ClaimHint {
	switch {
	case !h.Seen || !o.Seen:
		return ClaimHint{}
	case h.None:
		return o
	case o.None || h.In <= o.In:
		return h
	default:
		return o
	}
}

// AckParams says which acks to apply and where.
type AckParams struct {
	IDs       []uuid.UUID
	ReplicaID string
	// HandOver maps the replica's sessions that take more work to what
	// they take. An ack ending a lease held by one of them leases the
	// aggregate's next events to it in the same transaction, when they are
	// committed and not skipped, and the window of a lease that goes on
	// slides forward (outbox.ack).
	HandOver map[uuid.UUID]HandOverTarget
	// Filters maps the replica's sessions to the streams they take. An
	// ack's claim hint (AckResult.Claimable) and a hand-over's claim order
	// look only at the streams of the holder's session; a holder not
	// listed is taken to take every stream.
	Filters map[uuid.UUID]StreamFilter
	// MaxDue is ClaimParams.MaxDue, for the claim hint.
	MaxDue time.Duration
}

// StreamFilter is what a session takes: Streams, or when empty every
// stream but ExcludeStreams.
type StreamFilter struct {
	Streams, ExcludeStreams []string
}

// withoutLoans is targets with no lent credit.
func withoutLoans(targets map[uuid.UUID]HandOverTarget) map[uuid.UUID]HandOverTarget {
	out := make(map[uuid.UUID]HandOverTarget, len(targets))
	for h, t := range targets {
		t.Credit = 0
		out[h] = t
	}
	return out
}

// HandOverTarget is what a session takes from an ack batch.
type HandOverTarget struct {
	TTL time.Duration
	// Window is the session's most events of one aggregate under one lease
	// (0 or 1: one).
	Window int
	// Credit is what the session lends beyond the credit the batch's acks
	// free: the most extra events it may be leased.
	Credit int
	// Spare says the session has credit free beyond what a hand-over
	// replaces: older claimable work is its claims' to take, so a
	// hand-over to it need not yield to that work (outbox.ack's
	// p_handover_spare).
	Spare bool
}

// Ack marks events published in one transaction, each checked on its own.
// Every id must come from a verified lease token. A deadlock between two
// concurrent batches (possible only when both ack the same events) is
// retried.
//
// One id whose ack fails for a reason of its own cannot fail the others in
// its batch: a batch that fails with anything but a lost connection or a
// cancelled context is split in halves and each half tried on its own, down
// to single ids, and an id that still fails gets AckFailed with the error.
func (s *Store) Ack(ctx context.Context, p AckParams) ([]AckResult, error) {
	res, err := s.ackRetrying(ctx, p)
	if err == nil || ctx.Err() != nil || !isItemError(err) {
		return res, err
	}
	ids := p.IDs
	if len(ids) == 1 {
		return []AckResult{{EventID: ids[0], Status: AckFailed, Err: err}}, nil
	}
	half := len(ids) / 2
	p.IDs = ids[:half]
	first, err := s.Ack(ctx, p)
	if err != nil {
		return nil, err
	}
	// The credit sessions lend is for the whole batch: the first half may
	// have used it all.
	p.HandOver = withoutLoans(p.HandOver)
	p.IDs = ids[half:]
	second, err := s.Ack(ctx, p)
	if err != nil {
		return nil, err
	}
	return append(first, second...), nil
}

func (s *Store) ackRetrying(ctx context.Context, p AckParams) ([]AckResult, error) {
	for attempt := 0; ; attempt++ {
		res, err := s.ack(ctx, p)
		if err == nil || attempt >= 5 || !isRetryable(err) {
			return res, err
		}
	}
}

// isItemError reports whether err came from the database answering the
// statement (so some row in it may be at fault), rather than from the
// connection or the client.
func isItemError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	// Class 08 (connection), 53 (resources), 57 (operator intervention,
	// e.g. shutdown) and 58 (system) are the database's trouble, not a row's.
	switch pgErr.Code[:2] {
	case "08", "53", "57", "58":
		return false
	}
	return true
}

func (s *Store) ack(ctx context.Context, p AckParams) ([]AckResult, error) {
	var holders []uuid.UUID
	var ttls []time.Duration
	var windows, credits []int32
	var spare []bool
	for h, t := range p.HandOver {
		holders = append(holders, h)
		ttls = append(ttls, t.TTL)
		windows = append(windows, int32(max(t.Window, 1)))
		credits = append(credits, int32(max(t.Credit, 0)))
		spare = append(spare, t.Spare)
	}
	// One row per stream a session takes or excludes; a NULL stream for
	// a session that takes every stream.
	var filterHolders []uuid.UUID
	var filterStreams []*string
	var filterExcluded []bool
	for h, f := range p.Filters {
		if len(f.Streams) == 0 {
			filterHolders, filterStreams, filterExcluded = append(filterHolders, h), append(filterStreams, nil), append(filterExcluded, false)
		}
		for _, st := range f.Streams {
			filterHolders, filterStreams, filterExcluded = append(filterHolders, h), append(filterStreams, &st), append(filterExcluded, false)
		}
		for _, st := range f.ExcludeStreams {
			filterHolders, filterStreams, filterExcluded = append(filterHolders, h), append(filterStreams, &st), append(filterExcluded, true)
		}
	}
	rows, err := s.pool.Query(ctx,
		`SELECT a.event_id, a.status, a.holder, clock_timestamp() - a.created_at, a.claimable_in, `+leaseColumns("a.handover")+`
		 FROM outbox.ack($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) a`, p.IDs, p.ReplicaID, holders, ttls, windows, credits,
		filterHolders, filterStreams, filterExcluded, maxDue(p.MaxDue), spare)
	if err != nil {
		return nil, fmt.Errorf("store: ack: %w", err)
	}
	rowsOut, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (AckResult, error) {
		var r AckResult
		var status string
		var holder *uuid.UUID
		var lag *time.Duration
		var h nullableLease
		var claimableIn *time.Duration
		if err := row.Scan(append([]any{&r.EventID, &status, &holder, &lag, &claimableIn}, h.dest()...)...); err != nil {
			return r, err
		}
		if lag != nil {
			r.PublishLag = *lag
		}
		if holder != nil {
			r.Holder = *holder
		}
		if l := h.lease(); l != nil {
			r.HandOver = []Lease{*l}
		}
		switch status {
		case "published":
			r.Status = AckPublished
			r.Claimable = ClaimHint{Seen: true, None: claimableIn == nil}
			if claimableIn != nil {
				r.Claimable.In = *claimableIn
			}
		case "handed_over":
			// Not a result of its own: folded into its ack's below.
		case "already_published":
			r.Status = AckAlreadyPublished
		case "lease_lost":
			r.Status = AckLeaseLost
		case "out_of_order":
			r.Status = AckOutOfOrder
		case "not_found":
			r.Status = AckNotFound
		default:
			return r, fmt.Errorf("unknown ack status %q", status)
		}
		return r, nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: ack: %w", err)
	}
	// Leases come after every result, each naming the ack that handed it.
	res := make([]AckResult, 0, len(rowsOut))
	at := make(map[uuid.UUID]int, len(rowsOut))
	for _, r := range rowsOut {
		if r.Status != 0 {
			at[r.EventID] = len(res)
			res = append(res, r)
			continue
		}
		i, ok := at[r.EventID]
		if !ok || res[i].Status != AckPublished || len(r.HandOver) == 0 {
			return nil, fmt.Errorf("store: ack: a lease handed over by %s, which was not published in this batch", r.EventID)
		}
		res[i].HandOver = append(res[i].HandOver, r.HandOver...)
	}
	return res, nil
}

// NackParams describes a failed publish.
type NackParams struct {
	EventID     uuid.UUID
	Epoch       int64
	Error       string
	RetryAfter  time.Duration
	BackoffBase time.Duration
	BackoffCap  time.Duration
	MaxFailures int
}

// NackResult says what happens next.
type NackResult struct {
	Parked        bool
	NextAttemptAt time.Time
	Failures      int
	Holder        uuid.UUID
	// Ended lists the events the lease covered, the nacked one first: with
	// a window, more than one.
	Ended []uuid.UUID
}

// Nack records a failed publish by the current lease.
func (s *Store) Nack(ctx context.Context, p NackParams) (NackResult, error) {
	var r NackResult
	var next *time.Time
	var holder *uuid.UUID
	err := s.pool.QueryRow(ctx,
		`SELECT parked, next_attempt_at, failures, holder, ended FROM outbox.nack($1, $2, $3, $4, $5, $6, $7)`,
		p.EventID, p.Epoch, p.Error, p.RetryAfter, p.BackoffBase, p.BackoffCap, p.MaxFailures,
	).Scan(&r.Parked, &next, &r.Failures, &holder, &r.Ended)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, ErrLeaseLost
	}
	if err != nil {
		return r, fmt.Errorf("store: nack: %w", err)
	}
	if next != nil {
		r.NextAttemptAt = *next
	}
	if holder != nil {
		r.Holder = *holder
	}
	return r, nil
}

// NotifyReleased tells the replica whose session holder held a lease that
// the lease ended through another replica, as outbox.ack does for its
// remote holders: that replica's LISTEN connection routes it to the session.
func (s *Store) NotifyReleased(ctx context.Context, holder uuid.UUID) error {
	if _, err := s.pool.Exec(ctx, `SELECT pg_notify('outbox_released', $1::text)`, holder); err != nil {
		return fmt.Errorf("store: notify released: %w", err)
	}
	return nil
}

// Park parks the aggregate of the current lease on eventID at once, with
// reason, for an event that cannot be delivered at all. It returns the
// events the lease covered (see NackResult.Ended).
func (s *Store) Park(ctx context.Context, eventID uuid.UUID, epoch int64, reason string) ([]uuid.UUID, error) {
	var holder *uuid.UUID
	var ended []uuid.UUID
	err := s.pool.QueryRow(ctx, `SELECT holder, ended FROM outbox.park($1, $2, $3)`, eventID, epoch, reason).Scan(&holder, &ended)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrLeaseLost
	}
	if err != nil {
		return nil, fmt.Errorf("store: park: %w", err)
	}
	return ended, nil
}

// ExtendLease pushes the current lease's expiry to now + ttl.
func (s *Store) ExtendLease(ctx context.Context, eventID uuid.UUID, epoch int64, ttl time.Duration) (time.Time, error) {
	var exp time.Time
	err := s.pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.extend_lease($1, $2, $3)`,
		eventID, epoch, ttl).Scan(&exp)
	if errors.Is(err, pgx.ErrNoRows) {
		return exp, ErrLeaseLost
	}
	if err != nil {
		return exp, fmt.Errorf("store: extend lease: %w", err)
	}
	return exp, nil
}

// Release gives back every lease holder has.
func (s *Store) Release(ctx context.Context, holder uuid.UUID) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT outbox.release($1)`, holder).Scan(&n); err != nil {
		return 0, fmt.Errorf("store: release: %w", err)
	}
	return n, nil
}

// ReleaseAllBut gives back every lease holder has except those of the
// events in keep: leases a claim took that never reached the relay (the
// claim committed, but its caller gave up before reading the rows).
func (s *Store) ReleaseAllBut(ctx context.Context, holder uuid.UUID, keep []uuid.UUID) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT outbox.release($1, $2)`, holder, keep).Scan(&n); err != nil {
		return 0, fmt.Errorf("store: release all but: %w", err)
	}
	return n, nil
}

// HeldEvents returns the events holder currently has leased: every event
// each of its leases covers.
func (s *Store) HeldEvents(ctx context.Context, holder uuid.UUID) (map[uuid.UUID]bool, error) {
	rows, err := s.pool.Query(ctx,
		`SELECT unnest(outbox.lease_window(stream, aggregate_key, delivered_revision, leased_through))
		 FROM outbox.delivery WHERE holder = $1 AND state = 'leased'`, holder)
	if err != nil {
		return nil, fmt.Errorf("store: held events: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("store: held events: %w", err)
	}
	held := make(map[uuid.UUID]bool, len(ids))
	for _, id := range ids {
		held[id] = true
	}
	return held, nil
}

// EventStreams returns the distinct streams of the events among ids that
// exist.
func (s *Store) EventStreams(ctx context.Context, ids []uuid.UUID) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT DISTINCT stream FROM outbox.event WHERE event_id = ANY ($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("store: event streams: %w", err)
	}
	streams, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("store: event streams: %w", err)
	}
	return streams, nil
}

// PublishedAmong returns which of ids are published.
func (s *Store) PublishedAmong(ctx context.Context, ids []uuid.UUID) ([]uuid.UUID, error) {
	rows, err := s.pool.Query(ctx,
		`SELECT event_id FROM outbox.event WHERE event_id = ANY ($1) AND published_at IS NOT NULL`, ids)
	if err != nil {
		return nil, fmt.Errorf("store: published among: %w", err)
	}
	published, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("store: published among: %w", err)
	}
	return published, nil
}

// isRetryable reports deadlocks and serialization failures, which a retry of
// the whole statement resolves.
func isRetryable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001")
}

// KnownStreams returns the stream names that some event has used (each has
// outbox.aggregate rows from its first commit on), in name order, at most
// limit of them (0: all): what a refused subscription to an unknown stream
// lists as the names it might have meant, and the streams a lag report lists
// even while idle. It skips from one stream to the next along
// outbox.aggregate's primary key, one index probe per stream, however many
// aggregates each holds.
func (s *Store) KnownStreams(ctx context.Context, limit int) ([]string, error) {
	// Without a limit the statement has no parameter, so PostgreSQL plans
	// it once per connection: every lag read lists the known streams, and
	// with LIMIT $1 each call was planned afresh.
	query, args := knownStreamsSQL+` LIMIT $1`, []any{limit}
	if limit <= 0 {
		query, args = knownStreamsSQL, nil
	}
	rows, err := s.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("store: known streams: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("store: known streams: %w", err)
	}
	return names, nil
}

const knownStreamsSQL = `
		WITH RECURSIVE known(stream) AS (
			(SELECT stream FROM outbox.aggregate ORDER BY stream LIMIT 1)
			UNION ALL
			SELECT (SELECT a.stream FROM outbox.aggregate a WHERE a.stream > known.stream ORDER BY a.stream LIMIT 1)
			FROM known WHERE known.stream IS NOT NULL
		)
		SELECT stream FROM known WHERE stream IS NOT NULL`

// UnknownStreams returns the names among streams that no event has used.
func (s *Store) UnknownStreams(ctx context.Context, streams []string) ([]string, error) {
	rows, err := s.pool.Query(ctx,
		`SELECT n FROM unnest($1::text[]) AS n
		 WHERE NOT EXISTS (SELECT 1 FROM outbox.aggregate a WHERE a.stream = n)`, streams)
	if err != nil {
		return nil, fmt.Errorf("store: streams: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("store: streams: %w", err)
	}
	return names, nil
}
