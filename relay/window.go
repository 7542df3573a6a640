package relay

import (
	"context"
	"sync"
	"time"
)

// aggregateLines publishes with a window (Config.MaxInFlightPerAggregate
// above 1): the server may then have several events of one aggregate out
// at once, sent in revision order, and every one of them must reach the
// broker in that order. Each aggregate with deliveries gets a line: one
// goroutine that publishes its deliveries one after another, in the order
// they arrived, so the Publisher is still never called for two events of
// one aggregate at once and any broker keeps their order.
//
// A line stops at the first failure of a lease: before nacking the failed
// event it waits until the acks of the events before it are answered (the
// server takes a nack only for a lease's earliest pending revision), and it
// drops every later delivery of that lease, queued or still arriving
// (lease_epoch at or below the failed one's): they come again, after the
// failed one, under a new lease.
type aggregateLines struct {
	r    *Runner
	f    *fatal
	acks *ackBatcher
	// work is what publishes run under (it outlives stop by the drain
	// timeout); stop ends the taking of queued deliveries: those left are
	// released with the stream.
	work, stop context.Context
	wg         sync.WaitGroup

	mu    sync.Mutex
	lines map[aggregateRef]*aggregateLine
	// pruneAt is the number of lines at which add forgets idle lines
	// whose failed lease has lapsed (see prune).
	pruneAt int
}

type aggregateRef struct{ stream, key string }

type aggregateLine struct {
	queue   []received
	running bool // a goroutine is publishing this line's queue
	// failedEpoch is the epoch of the lease that failed last: its
	// deliveries are dropped. Only the line's goroutine touches it.
	failedEpoch int64
	// answered is closed once the line's last ack is answered.
	answered <-chan struct{}
	// epoch and expiry are the lease of the line's last publish and when
	// it lapses as far as the runner knows: an extension made while one
	// event of a window was being published extends the whole lease, so
	// the events after it start from there rather than from their own
	// receipt. Only the line's goroutine touches them.
	epoch  int64
	expiry time.Time
	// revision is the line's last revision published (or tried) under
	// epoch: a lease covers consecutive revisions, so the next delivery of
	// the same lease must be revision+1.
	revision int64
}

func newAggregateLines(r *Runner, f *fatal, acks *ackBatcher, work, stop context.Context) *aggregateLines {
	return &aggregateLines{r: r, f: f, acks: acks, work: work, stop: stop,
		lines: make(map[aggregateRef]*aggregateLine), pruneAt: minPruneAt}
}

// minPruneAt is the fewest lines at which add prunes.
const minPruneAt = 1024

// prune forgets the idle lines kept only to drop deliveries of a failed
// lease that has lapsed since: the server sends a lease's deliveries while
// it holds it, so none of that lease can still be on its way. Called with
// a.mu held; a line that is not running is not touched by any goroutine.
func (a *aggregateLines) prune(now time.Time) {
	for ref, l := range a.lines {
		if !l.running && len(l.queue) == 0 && now.After(l.expiry) {
			delete(a.lines, ref)
		}
	}
	a.pruneAt = max(2*len(a.lines), minPruneAt)
}

// add queues a delivery on its aggregate's line, starting the line's
// goroutine when it is not running.
func (a *aggregateLines) add(rd received) {
	ev := rd.d.GetEvent()
	ref := aggregateRef{ev.GetStream(), ev.GetAggregateKey()}
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.lines) >= a.pruneAt {
		a.prune(time.Now())
	}
	l := a.lines[ref]
	if l == nil {
		l = &aggregateLine{}
		a.lines[ref] = l
	}
	l.queue = append(l.queue, rd)
	if h := a.r.hooks.windowQueued; h != nil {
		h(ev.GetEventId())
	}
	if !l.running {
		l.running = true
		a.wg.Add(1)
		go a.run(ref, l)
	}
}

// wait waits for every line's goroutine to end.
func (a *aggregateLines) wait() { a.wg.Wait() }

// next takes the line's next delivery, or ends the goroutine's turn: the
// queue is empty or the runner is stopping. A line with no failure to
// remember is forgotten when its queue empties.
func (a *aggregateLines) next(ref aggregateRef, l *aggregateLine) (received, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(l.queue) == 0 || a.stop.Err() != nil {
		l.running = false
		if len(l.queue) == 0 && l.failedEpoch == 0 {
			delete(a.lines, ref)
		}
		return received{}, false
	}
	rd := l.queue[0]
	l.queue[0] = received{}
	l.queue = l.queue[1:]
	return rd, true
}

func (a *aggregateLines) run(ref aggregateRef, l *aggregateLine) {
	defer a.wg.Done()
	for {
		rd, ok := a.next(ref, l)
		if !ok {
			return
		}
		epoch := rd.d.GetLeaseEpoch()
		if l.failedEpoch > 0 && epoch <= l.failedEpoch {
			// An event of the lease that failed: published now, it would
			// overtake the failed one at the broker.
			a.r.log.Debug("delivery of a failed window dropped; it comes again", "event_id", rd.d.GetEvent().GetEventId())
			if h := a.r.hooks.windowDropped; h != nil {
				h(rd.d.GetEvent().GetEventId())
			}
			continue
		}
		rev := rd.d.GetEvent().GetRevision()
		if epoch != 0 && epoch == l.epoch && rev != l.revision+1 {
			// Never expected (the server slides a window only onto the
			// revision after the last it sent): publishing it would skip
			// revisions at the broker. Drop the rest of the lease; it
			// comes again from the cursor once the lease lapses.
			a.r.log.Error("delivery out of sequence within its lease; dropping the lease's deliveries",
				"event_id", rd.d.GetEvent().GetEventId(), "revision", rev, "after", l.revision)
			l.failedEpoch = epoch
			continue
		}
		expiry := leaseExpiry(rd.d, rd.at)
		if epoch == l.epoch && l.expiry.After(expiry) {
			expiry = l.expiry
		}
		err, cancelled, expiry := a.r.publish(a.work, a.f, rd, expiry)
		l.epoch, l.expiry, l.revision = epoch, expiry, rev
		switch {
		case cancelled:
			continue // released with the stream, as the rest of the queue is
		case err == nil:
			l.answered = a.acks.addWait(ackItem(rd))
		default:
			if l.answered != nil {
				select {
				case <-l.answered:
				case <-a.work.Done():
					continue
				}
			}
			l.failedEpoch = epoch
			a.r.nack(a.work, a.f, rd.d, err)
		}
	}
}
