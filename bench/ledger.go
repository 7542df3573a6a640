package bench

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Counts is the correctness account of one arm. Lost and Reordered must be
// zero; Duplicates are allowed (delivery is at-least-once) but reported.
type Counts struct {
	// Committed is how many events the producers committed (or the drain
	// workload inserted before delivery started).
	Committed int64 `json:"committed"`
	// Delivered is how many distinct committed events reached the sink.
	Delivered int64 `json:"delivered"`
	// Duplicates counts deliveries of an event beyond its first.
	Duplicates int64 `json:"duplicates"`
	// Reordered counts events whose first delivery came before that of an
	// earlier event of the same aggregate: a lower revision, or an event the
	// same producer committed earlier (the sequence number in the payload, a
	// check that does not trust the revision the server reports). An event
	// counts once even if both checks flag it.
	Reordered int64 `json:"reordered"`
	// Lost counts committed events that never reached the sink although the
	// database marks them published (a mark without the broker's
	// acceptance) or no longer holds them.
	Lost int64 `json:"lost"`
	// Backlog counts committed events that had not reached the sink when the
	// arm stopped and are still pending in the database: late, not lost.
	Backlog int64 `json:"backlog"`
	// Unacked counts events that reached the sink but are not marked
	// published (the ack was still in flight when the arm stopped); a real
	// relay would see them again.
	Unacked int64 `json:"unacked"`
	// Unexpected counts events the sink received that no producer committed.
	Unexpected int64 `json:"unexpected"`
}

// Failed reports whether the account shows a correctness failure.
func (c Counts) Failed() bool { return c.Lost > 0 || c.Reordered > 0 || c.Unexpected > 0 }

// dbState is what the database says about one event after the arm stopped.
type dbState uint8

const (
	dbMissing dbState = iota // not (or no longer) in the table
	dbPending
	dbPublished
)

// ledgerShards spreads the ledger's locks so producers and relays working on
// different aggregates rarely meet.
const ledgerShards = 64

// Ledger is the record of every event of one arm: which events the
// producers committed and when, which the sink received, when, how often and
// in what order, and finally what the database says about each. Every
// correctness figure and every latency comes from it. It is safe for
// concurrent use; the methods that take a time take it as an argument so
// that tests can drive them without a clock.
type Ledger struct {
	producers  int
	shards     [ledgerShards]sync.Mutex
	aggregates []aggregateLog

	committed atomic.Int64 // events committed so far
	delivered atomic.Int64 // first deliveries so far
	scanned   atomic.Bool  // the database state was recorded
	// absentAcked says the table deletes acked events, so a delivered event
	// the scan did not find was acked.
	absentAcked atomic.Bool
}

// aggregateLog is the ledger of one aggregate; its events are indexed by
// revision-1 (revisions count from 1 in a fresh database).
type aggregateLog struct {
	events []eventLog
	// contiguous says revisions 1..contiguous have all reached the sink.
	contiguous int64
	// lastSeq holds, per producer, the payload sequence number of its latest
	// event of this aggregate that reached the sink.
	lastSeq []int64
}

type eventLog struct {
	committedNs int64 // when the producer saw the commit; 0 when prefilled
	committed   bool
	firstSinkNs int64
	deliveries  int32
	reordered   bool
	db          dbState
	publishedNs int64
}

// NewLedger returns a ledger for aggregates numbered 0..aggregates-1 and
// producers numbered 0..producers-1.
func NewLedger(aggregates, producers int) *Ledger {
	return &Ledger{producers: producers, aggregates: make([]aggregateLog, aggregates)}
}

func (l *Ledger) lock(agg int) func() {
	mu := &l.shards[agg%ledgerShards]
	mu.Lock()
	return mu.Unlock
}

// event returns the record of revision rev of a, growing the log as needed.
// The caller holds a's shard lock.
func (a *aggregateLog) event(rev int64) *eventLog {
	for int64(len(a.events)) < rev {
		a.events = append(a.events, eventLog{})
	}
	return &a.events[rev-1]
}

