package server

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxd/outboxd/internal/ration"
	"github.com/outboxd/outboxd/internal/store"
)

// metrics are the replica's Prometheus instruments. Labels are bounded:
// outcomes, states and stream names, never an aggregate or an event.
type metrics struct {
	deliveries      prometheus.Counter
	redeliveries    prometheus.Counter
	discovered      prometheus.Counter
	discoveryErrors prometheus.Counter
	discoveryStop   prometheus.Gauge
	discoveryAsleep prometheus.Gauge
	acks            *prometheus.CounterVec
	nacks           *prometheus.CounterVec
	leasesExpired   prometheus.Counter
	purged          prometheus.Counter
	ackDuration     prometheus.Histogram
	publishLag      prometheus.Histogram
	sessions        prometheus.Gauge
	handOvers       prometheus.Counter
	dispatched      prometheus.Counter
	claimed         prometheus.Counter
	partitionsOwned prometheus.Gauge
}

func newMetrics() *metrics {
	return &metrics{
		deliveries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_deliveries_total",
			Help: "Events sent to relays, counting every attempt.",
		}),
		redeliveries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_redeliveries_total",
			Help: "Deliveries of an event that had been delivered before (after a nack, an expired lease or a relay that went away).",
		}),
		discovered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_discovered_events_total",
			Help: "Newly committed events found by this replica's discovery rounds.",
		}),
		discoveryErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_discovery_errors_total",
			Help: "Discovery rounds of this replica that failed (retried; new events wait meanwhile).",
		}),
		discoveryStop: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outboxd_discovery_stopped",
			Help: "1 while this replica finds discovery stopped (the database moved to another PostgreSQL cluster or its transaction counter was set back; new events wait for `outboxd rescan`), else 0.",
		}),
		discoveryAsleep: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outboxd_discovery_asleep",
			Help: "1 while this replica's discovery sleeps (its source was quiet: producers' commits wake it, and it checks once a second meanwhile), else 0. At most one replica per source sleeps.",
		}),
		acks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outboxd_acks_total",
			Help: "Acked deliveries by result: published, already_published, lease_lost, not_found, invalid, retry.",
		}, []string{"result"}),
		nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outboxd_nacks_total",
			Help: "Failed publishes reported by relays, by outcome: backoff (retried later) or parked.",
		}, []string{"outcome"}),
		leasesExpired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_leases_expired_total",
			Help: "Leases this replica granted that ended without an ack or nack from their holder: expired and leased again, or ended by an operator's skip.",
		}),
		purged: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_purged_events_total",
			Help: "Published events deleted by the retention janitor.",
		}),
		ackDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outboxd_ack_duration_seconds",
			Help:    "Time to answer one ack request (an Ack call, or a request on an AckStream), including its group commit.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		publishLag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outboxd_commit_to_published_seconds",
			Help:    "From an event's created_at to the commit that marked it published (database clock).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 20),
		}),
		sessions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outboxd_relay_sessions",
			Help: "Relay Subscribe streams open on this replica.",
		}),
		handOvers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_hand_overs_total",
			Help: "Leases an ack gave straight to the session whose lease it ended, on the aggregate's next event (no claim in between).",
		}),
		dispatched: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_dispatched_total",
			Help: "Leases a discovery round gave straight to a waiting session, on the next event of an aggregate it found idle (no claim in between).",
		}),
		claimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outboxd_claimed_total",
			Help: "Leases sessions' claims took from the claimable aggregates: work no discovery round or ack gave a session directly. A large share of outboxd_deliveries_total means the relays' credit runs out (each claim costs the database more, far more under a held xmin horizon).",
		}),
		partitionsOwned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outboxd_partitions_owned",
			Help: "Partitions of the aggregates (of 256) this replica owns: about an equal share among the replicas with relay sessions, none on a replica without.",
		}),
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.deliveries, m.redeliveries, m.discovered, m.discoveryErrors, m.discoveryStop, m.discoveryAsleep, m.acks, m.nacks, m.leasesExpired,
		m.purged, m.ackDuration, m.publishLag, m.sessions, m.handOvers, m.dispatched, m.claimed,
		m.partitionsOwned}
}

// lagCollector exports the database's backlog as gauges at scrape time. The
// figures are database-wide, so every replica reports the same values:
// aggregate them with max(), not sum(). Results are cached for a few seconds
// so that several scrapers cost one query, and where a read is slow for
// ration.Share times as long as it took: a lag read costs PostgreSQL in
// proportion to the aggregates pending (seconds with a million), and
// scraped every 15 s a database that far behind would spend a core on its
// own metrics.
type lagCollector struct {
	s       *Server
	cacheOK time.Duration
	readLag func(context.Context) (store.Lag, error)
	now     func() time.Time

	pending       *prometheus.Desc
	oldest        *prometheus.Desc
	aggregates    *prometheus.Desc
	delivered     *prometheus.Desc
	stranded      *prometheus.Desc
	stalled       *prometheus.Desc
	idleRelays    *prometheus.Desc
	relays        *prometheus.Desc
	xminHorizon   *prometheus.Desc
	scrapeSuccess *prometheus.Desc

	mu      sync.Mutex
	at      time.Time     // when the last read began
	took    time.Duration // how long it ran
	lag     store.Lag
	lastErr error
}

