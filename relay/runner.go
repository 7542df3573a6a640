// Package relay is the relay worker library: it subscribes to an outboxd
// server, publishes each delivered event through a Publisher (a broker
// client), and acknowledges the event only after the broker has durably
// accepted it.
//
// A Runner publishes with bounded concurrency (the server leases one event
// per aggregate at a time, so events of one aggregate never overlap; with a
// window, Config.MaxInFlightPerAggregate, the runner publishes an
// aggregate's events one after another itself), batches acks by size and
// delay, nacks failures with the error text, extends the lease of slow
// publishes, and reconnects with exponential backoff and jitter.
//
// No answer of the server can wedge it. It sorts errors into three kinds:
// the relay's credentials refused (UNAUTHENTICATED, PERMISSION_DENIED, from
// any RPC) stops the runner and Run returns the error; the server or network
// unavailable (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) is retried
// with bounded backoff; a request refused as such (INVALID_ARGUMENT,
// INTERNAL, ...) is not retried as it is, and an Ack batch refused that way
// is split until the item at fault is alone. An ack given up costs a
// redelivery, never an event.
//
// Cancelling Run's context stops receiving, lets publishes already under
// way finish (up to Config.DrainTimeout) and acks them before closing the
// stream, so they keep their leases meanwhile. A publish cut short by the
// drain timeout is neither acked nor nacked: it is no broker failure, and
// closing the stream gives its lease back at once without counting one
// against the event.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/limits"
)

// MaxDeliveryBytes is the largest message (one encoded SubscribeResponse:
// one delivery, or a batch of them) the runner receives; the server never
// sends a larger one.
const MaxDeliveryBytes = limits.MaxDeliveryBytes

// MaxAckBatchSize is the most acks the server takes in one Ack request, and
// so the largest Config.AckBatchSize.
const MaxAckBatchSize = limits.MaxAckItems

// DefaultMaxInFlight is Config.MaxInFlight's default, the credit a relay
// asks for. Credit only bounds what is in flight, which is otherwise the
// rate times the time from delivery to ack; when a slower pipeline (a busy
// database, a long-held snapshot) brings that up to the credit, discovery
// finds no relay to dispatch to and its events go through claims instead,
// which cost more, the more so under a held xmin. On the benchmark's
// machine four relays of 64 fell into that at 2,500 events/s even
// without a hold (14-47 % of events claimed, against 0-1 % at 256) and
// delivered 10 % less; 256 keeps a relay's memory to 256 payloads and
// a publisher's concurrency to 256 calls.
const DefaultMaxInFlight = 256

// DefaultDrainTimeout is Config.DrainTimeout's default.
const DefaultDrainTimeout = 10 * time.Second

