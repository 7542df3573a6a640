package relay

import (
	"context"
	"errors"
	"strconv"
	"time"
)

// Event is one delivery as a Publisher sees it. Every attempt at the same
// event carries the same ID, Payload bytes and Headers; brokers that can
// deduplicate should key on MessageID (ID, qualified by a source other than
// default).
type Event struct {
	// ID is the event's stable id (a UUID in canonical text form).
	ID string
	// Stream is the event's stream, matching ^[a-z][a-z0-9_.-]{0,127}$.
	Stream string
	// AggregateKey identifies the aggregate; use it as the broker's
	// partitioning or routing key to keep per-aggregate order.
	AggregateKey string
	// Revision is the event's position within its aggregate.
	Revision int64
	// Type names what happened.
	Type string
	// Payload is the event body, JSON text.
	Payload []byte
	// Headers are the producer's string headers.
	Headers map[string]string
	// CreatedAt is when the producer's transaction inserted the event.
	CreatedAt time.Time
	// Attempt counts deliveries of this event, from 1.
	Attempt int
	// Source names the source database of the event on a server that
	// fronts several; empty for the source named "default". ID is unique
	// within a source only: see MessageID.
	Source string
	// RepublishAction is not zero when this delivery is of an event an
	// operator republished: the id of that republish (outboxd actions
	// lists it). Every delivery under one republish carries the same id.
	RepublishAction int64
}

// MessageID is the id a broker or consumer deduplicates ev on: ev.ID for
// the source named "default" (and single-source servers), else
// "source/ID", since event ids are unique within a source only and two
// sources may well publish to one broker. Every sink sets it where its
// broker looks for a message id (Nats-Msg-Id, AMQP message-id, webhook-id,
// the CloudEvents id) and in Outbox-Event-Id (Redis: the event_id field).
func (e Event) MessageID() string {
	if e.Source == "" || e.Source == defaultSource {
		return e.ID
	}
	return e.Source + "/" + e.ID
}

// DedupID is the message id for a broker that drops a message whose id
// it stored within a window (JetStream's Nats-Msg-Id): MessageID, and for
// a delivery of a republish MessageID + "/republish/" + the action id. An
// operator's republish is then stored again, while each delivery's own
// retries (the same republish, the same id) are still dropped as
// duplicates. Consumers keep MessageID, which every copy shares.
func (e Event) DedupID() string {
	if e.RepublishAction == 0 {
		return e.MessageID()
	}
	return e.MessageID() + "/republish/" + strconv.FormatInt(e.RepublishAction, 10)
}

// defaultSource is the source whose events' ids need no qualifying.
const defaultSource = "default"

// Publisher hands events to a broker.
type Publisher interface {
	// Publish returns nil only after the broker has durably accepted ev (for
	// example a JetStream PubAck, a Kafka ack from all in-sync replicas, a
	// RabbitMQ publisher confirm). Any other outcome, including a timeout
	// whose result is unknown, must be an error: the event is then offered
	// again with the same ID. Publish is called concurrently for events of
	// different aggregates, never for two events of the same aggregate.
	Publish(ctx context.Context, ev Event) error
}

// Sink is a Publisher that owns a broker connection.
type Sink interface {
	Publisher
	// Close releases the broker connection.
	Close() error
}

// RetryAfter returns err marked with a broker's request to wait at least d
// before the event is offered again (an HTTP Retry-After, a throttle hint).
// The runner sends d as the Nack's retry_after; the server waits for the
// longer of d and its own backoff, up to its backoff cap. (A server that
// refuses a d above its cap gets the nack again without it.) A nil err
// stays nil; d <= 0 adds nothing.
func RetryAfter(err error, d time.Duration) error {
	if err == nil || d <= 0 {
		return err
	}
	return &retryAfterError{err: err, d: d}
}

// RetryAfterOf returns the delay the outermost RetryAfter in err's chain
// asks for, and whether there is one.
func RetryAfterOf(err error) (time.Duration, bool) {
	var ra *retryAfterError
	if errors.As(err, &ra) {
		return ra.d, true
	}
	return 0, false
}

type retryAfterError struct {
	err error
	d   time.Duration
}

func (e *retryAfterError) Error() string { return e.err.Error() }
func (e *retryAfterError) Unwrap() error { return e.err }

// Permanent returns err marked as a failure that retrying cannot fix (an
// event larger than the broker accepts, a message the broker refuses for
// its content). The runner's nack then asks the server to park the
// aggregate at once, with err as the reason, instead of after the
// server's max failures. A nil err stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err's chain holds an error marked by
// Permanent.
func IsPermanent(err error) bool {
	var pe *permanentError
	return errors.As(err, &pe)
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }
