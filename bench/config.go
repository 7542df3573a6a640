package bench

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"time"

	"github.com/outboxd/outboxd/relay"
)

// Workloads, as docs/benchmark.md defines them.
const (
	// WorkloadSteady: producers at full speed over many aggregates.
	WorkloadSteady = "steady"
	// WorkloadLatency: producers open-loop at half of outboxd's steady
	// maximum, so that slow responses are not hidden by slower producers.
	WorkloadLatency = "latency"
	// WorkloadDrain: a backlog committed before delivery starts, no producers.
	WorkloadDrain = "drain"
	// WorkloadHot: every event to one aggregate, the sequential round trip.
	WorkloadHot = "hot"
	// WorkloadHotDrain: a backlog of one aggregate committed before
	// delivery starts, no producers: the sequential round trip alone, not
	// bounded by producers that serialise on the aggregate's order lock.
	WorkloadHotDrain = "hot-drain"
	// WorkloadProducer: producers only, no delivery: what recording an
	// event costs a business transaction on each producer path.
	WorkloadProducer = "producer"
	// WorkloadHeldXmin: steady while another session holds a transaction id
	// (and so the xmin horizon) open for the whole window.
	WorkloadHeldXmin = "held-xmin"
	// WorkloadManyRelays: outboxd with many relays subscribed to one
	// replica (Config.ManyRelays): first idle, to measure what the server
	// costs when nothing happens, then open-loop producers at
	// Config.ManyRelaysRate, to measure commit→sink latency when a few
	// events at a time meet hundreds of idle sessions.
	WorkloadManyRelays = "many-relays"
	// WorkloadReplicas: steady through several replicas of one database
	// (Config.Replicas), the relays spread over them: what they deliver
	// against one replica's steady run, and how the events reached the
	// relays (a discovery round's dispatch, an ack's hand-over, or a claim).
	WorkloadReplicas = "replicas"
)

// Arms, as docs/benchmark.md defines them.
const (
	// ArmCeilingInsert: a plain INSERT per transaction into a table shaped
	// like outbox.event with no trigger: the database's floor cost.
	ArmCeilingInsert = "ceiling-insert"
	// ArmCeilingInsertMark: the same plus a second transaction per event
	// setting published_at, the least any marking relay must do.
	ArmCeilingInsertMark = "ceiling-insert-mark"
	// ArmNaivePoller: the textbook outbox protocol in SQL, publishing inside
	// the transaction that locks the aggregate.
	ArmNaivePoller = "naive-poller"
	// ArmOutboxd: client.Emit, the real server and relays over loopback gRPC.
	ArmOutboxd = "outboxd"
	// ArmWatermill: Watermill SQL Pub/Sub on PostgreSQL (the queue schema
	// and offsets adapter), published inside the producer's transaction,
	// one subscriber at the library's default poll interval (1s).
	ArmWatermill = "watermill"
	// ArmWatermill10ms: the same with a 10ms poll interval.
	ArmWatermill10ms = "watermill-10ms"
	// ArmRiver: one River job per producer transaction (InsertTx), worked
	// by a River client with its recommended settings.
	ArmRiver = "river"

	// ArmEmit and ArmInsertTrigger are the producer workload's outbox paths,
	// measured against ArmCeilingInsert: a call of outbox.emit, and
	// client.Emit, a plain INSERT into outbox.event whose trigger keeps the
	// bookkeeping.
	ArmEmit          = "emit"
	ArmInsertTrigger = "insert-trigger"
)

// Holders of the held-xmin workload: who keeps a transaction id open.
const (
	// HolderOtherDB is a transaction with an assigned id in another
	// database of the same cluster (the maintenance database).
	HolderOtherDB = "other-db"
	// HolderSameDBRR is a REPEATABLE READ transaction in the arm's own
	// database that took its snapshot and an id (pg_current_xact_id()).
	HolderSameDBRR = "same-db-rr"
)

// AllWorkloads and AllArms list every workload and selectable arm in the
// order they run. The producer workload always runs its three paths
// (ceiling-insert, emit, insert-trigger), whatever Arms says.
var (
	AllWorkloads = append(DefaultWorkloads[:len(DefaultWorkloads):len(DefaultWorkloads)], WorkloadSources, WorkloadIdleSources)
	// DefaultWorkloads run when none is named: all but the sources
	// workloads, which make bench-sources runs on their own (they create
	// dozens of databases and would lengthen make bench past its budget).
	DefaultWorkloads = []string{WorkloadSteady, WorkloadLatency, WorkloadDrain, WorkloadHot, WorkloadHotDrain, WorkloadProducer, WorkloadHeldXmin, WorkloadManyRelays, WorkloadReplicas}
	AllArms          = []string{ArmCeilingInsert, ArmCeilingInsertMark, ArmNaivePoller, ArmOutboxd, ArmWatermill, ArmWatermill10ms, ArmRiver}
	// PeerArms are the libraries users would pick instead of outboxd. None
	// promises per-aggregate order, so their reorders are reported and do
	// not fail a run.
	PeerArms = []string{ArmWatermill, ArmWatermill10ms, ArmRiver}
)

