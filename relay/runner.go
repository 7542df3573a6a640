// Package relay is the relay worker library: it subscribes to an outboxd
// server, publishes each delivered event through a Publisher (a broker
// client), and acknowledges the event only after the broker has durably
// accepted it.
//
// A Runner publishes with bounded concurrency (the server leases one event
// per aggregate at a time, so events of one aggregate never overlap), batches
// acks by size and delay, nacks failures with the error text, extends the
// lease of slow publishes, and reconnects with exponential backoff and jitter.
// Cancelling Run's context stops receiving, lets publishes already under way
// finish (up to Config.DrainTimeout) and acks them before returning.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// Config configures a Runner. Zero fields take the documented defaults.
type Config struct {
	// Conn is the connection to an outboxd server. Required.
	Conn grpc.ClientConnInterface
	// Publisher publishes events to the broker. Required.
	Publisher Publisher
	// RelayID names this relay to operators. Default "relay".
	RelayID string
	// Streams limits delivery to these streams; empty means all.
	Streams []string
	// MaxInFlight is the credit asked of the server, and so the most
	// concurrent publishes. Default 64.
	MaxInFlight int
	// LeaseTTL is asked of the server; zero takes the server's default.
	LeaseTTL time.Duration
	// AckBatchSize is the most acks one Ack request carries. Default 256.
	AckBatchSize int
	// AckMaxDelay is how long an ack may wait for company before it is
	// sent. Default 0: an ack is sent at once, and the acks that complete
	// while one Ack request is in flight share the next one, so batches
	// grow with load without delaying a lone ack (which would slow down
	// every aggregate whose events come one after another).
	AckMaxDelay time.Duration
	// ReconnectBase and ReconnectCap shape the reconnect backoff. Defaults
	// 100ms and 10s.
	ReconnectBase, ReconnectCap time.Duration
	// DrainTimeout bounds how long a stopping Runner waits for publishes
	// already under way. Default 10s.
	DrainTimeout time.Duration
	// Logger receives the relay's logs. Default: discard.
	Logger *slog.Logger
}

func (c *Config) setDefaults() error {
	if c.Conn == nil {
		return errors.New("relay: Config.Conn is required")
	}
	if c.Publisher == nil {
		return errors.New("relay: Config.Publisher is required")
	}
	if c.RelayID == "" {
		c.RelayID = "relay"
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 64
	}
	if c.MaxInFlight < 0 {
		return fmt.Errorf("relay: Config.MaxInFlight %d must be positive", c.MaxInFlight)
	}
	if c.AckBatchSize <= 0 {
		c.AckBatchSize = 256
	}
	if c.AckMaxDelay < 0 {
		return fmt.Errorf("relay: Config.AckMaxDelay %v must not be negative", c.AckMaxDelay)
	}
	if c.ReconnectBase <= 0 {
		c.ReconnectBase = 100 * time.Millisecond
	}
	if c.ReconnectCap < c.ReconnectBase {
		c.ReconnectCap = max(10*time.Second, c.ReconnectBase)
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Runner runs a relay.
type Runner struct {
	cfg    Config
	client outboxv1.RelayServiceClient
	log    *slog.Logger
}

// NewRunner validates cfg.
func NewRunner(cfg Config) (*Runner, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	return &Runner{
		cfg:    cfg,
		client: outboxv1.NewRelayServiceClient(cfg.Conn),
		log:    cfg.Logger.With("component", "relay", "relay_id", cfg.RelayID),
	}, nil
}

// Run relays until ctx is done, reconnecting whenever the stream breaks. It
// returns nil after a clean stop, or the error that makes retrying pointless
// (an INVALID_ARGUMENT, UNAUTHENTICATED or PERMISSION_DENIED answer).
func (r *Runner) Run(ctx context.Context) error {
	delay := r.cfg.ReconnectBase
	for {
		start := time.Now()
		err := r.runOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		switch status.Code(err) {
		case codes.InvalidArgument, codes.Unauthenticated, codes.PermissionDenied, codes.Unimplemented:
			return fmt.Errorf("relay: subscribe refused: %w", err)
		}
		if time.Since(start) > r.cfg.ReconnectCap {
			delay = r.cfg.ReconnectBase // it ran fine for a while: start over
		}
		wait := delay/2 + rand.N(delay/2+1)
		r.log.Warn("stream ended; reconnecting", "err", err, "in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		delay = min(delay*2, r.cfg.ReconnectCap)
	}
}

// runOnce runs one subscription until it breaks or ctx is done, then waits for
// its publishes and acks.
func (r *Runner) runOnce(ctx context.Context) error {
	// Publishes and acks outlive the stream by up to DrainTimeout after ctx
	// ends, so that work already handed to the broker is acknowledged.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	stopDrain := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(r.cfg.DrainTimeout, cancelWork)
		context.AfterFunc(workCtx, func() { t.Stop() })
	})
	defer stopDrain()

	streamCtx, cancelStream := context.WithCancel(ctx)
	defer cancelStream()
	req := &outboxv1.SubscribeRequest{
		RelayId:     r.cfg.RelayID,
		Streams:     r.cfg.Streams,
		MaxInFlight: uint32(r.cfg.MaxInFlight),
	}
	if r.cfg.LeaseTTL > 0 {
		req.LeaseTtl = durationpb.New(r.cfg.LeaseTTL)
	}
	stream, err := r.client.Subscribe(streamCtx, req)
	if err != nil {
		return err
	}

	acks := newAckBatcher(r, workCtx)
	var wg sync.WaitGroup
	defer func() {
		wg.Wait()
		acks.close()
	}()
	for {
		d, err := stream.Recv()
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.handle(workCtx, d, acks)
		}()
	}
}

