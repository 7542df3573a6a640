package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/leasetoken"
	"github.com/outboxd/outboxd/internal/store"
)

// DefaultAckLinger is Config.AckLinger's default (and serve --ack-linger's).
const DefaultAckLinger = 3 * time.Millisecond

// Config configures a Server. Zero fields take the defaults documented on
// each; New validates the rest and names the field at fault.
type Config struct {
	// Store is the database. Required.
	Store *store.Store
	// DatabaseURL is used for the dedicated LISTEN connection. Required.
	DatabaseURL string
	// Logger receives the server's logs. Default: discard.
	Logger *slog.Logger
	// ReplicaID names this replica in leases and ListRelays; it must be
	// unique among replicas sharing the database. Default: hostname-pid-random.
	ReplicaID string

	// DefaultLeaseTTL applies when a relay asks for none. Default 30s.
	DefaultLeaseTTL time.Duration
	// MinLeaseTTL and MaxLeaseTTL bound what relays may ask for. Defaults 1s, 1h.
	MinLeaseTTL, MaxLeaseTTL time.Duration
	// MaxInFlight bounds a relay's credit. Default 10000.
	MaxInFlight int
	// MaxInFlightPerAggregate bounds a relay's window on one aggregate
	// (SubscribeRequest.max_in_flight_per_aggregate). Default 1000.
	MaxInFlightPerAggregate int
	// ClaimBatch is the most aggregates one claim statement leases. Default 64.
	ClaimBatch int

	// BackoffBase and BackoffCap shape the retry delay after a Nack:
	// min(cap, base*2^failures), with equal jitter. Defaults 1s and 5m.
	BackoffBase, BackoffCap time.Duration
	// MaxFailures is how many failed publishes of one event park its
	// aggregate. Default 10.
	MaxFailures int
	// MaxDeliveries is how many times one event is delivered without an ack
	// or a nack (its lease expired, or the stream holding it ended) before
	// its aggregate is parked: a relay that crashes on an event, say. A
	// relay's clean shutdown costs its in-flight events one delivery each.
	// Default 25.
	MaxDeliveries int

	// PollInterval is the longest pause of the fallback poll, which finds
	// work even when a notification was lost: one poll (one claim) per
	// stream filter of the replica's idle sessions, not one per session
	// (see pollGroup). Default 1s.
	PollInterval time.Duration
	// DiscoveryInterval is the shortest pause between discovery rounds
	// while they find new events (see DiscoveryPaceMax);
	// DiscoveryIdleInterval the longest pause while they find none, and so
	// the longest a newly committed event waits to be found. Defaults 1ms
	// and 25ms.
	DiscoveryInterval, DiscoveryIdleInterval time.Duration
	// DiscoveryPaceMax is the longest pause after a round that found
	// events, which lasts as long as the round took (its wall time, waits
	// for a connection included) once it found 32 events or more, and that
	// share of it for fewer (DiscoveryInterval at least): under load the
	// next round collects what arrived while this one ran, so while rounds
	// are full (and shorter than this) the loop spends about half its time
	// in rounds and each carries about twice the events, at about the same
	// fixed cost (see doc.go, Wake-ups). A light load's rounds are small
	// and short, and go on after DiscoveryInterval. Default
	// DiscoveryIdleInterval; DiscoveryInterval turns pacing off.
	DiscoveryPaceMax time.Duration
	// DiscoveryQuietInterval is the pause between an idle loop's checks
	// once its rounds have found nothing for DiscoveryQuietAfter: a quiet
	// source costs one statement per DiscoveryQuietInterval, and its first
	// event after the quiet spell waits up to that long to be found (the
	// loop is fast again from that event on). Defaults: DiscoveryIdleInterval
	// (no quiet mode) and 10s. A replica serving many sources sets it so that
	// its sources' idle checks together stay within a budget (internal/app).
	DiscoveryQuietInterval, DiscoveryQuietAfter time.Duration
	// DiscoveryMaxFound is the most aggregates one discovery round hands the
	// replica to choose dispatches from, the oldest first. A round over a
	// larger backlog still makes every aggregate it found deliverable (the
	// rest wait for a claim instead of a dispatch), so this bounds the
	// replica's memory, not what a round discovers. Default 10000.
	DiscoveryMaxFound int
	// DiscoveryMaxEvents, when positive, is about the most events one
	// discovery round takes: a larger backlog (replicas back from an
	// outage) is then taken in rounds of whole transactions, each a
	// transaction of its own, so the first events are delivered while the
	// rest are still being found and no round holds the cluster's xmin
	// horizon back for long. It costs more discovery work in all, spent
	// while the first events are delivered (see BENCHMARKS.md). A round
	// that found this many events or more is followed after
	// DiscoveryInterval, unpaced (see DiscoveryPaceMax): the rest of the
	// backlog is there already; so a limit below 32 leaves rounds under load
	// unpaced too. Default 0: one round takes everything found.
	DiscoveryMaxEvents int
	// ReconcileInterval is how often a session with deliveries outstanding
	// checks which of its leases still exist (acks on other replicas, expired
	// leases claimed elsewhere). Default 2s.
	ReconcileInterval time.Duration
	// AckBatch is the most acks one group commit applies. Default 2000.
	AckBatch int
	// AckCommitters is how many ack batches the replica applies at once,
	// each on its own database connection. Default 1. More drain a backlog
	// faster on several cores (2 on this project's 2-core benchmark machine:
	// +7-25% drain), but each batch is then smaller, so a lightly loaded
	// replica does more database work per ack (latency at half load +10%).
	AckCommitters int
	// AckLinger is how long an ack batch may wait for company once its
	// committer has taken the first ack, while the replica is under load:
	// only when acks of more than one relay connection interleave (another
	// connection's ack is in the batch, or came last, within four lingers)
	// and this replica's sessions have deliveries outstanding besides the
	// ones acked. Acks of one relay process (its next call waits for this
	// answer), a hot aggregate's revisions handed over ack by ack, and a
	// trickle never wait. It ends early once every delivery outstanding
	// when it began is acked, or the batch is full.
	// Each ack statement costs about as much to start as a dozen acks to
	// apply, so fewer, larger batches cost less database and server CPU
	// per event, at up to this much more commit→published_at. Default
	// DefaultAckLinger; a negative value turns it off. Measured on the
	// benchmark's 2 cores (BENCHMARKS.md): on the slower machine 3 ms took
	// about 6 % off the CPU per event at half load (five pairs, -11 to
	// +1 %), where a batch holds three or four acks, with
	// commit→published_at no worse, and changed nothing resolvable at full
	// load, for a hot aggregate or in a drain; on one twice as fast, 18 % at
	// half load and at full load, for about 1 ms more commit→published_at
	// p50 at half load.
	AckLinger time.Duration

	// Registerer receives the replica's Prometheus metrics, including the
	// database-wide backlog gauges read at scrape time. Default: none.
	Registerer prometheus.Registerer
	// SessionRefreshInterval is how often the replica records its relay
	// sessions' figures in the database for ListRelays; a session not
	// refreshed for three intervals counts as gone. Default 5s.
	SessionRefreshInterval time.Duration
	// PartitionTTL is how long a replica's ownership of its partitions of
	// the aggregates (outbox.partition) lasts without a renewal; it renews
	// every third of it. A replica that crashed keeps its partitions from
	// the others this long. Default 15s.
	PartitionTTL time.Duration
	// Retention, when positive, makes the replica's janitor delete events
	// published longer ago than this, every JanitorInterval, in batches of
	// JanitorBatch. Default 0: keep everything.
	Retention time.Duration
	// JanitorInterval defaults to 1m; JanitorBatch to 1000.
	JanitorInterval time.Duration
	JanitorBatch    int
	// SchemaCheckInterval is how long readiness trusts a schema it found
	// current while the discovery loop's turns show the database answering:
	// readiness reads the applied migrations again only after it (or at
	// once when the loop has not reached the database lately), so a quiet
	// source's readiness check costs no statement. Default 30s.
	SchemaCheckInterval time.Duration
	// StrandedAuditInterval is how long the stranded-events audit's counts
	// serve every lag reader (GetLag, the metrics, the console) before a
	// reader starts the next audit; longer where the audit itself is slow
	// (ration.Pause). The audit reads every aggregate, so it is not
	// run for each read. Default 1m.
	StrandedAuditInterval time.Duration

	// MaxSubscriptionsPerRelay bounds the Subscribe streams one caller (a
	// token's name, or a relay_id when auth is off) holds open on this
	// replica. Default 64.
	MaxSubscriptionsPerRelay int

	// NoHandOver turns off hand-over (an ack that ends a local session's
	// lease leasing the aggregate's next event to that session at once):
	// every next event then waits for a claim. It exists to compare the
	// two paths in benchmarks and tests; leave it off.
	NoHandOver bool
	// NoDispatch turns off dispatch (a discovery round leasing the next
	// event of an idle aggregate straight to a waiting local session):
	// every event then waits for a claim. It exists to compare the two
	// paths in benchmarks and to test the claim path; leave it off.
	NoDispatch bool
}