// promisesOrder says whether a reordered event fails the arm.
func promisesOrder(arm string) bool { return !slices.Contains(PeerArms, arm) }

// Config configures a benchmark run. Zero fields take the standard set's
// values, or the reduced set's when Quick is set.
type Config struct {
	// DatabaseURL names the PostgreSQL server and a database on it to
	// connect to (its maintenance database, usually postgres); every
	// database the run uses is created there and dropped at the end.
	// Required.
	DatabaseURL string
	// Workloads and Arms select what runs; empty means DefaultWorkloads and
	// all arms.
	Workloads []string
	Arms      []string
	// Duration is each arm's measured window. Default 10s (quick: 3s).
	Duration time.Duration
	// Warmup runs producers and delivery before the window opens. Default
	// 2s (quick: 1s).
	Warmup time.Duration
	// Producers is P, the producer connections of every arm. Default 8.
	Producers int
	// Relays is K: outboxd's relay connections and the naive poller's
	// workers. Default 4.
	Relays int
	// MaxInFlight is each relay's credit. Default relay.DefaultMaxInFlight
	// (what outboxd relay asks for), and at least 1,000
	// across the K relays in the drain workload (the RSS goal of
	// docs/benchmark.md).
	MaxInFlight int
	// Aggregates is how many aggregates steady and latency spread events
	// over, uniformly. Default 10,000.
	Aggregates int
	// SinkLatencies are the broker round trips the sink stands in for.
	// Steady runs the delivering arms at each; the other workloads use the
	// first. Default 0, 1ms, 5ms (quick: 0, 1ms).
	SinkLatencies []time.Duration
	// DrainSizes are the backlogs the drain workload delivers from, each
	// spread over size/10 aggregates, for at most twice Duration. Default
	// 10k, 100k, 1M (quick: 10k, 50k).
	DrainSizes []int
	// LatencyRate, when positive, is the latency workload's open-loop
	// producer rate in events/s instead of half of outboxd's steady rate in
	// the same run: two builds compared back to back then carry the same
	// load. Default 0.
	LatencyRate float64
	// ManyRelays is how many relays the many-relays workload subscribes,
	// each on its own connection. Default 300 (quick: 100).
	ManyRelays int
	// ManyRelaysRate is the many-relays workload's open-loop producer rate
	// in events/s. Default 500.
	ManyRelaysRate float64
	// Replicas is how many replicas the replicas workload runs on its
	// database; Config.Relays relays spread over them. Default 2.
	Replicas int
	// Sources is how many source databases the sources workload puts
	// behind one server: one heavy, the rest light. Default 20.
	Sources int
	// SourcesLightRate is each light source's open-loop producer rate in
	// events/s. Default 20.
	SourcesLightRate float64
	// SourcesNamedStream makes the sources workloads' relays subscribe to
	// "source/bench" rather than "source/*": a Subscribe that names its
	// stream, as relays with --route do, against one that takes every
	// stream of its source, as the steady arm's relays take every stream.
	SourcesNamedStream bool
	// IdleSources is how many idle source databases the idle-sources
	// workload puts behind one server. Default 50.
	IdleSources int
	// IdleSourcesSettle is the least warm-up before each idle-sources
	// window: the sources' discovery loops go quiet after 10s without
	// events (server.Config.DiscoveryQuietAfter), and the window measures
	// them quiet. Default 12s.
	IdleSourcesSettle time.Duration
	// Quick selects the reduced set's defaults (about a minute in all).
	Quick bool
	// ServerBinary is the outboxd binary whose `serve` command runs the
	// server in a child process (BuildServer makes one). Required when an
	// arm needs the server.
	ServerBinary string
	// ServeFlags are extra flags for the child's serve command (say
	// --ack-committers=2), to measure a setting other than the defaults.
	ServeFlags []string
	// SinkURL, when set, names a real broker (a relay sink URL such as
	// nats://host:4222) every delivery is published to before the
	// in-process sink counts it.
	SinkURL string
	// Logger receives the server's and relays' warnings. Default: discard.
	Logger *slog.Logger
	// Progress receives one line per arm as the run goes. Default: discard.
	Progress io.Writer
	// Command is the command line to record in the report.
	Command string

	// sinkFault, when set, breaks the sources workloads' sink for some
	// deliveries: the tests' proof that their account catches a lost or
	// duplicated event.
	sinkFault func(relay.Event) sinkFault
}

