// Package multisource puts several source databases behind one outboxd
// control plane.
//
// Each source database has its own engine: a server.Server with its own
// pool, discovery, acker, LISTEN connection, janitor and health, exactly
// the engine a single-source replica runs. Nothing is shared between
// engines but the process and its gRPC listener, so a source that is down,
// slow or mid-migration holds up only its own engine. The Router in front
// of them implements the RelayService and AdminService and sends each call
// to the engine of the source it names:
//
//   - Streams are addressed "source/stream"; a bare stream name means the
//     source named "default" (the --database-url), so relays and operators
//     that predate sources keep working unchanged.
//
//   - A Subscribe stream serves one source: its streams and
//     exclude_streams all name that source ("orders/billing",
//     "orders/*" for every stream of it). A subscription that spans sources
//     ("*/payments", or names of two sources) is refused with
//     INVALID_ARGUMENT: open one stream per source (each with its own
//     credit). The engine sees the bare names. A relay expands a source
//     pattern itself: ListSources names the live sources (not those being
//     removed) that the caller's token reaches, and outboxd relay opens
//     one stream per listed source for "*/payments" or "*/*", re-listing
//     to follow sources added and removed.
//
//   - A lease token of a source other than default is the engine's token
//     prefixed with "source." (engine tokens are base64url, which has no
//     '.'), so an Ack, Nack or ExtendLease reaches the engine that issued
//     it through any replica serving the same sources. Each engine signs
//     with its own database's key, so a token moved to another source's
//     prefix does not verify. Default's tokens carry no prefix: they are
//     byte for byte what a single-source server issues. Deliveries of a
//     source other than default name it in Event.source.
//
//   - Tokens scoped with "streams=source/pattern" reach an engine only as
//     auth.Principal.ForSource projects them, so a token scoped to one
//     source is refused on every other.
//
//   - GetLag asks every engine at once and reports per source
//     (GetLagResponse.sources): one source down leaves out its figures and
//     says why, and the others' are reported.
//
//   - Sources can be added and removed while serving (Router.Add, Retire,
//     Remove; app.Replica.AddSource and RemoveSource drive them): the
//     engines are a copy-on-write snapshot, so a change touches no other
//     source's engine, and a removed source is named as removed: NOT_FOUND
//     for a new Subscribe, ACK_STATUS_INVALID for an Ack of its lease,
//     FAILED_PRECONDITION for Nack and ExtendLease.
//
//   - The other admin RPCs reach one source, chosen by the "source/" prefix
//     of their stream, their filter's stream, or their event_id
//     ("orders/<uuid>", the message id the relay's sinks give an event of
//     a source other than default); a bare name or id is default's. Their
//     answers name the source as requests do: Event.source, and every
//     other stream field as "source/stream" (Aggregate, Attempt,
//     OperatorAction), so an answer can be sent back as it is; default's
//     are byte for byte a single source's.
//
//   - Purge without a stream purges every source the caller may purge
//     entirely, one after another, each source's progress naming it
//     (PurgeResponse.source) and a final message summing them
//     (PurgeResponse.sources). A token that may access only some streams
//     of a source is refused before anything is deleted; sources it may
//     access nothing of are left out.
//
// Milestone limits: the listings without a stream (ListEvents,
// ListAggregates, ListOperatorActions) read default's.
package multisource