// Config configures a Runner. Zero fields take the documented defaults.
type Config struct {
	// Conn is the connection to an outboxd server. Required.
	Conn grpc.ClientConnInterface
	// Publisher publishes events to the broker. Required.
	Publisher Publisher
	// RelayID names this relay to operators. Default "relay".
	RelayID string
	// Streams limits delivery to these streams; empty means all. On a
	// server with several source databases a Subscribe stream serves one
	// source: a stream of a source other than default is "source/stream"
	// ("source/*" for all of it), and the names of one Runner must all be
	// of one source (run one Runner per source; outboxd relay --route
	// does).
	Streams []string
	// ExcludeStreams are never delivered to this runner: with Streams
	// empty, a catch-all beside runners that take those streams. Needs a
	// server that knows SubscribeRequest.exclude_streams.
	ExcludeStreams []string
	// MaxInFlight is the credit asked of the server, and so the most
	// concurrent publishes and the most payloads held. Default
	// DefaultMaxInFlight.
	MaxInFlight int
	// MaxInFlightPerAggregate is the window asked of the server: the most
	// events of one aggregate it sends before the first of them is acked
	// (SubscribeRequest.max_in_flight_per_aggregate). Default 1. Above 1 the
	// runner still publishes an aggregate's events one at a time, in
	// revision order, so every Publisher keeps their order; what the window
	// saves is the wait for the server between one event and the next (an
	// ack, then a send). It stops at an aggregate's first failure (see
	// aggregateLines). Needs a server that knows the field; one that does
	// not sends one event of an aggregate at a time. At most MaxInFlight.
	MaxInFlightPerAggregate int
	// LeaseTTL is asked of the server; zero takes the server's default.
	LeaseTTL time.Duration
	// AckBatchSize is the most acks one Ack request carries: 1 to
	// MaxAckBatchSize. Default 256.
	AckBatchSize int
	// AckMaxDelay is how long an ack may wait for company before it is
	// sent. Default 0: an ack is sent at once, and the acks that complete
	// while one Ack request is in flight share the next one, so batches
	// grow with load without delaying a lone ack (which would slow down
	// every aggregate whose events come one after another).
	AckMaxDelay time.Duration
	// AckRetryTimeout is how long an Ack batch is retried through transient
	// failures (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) before
	// it is split in halves to find an item at fault; when both halves fail
	// too, its acks are given up and their events delivered again.
	// Default 30s.
	AckRetryTimeout time.Duration
	// ReconnectBase and ReconnectCap shape the reconnect backoff: the wait
	// starts at about ReconnectBase and doubles up to ReconnectCap, each
	// wait randomised by ±50 %. Defaults 100ms and 10s. A failure that
	// repeats unchanged is logged as a warning once, then every 5 minutes.
	ReconnectBase, ReconnectCap time.Duration
	// DrainTimeout bounds how long a stopping Runner waits for publishes
	// already under way; their leases stay held meanwhile. A publish still
	// running then is cancelled and its lease released, with no failure
	// counted. Default DefaultDrainTimeout.
	DrainTimeout time.Duration
	// Logger receives the relay's logs. Default: discard.
	Logger *slog.Logger
	// TracerProvider makes each publish's producer span (see tracing.go).
	// Default: OpenTelemetry's global provider, a no-op unless the process
	// installs one.
	TracerProvider trace.TracerProvider
	// MessagingSystem is the publish spans' messaging.system, naming the
	// broker ("nats", "kafka", ...; sink.MessagingSystem maps a sink URL).
	// Empty leaves the attribute out.
	MessagingSystem string
}