// maxDue bounds how far ahead of the database clock a lease expiry or next
// attempt may lie before it counts as left there by a clock that stepped
// back, and is claimable at once: twice the longest lease or backoff this
// replica sets (a relay's lease TTL is at most MaxLeaseTTL, a backoff at
// most BackoffCap). Not once: a lease granted for the longest TTL would then
// lose its protection to the smallest step back (a leap second, an NTP
// step) and be leased to a second holder while the first still publishes.
// With the margin only a step longer than the longest lease or backoff ends
// one early.
func (c *Config) maxDue() time.Duration { return 2 * max(c.MaxLeaseTTL, c.BackoffCap) }

func (c *Config) setDefaults() error {
	if c.Store == nil {
		return errors.New("server: Config.Store is required")
	}
	if c.DatabaseURL == "" {
		return errors.New("server: Config.DatabaseURL is required")
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.ReplicaID == "" {
		c.ReplicaID = NewReplicaID()
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	defInt := func(d *int, v int) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.DefaultLeaseTTL, 30*time.Second)
	def(&c.MinLeaseTTL, time.Second)
	def(&c.MaxLeaseTTL, time.Hour)
	def(&c.BackoffBase, time.Second)
	def(&c.BackoffCap, 5*time.Minute)
	def(&c.PollInterval, time.Second)
	def(&c.DiscoveryInterval, time.Millisecond)
	def(&c.DiscoveryIdleInterval, 25*time.Millisecond)
	def(&c.DiscoveryQuietInterval, c.DiscoveryIdleInterval)
	def(&c.DiscoveryPaceMax, c.DiscoveryIdleInterval)
	def(&c.DiscoveryQuietAfter, 10*time.Second)
	def(&c.ReconcileInterval, 2*time.Second)
	defInt(&c.MaxInFlight, 10000)
	defInt(&c.MaxInFlightPerAggregate, 1000)
	defInt(&c.ClaimBatch, 64)
	defInt(&c.MaxFailures, 10)
	defInt(&c.MaxDeliveries, 25)
	defInt(&c.AckBatch, 2000)
	defInt(&c.AckCommitters, 1)
	def(&c.AckLinger, DefaultAckLinger)
	defInt(&c.DiscoveryMaxFound, 10000)
	def(&c.SessionRefreshInterval, 5*time.Second)
	def(&c.PartitionTTL, 15*time.Second)
	def(&c.JanitorInterval, time.Minute)
	def(&c.SchemaCheckInterval, 30*time.Second)
	def(&c.StrandedAuditInterval, time.Minute)
	defInt(&c.JanitorBatch, 1000)
	defInt(&c.MaxSubscriptionsPerRelay, 64)
	switch {
	case c.MinLeaseTTL <= 0 || c.MaxLeaseTTL < c.MinLeaseTTL:
		return fmt.Errorf("server: Config.MinLeaseTTL %v / MaxLeaseTTL %v: want 0 < min <= max", c.MinLeaseTTL, c.MaxLeaseTTL)
	case c.DefaultLeaseTTL < c.MinLeaseTTL || c.DefaultLeaseTTL > c.MaxLeaseTTL:
		return fmt.Errorf("server: Config.DefaultLeaseTTL %v is outside [%v, %v]", c.DefaultLeaseTTL, c.MinLeaseTTL, c.MaxLeaseTTL)
	case c.MaxInFlight < 1:
		return fmt.Errorf("server: Config.MaxInFlight %d must be positive", c.MaxInFlight)
	case c.MaxInFlightPerAggregate < 1:
		return fmt.Errorf("server: Config.MaxInFlightPerAggregate %d must be positive", c.MaxInFlightPerAggregate)
	case c.ClaimBatch < 1:
		return fmt.Errorf("server: Config.ClaimBatch %d must be positive", c.ClaimBatch)
	case c.MaxFailures < 1:
		return fmt.Errorf("server: Config.MaxFailures %d must be positive", c.MaxFailures)
	case c.MaxDeliveries < 2:
		return fmt.Errorf("server: Config.MaxDeliveries %d must be at least 2", c.MaxDeliveries)
	case c.BackoffBase <= 0 || c.BackoffCap < c.BackoffBase:
		return fmt.Errorf("server: Config.BackoffBase %v / BackoffCap %v: want 0 < base <= cap", c.BackoffBase, c.BackoffCap)
	case c.PollInterval <= 0 || c.ReconcileInterval <= 0:
		return errors.New("server: Config.PollInterval and ReconcileInterval must be positive")
	case c.DiscoveryInterval <= 0 || c.DiscoveryIdleInterval < c.DiscoveryInterval:
		return fmt.Errorf("server: Config.DiscoveryInterval %v / DiscoveryIdleInterval %v: want 0 < interval <= idle interval",
			c.DiscoveryInterval, c.DiscoveryIdleInterval)
	case c.DiscoveryPaceMax < c.DiscoveryInterval || c.DiscoveryPaceMax > c.DiscoveryIdleInterval:
		return fmt.Errorf("server: Config.DiscoveryPaceMax %v: want between DiscoveryInterval %v and DiscoveryIdleInterval %v",
			c.DiscoveryPaceMax, c.DiscoveryInterval, c.DiscoveryIdleInterval)
	case c.DiscoveryQuietInterval < c.DiscoveryIdleInterval:
		return fmt.Errorf("server: Config.DiscoveryQuietInterval %v: want at least DiscoveryIdleInterval %v",
			c.DiscoveryQuietInterval, c.DiscoveryIdleInterval)
	case c.DiscoveryMaxFound < 1:
		return fmt.Errorf("server: Config.DiscoveryMaxFound %d must be positive", c.DiscoveryMaxFound)
	case c.DiscoveryMaxEvents < 0:
		return fmt.Errorf("server: Config.DiscoveryMaxEvents %d must not be negative (0: no limit)", c.DiscoveryMaxEvents)
	case c.AckBatch < 1:
		return fmt.Errorf("server: Config.AckBatch %d must be positive", c.AckBatch)
	case c.AckCommitters < 1:
		return fmt.Errorf("server: Config.AckCommitters %d must be positive", c.AckCommitters)
	case c.MaxSubscriptionsPerRelay < 1:
		return fmt.Errorf("server: Config.MaxSubscriptionsPerRelay %d must be positive", c.MaxSubscriptionsPerRelay)
	case c.PartitionTTL < 3*time.Millisecond:
		return fmt.Errorf("server: Config.PartitionTTL %v must be at least 3ms", c.PartitionTTL)
	case c.SessionRefreshInterval <= 0:
		return fmt.Errorf("server: Config.SessionRefreshInterval %v must be positive", c.SessionRefreshInterval)
	case c.StrandedAuditInterval < 0:
		return fmt.Errorf("server: Config.StrandedAuditInterval %v must not be negative", c.StrandedAuditInterval)
	case c.Retention < 0 || c.JanitorInterval <= 0 || c.JanitorBatch < 1 || c.JanitorBatch > maxPurgeBatch:
		return fmt.Errorf("server: Config.Retention %v, JanitorInterval %v, JanitorBatch %d: want retention >= 0, interval > 0, 1 <= batch <= %d",
			c.Retention, c.JanitorInterval, c.JanitorBatch, maxPurgeBatch)
	}
	return nil
}

// Server is one outboxd replica: the RelayService and AdminService on top of
// the shared database. Create it with New, register it on a grpc.Server, and
// run it with Run.
type Server struct {
	cfg     Config
	log     *slog.Logger
	store   *store.Store
	signer  *leasetoken.Signer
	acks    *ackCommitter
	wake    *waker
	metrics *metrics

	stranded strandedAudit

	// partitions is what the replica owns of the aggregates' partitions;
	// ownershipKick wakes the ownership loop (ownPartitions). instance
	// names this Server in the ownership: a process restarted under the
	// same ReplicaID is another owner.
	partitions    ownedPartitions
	instance      uuid.UUID
	ownershipKick chan struct{}

	mu       sync.Mutex
	sessions map[uuid.UUID]*session
	stopping chan struct{} // closed when the server stops taking work
	stopOnce sync.Once
	sessWG   sync.WaitGroup
	// leaseGate is held shared by every statement that can lease an event
	// (a session's claim, a discovery round that dispatches, an ack batch
	// that hands over), from its check of stopping until the statement has
	// returned and its leases are with their sessions, and exclusively by
	// Stop while it closes stopping (see leasing). So once stopping is
	// closed no such statement is under way or begins: an event committed
	// after that is leased by no session of this replica.
	leaseGate sync.RWMutex

	// sessionRows serializes the writes of this replica's relay-session
	// rows that would otherwise undo each other: a refresh's snapshot of
	// the sessions and its upsert (saveSessions) against a session's
	// removal (removeSession).
	sessionRows sync.Mutex

	// beforeAddSession, when set (by tests), runs in Subscribe just before
	// its session is added.
	beforeAddSession hook[func()]
	// beforeSaveSessions, when set (by tests), runs in saveSessions between
	// its snapshot of the sessions and its write of their rows;
	// removeWaits runs in removeSession when it finds sessionRows held and
	// is about to wait for it.
	beforeSaveSessions hook[func()]
	removeWaits        hook[func()]
	// beforeLease, when set (by tests), runs just before a claim ("claim")
	// or an ack batch that may hand over ("hand-over") is sent, once it
	// holds leaseGate (a round that dispatches runs beforeRound there);
	// stopWaits runs in Stop when it finds leaseGate held and is about to
	// wait for it.
	beforeLease hook[func(path string)]
	stopWaits   hook[func()]
	// afterClaim, when set (by tests), sees and may replace the outcome of
	// every claim statement.
	afterClaim hook[func([]store.Lease, error) ([]store.Lease, error)]
	// afterAck, when set (by tests), sees and may replace the outcome of
	// every ack statement (say, to lose the answer of one that committed).
	afterAck hook[func([]store.AckResult, error) ([]store.AckResult, error)]
	// afterOffer, when set (by tests), runs in a session's loop each time
	// it has offered its free credit to discovery, before it waits.
	afterOffer hook[func(session uuid.UUID, offered int)]
	// sweepWaits, when set (by tests), runs in a session's loop when its
	// sweep for orphans (releaseUndelivered) finds handOverMu held and is
	// about to wait for it; afterSweep runs when the sweep is done, with
	// how many leases it released.
	sweepWaits hook[func(session uuid.UUID)]
	afterSweep hook[func(session uuid.UUID, released int)]
	// afterGive, when set (by tests), runs as a discovery round gives a
	// session the leases it dispatched to it and the credit they did not
	// use, with whether that woke the session's loop.
	afterGive hook[func(session uuid.UUID, leases, unused int, woke bool)]
	// noPolls, when set (by tests), keeps poll groups from arming their
	// polls: work then reaches an idle session only by a wake-up, so a test
	// can tell a missed wake-up from one the poll made up for.
	noPolls atomic.Bool
	// beforeNackNotice, when set (by tests), runs in Nack once the nack
	// committed, before the holder's session hears that the lease ended.
	beforeNackNotice hook[func(holder uuid.UUID)]
	// afterFreed, when set (by tests), runs in a session's loop each time
	// it found credit freed, with its decision: claim at once, or not
	// (then by claimBy at the latest, when set).
	afterFreed hook[func(session uuid.UUID, claim bool, claimBy time.Time)]
	// freedApplied, when set (by tests), runs in a session's loop as soon
	// as it has applied the acks and hand-overs of its freed list and let
	// the session's lock go, with how many it applied and what
	// session.outstanding then says.
	freedApplied hook[func(applied int, outstanding int64)]
	// beforeRound, when set (by tests), runs in a discovery round that
	// borrowed credit from sessions, after it did and before the round is
	// sent (and so before its leases are written).
	beforeRound hook[func()]
	// afterDiscover, when set (by tests), sees and may replace the outcome
	// of every discovery round.
	afterDiscover hook[func(store.Discovery, error) (store.Discovery, error)]
	// afterRoundDue, when set (by tests), runs after every check an idle
	// discovery loop makes before a round (see discover), with its
	// answer, before the loop acts on it.
	afterRoundDue hook[func(due bool, err error)]
	// afterPutOff, when set (by tests), runs each time the discovery loop
	// puts a round off because no session offered credit (see
	// discoverRound), before it waits for an offer.
	afterPutOff hook[func()]
	// beforeOwnPartitions, when set (by tests), runs before an ownership
	// turn's statement; an error it returns stands for the statement's.
	// afterOwnershipTurn runs after every turn.
	beforeOwnPartitions hook[func(wants bool) error]
	afterOwnershipTurn  hook[func()]
	// ownershipTurnTimeout, when set (by tests: a turn made to wait for a
	// lock must not end at releaseTimeout on a slow machine), bounds an
	// ownership turn's statements instead of releaseTimeout.
	ownershipTurnTimeout atomic.Int64
	// afterLoopWait, when set (by tests), sees every pause a periodic loop
	// ("readiness", "refresh") of the given interval arms, and when.
	afterLoopWait hook[func(loop string, interval, armed time.Duration, at time.Time)]
	// afterDiscoveryWait, when set (by tests), sees every pause the
	// discovery loop chooses before its next turn, the pause it arms (a
	// quiet one aligned: see alignedPause) and when.
	afterDiscoveryWait hook[func(chosen, armed time.Duration, at time.Time)]
	// beforeSleep, when set (by tests), runs before the discovery loop
	// tries to sleep; afterSleep after, with whether it sleeps.
	beforeSleep hook[func()]
	afterSleep  hook[func(asleep bool)]
	// asleepCheck is the pause between a sleeping discovery loop's checks,
	// in nanoseconds (asleepCheckInterval; tests lengthen it, so that only
	// a producer's notice can find an event).
	asleepCheck atomic.Int64
	// quietInterval is Config.DiscoveryQuietInterval as last set (see
	// SetDiscoveryQuietInterval), in nanoseconds.
	quietInterval atomic.Int64
	// lastTurn is what the discovery loop's last turn that reached the
	// database said of discovery, and when (nil before the first): readiness
	// takes it instead of asking again while it is fresh.
	lastTurn atomic.Pointer[discoveryTurn]
	// schemaCurrentAt is when readiness last found no migration pending, in
	// Unix nanoseconds; 0 when it has not or found one since.
	schemaCurrentAt atomic.Int64
	// lastEvents is when a discovery round last found events, in Unix
	// nanoseconds; 0 until one has (see FoundEventsLately).
	lastEvents atomic.Int64
	// reconcileTick, when set (by tests), replaces every session's
	// reconcile ticker: a session with leases to check takes a tick from
	// it when the test sends one.
	reconcileTick <-chan time.Time
	// beforeHandOver, when set (by tests), runs after an ack batch that
	// handed leases over has committed, before they reach their sessions.
	beforeHandOver hook[func([]store.AckResult)]
	// beforeAckBatch and afterAckQueued, when set (by tests), run as each
	// ack batch begins, and after each ack request is queued for a
	// committer.
	beforeAckBatch, afterAckQueued hook[func()]
	// ackLingering, when set (by tests), runs as an ack batch begins to
	// wait for company (Config.AckLinger), with the acks it holds so far.
	ackLingering hook[func(acks int)]
	// bulkPage, when set (by tests), is how many aggregates a bulk action
	// reads per page instead of bulkBatch; afterBulkPage, when set (by
	// tests), runs after a bulk action acted on a page and woke the
	// sessions, before it reads the next page.
	bulkPage      atomic.Int64
	afterBulkPage hook[func()]
	// beforeBulkAct, when set (by tests), runs as a bulk action is about to
	// act on an aggregate it matched, with its stream and key.
	beforeBulkAct hook[func(ctx context.Context, stream, key string)]
	// handOverMu is held shared by the ack committer from an ack batch's
	// statement until every lease it handed over is with its session (or
	// released), and likewise by a discovery round that dispatches; and
	// exclusively by a session computing which of its leases are orphans:
	// a lease handed over or dispatched but not yet with its session is
	// never mistaken for one. Whoever holds both takes leaseGate first.
	handOverMu sync.RWMutex
	// groupsMu guards groups, the poll groups of the sessions by stream
	// filter (see pollGroup).
	groupsMu sync.Mutex
	groups   map[string]*pollGroup
	// wakeups counts the claims poll groups asked of sessions other than
	// their polls (wake-ups, and claims that found all they asked for);
	// read by tests.
	wakeups atomic.Uint64
	// afterNotify, when set (by tests), runs after the listener acted on
	// each notification.
	afterNotify hook[func(channel string)]
	// groupWakeups counts the wake-ups poll groups received (one per group
	// per discovery round that made rows ready, NOTIFY, operator action);
	// read by tests.
	groupWakeups atomic.Uint64
	// afterPoll, when set (by tests), runs each time a poll group's poll
	// fires, after it woke a member (or kept the wake-up for the next) or
	// skipped its claim (see pollGroup.fire).
	afterPoll hook[func()]
	// claimProbe is what the discovery loop's last check that probed the
	// claims found, and when (nil before the first; see pollCovered).
	claimProbe atomic.Pointer[probedClaims]
	// skippedPolls counts the polls whose claim a probe made pointless.
	skippedPolls atomic.Uint64
	// dispatchAfter is the session the last discovery round gave its last
	// aggregate to: the next round's turns begin with the session after it
	// by id, so that dispatch spreads over the relays.
	dispatchAfter uuid.UUID
	// creditOffered is signalled (without blocking) whenever a session
	// offers credit: a discovery loop that put its round off for want of
	// any waits for it.
	creditOffered chan struct{}
	// discoverWake: a producer committed while the discovery loop slept, or
	// the LISTEN connection its sleep was held on was lost (see waker).
	discoverWake chan struct{}
	// shortSince is when the discovery loop's rounds began to find more
	// events than their sessions' credit, every round since (zero: the
	// last one did not); saturatedAfter is how long that must last before
	// rounds take no more than the credit (saturatedAfter, or as a test
	// set it; 0: always).
	shortSince     time.Time
	saturatedAfter atomic.Int64
	// handOvers counts leases handed over by acks (and delivered or
	// released), dispatched those discovery rounds gave to sessions; read
	// by tests.
	handOvers, dispatched atomic.Uint64
}

// New validates cfg and loads the lease-signing key.
// SetDiscoveryQuietInterval lengthens Config.DiscoveryQuietInterval to d
// while the server runs (never below the configured value): a replica whose
// sources come and go spreads its budget of idle checks over the ones it
// has. The discovery loop takes it at its next pause.
func (s *Server) SetDiscoveryQuietInterval(d time.Duration) {
	s.quietInterval.Store(int64(max(d, s.cfg.DiscoveryQuietInterval)))
}

// DiscoveryQuietInterval returns the pause between a quiet discovery
// loop's checks, as last set.
func (s *Server) DiscoveryQuietInterval() time.Duration {
	return time.Duration(s.quietInterval.Load())
}

// FoundEventsLately says whether discovery found events within the last
// DiscoveryQuietAfter: whether the source is in use, however few its
// events (serve keeps such a source's pool whole). Starting is no use: a
// replica that found none since it started says no, so that an idle
// source's pool is trimmed from the start (its discovery loop still runs
// fast for DiscoveryQuietAfter after starting: see discover).
func (s *Server) FoundEventsLately() bool {
	at := s.lastEvents.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < s.cfg.DiscoveryQuietAfter
}

func New(ctx context.Context, cfg Config) (*Server, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	key, err := cfg.Store.LeaseKey(ctx)
	if err != nil {
		return nil, fmt.Errorf("server: %w (are migrations applied? run `outboxd migrate`)", err)
	}
	signer, err := leasetoken.NewSigner(key)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:           cfg,
		log:           cfg.Logger.With("component", "server", "replica", cfg.ReplicaID),
		store:         cfg.Store,
		signer:        signer,
		sessions:      make(map[uuid.UUID]*session),
		creditOffered: make(chan struct{}, 1),
		discoverWake:  make(chan struct{}, 1),
		ownershipKick: make(chan struct{}, 1),
		instance:      uuid.New(),
		stopping:      make(chan struct{}),
		metrics:       newMetrics(),
	}
	s.quietInterval.Store(int64(cfg.DiscoveryQuietInterval))
	s.asleepCheck.Store(int64(asleepCheckInterval))
	s.saturatedAfter.Store(int64(saturatedAfter))
	s.acks = newAckCommitter(s)
	s.wake = newWaker(s)
	if cfg.Registerer != nil {
		for _, c := range append(s.metrics.collectors(), newLagCollector(s)) {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("server: registering metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Register adds the RelayService and AdminService to g.
func (s *Server) Register(g grpc.ServiceRegistrar) {
	outboxv1.RegisterRelayServiceServer(g, &relayService{s: s})
	outboxv1.RegisterAdminServiceServer(g, &adminService{s: s})
}

// AdminServer returns the AdminService implementation itself. Calls made
// on it directly bypass the gRPC interceptors, authentication included, as
// if auth were disabled: it is for in-process callers that apply access
// rules themselves (the console's lag sampler, whose samples are filtered
// by each viewer's streams). Everything else goes through gRPC.
func (s *Server) AdminServer() outboxv1.AdminServiceServer { return &adminService{s: s} }

// RelayServer returns the RelayService implementation itself, for a
// router in front of several servers (internal/multisource) that the gRPC
// interceptors have already run for. Like AdminServer, calls made on it
// directly bypass authentication unless the context carries a principal.
func (s *Server) RelayServer() outboxv1.RelayServiceServer { return &relayService{s: s} }

// Run runs the replica's background work (discovery, group-committed acks,
// the LISTEN connection, the relay-session registry, partition ownership,
// the retention janitor) until ctx is done. Call Stop first for a graceful end.
func (s *Server) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Add(6)
	go func() { defer wg.Done(); s.discover(ctx) }()
	go func() { defer wg.Done(); s.ownPartitions(ctx) }()
	go func() { defer wg.Done(); s.acks.run(ctx) }()
	go func() { defer wg.Done(); s.wake.run(ctx) }()
	go func() { defer wg.Done(); s.refreshSessions(ctx) }()
	go func() { defer wg.Done(); s.janitor(ctx) }()
	wg.Wait()
	return nil
}

// errShuttingDown ends a relay's stream when this replica stops.
var errShuttingDown = status.Error(codes.Unavailable, "server is shutting down; reconnect to another replica")

// abortGrace is how long Stop, once its deadline has passed and it has
// aborted the sessions, waits for them to end. A session blocked sending to
// a relay that does not read cannot see the abort: only closing its
// connection (grpc.Server.Stop) ends that send.
const abortGrace = time.Second

// Stop makes every session stop claiming at once (once a claim, a
// dispatching round or a handing-over ack batch under way has returned),
// waits up to ctx's deadline for their outstanding deliveries to be acked
// or nacked, then aborts the streams that still hold deliveries (their
// leases are released as each stream ends). Acks keep being applied while
// Stop waits. Subscribe streams opened from now on are refused with
// UNAVAILABLE.
//
// Stop returns by ctx's deadline plus abortGrace. It returns an error when
// some session has still not ended by then: one blocked in sending to a
// relay that stopped reading. Such a session ends, and releases its leases,
// only when its connection closes: call the gRPC server's Stop, then Wait.
func (s *Server) Stop(ctx context.Context) error {
	// Closed only once no leasing statement is under way: one that checked
	// stopping before it closed could otherwise lease an event committed
	// after it closed (see leaseGate). Such statements are bounded
	// (claimTimeout and the like); should one outlive ctx, stopping is
	// closed anyway and the promise gives way to the deadline.
	gated := make(chan struct{})
	go func() {
		defer close(gated)
		if !s.leaseGate.TryLock() {
			if h := s.stopWaits.get(); h != nil {
				h()
			}
			s.leaseGate.Lock()
		}
		s.closeStopping()
		s.leaseGate.Unlock()
	}()
	select {
	case <-gated:
	case <-ctx.Done():
		s.closeStopping()
	}
	done := s.sessionsDone()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	s.forEachSession((*session).abort)
	grace := time.NewTimer(abortGrace)
	defer grace.Stop()
	select {
	case <-done:
		return nil
	case <-grace.C:
	}
	var n int
	s.forEachSession(func(*session) { n++ })
	s.log.Warn("relay streams still sending after the shutdown deadline; they end when their connections close",
		"sessions", n)
	return fmt.Errorf("server: %d relay stream(s) still blocked sending to relays that do not read", n)
}

// closeStopping closes stopping, once. Under mu, so that no session is
// added (sessWG.Add) once Wait may have started.
func (s *Server) closeStopping() {
	s.mu.Lock()
	s.stopOnce.Do(func() { close(s.stopping) })
	s.mu.Unlock()
}

// leasing reports whether a statement that may lease events may go ahead:
// the server is not stopping. When it may, it holds leaseGate shared until
// the caller calls done, once the statement has returned; when not, done is
// nil. A caller whose statement runs as well without leasing (an ack batch
// that hands nothing over, a round that dispatches nothing) passes wait
// false: while Stop waits for the gate it leases nothing instead of
// waiting, so that acks are never held up by a claim under way.
func (s *Server) leasing(wait bool) (done func(), ok bool) {
	if !wait {
		if !s.leaseGate.TryRLock() {
			return nil, false
		}
	} else {
		s.leaseGate.RLock()
	}
	if isClosed(s.stopping) {
		s.leaseGate.RUnlock()
		return nil, false
	}
	return s.leaseGate.RUnlock, true
}

// Wait waits until every session has ended and released its leases, or ctx
// is done. After Stop and the gRPC server's Stop it is short: each remaining
// session only gives its leases back (bounded by releaseTimeout).
func (s *Server) Wait(ctx context.Context) error {
	select {
	case <-s.sessionsDone():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// sessionsDone returns a channel closed once every session has ended.
func (s *Server) sessionsDone() <-chan struct{} {
	done := make(chan struct{})
	go func() { s.sessWG.Wait(); close(done) }()
	return done
}

// addSession makes sess known locally and, for ListRelays, to every
// replica. It refuses once Stop has begun.
func (s *Server) addSession(ctx context.Context, sess *session) error {
	s.mu.Lock()
	if isClosed(s.stopping) {
		s.mu.Unlock()
		return errShuttingDown
	}
	s.sessions[sess.id] = sess
	first := len(s.sessions) == 1
	s.sessWG.Add(1)
	s.mu.Unlock()
	if first {
		s.kickOwnership()
	}
	s.metrics.sessions.Inc()
	// Not under sessionRows: this session's removal comes after this
	// returns, and the write is not cancelled with ctx, so it has landed by
	// then; a refresh's upsert of the same row meanwhile is harmless. Relays
	// connecting together thus do not wait for each other's writes.
	if err := s.writeSessionRows(ctx, []store.RelaySession{sess.record()}); err != nil && ctx.Err() == nil {
		s.log.Warn("recording relay session failed; ListRelays shows it after the next refresh", "err", err)
	}
	return nil
}

// removeSession forgets sess locally and deletes its relay-session row.
// It holds sessionRows throughout, so that a refresh of this replica's rows
// (saveSessions) that took sess into its snapshot has written before the
// row is deleted, and one that snapshots later no longer finds sess: no
// refresh writes the row of a session that has ended back.
func (s *Server) removeSession(sess *session) {
	if !s.sessionRows.TryLock() {
		if h := s.removeWaits.get(); h != nil {
			h()
		}
		s.sessionRows.Lock()
	}
	s.mu.Lock()
	delete(s.sessions, sess.id)
	last := len(s.sessions) == 0
	s.mu.Unlock()
	if last {
		s.kickOwnership()
	}
	ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
	if err := s.store.DeleteRelaySession(ctx, sess.id); err != nil {
		s.log.Warn("forgetting relay session failed; it disappears from ListRelays when stale", "err", err)
	}
	cancel()
	s.sessionRows.Unlock()
	s.metrics.sessions.Dec()
	s.sessWG.Done()
}

// released tells the local session holder that its leases of events ids
// ended, by an ack (published) or by a nack of the lease at epoch. It
// reports whether holder is a session of this replica.
func (s *Server) released(holder uuid.UUID, published bool, epoch int64, ids ...uuid.UUID) bool {
	s.mu.Lock()
	sess := s.sessions[holder]
	s.mu.Unlock()
	if sess != nil {
		sess.free(published, epoch, ids...)
	}
	return sess != nil
}

// handOverTargets returns this replica's sessions that take handed-over
// leases, with their lease TTL and window, or nil when hand-over is off.
// The caller has checked, under leaseGate, that the server is not stopping
// (see leasing). A session with a window lends the credit it
// offers (see session.lendUpTo), so that a window can grow as well as
// slide; loans says how much, for the caller to settle.
func (s *Server) handOverTargets() (targets map[uuid.UUID]store.HandOverTarget, loans map[uuid.UUID]int) {
	if s.cfg.NoHandOver {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	targets = make(map[uuid.UUID]store.HandOverTarget, len(s.sessions))
	for id, sess := range s.sessions {
		takes, spare := sess.handOverState()
		if !takes {
			continue
		}
		t := store.HandOverTarget{TTL: sess.ttl, Window: sess.window}
		// With credit free beyond the lease an ack of it ends (still
		// counted here) and what rounds have borrowed, older claimable
		// work has credit to be claimed with: the hand-over need not
		// yield to it. A windowed session's credit goes to its windows;
		// it yields as before.
		t.Spare = sess.window == 1 && spare
		if sess.window > 1 {
			if n := sess.lendUpTo(math.MaxInt); n > 0 {
				t.Credit = n
				if loans == nil {
					loans = make(map[uuid.UUID]int)
				}
				loans[id] = n
			}
		}
		targets[id] = t
	}
	return targets, loans
}

// streamFilters says which streams each local session takes, so that an ack
// batch's claim hint and hand-over order look at those streams alone.
func (s *Server) streamFilters() map[uuid.UUID]store.StreamFilter {
	s.mu.Lock()
	defer s.mu.Unlock()
	filters := make(map[uuid.UUID]store.StreamFilter, len(s.sessions))
	for id, sess := range s.sessions {
		filters[id] = sess.filter()
	}
	return filters
}

// sweepSessions asks each of these local sessions to release the leases it
// holds but does not know of.
func (s *Server) sweepSessions(holders map[uuid.UUID]store.HandOverTarget) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range holders {
		if sess := s.sessions[id]; sess != nil {
			sess.requestSweep()
		}
	}
}

// settleAcks tells the local session holder, in one step, that its leases
// of the events acked ended by an ack, that the same ack batch leased it
// leases (hand-over, or a window sliding forward), and that the loan of
// credit it made to the batch is over. When the session has ended in the
// meantime, the leases are released at once rather than left to their TTL.
func (s *Server) settleAcks(ctx context.Context, holder uuid.UUID, acked []uuid.UUID, leases []store.Lease, lent int, claimable store.ClaimHint) {
	s.handOvers.Add(uint64(len(leases)))
	s.metrics.handOvers.Add(float64(len(leases)))
	s.mu.Lock()
	sess := s.sessions[holder]
	s.mu.Unlock()
	if sess != nil && sess.settle(acked, leases, lent, claimable) {
		return
	}
	if len(leases) == 0 {
		return
	}
	// The session closed before the leases reached it. Its own release may
	// have run before this lease committed, so release again: the holder
	// is gone, so every lease it still has is orphaned.
	relCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	if _, err := s.store.Release(relCtx, holder); err != nil {
		s.log.Warn("releasing leases handed to a session that ended failed; they expire by TTL",
			"session", holder, "event_id", leases[0].Event.ID, "err", err)
	}
}

// reconcileSession makes a local session recheck its leases (a lease of its
// was ended through another replica).
func (s *Server) reconcileSession(holder uuid.UUID) {
	s.mu.Lock()
	sess := s.sessions[holder]
	s.mu.Unlock()
	if sess != nil {
		sess.requestReconcile()
	}
}

// outstandingDeliveries is how many deliveries this replica's sessions hold
// whose leases have not ended (sent or about to be, not yet acked, nacked
// or expired), counting the acks applied since their loops last turned.
func (s *Server) outstandingDeliveries() (n int64) {
	s.forEachSession(func(ss *session) { n += ss.outstanding() })
	return n
}

func (s *Server) forEachSession(fn func(*session)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sess := range s.sessions {
		fn(sess)
	}
}

// releaseTimeout bounds giving back a finished stream's leases.
const releaseTimeout = 5 * time.Second

// dbError logs a database failure and returns what the client may see: no
// SQL, no SQLSTATE, just that the service is unavailable (retry) or that the
// caller gave up.
func (s *Server) dbError(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	s.log.Error("database error", "op", op, "err", err)
	return status.Errorf(codes.Unavailable, "%s failed: database unavailable; retry", op)
}

// NewReplicaID is a replica id for a process that was given none
// (Config.ReplicaID): host, process id and a random part, unique to each
// call. A process serving several sources gives them all one, so that
// operators see one replica (internal/app).
func NewReplicaID() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), uuid.NewString()[:8])
}