func (l *Ledger) check(agg int, rev int64) error {
	if agg < 0 || agg >= len(l.aggregates) {
		return fmt.Errorf("bench: aggregate %d is outside 0..%d", agg, len(l.aggregates)-1)
	}
	if rev < 1 {
		return fmt.Errorf("bench: aggregate %d: revision %d is not positive", agg, rev)
	}
	return nil
}

// Commit records that a producer saw revision rev of aggregate agg commit at
// atNs (Unix nanoseconds). Committing the same revision twice is an error:
// the database promised revisions unique per aggregate.
func (l *Ledger) Commit(agg int, rev int64, atNs int64) error {
	if err := l.check(agg, rev); err != nil {
		return err
	}
	defer l.lock(agg)()
	e := l.aggregates[agg].event(rev)
	if e.committed {
		return fmt.Errorf("bench: aggregate %d revision %d committed twice", agg, rev)
	}
	e.committed, e.committedNs = true, atNs
	l.committed.Add(1)
	return nil
}

// Prefill records revisions 1..n of agg as committed before the measurement
// started (the drain workload's backlog).
func (l *Ledger) Prefill(agg int, n int64) error {
	if err := l.check(agg, max(n, 1)); err != nil {
		return err
	}
	defer l.lock(agg)()
	a := &l.aggregates[agg]
	for rev := int64(1); rev <= n; rev++ {
		e := a.event(rev)
		if !e.committed {
			e.committed = true
			l.committed.Add(1)
		}
	}
	return nil
}

// Delivery says what a delivery was.
type Delivery int

// Outcomes of Ledger.Deliver.
const (
	// FirstDelivery is the first time the event reached the sink, in order.
	FirstDelivery Delivery = iota + 1
	// ReorderedDelivery is a first delivery that overtook an earlier event of
	// its aggregate.
	ReorderedDelivery
	// DuplicateDelivery is a repeat of an event the sink already has.
	DuplicateDelivery
)

// Deliver records that the sink received revision rev of aggregate agg at
// atNs. producer and seq come from the event's payload (producer < 0 when no
// producer wrote it, as for the drain backlog): within one aggregate, the
// events of one producer must arrive in the order it committed them.
func (l *Ledger) Deliver(agg int, rev int64, producer int, seq int64, atNs int64) (Delivery, error) {
	if err := l.check(agg, rev); err != nil {
		return 0, err
	}
	defer l.lock(agg)()
	a := &l.aggregates[agg]
	e := a.event(rev)
	e.deliveries++
	if e.deliveries > 1 {
		return DuplicateDelivery, nil
	}
	e.firstSinkNs = atNs
	l.delivered.Add(1)

	// An earlier revision has not arrived yet: this event overtook it.
	if rev > a.contiguous+1 {
		e.reordered = true
	}
	if producer >= 0 && producer < l.producers {
		if a.lastSeq == nil {
			a.lastSeq = make([]int64, l.producers)
		}
		if seq <= a.lastSeq[producer] {
			e.reordered = true // the producer committed this one earlier
		} else {
			a.lastSeq[producer] = seq
		}
	}
	for a.contiguous < int64(len(a.events)) && a.events[a.contiguous].deliveries > 0 {
		a.contiguous++
	}
	if e.reordered {
		return ReorderedDelivery, nil
	}
	return FirstDelivery, nil
}

// RecordDB records what the database holds for revision rev of agg after the
// arm stopped: published at publishedNs, or still pending when publishedNs
// is 0 (publishedNs < 0: published at a time the database does not
// record). Events never recorded count as missing from the database.
func (l *Ledger) RecordDB(agg int, rev int64, publishedNs int64) error {
	if err := l.check(agg, rev); err != nil {
		return err
	}
	defer l.lock(agg)()
	e := l.aggregates[agg].event(rev)
	if publishedNs == 0 {
		e.db = dbPending
	} else {
		e.db, e.publishedNs = dbPublished, publishedNs
	}
	return nil
}

