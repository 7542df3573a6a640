package relay

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

// ackBatcher sends acks in batches of up to AckBatchSize: one request at a
// time, carrying every ack that completed meanwhile (and, with AckMaxDelay,
// waiting that long for more). Requests go on one AckStream, opened when
// the first is sent and again after a failure, which spares each its own
// call (a hot aggregate's cycle is 1.13 times as fast, see BENCHMARKS.md); a
// server that predates AckStream is sent Ack calls instead.
//
// No batch may hold up the others for long: transient failures are retried
// for at most AckRetryTimeout, a batch that still fails is split in halves
// until the item at fault is alone (and given up), and a refusal of the
// relay's credentials stops the runner. An ack given up costs
// a redelivery, never a lost event.
type ackBatcher struct {
	r     *Runner
	ctx   context.Context
	fatal *fatal
	items chan ackEntry
	done  chan struct{}
	// stream is the open AckStream (nil: none), opened with streamCtx,
	// which closeStream cancels (nil: none).
	stream      outboxv1.RelayService_AckStreamClient
	streamCtx   context.Context
	closeStream context.CancelFunc
	// unary: the server answered AckStream with UNIMPLEMENTED.
	unary bool
}

// ackEntry is one queued ack; answered, when set, is closed once the
// request carrying it is answered or the ack given up.
type ackEntry struct {
	item     *outboxv1.AckItem
	answered chan struct{}
}

func newAckBatcher(ctx context.Context, r *Runner, f *fatal) *ackBatcher {
	b := &ackBatcher{
		r: r, ctx: ctx, fatal: f,
		items: make(chan ackEntry, r.cfg.MaxInFlight),
		done:  make(chan struct{}),
	}
	go b.run()
	return b
}

func (b *ackBatcher) add(it *outboxv1.AckItem) { b.items <- ackEntry{item: it} }

// addWait queues it and returns a channel closed once the request carrying
// it is answered (whatever the answer) or the ack is given up: the point
// after which a Nack of a later revision of its aggregate finds it applied
// if it could be.
func (b *ackBatcher) addWait(it *outboxv1.AckItem) <-chan struct{} {
	answered := make(chan struct{})
	b.items <- ackEntry{item: it, answered: answered}
	return answered
}

// close flushes what is queued and waits for it.
func (b *ackBatcher) close() {
	close(b.items)
	<-b.done
}

func (b *ackBatcher) run() {
	defer close(b.done)
	defer b.dropStream()
	for {
		e, ok := <-b.items
		if !ok {
			return
		}
		batch, open := b.gather([]ackEntry{e})
		items := make([]*outboxv1.AckItem, len(batch))
		for i, e := range batch {
			items[i] = e.item
		}
		b.flush(items)
		for _, e := range batch {
			if e.answered != nil {
				close(e.answered)
			}
		}
		if !open {
			return
		}
	}
}

