package relay

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

const (
	// extendCallTimeout bounds one ExtendLease request; it is also cut
	// short by the lease's own expiry.
	extendCallTimeout = 10 * time.Second
	// extendRetryBase and extendRetryCap shape the backoff between
	// ExtendLease retries.
	extendRetryBase = 50 * time.Millisecond
	extendRetryCap  = time.Second
)

// remaining is how long a lease has left as the server states it. A server
// that predates lease_ttl_remaining gives only the expiry by the database's
// clock, which then has to be read against the relay's clock.
func remaining(d *durationpb.Duration, expiresAt *timestamppb.Timestamp) time.Duration {
	if d != nil {
		return d.AsDuration()
	}
	return time.Until(expiresAt.AsTime())
}

// leaseExpiry is when d's lease lapses by the relay's monotonic clock, as
// the server stated it on a delivery received at receivedAt; zero when the
// server stated none.
func leaseExpiry(d *outboxv1.SubscribeResponse, receivedAt time.Time) time.Time {
	ttl := remaining(d.GetLeaseTtlRemaining(), d.GetLeaseExpiresAt())
	if ttl <= 0 {
		return time.Time{}
	}
	return receivedAt.Add(ttl)
}

// keepLease extends the delivery's lease, at half its remaining life, until
// the returned stop function is called; stop returns the lease's expiry as
// the last extension left it. Lease time is measured on the relay's
// monotonic clock: expiry is when the lease lapses as far as the runner
// knows (from the delivery's receipt, or from an earlier extension of the
// same lease: with a window, one lease covers several deliveries), and
// each extension counts from the moment its request was sent (which can
// only underestimate what the server granted).
//
// A failed extension is retried with backoff until it succeeds, the server
// says the lease is gone (FAILED_PRECONDITION, NOT_FOUND), or the lease's
// expiry passes; a refusal of the relay's credentials stops the runner.
func (r *Runner) keepLease(ctx context.Context, f *fatal, d *outboxv1.SubscribeResponse, expiry time.Time) (stop func() time.Time) {
	ttl := remaining(d.GetLeaseTtlRemaining(), d.GetLeaseExpiresAt())
	if ttl <= 0 || expiry.IsZero() {
		return func() time.Time { return expiry }
	}
	extendTTL := r.cfg.LeaseTTL
	if extendTTL <= 0 {
		extendTTL = max(ttl, time.Second)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		next := time.Now().Add(time.Until(expiry) / 2)
		for {
			if !sleep(ctx, time.Until(next)) {
				return
			}
			var ok bool
			if expiry, ok = r.extend(ctx, f, d, extendTTL, expiry); !ok {
				return
			}
			next = time.Now().Add(time.Until(expiry) / 2)
		}
	}()
	return func() time.Time { cancel(); <-done; return expiry }
}

// extend extends the lease once, retrying until it succeeds, the lease is
// definitely lost, or expiry passes. It returns the new expiry, and false
// when there is nothing more to do for this lease.
func (r *Runner) extend(ctx context.Context, f *fatal, d *outboxv1.SubscribeResponse, ttl time.Duration, expiry time.Time) (time.Time, bool) {
	id := d.GetEvent().GetEventId()
	req := &outboxv1.ExtendLeaseRequest{EventId: id, LeaseToken: d.GetLeaseToken(), Ttl: durationpb.New(ttl)}
	delay := extendRetryBase
	for {
		sent := time.Now()
		// An extension arriving after the expiry may still find the lease
		// unclaimed, but by then another relay may hold it: stop trying.
		deadline := sent.Add(extendCallTimeout)
		if expiry.Before(deadline) {
			deadline = expiry
		}
		callCtx, cancel := context.WithDeadline(ctx, deadline)
		res, err := r.client.ExtendLease(callCtx, req)
		cancel()
		if err == nil {
			left := remaining(res.GetLeaseTtlRemaining(), res.GetLeaseExpiresAt())
			return sent.Add(left), true
		}
		if ctx.Err() != nil {
			return expiry, false
		}
		switch classify(err) {
		case classTerminal:
			f.set("ExtendLease", err)
			return expiry, false
		case classLeaseLost:
			r.log.Warn("lease lost during a slow publish; the event may be delivered again", "event_id", id, "err", err)
			if h := r.hooks.extendStopped; h != nil {
				h(id, true)
			}
			return expiry, false
		case classRequest:
			r.log.Error("extend lease refused", "event_id", id, "err", err)
			return expiry, false
		}
		if !time.Now().Add(delay).Before(expiry) {
			r.log.Warn("lease expired while extending it kept failing; the event may be delivered again", "event_id", id, "err", err)
			if h := r.hooks.extendStopped; h != nil {
				h(id, false)
			}
			return expiry, false
		}
		r.log.Debug("extend lease failed; retrying", "event_id", id, "in", delay, "err", err)
		if !sleep(ctx, delay) {
			return expiry, false
		}
		delay = min(delay*2, extendRetryCap)
	}
}