// lagReadTimeout ends a lag read for the metrics that runs longer than
// this. Not the scrape's few seconds: a read past them would fail every
// scrape of a database far behind, when the figures matter most. A scrape
// that gives up first leaves the read to finish, and the scrapes after it
// are answered from it.
const lagReadTimeout = time.Minute

func newLagCollector(s *Server) *lagCollector {
	return &lagCollector{
		s: s, cacheOK: 2 * time.Second,
		readLag: func(ctx context.Context) (store.Lag, error) { return s.lag(ctx, nil) },
		now:     time.Now,
		pending: prometheus.NewDesc("outboxd_pending_events",
			"Events neither published nor skipped, per stream (database-wide).", []string{"stream"}, nil),
		oldest: prometheus.NewDesc("outboxd_oldest_pending_age_seconds",
			"Age of the oldest pending event, per stream, parked and backing-off work included (database-wide).", []string{"stream"}, nil),
		aggregates: prometheus.NewDesc("outboxd_pending_aggregates",
			"Aggregates with pending events, per stream and delivery state: ready, leased, backoff, parked, gap (database-wide).",
			[]string{"stream", "state"}, nil),
		delivered: prometheus.NewDesc("outboxd_delivered_last_minute",
			"Events marked published in the last minute, per stream (database-wide).", []string{"stream"}, nil),
		stranded: prometheus.NewDesc("outboxd_stranded_events",
			"Pending events no rule will deliver, per stream (database-wide), as of the last audit (about a minute old at most; none before the first); anything but 0 needs an operator.", []string{"stream"}, nil),
		stalled: prometheus.NewDesc("outboxd_stalled_aggregates",
			"Aggregates whose deliveries keep ending without progress (leases expiring or publishes failing repeatedly), per stream (database-wide).",
			[]string{"stream"}, nil),
		idleRelays: prometheus.NewDesc("outboxd_idle_relays",
			"Connected relays holding no delivery while a ready aggregate of the stream has waited longer than outbox.settings.idle_relay_after, per stream (database-wide).",
			[]string{"stream"}, nil),
		relays: prometheus.NewDesc("outboxd_connected_relays",
			"Relay Subscribe streams open on all replicas (database-wide).", nil, nil),
		xminHorizon: prometheus.NewDesc("outboxd_xmin_horizon_age_transactions",
			"Transactions since the database's xmin horizon as held furthest back by a transaction, snapshot, prepared transaction, replication slot or standby (small while none is held long). PostgreSQL keeps every row version written since, and delivery slows as they pile up: GetLag (outboxd lag) names the holder.", nil, nil),
		scrapeSuccess: prometheus.NewDesc("outboxd_lag_scrape_success",
			"1 if the backlog figures above could be read from the database, else 0.", nil, nil),
	}
}

func (c *lagCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.pending, c.oldest, c.aggregates, c.delivered, c.stranded, c.stalled, c.idleRelays, c.relays, c.xminHorizon, c.scrapeSuccess} {
		ch <- d
	}
}

func (c *lagCollector) Collect(ch chan<- prometheus.Metric) {
	lag, err := c.read()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.scrapeSuccess, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeSuccess, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(c.relays, prometheus.GaugeValue, float64(lag.ConnectedRelays))
	ch <- prometheus.MustNewConstMetric(c.xminHorizon, prometheus.GaugeValue, float64(lag.XminHorizon.Age))
	for _, l := range lag.Streams {
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(l.PendingEvents), l.Stream)
		age := 0.0
		if !l.OldestPending.IsZero() {
			age = max(0, lag.Now.Sub(l.OldestPending).Seconds())
		}
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, age, l.Stream)
		for state, n := range map[string]int64{"ready": l.Ready, "leased": l.Leased, "backoff": l.Backoff, "parked": l.Parked, "gap": l.Gap} {
			ch <- prometheus.MustNewConstMetric(c.aggregates, prometheus.GaugeValue, float64(n), l.Stream, state)
		}
		ch <- prometheus.MustNewConstMetric(c.delivered, prometheus.GaugeValue, float64(l.DeliveredLastMinute), l.Stream)
		if !lag.StrandedAt.IsZero() { // else unknown until the first audit ends: no sample, not a 0
			ch <- prometheus.MustNewConstMetric(c.stranded, prometheus.GaugeValue, float64(l.Stranded), l.Stream)
		}
		ch <- prometheus.MustNewConstMetric(c.stalled, prometheus.GaugeValue, float64(l.Stalled), l.Stream)
		ch <- prometheus.MustNewConstMetric(c.idleRelays, prometheus.GaugeValue, float64(len(l.IdleRelays)), l.Stream)
	}
}

func (c *lagCollector) read() (store.Lag, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && c.now().Sub(c.at) < ration.Pause(c.cacheOK, c.took) {
		return c.lag, c.lastErr
	}
	ctx, cancel := context.WithTimeout(context.Background(), lagReadTimeout)
	defer cancel()
	began := c.now()
	c.lag, c.lastErr = c.readLag(ctx)
	c.at, c.took = began, c.now().Sub(began)
	if c.lastErr != nil {
		c.s.log.Warn("reading backlog for metrics failed", "err", c.lastErr)
	}
	return c.lag, c.lastErr
}
