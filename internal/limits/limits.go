// Package limits holds the sizes (and the one header name) that the server
// and the relay must agree on. It is a leaf package, so both server/ and relay/ import it without
// importing each other.
package limits

// MaxDeliveryBytes is the largest deliverable event: the most bytes one
// encoded SubscribeResponse (the event with its headers, lease token and
// lease fields) may take. The server must not send a larger delivery (it
// cannot be received, so it can only be parked); the relay receives up to
// this size. It equals gRPC's default receive limit, so that a relay written
// in any language with its gRPC client's default settings can receive every
// event the server delivers. A message of several deliveries (for a relay
// that set SubscribeRequest.accept_batches) stays under 1 MiB, far below it;
// a delivery too large to share one is sent alone.
const MaxDeliveryBytes = 4 << 20

// MaxAckItems is the most acks one Ack request may carry.
const MaxAckItems = 1000

// SessionIDHeader is the response header of an accepted Subscribe stream:
// the session's id, sent before any delivery, as operators see it in
// ListRelays and as the lease holder in GetAggregate.
const SessionIDHeader = "outbox-session-id"