// setDefaults fills in the defaults and reports every field at fault.
func (c *Config) setDefaults() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("relay: Config."+format, args...)) }
	if c.Conn == nil {
		bad("Conn is required")
	}
	if c.Publisher == nil {
		bad("Publisher is required")
	}
	if c.RelayID == "" {
		c.RelayID = "relay"
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxInFlight < 0 {
		bad("MaxInFlight %d must be positive", c.MaxInFlight)
	}
	if c.MaxInFlightPerAggregate == 0 {
		c.MaxInFlightPerAggregate = 1
	}
	if c.MaxInFlightPerAggregate < 0 || c.MaxInFlightPerAggregate > max(c.MaxInFlight, 1) {
		bad("MaxInFlightPerAggregate %d must be between 1 and MaxInFlight (%d)", c.MaxInFlightPerAggregate, c.MaxInFlight)
	}
	if c.LeaseTTL < 0 {
		bad("LeaseTTL %v must not be negative", c.LeaseTTL)
	}
	if c.AckBatchSize == 0 {
		c.AckBatchSize = 256
	}
	if c.AckBatchSize < 0 || c.AckBatchSize > MaxAckBatchSize {
		bad("AckBatchSize %d must be between 1 and %d (the most acks the server takes in one request)", c.AckBatchSize, MaxAckBatchSize)
	}
	if c.AckMaxDelay < 0 {
		bad("AckMaxDelay %v must not be negative", c.AckMaxDelay)
	}
	if c.AckRetryTimeout == 0 {
		c.AckRetryTimeout = 30 * time.Second
	}
	if c.AckRetryTimeout < 0 {
		bad("AckRetryTimeout %v must not be negative", c.AckRetryTimeout)
	}
	if c.ReconnectBase == 0 {
		c.ReconnectBase = 100 * time.Millisecond
	}
	if c.ReconnectBase < 0 {
		bad("ReconnectBase %v must not be negative", c.ReconnectBase)
	}
	if c.ReconnectCap < 0 {
		bad("ReconnectCap %v must not be negative", c.ReconnectCap)
	}
	if c.ReconnectCap < c.ReconnectBase {
		c.ReconnectCap = max(10*time.Second, c.ReconnectBase)
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.DrainTimeout < 0 {
		bad("DrainTimeout %v must not be negative", c.DrainTimeout)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return errors.Join(errs...)
}

// Runner runs a relay.
type Runner struct {
	cfg    Config
	client outboxv1.RelayServiceClient
	log    *slog.Logger
	hooks  hooks
}

// hooks tell this package's tests what the runner did, so that they wait on
// signals instead of sleeping. All nil outside tests.
type hooks struct {
	// ackGivenUp is called when n acks are dropped.
	ackGivenUp func(n int)
	// extendStopped is called when the runner stops extending a lease
	// before its publish ends: lost says the server answered that the lease
	// is gone, rather than the lease's time running out.
	extendStopped func(eventID string, lost bool)
	// publishCancelled is called when a publish was cut short by the
	// runner (drain timeout, terminal error) and left unacked and unnacked.
	publishCancelled func(eventID string)
	// reconnecting is called before each wait to reconnect, with the error
	// that ended the stream and the wait.
	reconnecting func(err error, wait time.Duration)
	// now replaces time.Now for the reconnect log's quiet interval.
	now func() time.Time
	// windowQueued is called for each delivery queued on its aggregate's
	// line, and windowDropped for one dropped because an earlier event of
	// its lease failed (see aggregateLines).
	windowQueued, windowDropped func(eventID string)
	// ackCallTimeout, when set, replaces ackCallTimeout: each request's
	// timeout is what it returns as the request is sent.
	ackCallTimeout func() time.Duration
	// ackTimer, when set, replaces time.AfterFunc for the timer of a
	// request on the AckStream; it returns the timer's Stop.
	ackTimer func(d time.Duration, f func()) (stop func() bool)
}

// NewRunner validates cfg; the error names every field at fault.
func NewRunner(cfg Config) (*Runner, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	cfg.Publisher = newTracedPublisher(cfg)
	return &Runner{
		cfg:    cfg,
		client: outboxv1.NewRelayServiceClient(cfg.Conn),
		log:    cfg.Logger.With("component", "relay", "relay_id", cfg.RelayID),
	}, nil
}

// Run relays until ctx is done, reconnecting whenever the stream breaks. It
// returns nil after a clean stop, or the error that makes going on
// pointless: Subscribe refused as malformed or unimplemented
// (INVALID_ARGUMENT, UNIMPLEMENTED), or the relay's credentials refused by
// any RPC (UNAUTHENTICATED, PERMISSION_DENIED). The error wraps the gRPC
// status, so status.Code reports it.
func (r *Runner) Run(ctx context.Context) error {
	// A well-kept implementation of exponential backoff with jitter, in the
	// module graph already (through OpenTelemetry's exporters).
	b := &backoff.ExponentialBackOff{
		InitialInterval: r.cfg.ReconnectBase, RandomizationFactor: 0.5, Multiplier: 2, MaxInterval: r.cfg.ReconnectCap,
	}
	b.Reset()
	var quiet repeatedFailure
	for {
		start := r.now()
		err := r.runOnce(ctx)
		var fe *fatalError
		if errors.As(err, &fe) {
			return fe.err
		}
		if ctx.Err() != nil {
			return nil
		}
		switch code := status.Code(err); code {
		case codes.InvalidArgument, codes.Unauthenticated, codes.PermissionDenied, codes.Unimplemented:
			return fmt.Errorf("relay: Subscribe refused (%s): %w", code, err)
		}
		if r.now().Sub(start) > r.cfg.ReconnectCap {
			// It ran fine for a while: start over, and say the next
			// failure again.
			b.Reset()
			quiet = repeatedFailure{}
		}
		wait := b.NextBackOff()
		r.logReconnect(&quiet, err, wait)
		if h := r.hooks.reconnecting; h != nil {
			h(err, wait)
		}
		if !sleep(ctx, wait) {
			return nil
		}
	}
}

// quietInterval is how often a failure that keeps repeating unchanged is
// logged as a warning again; the repeats in between are logged at debug
// level. A relay started before its producers, or with a mistyped stream,
// retries for as long as it runs: one warning that says what is wrong is
// useful, one every few seconds buries everything else.
const quietInterval = 5 * time.Minute

// repeatedFailure is what the runner last warned about, and when.
type repeatedFailure struct {
	last     string
	warnedAt time.Time
	repeats  int // since warnedAt
}

// logReconnect logs a broken (or refused) stream: a warning when the
// failure is new, or again every quietInterval while it repeats, and at
// debug level in between.
func (r *Runner) logReconnect(q *repeatedFailure, err error, wait time.Duration) {
	st := status.Convert(err)
	key := st.Code().String() + ": " + st.Message()
	now := r.now()
	if key == q.last && now.Sub(q.warnedAt) < quietInterval {
		q.repeats++
		r.log.Debug("stream failed again; reconnecting", "err", err, "in", wait)
		return
	}
	repeats := q.repeats
	if key != q.last {
		repeats = 0
	}
	*q = repeatedFailure{last: key, warnedAt: now}
	var msg string
	switch {
	case st.Code() == codes.NotFound:
		// The server refuses streams no event has used yet, naming the
		// ones that exist (a typo, or the producers have not run yet),
		// and a source it does not serve (removed from its configuration,
		// perhaps to come back).
		msg = fmt.Sprintf("subscription refused: %s; retrying until the server takes it (the streams have events, or the source is served), saying so again every %v", st.Message(), quietInterval)
	case repeats > 0:
		msg = fmt.Sprintf("stream still failing (%d more times in the last %v); reconnecting", repeats, quietInterval)
	default:
		msg = "stream ended; reconnecting"
	}
	r.log.Warn(msg, "err", err, "in", wait)
}

// now is the runner's clock: a test's when set.
func (r *Runner) now() time.Time {
	if h := r.hooks.now; h != nil {
		return h()
	}
	return time.Now()
}

// fatalError carries a terminal error out of runOnce.
type fatalError struct{ err error }

func (e *fatalError) Error() string { return e.err.Error() }

// received is a delivery and when it arrived, by the relay's monotonic
// clock.
type received struct {
	d  *outboxv1.SubscribeResponse
	at time.Time
}

// unbatch is the deliveries one message carries, in order, received at
// at: those of SubscribeResponse.deliveries when it has any (the server
// batches them, since the runner sets accept_batches), else the message
// itself.
func unbatch(msg *outboxv1.SubscribeResponse, at time.Time) []received {
	ds := msg.GetDeliveries()
	if len(ds) == 0 {
		return []received{{msg, at}}
	}
	out := make([]received, len(ds))
	for i, d := range ds {
		out[i] = received{d, at}
	}
	return out
}

// runOnce runs one subscription until it breaks, ctx is done or the server
// refuses the relay, then waits for its publishes and acks.
func (r *Runner) runOnce(ctx context.Context) error {
	// Publishes, lease extensions and acks outlive ctx by up to DrainTimeout,
	// so that work already handed to the broker is acknowledged. A terminal
	// error ends them at once.
	workCtx, cancelWork := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancelWork(nil)
	stopDrain := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(r.cfg.DrainTimeout, func() { cancelWork(errDrainTimeout) })
		context.AfterFunc(workCtx, func() { t.Stop() })
	})
	defer stopDrain()
	f := newFatal(cancelWork)

	// The stream too outlives ctx until the publishes under way are done:
	// the server holds their leases for as long as it is open, and closing
	// it afterwards gives back at once the leases of whatever is left.
	streamCtx, cancelStream := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelStream()
	req := &outboxv1.SubscribeRequest{
		RelayId:        r.cfg.RelayID,
		Streams:        r.cfg.Streams,
		ExcludeStreams: r.cfg.ExcludeStreams,
		MaxInFlight:    uint32(r.cfg.MaxInFlight),
		// The runner reads several deliveries from one message (see
		// received), which saves both sides a message per delivery.
		AcceptBatches: true,
	}
	if r.cfg.MaxInFlightPerAggregate > 1 {
		req.MaxInFlightPerAggregate = uint32(r.cfg.MaxInFlightPerAggregate)
	}
	if r.cfg.LeaseTTL > 0 {
		req.LeaseTtl = durationpb.New(r.cfg.LeaseTTL)
	}
	// Until the stream is open there is nothing to drain: a stop while
	// connecting cancels at once.
	stopEarly := context.AfterFunc(ctx, cancelStream)
	stream, err := r.client.Subscribe(streamCtx, req, grpc.MaxCallRecvMsgSize(MaxDeliveryBytes))
	stopEarly()
	if err != nil {
		return err
	}

	deliveries := make(chan []received)
	recvErr := make(chan error, 1)
	go func() {
		// The server's headers say it accepted the subscription, before
		// any event exists: from here the relay is connected, which its
		// log says (after an outage's warnings, too), with the session
		// id operators see in outboxd relays. A refusal sends none.
		if md, err := stream.Header(); err == nil {
			if ids := md.Get(limits.SessionIDHeader); len(ids) == 1 {
				r.log.Info("subscribed", "session", ids[0])
			}
		}
		for {
			msg, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case deliveries <- unbatch(msg, time.Now()):
			case <-streamCtx.Done():
				// Not handled: released when the stream closes.
				recvErr <- streamCtx.Err()
				return
			}
		}
	}()

	acks := newAckBatcher(workCtx, r, f)
	var lines *aggregateLines
	if r.cfg.MaxInFlightPerAggregate > 1 {
		lines = newAggregateLines(r, f, acks, workCtx, ctx)
	}
	var wg sync.WaitGroup
	var result error
