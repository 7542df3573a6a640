package relay

import (
	"context"
	"time"
)

// Event is one delivery as a Publisher sees it. Every attempt at the same
// event carries the same ID, Payload bytes and Headers; brokers that can
// deduplicate should key on ID.
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
}

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