// MarkScanned says the database's state has been recorded for every event
// it holds, so that an event never recorded is known to be missing.
func (l *Ledger) MarkScanned() { l.scanned.Store(true) }

// MarkAbsentAcked says the arm deletes an event once it is acked, so a
// delivered event missing from the database is not unacked.
func (l *Ledger) MarkAbsentAcked() { l.absentAcked.Store(true) }

// Committed is how many events have been committed so far.
func (l *Ledger) Committed() int64 { return l.committed.Load() }

// Delivered is how many distinct events have reached the sink so far.
func (l *Ledger) Delivered() int64 { return l.delivered.Load() }

// Counts returns the correctness account. Without a recorded database state
// an undelivered event counts as backlog, since nothing proves it lost.
func (l *Ledger) Counts() Counts {
	scanned, absentAcked := l.scanned.Load(), l.absentAcked.Load()
	var c Counts
	for i := range l.aggregates {
		unlock := l.lock(i)
		for _, e := range l.aggregates[i].events {
			if e.deliveries > 1 {
				c.Duplicates += int64(e.deliveries - 1)
			}
			if !e.committed {
				if e.deliveries > 0 {
					c.Unexpected++
				}
				continue
			}
			c.Committed++
			switch {
			case e.deliveries > 0:
				c.Delivered++
				if e.reordered {
					c.Reordered++
				}
				if scanned && e.db != dbPublished && (e.db != dbMissing || !absentAcked) {
					c.Unacked++
				}
			case !scanned || e.db == dbPending:
				c.Backlog++
			default: // published without reaching the sink, or gone
				c.Lost++
			}
		}
		unlock()
	}
	return c
}

// Latencies returns, for every event committed in [fromNs, toNs), the time
// from its commit to its first arrival at the sink and to its published_at.
// An event without one of them by endNs counts as endNs minus its commit
// time and is reported as censored.
func (l *Ledger) Latencies(fromNs, toNs, endNs int64) (toSink, toPublished []time.Duration, censoredSink, censoredPublished int) {
	since := func(commitNs, atNs int64) time.Duration {
		// The sink can see an event a hair before the producer's goroutine
		// notes that its commit returned.
		return time.Duration(max(atNs-commitNs, 0))
	}
	absentAcked := l.absentAcked.Load()
	for i := range l.aggregates {
		unlock := l.lock(i)
		for _, e := range l.aggregates[i].events {
			if !e.committed || e.committedNs < fromNs || e.committedNs >= toNs {
				continue
			}
			if e.deliveries > 0 {
				toSink = append(toSink, since(e.committedNs, e.firstSinkNs))
			} else {
				toSink = append(toSink, since(e.committedNs, endNs))
				censoredSink++
			}
			switch {
			case absentAcked:
				// The arm deletes what it delivered: no mark to time.
			case e.db == dbPublished && e.publishedNs < 0:
				// Published, but the arm's table records no time.
			case e.db == dbPublished:
				toPublished = append(toPublished, since(e.committedNs, e.publishedNs))
			default:
				toPublished = append(toPublished, since(e.committedNs, endNs))
				censoredPublished++
			}
		}
		unlock()
	}
	return toSink, toPublished, censoredSink, censoredPublished
}

// DeliverySpan returns the first and last first-delivery times (Unix
// nanoseconds) and how many events they span; ok is false when nothing was
// delivered.
func (l *Ledger) DeliverySpan() (firstNs, lastNs int64, n int64, ok bool) {
	for i := range l.aggregates {
		unlock := l.lock(i)
		for _, e := range l.aggregates[i].events {
			if e.deliveries == 0 {
				continue
			}
			if !ok || e.firstSinkNs < firstNs {
				firstNs = e.firstSinkNs
			}
			if !ok || e.firstSinkNs > lastNs {
				lastNs = e.firstSinkNs
			}
			ok = true
			n++
		}
		unlock()
	}
	return firstNs, lastNs, n, ok
}