loop:
	for {
		select {
		case batch := <-deliveries:
			// A batch's deliveries are handled in order, as if each had
			// come in a message of its own.
			for _, rd := range batch {
				if ctx.Err() != nil {
					break loop // stopping: released with the stream
				}
				if lines != nil {
					lines.add(rd)
					continue
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					r.handle(workCtx, f, rd, acks)
				}()
			}
		case result = <-recvErr:
			break loop
		case <-ctx.Done():
			break loop
		case <-f.done:
			break loop
		}
	}
	wg.Wait()
	if lines != nil {
		lines.wait()
	}
	acks.close()
	cancelStream()
	if result == nil {
		<-recvErr
	}
	if err := f.get(); err != nil {
		return &fatalError{err}
	}
	return result
}

// errDrainTimeout is why publishes still running DrainTimeout after Run's
// context ended are cancelled.
var errDrainTimeout = errors.New("relay: stopping, and Config.DrainTimeout passed")

// handle publishes one delivery and acks or nacks it.
func (r *Runner) handle(ctx context.Context, f *fatal, rd received, acks *ackBatcher) {
	err, cancelled, _ := r.publish(ctx, f, rd, leaseExpiry(rd.d, rd.at))
	switch {
	case cancelled:
	case err == nil:
		acks.add(ackItem(rd))
	default:
		r.nack(ctx, f, rd.d, err)
	}
}

