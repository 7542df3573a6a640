// Package client is what Go producers and operators import.
//
// Producers call Emit inside the transaction that changes their business rows,
// so the event exists if and only if that transaction commits. Emit inserts
// into outbox.event, whose insert trigger checks the event and assigns its
// revision, as it does for outbox.emit, the function producers in other
// languages call with their own drivers; a plain INSERT spares the function
// call (BENCHMARKS.md, bench/pgbench/producer-and-ack.sh).
//
// Emit carries the caller's OpenTelemetry trace context to the relay: when
// ctx holds a valid span context, the event's headers get its W3C
// "traceparent" and "tracestate" (see Event.Headers), so the relay's publish
// span links back to the transaction that recorded the event.
package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Querier is what Emit needs from a connection: pgx.Tx, *pgx.Conn and
// *pgxpool.Pool all satisfy it. Pass the transaction that makes the business
// change; with a pool or a bare connection the event commits on its own.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Event is an event to record.
type Event struct {
	// Stream is the event's stream, matching ^[a-z][a-z0-9_.-]{0,127}$.
	Stream string
	// AggregateKey identifies the aggregate; events of one aggregate are
	// delivered in revision order.
	AggregateKey string
	// Type names what happened, for example "OrderPaid".
	Type string
	// Payload is the event body as JSON text. It must be valid JSON and at
	// most outbox.settings.max_payload_bytes (1 MiB by default).
	Payload json.RawMessage
	// Headers are string headers carried to the broker. When Emit's context
	// holds a valid OpenTelemetry span context, Emit adds its W3C trace
	// context as "traceparent" and "tracestate" (the latter only when not
	// empty), unless Headers already has either key (in any case): the
	// caller's trace context is never overwritten nor mixed with another,
	// so a producer can carry a context of its own choosing. Emit does not
	// modify the map it is given.
	Headers map[string]string
	// Revision is the event's revision within its aggregate. Zero lets the
	// database assign the next one; otherwise it is checked for uniqueness.
	Revision int64
	// ID fixes the event's id. The zero value lets the database generate one.
	ID uuid.UUID
}

// Emitted is what Emit recorded.
type Emitted struct {
	// ID is the event's stable id.
	ID uuid.UUID
	// Revision is the event's revision within its aggregate.
	Revision int64
}

// ErrInvalidEvent is wrapped by errors Emit returns before reaching the
// database, for input it can check itself.
var ErrInvalidEvent = errors.New("client: invalid event")

// Emit records ev in outbox.event through q. The database checks everything
// again and answers bad input with SQLSTATE 22023 (invalid_parameter_value),
// an oversized payload with 54000, and a repeated revision with 23505; those
// errors come back as *pgconn.PgError.
func Emit(ctx context.Context, q Querier, ev Event) (Emitted, error) {
	if len(ev.Payload) == 0 {
		return Emitted{}, fmt.Errorf("%w: payload is empty; use {} for an empty body", ErrInvalidEvent)
	}
	if !json.Valid(ev.Payload) {
		return Emitted{}, fmt.Errorf("%w: payload is not valid JSON", ErrInvalidEvent)
	}
	if ev.Revision < 0 {
		return Emitted{}, fmt.Errorf("%w: revision %d is negative", ErrInvalidEvent, ev.Revision)
	}
	headers := []byte("{}")
	if h := withTraceContext(ctx, ev.Headers); len(h) > 0 {
		var err error
		if headers, err = json.Marshal(h); err != nil {
			return Emitted{}, fmt.Errorf("%w: headers: %v", ErrInvalidEvent, err)
		}
	}
	var revision *int64
	if ev.Revision != 0 {
		revision = &ev.Revision
	}
	// pgtype.UUID rather than uuid.UUID: pgx encodes the latter through its
	// driver.Valuer string, after a failed binary attempt, unless the
	// caller's pool registered an integration.
	var id pgtype.UUID
	if ev.ID != uuid.Nil {
		id = pgtype.UUID{Bytes: ev.ID, Valid: true}
	}
	var out Emitted
	var outID pgtype.UUID
	err := q.QueryRow(ctx,
		`INSERT INTO outbox.event (stream, aggregate_key, event_type, payload, headers, revision, event_id)
		 VALUES ($1, $2, $3, $4::jsonb, $5::jsonb, $6, $7) RETURNING event_id, revision`,
		ev.Stream, ev.AggregateKey, ev.Type, string(ev.Payload), string(headers), revision, id,
	).Scan(&outID, &out.Revision)
	if errors.Is(err, pgx.ErrNoRows) && id.Valid {
		// The insert trigger inserts nothing for a retry of a recorded event
		// (same id and content): answer with the recorded one.
		err = q.QueryRow(ctx, `SELECT event_id, revision FROM outbox.event WHERE event_id = $1`, id).
			Scan(&outID, &out.Revision)
	}
	if err != nil {
		return Emitted{}, fmt.Errorf("client: emit %s/%s: %w", ev.Stream, ev.AggregateKey, err)
	}
	out.ID = outID.Bytes
	return out, nil
}

// withTraceContext returns a copy of h with the W3C trace context of ctx's
// span added, or h itself when ctx holds no valid span context or h
// already carries a trace context of the caller's.
func withTraceContext(ctx context.Context, h map[string]string) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return h
	}
	for k := range h {
		if strings.EqualFold(k, "traceparent") || strings.EqualFold(k, "tracestate") {
			return h
		}
	}
	out := make(map[string]string, len(h)+2)
	for k, v := range h {
		out[k] = v
	}
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(out))
	return out
}