// handle publishes one delivery and acks or nacks it, extending its lease
// while a slow publish runs.
func (r *Runner) handle(ctx context.Context, d *outboxv1.SubscribeResponse, acks *ackBatcher) {
	ev := d.GetEvent()
	e := Event{
		ID: ev.GetEventId(), Stream: ev.GetStream(), AggregateKey: ev.GetAggregateKey(),
		Revision: ev.GetRevision(), Type: ev.GetEventType(), Payload: ev.GetPayload(),
		Headers: ev.GetHeaders(), CreatedAt: ev.GetCreatedAt().AsTime(), Attempt: int(d.GetAttempt()),
	}
	stopExtend := r.keepLease(ctx, d)
	err := r.cfg.Publisher.Publish(ctx, e)
	stopExtend()
	if err == nil {
		acks.add(&outboxv1.AckItem{EventId: e.ID, LeaseToken: d.GetLeaseToken()})
		return
	}
	r.log.Warn("publish failed; nacking", "event_id", e.ID, "stream", e.Stream, "aggregate_key", e.AggregateKey, "attempt", e.Attempt, "err", err)
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if _, nerr := r.client.Nack(nctx, &outboxv1.NackRequest{
		EventId: e.ID, LeaseToken: d.GetLeaseToken(), Error: err.Error(),
	}); nerr != nil {
		// The lease expires and the event comes again; nothing is lost.
		r.log.Warn("nack failed; the lease will expire instead", "event_id", e.ID, "err", nerr)
	}
}

// keepLease extends the delivery's lease at half its remaining life until
// the returned stop function is called.
func (r *Runner) keepLease(ctx context.Context, d *outboxv1.SubscribeResponse) (stop func()) {
	ttl := time.Until(d.GetLeaseExpiresAt().AsTime())
	if ttl <= 0 {
		return func() {}
	}
	extendTTL := r.cfg.LeaseTTL
	if extendTTL <= 0 {
		extendTTL = max(ttl, time.Second)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		next := ttl / 2
		for {
			t := time.NewTimer(next)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			res, err := r.client.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{
				EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Ttl: durationpb.New(extendTTL),
			})
			if err != nil {
				if ctx.Err() == nil {
					r.log.Warn("extend lease failed", "event_id", d.GetEvent().GetEventId(), "err", err)
				}
				return
			}
			next = max(time.Until(res.GetLeaseExpiresAt().AsTime())/2, 10*time.Millisecond)
		}
	}()
	return func() { cancel(); <-done }
}

// ackBatcher sends acks in batches of up to AckBatchSize: one Ack request
// at a time, carrying every ack that completed meanwhile (and, with
// AckMaxDelay, waiting that long for more).
type ackBatcher struct {
	r     *Runner
	ctx   context.Context
	items chan *outboxv1.AckItem
	done  chan struct{}
}

func newAckBatcher(r *Runner, ctx context.Context) *ackBatcher {
	b := &ackBatcher{r: r, ctx: ctx, items: make(chan *outboxv1.AckItem, r.cfg.MaxInFlight), done: make(chan struct{})}
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

// flush sends one Ack, retrying while the server is unreachable: an ack lost
// here only costs a redelivery, but retrying spares it.
func (b *ackBatcher) flush(batch []*outboxv1.AckItem) {
	if len(batch) == 0 {
		return
	}
	delay := 50 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
		res, err := b.r.client.Ack(ctx, &outboxv1.AckRequest{Acks: batch})
		cancel()
		if err == nil {
			for _, r := range res.GetResults() {
				switch r.GetStatus() {
				case outboxv1.AckStatus_ACK_STATUS_PUBLISHED, outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED:
				default:
					b.r.log.Warn("ack not applied", "event_id", r.GetEventId(), "status", r.GetStatus(), "message", r.GetMessage())
				}
			}
			return
		}
		if b.ctx.Err() != nil || status.Code(err) == codes.InvalidArgument {
			b.r.log.Warn("ack failed; events will be redelivered", "acks", len(batch), "err", err)
			return
		}
		t := time.NewTimer(delay)
		select {
		case <-b.ctx.Done():
			t.Stop()
		case <-t.C:
		}
		delay = min(delay*2, 2*time.Second)
	}
}