// ackItem is the ack of a delivery.
func ackItem(rd received) *outboxv1.AckItem {
	return &outboxv1.AckItem{EventId: rd.d.GetEvent().GetEventId(), LeaseToken: rd.d.GetLeaseToken()}
}

// publish publishes one delivery, extending its lease (which lapses at
// expiry as far as the runner knows) while a slow publish runs. It returns
// the broker's error, cancelled when the runner cut the publish short,
// which is no failure to nack, and the lease's expiry as the extensions
// left it.
func (r *Runner) publish(ctx context.Context, f *fatal, rd received, expiry time.Time) (err error, cancelled bool, leaseExpiry time.Time) {
	d := rd.d
	ev := d.GetEvent()
	e := Event{
		ID: ev.GetEventId(), Stream: ev.GetStream(), AggregateKey: ev.GetAggregateKey(),
		Revision: ev.GetRevision(), Type: ev.GetEventType(), Payload: ev.GetPayload(),
		Headers: ev.GetHeaders(), CreatedAt: ev.GetCreatedAt().AsTime(), Attempt: int(d.GetAttempt()),
		Source: ev.GetSource(), RepublishAction: d.GetRepublishActionId(),
	}
	stopExtend := r.keepLease(ctx, f, d, expiry)
	err = r.cfg.Publisher.Publish(ctx, e)
	expiry = stopExtend()
	if err == nil {
		return nil, false, expiry
	}
	if ctx.Err() != nil {
		// The runner cut the publish short (it is stopping): that is no
		// failure of the broker, and a nack would count one against the
		// event on every rolling deploy, pushing it towards parking.
		// Closing the stream releases the lease at once instead.
		r.log.Info("publish cancelled; its lease is released with the stream", "event_id", e.ID, "cause", context.Cause(ctx))
		if h := r.hooks.publishCancelled; h != nil {
			h(e.ID)
		}
		return err, true, expiry
	}
	r.log.Warn("publish failed; nacking", "event_id", e.ID, "stream", e.Stream, "aggregate_key", e.AggregateKey,
		"revision", e.Revision, "attempt", e.Attempt, "err", err)
	return err, false, expiry
}

