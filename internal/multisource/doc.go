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
//     a source other than default); a bare name or id is default's, and
//     "orders/" (an empty stream) is every stream of orders. Their
//     answers name the source as requests do: Event.source, and every
//     other stream field as "source/stream" (Aggregate, Attempt,
//     OperatorAction), so an answer can be sent back as it is; default's
//     are byte for byte a single source's. An OperatorAction's
//     request_json is rewritten the same way on the way out (its stream,
//     filter stream and event_id), so every action in the operator log
//     names its source as the caller wrote it; the record in the
//     database stays the engine's (bare names), as a single source keeps it.
//
//   - The listings ListEvents, ListAggregates and ListOperatorActions with
//     no stream and no event id, on a server of several sources, or with a
//     stream "*/PATTERN" on any, read every source the caller's token may
//     see (auth.Principal.ForSource), in name order: a page is filled from
//     one source and goes on into the next. Their next_page_token is
//     "SOURCE:TOKEN", the source to go on in and that engine's own token
//     (empty to start it); a token not of that form, or one that goes on in
//     a source no longer served, is INVALID_ARGUMENT (start again without
//     it). A source that cannot answer is left out and named, with the
//     reason, in the page's skipped_sources, as GetLag leaves it out; when
//     none answers the call fails. So is a source that refuses the token
//     (PERMISSION_DENIED: it may see only some streams of that source and
//     the request spans them all, naming no stream or "*/*"), the reason
//     saying to name a stream of it; when no source on the first page lets
//     the token list, the call fails with PERMISSION_DENIED naming each. A server of one source answers a listing
//     without a stream exactly as a single-source server does (its tokens
//     are the engine's), but still takes a "SOURCE:TOKEN" token issued
//     before its other sources were removed (engine tokens have no ':').
//     The items are ordered within a source (newest or oldest first, as
//     the RPC says), not across sources. ListRelays always lists every
//     source's relays (it has no paging); ListAttempts names an event or
//     an aggregate, so one source.
//
//   - BulkRetry and BulkSkip whose filter names no stream, on a server of
//     several sources, or names "*/PATTERN", act on every source the
//     caller may see, once each: a dry run of every source first, so that
//     a filter or token a source refuses, or a source that cannot answer,
//     fails the action (naming the source) before anything changes; then
//     each source acts in name order and records its own operator action
//     ("orders/*" for orders', as OperatorAction.stream and as its
//     request_json's filter stream). The answer sums the counts, its
//     sample names each aggregate's source. A source failing midway ends
//     the action with its error, naming it and the sources that acted. A
//     bare "*" stays every stream of default, as every bare name is
//     default's: "*/*" is every stream of every source.
//
//   - Purge without a stream purges every source the caller may purge
//     entirely, one after another, each source's progress naming it
//     (PurgeResponse.source) and a final message summing them
//     (PurgeResponse.sources). A token that may access only some streams
//     of a source is refused before anything is deleted; sources it may
//     access nothing of are left out.
//
// The gRPC server's own metrics (per-method counts, recovered panics) are
// the process's, not any source's: they outlive a source removed at run
// time.
package multisource