// gather adds to batch what is queued, and what arrives within AckMaxDelay,
// up to AckBatchSize. It reports whether the queue is still open.
func (b *ackBatcher) gather(batch []ackEntry) ([]ackEntry, bool) {
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

// flush sends one batch. Transient failures are retried with backoff for
// up to AckRetryTimeout; a batch that still fails is isolated.
func (b *ackBatcher) flush(batch []*outboxv1.AckItem) {
	if len(batch) == 0 {
		return
	}
	retryUntil := time.Now().Add(b.r.cfg.AckRetryTimeout)
	if err := b.try(batch, retryUntil); err != nil {
		b.isolate(batch, err, retryUntil)
	}
}

// try sends items in one Ack, retrying transient failures with backoff
// while that ends before retryUntil (after it, it makes one attempt). It
// returns nil once the server has answered, each item with its own result,
// or else the last error. A refusal of the relay's credentials stops the
// runner.
func (b *ackBatcher) try(items []*outboxv1.AckItem, retryUntil time.Time) error {
	delay := ackRetryBase
	for {
		if err := b.stopped(); err != nil {
			return err
		}
		res, err := b.call(items)
		if err == nil {
			again := b.report(items, res)
			if len(again) == 0 {
				return nil
			}
			// The server asks for some acks again: send those, within the
			// same budget as transient failures.
			if !time.Now().Add(delay).Before(retryUntil) {
				b.giveUp(again, errAckRetry)
				return nil
			}
			b.r.log.Debug("server asks for acks again; retrying", "acks", len(again), "in", delay)
			sleep(b.ctx, delay)
			delay = min(delay*2, ackRetryCap)
			items = again
			continue
		}
		if b.ctx.Err() != nil {
			return err
		}
		switch classify(err) {
		case classTerminal:
			b.fatal.set("Ack", err)
			return err
		case classTransient:
			if time.Now().Add(delay).Before(retryUntil) {
				b.r.log.Debug("ack failed; retrying", "acks", len(items), "in", delay, "err", err)
				sleep(b.ctx, delay)
				delay = min(delay*2, ackRetryCap)
				continue
			}
		}
		return err
	}
}

// call sends items in one request, on the AckStream unless the server
// predates it, and returns the answer, within ackCallTimeout.
func (b *ackBatcher) call(items []*outboxv1.AckItem) (*outboxv1.AckResponse, error) {
	if !b.unary {
		res, err := b.callStream(items)
		if status.Code(err) != codes.Unimplemented {
			return res, err
		}
		b.unary = true
		b.r.log.Info("the server does not serve AckStream; acking by Ack calls")
	}
	ctx, cancel := context.WithTimeout(b.ctx, b.callTimeout())
	defer cancel()
	return b.r.client.Ack(ctx, &outboxv1.AckRequest{Acks: items})
}

// callTimeout bounds one ack request.
func (b *ackBatcher) callTimeout() time.Duration {
	if h := b.r.hooks.ackCallTimeout; h != nil {
		return h()
	}
	return ackCallTimeout
}

// startTimer runs f after d, as time.AfterFunc does, and returns the
// timer's Stop.
func (b *ackBatcher) startTimer(d time.Duration, f func()) (stop func() bool) {
	if h := b.r.hooks.ackTimer; h != nil {
		return h(d, f)
	}
	return time.AfterFunc(d, f).Stop
}

// callStream sends items on the AckStream, opening one if none is open,
// and waits for the answer. Any failure ends the stream (the next request
// opens another); an answer that does not come within the call's timeout,
// opening the stream included, is DEADLINE_EXCEEDED, as an Ack call's
// would be.
func (b *ackBatcher) callStream(items []*outboxv1.AckItem) (*outboxv1.AckResponse, error) {
	if b.closeStream == nil {
		b.streamCtx, b.closeStream = context.WithCancel(b.ctx)
	}
	// (The timer keeps its own copy: dropStream clears the field.)
	closeStream, timeout := b.closeStream, b.callTimeout()
	var late atomic.Bool
	stopTimer := b.startTimer(timeout, func() {
		late.Store(true)
		closeStream()
	})
	res, err := b.exchange(items)
	if !stopTimer() || err != nil {
		// Failed, or answered just as the timer fired (which cancelled
		// the stream): the next request opens another.
		b.dropStream()
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = status.Error(codes.Unavailable, "the server ended the ack stream")
		}
		if late.Load() && b.ctx.Err() == nil {
			err = status.Errorf(codes.DeadlineExceeded, "no answer on the ack stream within %v", timeout)
		}
		return nil, err
	}
	return &outboxv1.AckResponse{Results: res.GetResults()}, nil
}

// exchange sends one request on the stream, opened now if it is not, and
// receives its answer.
func (b *ackBatcher) exchange(items []*outboxv1.AckItem) (*outboxv1.AckStreamResponse, error) {
	if b.stream == nil {
		st, err := b.r.client.AckStream(b.streamCtx)
		if err != nil {
			return nil, err
		}
		b.stream = st
	}
	err := b.stream.Send(&outboxv1.AckStreamRequest{Acks: items})
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	// (io.EOF from Send: the stream has ended; Recv says why.)
	return b.stream.Recv()
}