// nack reports a failed publish, retrying briefly while the server is
// unavailable. If it cannot, the lease expires (or is released with the
// stream) and the event comes again: nothing is lost.
func (r *Runner) nack(ctx context.Context, f *fatal, d *outboxv1.SubscribeResponse, perr error) {
	id := d.GetEvent().GetEventId()
	req := &outboxv1.NackRequest{EventId: id, LeaseToken: d.GetLeaseToken(), Error: nackText(perr), Permanent: IsPermanent(perr)}
	if after, ok := RetryAfterOf(perr); ok {
		req.RetryAfter = durationpb.New(after)
	}
	delay := extendRetryBase
	for attempt := 1; ; attempt++ {
		callCtx, cancel := context.WithTimeout(ctx, extendCallTimeout)
		_, err := r.client.Nack(callCtx, req)
		cancel()
		if err == nil || ctx.Err() != nil {
			return
		}
		if req.RetryAfter != nil && status.Code(err) == codes.InvalidArgument {
			// A server that refuses a retry_after above its backoff cap
			// (current ones cap it): the failure must still count, so
			// nack without it.
			r.log.Info("nack's retry_after refused; nacking with the server's backoff", "event_id", id,
				"retry_after", req.RetryAfter.AsDuration(), "err", err)
			req.RetryAfter = nil
			continue
		}
		switch classify(err) {
		case classTerminal:
			f.set("Nack", err)
			return
		case classLeaseLost:
			r.log.Info("nack found the lease gone; nothing to do", "event_id", id, "err", err)
			return
		case classTransient:
			if attempt < nackAttempts && sleep(ctx, delay) {
				delay = min(delay*2, extendRetryCap)
				continue
			}
		}
		r.log.Warn("nack failed; the lease will end by itself instead", "event_id", id, "err", err)
		return
	}
}

// nackAttempts bounds the tries of one Nack.
const nackAttempts = 5

// maxNackText is the most bytes of error text a Nack carries: what the
// server stores.
const maxNackText = 4096

// nackText is err's text as a Nack can carry it. A broker's error may hold
// anything: bytes that are not UTF-8 would make the request unmarshalable
// (a proto3 string) and a NUL cannot be stored in PostgreSQL text, so that
// the nack would fail and the failure never count towards parking.
func nackText(err error) string {
	s := strings.ToValidUTF8(err.Error(), "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\\0")
	if len(s) <= maxNackText {
		return s
	}
	cut := maxNackText - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
