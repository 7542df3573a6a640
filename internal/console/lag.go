package console

import (
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/advice"
)

// maxSampledStreams bounds the streams one sample keeps (the ones with the
// most pending events), so the ring's memory is bounded whatever the
// number of streams.
const maxSampledStreams = 50

// point is one stream's figures in a sample.
type point struct {
	Pending    int64   `json:"pending"`
	OldestAgeS float64 `json:"oldest_age_s"`
	Rate       float64 `json:"rate"`
}

type sample struct {
	at      time.Time
	streams map[string]point
}

// lagRing keeps the last samples of GetLag, oldest first.
type lagRing struct {
	mu   sync.Mutex
	buf  []sample
	next int
	full bool
}

func newLagRing(n int) *lagRing { return &lagRing{buf: make([]sample, max(n, 1))} }

func (g *lagRing) add(at time.Time, lag *outboxv1.GetLagResponse) {
	streams := slices.Clone(lag.GetStreams())
	slices.SortFunc(streams, func(a, b *outboxv1.StreamLag) int {
		return int(min(max(b.GetPendingEvents()-a.GetPendingEvents(), -1), 1))
	})
	s := sample{at: at, streams: make(map[string]point, min(len(streams), maxSampledStreams))}
	for _, l := range streams[:min(len(streams), maxSampledStreams)] {
		s.streams[streamAddress(l)] = pointOf(l)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.buf[g.next] = s
	g.next = (g.next + 1) % len(g.buf)
	g.full = g.full || g.next == 0
}

func pointOf(l *outboxv1.StreamLag) point {
	return point{Pending: l.GetPendingEvents(), OldestAgeS: l.GetOldestPendingAge().AsDuration().Seconds(), Rate: l.GetDeliveredPerSecond()}
}

// samples returns the samples oldest first.
func (g *lagRing) samples() []sample {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.full {
		return slices.Clone(g.buf[:g.next])
	}
	return append(slices.Clone(g.buf[g.next:]), g.buf[:g.next]...)
}

// lagJSON is what the overview polls: the current lag, asked with the
// session's token, and the sampled history, narrowed to the streams the
// token may see.
type lagJSON struct {
	Now     time.Time   `json:"now"`
	Error   string      `json:"error,omitempty"`
	Streams []streamRow `json:"streams"`
	Total   streamRow   `json:"total"`
	Relays  uint32      `json:"connected_relays"`
	// Sources is set when the replica serves more than default.
	Sources []sourceLag `json:"sources,omitempty"`
	// Warnings are the conditions of the report that need an operator,
	// worded as `outboxd lag` words them (warningsOf).
	Warnings  []string    `json:"warnings"`
	History   []histPoint `json:"history"`
	IntervalS float64     `json:"interval_s"`
	WindowS   float64     `json:"window_s"`
}

type histPoint struct {
	At      time.Time        `json:"at"`
	Streams map[string]point `json:"streams"`
	Total   point            `json:"total"`
}

// streamRow is one row of the streams table.
type streamRow struct {
	Stream     string  `json:"stream"`
	Pending    int64   `json:"pending"`
	Aggregates int64   `json:"aggregates"`
	OldestAgeS float64 `json:"oldest_age_s"`
	Oldest     string  `json:"oldest"`
	Rate       float64 `json:"rate"`
	Ready      int64   `json:"ready"`
	Leased     int64   `json:"leased"`
	Backoff    int64   `json:"backoff"`
	Parked     int64   `json:"parked"`
	Gap        int64   `json:"gap"`
	Stalled    int64   `json:"stalled"`
	IdleRelays int64   `json:"idle_relays"`
	Stranded   int64   `json:"stranded"`
}

func rowOf(l *outboxv1.StreamLag) streamRow {
	age := l.GetOldestPendingAge().AsDuration()
	return streamRow{
		Stream: streamAddress(l), Pending: l.GetPendingEvents(), Aggregates: l.GetPendingAggregates(),
		OldestAgeS: age.Seconds(), Oldest: humanDuration(age, l.GetPendingEvents() > 0), Rate: l.GetDeliveredPerSecond(),
		Ready: l.GetReadyAggregates(), Leased: l.GetLeasedAggregates(), Backoff: l.GetBackingOffAggregates(),
		Parked: l.GetParkedAggregates(), Gap: l.GetGapAggregates(), Stalled: l.GetStalledAggregates(),
		IdleRelays: l.GetIdleRelays(), Stranded: l.GetStrandedEvents(),
	}
}

func (c *Console) lagJSON(q *request) {
	out := lagJSON{Now: time.Now(), IntervalS: c.cfg.SampleInterval.Seconds(), WindowS: c.cfg.History.Seconds(),
		Streams: []streamRow{}, History: []histPoint{}, Warnings: []string{}}
	lag, err := c.admin.GetLag(q.ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		out.Error = describe(err)
	} else {
		for _, l := range lag.GetStreams() {
			out.Streams = append(out.Streams, rowOf(l))
		}
		out.Total, out.Relays, out.Sources = rowOf(lag.GetTotal()), lag.GetConnectedRelays(), sourcesOf(lag)
		out.Warnings = warningsOf(lag)
	}
	for _, s := range c.ring.samples() {
		h := histPoint{At: s.at, Streams: map[string]point{}}
		for name, p := range s.streams {
			if q.who != nil && !q.who.AllowsStream(name) {
				continue
			}
			h.Streams[name] = p
			h.Total.Pending += p.Pending
			h.Total.Rate += p.Rate
			h.Total.OldestAgeS = max(h.Total.OldestAgeS, p.OldestAgeS)
		}
		out.History = append(out.History, h)
	}
	q.w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(q.w).Encode(out)
}

// warningsOf lists what a lag report says needs an operator beyond its
// figures: a source whose figures could not be read (its pending events
// are in none of them, the totals included), a stopped discovery (new
// events are not found) and a held xmin horizon (delivery slows while it
// lasts).
func warningsOf(lag *outboxv1.GetLagResponse) []string {
	warnings := []string{}
	for _, src := range lag.GetSources() {
		if src.GetLagUnknown() {
			warnings = append(warnings, fmt.Sprintf("Source %s: its lag could not be read (%s); its pending events are in none of these figures",
				src.GetName(), src.GetReason()))
		}
	}
	if stopped := lag.GetDiscoveryStopped(); stopped != "" {
		warnings = append(warnings, "Discovery stopped: "+stopped)
	}
	if held := advice.XminHorizon(lag.GetXminHorizon(), time.UTC); held != "" {
		warnings = append(warnings, "PostgreSQL's xmin horizon is held "+held)
	}
	return warnings
}

// streamAddress names a stream as operators and token scopes do: the bare
// name for the default source, "source/stream" for another.
func streamAddress(l *outboxv1.StreamLag) string {
	if src := l.GetSource(); src != "" {
		return src + "/" + l.GetStream()
	}
	return l.GetStream()
}