func (c *Config) setDefaults() error {
	if c.DatabaseURL == "" {
		return errors.New("bench: Config.DatabaseURL is required (--database-url)")
	}
	if len(c.Workloads) == 0 {
		c.Workloads = DefaultWorkloads
	}
	if len(c.Arms) == 0 {
		c.Arms = AllArms
	}
	for _, w := range c.Workloads {
		if !slices.Contains(AllWorkloads, w) {
			return fmt.Errorf("bench: unknown workload %q (--workload): want some of %v", w, AllWorkloads)
		}
	}
	for _, a := range c.Arms {
		if !slices.Contains(AllArms, a) {
			return fmt.Errorf("bench: unknown arm %q (--arms): want some of %v", a, AllArms)
		}
	}
	quick := func(std, q time.Duration) time.Duration {
		if c.Quick {
			return q
		}
		return std
	}
	if c.Duration == 0 {
		c.Duration = quick(10*time.Second, 3*time.Second)
	}
	if c.Warmup == 0 {
		c.Warmup = quick(2*time.Second, time.Second)
	}
	if c.Producers == 0 {
		c.Producers = 8
	}
	if c.Relays == 0 {
		c.Relays = 4
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = relay.DefaultMaxInFlight
	}
	if c.Aggregates == 0 {
		c.Aggregates = 10_000
	}
	if c.ManyRelays == 0 {
		c.ManyRelays = 300
		if c.Quick {
			c.ManyRelays = 100
		}
	}
	if c.Replicas == 0 {
		c.Replicas = 2
	}
	if c.Sources == 0 {
		c.Sources = 20
	}
	if c.SourcesLightRate == 0 {
		c.SourcesLightRate = 20
	}
	if c.IdleSourcesSettle == 0 {
		c.IdleSourcesSettle = 12 * time.Second
	}
	if c.IdleSources == 0 {
		c.IdleSources = 50
	}
	if c.ManyRelaysRate == 0 {
		c.ManyRelaysRate = 500
	}
	if len(c.SinkLatencies) == 0 {
		c.SinkLatencies = []time.Duration{0, time.Millisecond, 5 * time.Millisecond}
		if c.Quick {
			c.SinkLatencies = c.SinkLatencies[:2]
		}
	}
	if len(c.DrainSizes) == 0 {
		c.DrainSizes = []int{10_000, 100_000, 1_000_000}
		if c.Quick {
			c.DrainSizes = []int{10_000, 50_000}
		}
	}
	if c.ServerBinary == "" && c.uses(ArmOutboxd) && (len(c.Workloads) > 1 || !c.runs(WorkloadProducer)) {
		return errors.New("bench: Config.ServerBinary is required to run the outboxd arm (--server-binary, or BuildServer)")
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
	switch {
	case c.Duration < 0 || c.Warmup < 0:
		return fmt.Errorf("bench: Config.Duration %v and Warmup %v (--duration, --warmup) must not be negative", c.Duration, c.Warmup)
	case c.Producers < 1:
		return fmt.Errorf("bench: Config.Producers %d (--producers) must be positive", c.Producers)
	case c.Relays < 1:
		return fmt.Errorf("bench: Config.Relays %d (--relays) must be positive", c.Relays)
	case c.MaxInFlight < 1:
		return fmt.Errorf("bench: Config.MaxInFlight %d (--max-in-flight) must be positive", c.MaxInFlight)
	case c.ManyRelays < 1:
		return fmt.Errorf("bench: Config.ManyRelays %d (--many-relays) must be positive", c.ManyRelays)
	case c.ManyRelaysRate < 0 || math.IsNaN(c.ManyRelaysRate) || math.IsInf(c.ManyRelaysRate, 0):
		return fmt.Errorf("bench: Config.ManyRelaysRate %v (--many-relays-rate) must be a positive rate", c.ManyRelaysRate)
	case c.Replicas < 2:
		return fmt.Errorf("bench: Config.Replicas %d (--replicas) must be at least 2", c.Replicas)
	case c.runs(WorkloadReplicas) && c.Relays < c.Replicas:
		return fmt.Errorf("bench: the replicas workload spreads Config.Relays %d (--relays) over Config.Replicas %d (--replicas): give every replica a relay", c.Relays, c.Replicas)
	case c.Sources < 2:
		return fmt.Errorf("bench: Config.Sources %d (--sources) must be at least 2 (one heavy source, the rest light)", c.Sources)
	case c.SourcesLightRate < 0 || math.IsNaN(c.SourcesLightRate) || math.IsInf(c.SourcesLightRate, 0):
		return fmt.Errorf("bench: Config.SourcesLightRate %v (--sources-light-rate) must be a positive rate", c.SourcesLightRate)
	case c.IdleSources < 1:
		return fmt.Errorf("bench: Config.IdleSources %d (--idle-sources) must be positive", c.IdleSources)
	case c.Aggregates < 1:
		return fmt.Errorf("bench: Config.Aggregates %d (--aggregates) must be positive", c.Aggregates)
	case c.LatencyRate < 0 || math.IsNaN(c.LatencyRate) || math.IsInf(c.LatencyRate, 0):
		return fmt.Errorf("bench: Config.LatencyRate %v (--latency-rate) must be a positive rate, or 0 for half the steady rate", c.LatencyRate)
	}
	for _, l := range c.SinkLatencies {
		if l < 0 {
			return fmt.Errorf("bench: sink latency %v (--sink-latency) must not be negative", l)
		}
	}
	for _, n := range c.DrainSizes {
		if n < 10 {
			return fmt.Errorf("bench: drain size %d (--drain-sizes) must be at least 10 (10 events per aggregate)", n)
		}
	}
	return nil
}

func (c *Config) runs(workload string) bool { return slices.Contains(c.Workloads, workload) }
func (c *Config) uses(arm string) bool      { return slices.Contains(c.Arms, arm) }