// dropStream ends the AckStream, if one is open or being opened.
func (b *ackBatcher) dropStream() {
	if b.stream != nil {
		_ = b.stream.CloseSend()
	}
	if b.closeStream != nil {
		b.closeStream()
	}
	b.stream, b.streamCtx, b.closeStream = nil, nil, nil
}

// isolate deals with items whose Ack failed with err. Unless the relay is
// stopping, it splits them in halves and sends each on its own, so that an
// item the server cannot take (a request refused as a whole: INTERNAL,
// INVALID_ARGUMENT, ...; or one that keeps failing as unavailable) ends up
// alone and is given up while the others land. When both halves fail as
// unavailable, the server rather than one item is at fault: they are given
// up at once instead of being split further, so that an outage costs two
// requests per batch, not one per item.
func (b *ackBatcher) isolate(items []*outboxv1.AckItem, err error, retryUntil time.Time) {
	if b.stopped() != nil || classify(err) == classTerminal || len(items) == 1 {
		b.giveUp(items, err)
		return
	}
	b.r.log.Warn("ack failed; splitting the batch", "acks", len(items), "err", err)
	half := len(items) / 2
	halves := [2][]*outboxv1.AckItem{items[:half], items[half:]}
	var errs [2]error
	for i, h := range halves {
		errs[i] = b.try(h, retryUntil)
	}
	if errs[0] != nil && errs[1] != nil && classify(errs[0]) == classTransient && classify(errs[1]) == classTransient {
		b.giveUp(items, errs[1])
		return
	}
	for i, h := range halves {
		if errs[i] != nil {
			b.isolate(h, errs[i], retryUntil)
		}
	}
}

// stopped returns why no more acks should be sent, if so.
func (b *ackBatcher) stopped() error {
	if err := b.fatal.get(); err != nil {
		return err
	}
	if b.ctx.Err() != nil {
		return context.Cause(b.ctx)
	}
	return nil
}

// errAckRetry is why acks the server kept asking for again are given up.
var errAckRetry = errors.New("the server kept asking for these acks again")

// report logs the items the server did not apply, and returns those to send
// again: those with a status other than the five final ones (see
// AckStatus). That covers ACK_STATUS_RETRY, by which the server says the
// database refused this one ack on its own and asks for it again later, and
// any status newer than this relay: acks are idempotent, so sending one
// again is always safe.
func (b *ackBatcher) report(items []*outboxv1.AckItem, res *outboxv1.AckResponse) (again []*outboxv1.AckItem) {
	for i, r := range res.GetResults() {
		switch r.GetStatus() {
		case outboxv1.AckStatus_ACK_STATUS_PUBLISHED, outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED:
		case outboxv1.AckStatus_ACK_STATUS_LEASE_LOST, outboxv1.AckStatus_ACK_STATUS_NOT_FOUND, outboxv1.AckStatus_ACK_STATUS_INVALID:
			b.r.log.Warn("ack not applied", "event_id", r.GetEventId(), "status", r.GetStatus(), "message", r.GetMessage())
		default:
			// Results come one per item, in request order.
			if i < len(items) && items[i].GetEventId() == r.GetEventId() {
				again = append(again, items[i])
			}
			b.r.log.Debug("ack to be sent again", "event_id", r.GetEventId(), "status", r.GetStatus(), "message", r.GetMessage())
		}
	}
	return again
}

// giveUp drops acks for err: their leases lapse (or are released with the
// stream) and the events are delivered again.
func (b *ackBatcher) giveUp(items []*outboxv1.AckItem, err error) {
	why := "the server keeps failing them"
	switch {
	case b.fatal.get() != nil:
		why = "the server refuses this relay"
	case b.ctx.Err() != nil:
		why = "the relay is stopping"
	}
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
