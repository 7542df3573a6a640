package relay

import (
	"context"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

const (
	// ackCallTimeout bounds one Ack request.
	ackCallTimeout = 10 * time.Second
	// ackRetryBase and ackRetryCap shape the backoff between retries of an
	// Ack that failed transiently.
	ackRetryBase = 50 * time.Millisecond
	ackRetryCap  = 2 * time.Second
)

// ackBatcher sends acks in batches of up to AckBatchSize: one Ack request
// at a time, carrying every ack that completed meanwhile (and, with
// AckMaxDelay, waiting that long for more).
//
// No batch may hold up the others for long: transient failures are retried
// for at most AckRetryTimeout, a batch the server refuses as a whole is
// split in halves until the item at fault is alone (and given up), and a
// refusal of the relay's credentials stops the runner. An ack given up costs
// a redelivery, never a lost event.
type ackBatcher struct {
	r     *Runner
	ctx   context.Context
	fatal *fatal
	items chan *outboxv1.AckItem
	done  chan struct{}
}

func newAckBatcher(ctx context.Context, r *Runner, f *fatal) *ackBatcher {
	b := &ackBatcher{
		r: r, ctx: ctx, fatal: f,
		items: make(chan *outboxv1.AckItem, r.cfg.MaxInFlight),
		done:  make(chan struct{}),
	}
	go b.run()
	return b
}

func (b *ackBatcher) add(it *outboxv1.AckItem) { b.items <- it }

// close flushes what is queued and waits for it.
func (b *ackBatcher) close() {
	close(b.items)
	<-b.done
}

func (b *ackBatcher) run() {
	defer close(b.done)
	for {
		it, ok := <-b.items
		if !ok {
			return
		}
		batch, open := b.gather([]*outboxv1.AckItem{it})
		b.flush(batch)
		if !open {
			return
		}
	}
}

// gather adds to batch what is queued, and what arrives within AckMaxDelay,
// up to AckBatchSize. It reports whether the queue is still open.
func (b *ackBatcher) gather(batch []*outboxv1.AckItem) ([]*outboxv1.AckItem, bool) {
	var linger <-chan time.Time
	if d := b.r.cfg.AckMaxDelay; d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		linger = t.C
	}
	for len(batch) < b.r.cfg.AckBatchSize {
		select {
		case it, ok := <-b.items:
			if !ok {
				return batch, false
			}
			batch = append(batch, it)
			continue
		default:
		}
		if linger == nil {
			return batch, true
		}
		select {
		case it, ok := <-b.items:
			if !ok {
				return batch, false
			}
			batch = append(batch, it)
		case <-linger:
			return batch, true
		}
	}
	return batch, true
}

// flush sends one batch, within AckRetryTimeout of retries (twice that in
// all when the batch has to be split while the server keeps failing).
func (b *ackBatcher) flush(batch []*outboxv1.AckItem) {
	if len(batch) == 0 {
		return
	}
	retryUntil := time.Now().Add(b.r.cfg.AckRetryTimeout)
	ctx, cancel := context.WithDeadline(b.ctx, retryUntil.Add(b.r.cfg.AckRetryTimeout))
	defer cancel()
	b.send(ctx, batch, retryUntil)
}

// send sends items in one Ack. Transient failures are retried with backoff
// until retryUntil. A batch the server refuses as a whole (INVALID_ARGUMENT,
// INTERNAL, ...), or that still fails transiently after retryUntil, is split
// in halves and each half sent on its own, so that an item the server cannot
// take ends up alone and is given up while the others land.
func (b *ackBatcher) send(ctx context.Context, items []*outboxv1.AckItem, retryUntil time.Time) {
	delay := ackRetryBase
	for {
		if ctx.Err() != nil || b.fatal.get() != nil {
			b.giveUp(items, "the relay is stopping or out of time for this batch", context.Cause(ctx))
			return
		}
		callCtx, cancel := context.WithTimeout(ctx, ackCallTimeout)
		res, err := b.r.client.Ack(callCtx, &outboxv1.AckRequest{Acks: items})
		cancel()
		if err == nil {
			b.report(res)
			return
		}
		if ctx.Err() != nil {
			continue // gives up above
		}
		switch classify(err) {
		case classTerminal:
			b.fatal.set("Ack", err)
			b.giveUp(items, "the server refuses this relay", err)
			return
		case classTransient:
			if time.Now().Add(delay).Before(retryUntil) {
				b.r.log.Debug("ack failed; retrying", "acks", len(items), "in", delay, "err", err)
				if !sleep(ctx, delay) {
					continue
				}
				delay = min(delay*2, ackRetryCap)
				continue
			}
		}
		if len(items) == 1 {
			b.giveUp(items, "the server keeps refusing it", err)
			return
		}
		b.r.log.Warn("ack failed; splitting the batch", "acks", len(items), "err", err)
		half := len(items) / 2
		b.send(ctx, items[:half], retryUntil)
		b.send(ctx, items[half:], retryUntil)
		return
	}
}

// report logs the items the server did not apply: each has its own status,
// and none is worth retrying (see AckStatus).
func (b *ackBatcher) report(res *outboxv1.AckResponse) {
	for _, r := range res.GetResults() {
		switch r.GetStatus() {
		case outboxv1.AckStatus_ACK_STATUS_PUBLISHED, outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED:
		default:
			b.r.log.Warn("ack not applied", "event_id", r.GetEventId(), "status", r.GetStatus(), "message", r.GetMessage())
		}
	}
}

// giveUp drops acks: their leases lapse (or are released with the stream)
// and the events are delivered again.
func (b *ackBatcher) giveUp(items []*outboxv1.AckItem, why string, err error) {
	ids := make([]string, 0, min(len(items), 10))
	for _, it := range items[:min(len(items), 10)] {
		ids = append(ids, it.GetEventId())
	}
	b.r.log.Warn("acks given up; their events will be delivered again",
		"why", why, "acks", len(items), "event_ids", ids, "err", err)
	if h := b.r.hooks.ackGivenUp; h != nil {
		h(len(items))
	}
}

// sleep waits d or until ctx ends; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
