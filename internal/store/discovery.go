package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrDiscoveryStopped means discovery cannot run on this database: its
// stored snapshot's transaction ids are not this cluster's (the database
// was restored or copied into another cluster) or the cluster's counter is
// behind it. It stays so until RescanDiscovery runs. The wrapping error
// says why.
var ErrDiscoveryStopped = errors.New("store: discovery is stopped")

// discoverError maps the SQLSTATE outbox.discover_scan stops with (XX001,
// data_corrupted) to ErrDiscoveryStopped.
func discoverError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "XX001" {
		return fmt.Errorf("%w: %s", ErrDiscoveryStopped, pgErr.Message)
	}
	return fmt.Errorf("store: discover: %w", err)
}

// RoundDue says whether a discovery round has anything to do: an event
// committed since the stored snapshot (one that a round would find), or a
// stopped discovery (which the round reports as ErrDiscoveryStopped). It is
// one statement outside any transaction, one round trip, and writes
// nothing, where an empty round runs the delivery functions and takes the
// discovery lock, which replicas take turns with; so an idle replica checks
// before each round.
//
// false holds only as of the statement's snapshot: an event that commits
// later is not visible in it and so not in the stored snapshot either (a
// snapshot stored before is older), and the next check or round finds it.
// Nothing is stored or remembered, so a false answer changes nothing a
// round would do later.
//
// The reads mirror outbox.events_since, written as "the first such xid"
// so that the plan is an index probe whatever the statistics say (an
// EXISTS over "xid >= x" is planned as a sequential scan, which on a large
// table reads it all to find nothing); outbox.discover_scan's stop
// conditions (a recorded stop, a counter behind the stored xmax) are
// repeated so that an idle replica still notices and reports a stop. The
// scan checks the cluster only when it found events (an empty round writes
// nothing); the check compares it always (with the identifier a round or
// an earlier check kept for the connection, else pg_control's, which it
// then keeps as a round does: reading pg_control through the definer
// function was a third of a check's backend CPU), and on a difference records the
// stop (outbox.discovery_stopped()), so the round it asks for fails with
// it: a database moved to another cluster is reported while idle too.
//
// With probeClaims it also answers, in the same statement, what a claim of
// every stream would find now (outbox.probe_claims): whether an aggregate is
// claimable, and when the first one will be. An idle replica's poll groups
// then skip the claims this answer makes pointless (see
// server.pollGroup.fire); maxDue is the claim's (Config.maxDue).
func (s *Store) RoundDue(ctx context.Context, probeClaims bool, maxDue time.Duration) (bool, ClaimProbe, error) {
	var due bool
	var probe ClaimProbe
	var err error
	if !probeClaims {
		err = s.pool.QueryRow(ctx, `SELECT `+roundDueSQL).Scan(&due)
	} else {
		var claimable bool
		var nextIn *float64
		// maxDue is written into the statement, not passed as a parameter:
		// a statement without parameters is planned once per connection,
		// where PostgreSQL kept choosing custom plans for this one in some
		// databases (by their statistics): 109 plans in 506 checks of 50
		// idle sources, 1.2 ms each, more than twice the checks' own time.
		// The text is the same on every call (maxDue is the server's), so
		// pgx prepares it once per connection.
		err = s.pool.QueryRow(ctx, fmt.Sprintf(`SELECT (`+roundDueSQL+`), p.oldest IS NOT NULL, extract(epoch FROM p.next_at - now())::float8
			FROM outbox.probe_claims(NULL, NULL, interval '%d microseconds') p`, maxDue.Microseconds())).Scan(&due, &claimable, &nextIn)
		probe = ClaimProbe{Probed: true, Claimable: claimable, NextIn: -1}
		if nextIn != nil {
			probe.NextIn = time.Duration(*nextIn * float64(time.Second))
		}
	}
	if err != nil {
		return false, ClaimProbe{}, fmt.Errorf("store: discovery round due: %w", err)
	}
	return due, probe, nil
}

// roundDueSQL is RoundDue's question, an expression. The check without the
// probe is its own statement, not the probe's statement with the probe
// switched off by a parameter: PostgreSQL planned that one afresh on every
// call (its custom plan, with the probe cut away, looked far cheaper than
// the generic plan), 550 against 170 µs of backend CPU per check.
const roundDueSQL = `(SELECT d.stopped_reason IS NOT NULL
	    OR pg_snapshot_xmax(d.snapshot) > pg_snapshot_xmax(pg_current_snapshot())
	    OR (d.system_identifier IS DISTINCT FROM coalesce(nullif(current_setting('outbox.system_identifier', true), ''),
	                                                      set_config('outbox.system_identifier', outbox.cluster_system_identifier()::text, false))::bigint
	        AND outbox.discovery_stopped() IS NOT NULL)
	    OR EXISTS (SELECT FROM (SELECT e.xid FROM outbox.event e
	               WHERE e.xid >= pg_snapshot_xmax(d.snapshot) ORDER BY e.xid LIMIT 1) n)
	    OR EXISTS (SELECT FROM (SELECT e.xid FROM outbox.event e
	               WHERE e.xid = ANY (ARRAY(SELECT pg_snapshot_xip(d.snapshot))) ORDER BY e.xid LIMIT 1) r)
	  FROM outbox.discovery d)`

// ClaimProbe is what a claim of every stream would have found when a
// discovery check probed (Store.RoundDue).
type ClaimProbe struct {
	// Probed says the check probed; the rest is zero otherwise.
	Probed bool
	// Claimable says an aggregate was claimable; NextIn is how long after
	// the probe (by the database's clock, so that no clock skew between the
	// hosts counts) the first one is or becomes claimable: negative when
	// none will be without a change (an event, a release, an operator's
	// action).
	Claimable bool
	NextIn    time.Duration
}

// DiscoveryStopped returns why discovery is stopped and what to do, or ""
// while it runs (outbox.discovery_stopped). The first caller to notice a
// reason records it, so that discovery stays stopped until a re-scan even
// once the cluster's transaction counter passes the stored snapshot.
func (s *Store) DiscoveryStopped(ctx context.Context) (string, error) {
	var reason *string
	if err := s.pool.QueryRow(ctx, `SELECT outbox.discovery_stopped()`).Scan(&reason); err != nil {
		return "", fmt.Errorf("store: reading whether discovery is stopped: %w", err)
	}
	return deref(reason), nil
}

// Rescan is what a re-scan of discovery state found and did.
type Rescan struct {
	// Events is how many pending events it found, Aggregates how many
	// delivery rows it created or woke, Restamped how many events copied
	// from another cluster it re-stamped so that no round finds them again.
	Events, Aggregates, Restamped int64
}

// RescanDiscovery rebuilds discovery's state from the events themselves
// (outbox.rescan_discovery) and lets a stopped discovery resume. It is
// safe while producers write and relays deliver; it reads the whole event
// table and, after a restore, rewrites the transaction id of each copied
// event once, so it wants the schema owner's role.
func (s *Store) RescanDiscovery(ctx context.Context) (Rescan, error) {
	var r Rescan
	if err := s.pool.QueryRow(ctx, `SELECT events, aggregates, restamped FROM outbox.rescan_discovery()`).
		Scan(&r.Events, &r.Aggregates, &r.Restamped); err != nil {
		return r, fmt.Errorf("store: rescan discovery: %w", err)
	}
	return r, nil
}
