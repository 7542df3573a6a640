// Package server is outboxd's delivery control plane: it implements the
// outbox.v1 RelayService (and AdminService) on top of the outbox schema in
// PostgreSQL. Replicas are stateless and share nothing but the database.
//
// # Tables
//
// outbox.event holds what producers committed; only published_at ever
// changes, and only outbox.ack changes it. Each row carries the id of the
// transaction that wrote it (xid). Two rows per aggregate carry the
// bookkeeping, split by who writes them:
//
//   - outbox.aggregate is the producers' row: the revision counter and the
//     order lock concurrent producers of one aggregate serialise on, held to
//     their commit. The server never writes it and never waits for it (only
//     an operator's accept-gap locks it).
//   - outbox.delivery is the server's row: the cursor (delivered_revision),
//     the lease (epoch, holder, expiry), attempts, failures, backoff, parking.
//     Producers never touch it: a producer's transaction writes its event and
//     its counter, nothing else, so it cannot block the server, and nothing
//     it reads can, if stale under REPEATABLE READ or SERIALIZABLE, strand its
//     event.
//
// # Discovery
//
// Every replica runs discovery rounds (replicas take turns with an advisory
// lock). outbox.discovery stores a transaction snapshot S: every event whose
// transaction is visible in S has been discovered. A round is one
// statement, outbox.discover_round (so one transaction), in two parts, each
// with its own snapshot. outbox.discover_scan reads, in one
// snapshot N, the events with xid >= xmax(S) or xid in S's list of running
// transactions: exactly those visible in N and not in S, whenever they
// committed; it returns N and the aggregates found, saying which are idle
// or new (the oldest Config.DiscoveryMaxFound of them: a backlog of a
// million aggregates must not cost the replica a million rows in memory;
// the apply wakes those it did not return, whose sessions then claim
// them). With Config.DiscoveryMaxEvents the round may return, instead of
// N, N cut at an xid X: xmax X, and N's running transactions below X. The
// events visible in the cut snapshot are exactly those of N below X, which
// the apply reads and stores the cut snapshot with, so "everything
// visible in S was discovered" holds after the round; the next one reads
// from X on and the transactions that were running below it. Transaction
// ids follow first writes, not commits, so a cut can show an aggregate's
// revision 6 without 5 (whose transaction, with the later id, committed
// first); the apply's decision statement, whose snapshot is newer than N
// and so sees 5, starts a new aggregate's cursor below its lowest pending
// revision. The round
// then picks which of those go straight to the replica's waiting
// sessions (dispatch, below: the replica sends the sessions' offer with
// the round), and outbox.discover_apply re-reads exactly the
// events visible in N, locks every found aggregate's delivery row, creates
// the row of a new aggregate (cursor just below its lowest pending revision) or
// wakes an idle or gap-held one, stores N, and sends one NOTIFY
// outbox_wakeup when it made a row ready. A transaction left open costs one
// index probe per round; it never delays other events. An empty round
// writes nothing. A round is one round trip to the database (once its
// statement is prepared on the connection): the choice of sessions travels
// with it rather than being made between the scan and the apply, which
// made a round two round trips (BEGIN with the scan, the apply with
// COMMIT), each landing, on a source with a trickle of events, on a
// backend idle since the last.
//
// A replica does not run empty rounds back to back: after a turn that
// found nothing (see Wake-ups for the pauses, which double up to the idle
// interval), the loop first asks (store.RoundDue) whether the next round
// has anything to do, in one statement outside any transaction, one round
// trip, with no lock: is an event visible in the statement's snapshot C
// and not in S (the same two index probes as the scan, xid >= xmax(S) or
// in S's running list), or is discovery stopped (recorded, or the counter
// behind xmax(S), the scan's own conditions)? Only a yes runs the round.
// Skipping on a no changes nothing, since an empty round stores nothing
// either: S stays, and every later round still reads from S. And an
// answer that is stale by the time the loop acts on it misses nothing: an
// event not visible in C (its transaction still running at C, or not yet
// begun) is not visible in S, which was stored before C, so it is
// "visible now, not in S" to the next check and the next round, which
// find it, its transaction in S's running list or at or above its xmax.
// A round that found several events is followed by a round, without a
// check (the scan answers the same question), so a busy replica never pays
// the extra round trip; the first round after a pause pays it, next to the
// pause it waited, and so does the round after one that found a single
// event. That check follows after DiscoveryInterval at least (see
// Wake-ups for the pause after a round), but after half the
// idle interval in a trickle (a lone event, the round before that found
// any more than the idle interval earlier), where checks 1, 2, 4 ms later
// would almost never find the next event; events closer together keep the
// short pause, so a busy source is not slowed, nor a burst after its first
// round (which, finding one event, delays the rest by up to half the idle
// interval once). A source with one event every 50 ms pays one round per
// event and about one or two checks, where the doubling from
// DiscoveryInterval cost five, a round after every pause a dozen empty
// rounds, each then two round trips and the discovery lock, and a round after
// every round that found events one empty round per event.
//
// A quiet source's loop sleeps instead of checking: producers wake it. After
// a check that found nothing, the loop takes a session-level advisory lock
// (outbox.discovery_sleep) on its replica's LISTEN connection and checks
// once more; from then on it makes no checks but a safety one a second
// (asleepCheckInterval). The insert trigger tries the same key shared
// (pg_try_advisory_xact_lock_shared) for every event: while a replica
// sleeps that fails, and the producer sends NOTIFY outbox_discover, which
// reaches the sleeper at the producer's commit and runs a round (without
// a check). Nothing is missed between the lock and the sleep: a producer
// whose try succeeded holds the key shared until its transaction ends, so
// the loop's lock, and the check after it, come after that commit, and the
// check sees the event; a producer whose try failed notifies at its
// commit. Locks are not bound to snapshots, so this holds at every
// isolation level, and for a prepared transaction (which keeps its lock
// until COMMIT PREPARED). A round that finds more than one event, or as
// many as its bound, or fails, ends the sleep (the lock is given back by
// an op on the LISTEN connection, queued before the loop goes on: ops run
// in order there, so it comes before any later try to sleep, and the loop
// never waits on a listener busy with notifications), so producers under
// load never notify: a NOTIFY serialises committing transactions
// cluster-wide, and a burst is then polled as above. A lone event keeps the loop asleep. The lock lives
// on the LISTEN connection: a lost connection gives it back by itself
// (producers stop notifying a listener that is gone) and tells the loop,
// which runs a round and checks again until it can sleep anew. Only one
// replica of a database sleeps (the lock is exclusive); the others check
// as above, trying to sleep again a second after a try that failed
// (sleepRetry). PostgreSQL refuses PREPARE TRANSACTION after a NOTIFY, so
// where producers use two-phase commit no replica may sleep:
// outbox.settings.producer_wakeups is 'auto' by default, which sleeps only
// in a cluster whose max_prepared_transactions is 0, and 'on' or 'off'
// where the operator decides. A sleeping source costs no statement but the
// safety check, and a lone event's commit reaches its round in a
// notification's time rather than after the pauses above.
//
// Dispatch: a new or idle aggregate has nothing in hand, so instead of
// making it ready for a claim (a second write of its row, a second
// statement, a wake-up), the round leases its next event to a local session
// in the same statement, when that event is committed and not skipped and
// the row is still idle once locked. A session offers the credit it has
// free while it waits after a claim that came back short; the round borrows
// it before it is sent, and the database takes one unit per aggregate from
// the next session in turn whose stream filter admits it (turns rotate over
// rounds); the round gives back what it did not use together with the leases;
// either wakes the session's loop, which may have turned while its credit
// was lent and then waits without credit, out of its poll group's reach.
// Credit an ack frees is claimed with before any is offered again, so
// dispatch never starves older claimable work. A session whose stream
// ended before its leases reached it refuses them and the round releases
// them; a round whose answer is lost makes the sessions it lent credit
// from sweep their orphans, as a lost ack answer does.
//
// A saturated replica's round takes what the sessions can take. Once every
// round for a quarter of a second has found more events than its sessions
// offered credit for (saturatedAfter), and while every session of the
// replica takes every stream, a round takes about as many events as they
// offer credit (the scan's event bound, as with DiscoveryMaxEvents: whole
// transactions, the oldest first, the snapshot cut after them), and a
// replica whose sessions offer none puts its round off until one does
// (an offer signals the loop; sessions that end offer nothing, so it also
// looks again after the idle interval); a round that takes everything it
// found within the credit ends it, as does a check that finds nothing due,
// but not a round that lost its turn to another replica's. What a round
// found beyond the credit it could only make ready, for claims; left
// undiscovered in outbox.event it costs nothing until credit frees (the
// lag report counts it as undiscovered), while a ready row costs a claim
// and a second write of its delivery row, and under a held xmin horizon
// every claim reads past the dead entries the claims before it left.
// Relays with little credit used to bring that on under load
// (BENCHMARKS.md). Not before
// saturation: a burst beyond the credit is made ready as ever, and every
// session's claims take it in parallel as acks free credit, where left
// undiscovered it would wait for the loop's rounds, one at a time (bounding
// every round doubled commit->sink p99 at 16 credit and 900 events/s).
// Nothing waits
// on discovery that credit would not free: the events of an aggregate a
// session holds go by its acks' hand-overs, which read outbox.event, not
// the round; any session can take any event, so the oldest first is the
// order they would go in anyway; and other replicas run their own rounds,
// bounded by their own sessions' credit. A replica with a session that
// takes only some streams (named, or all but some) does not bound its
// rounds: bounded, they would take the oldest events of every stream
// first, and a backlog of a stream no local session takes would keep the
// others' events from their sessions. Its rounds and those of a replica
// without sessions make ready what they do not dispatch, as before, for
// whichever session claims it.
//
// Transaction ids are the cluster's: S is stored with the cluster's
// system identifier, and the argument above holds only while every new
// event gets an id the next round looks at (at or above xmax(S), or in its
// running list), that is, while the counter stays ahead of S in the same
// cluster. A database restored from a dump into another cluster (or moved
// by pg_upgrade, or with its counter set back) breaks that: an event
// written with an id below xmax(S) would never be found. So discover_scan
// refuses to run (XX001) when the counter is behind xmax(S) or, in a round
// that found something, the cluster is not S's; the first to notice (the
// replica whose round failed, a readiness check) records the stop in
// outbox.discovery, so it holds after the counter passes xmax(S), when the
// ids would look plausible again. Readiness and GetLag say so.
// outbox.rescan_discovery (`outboxd rescan`) restores the argument: in one
// snapshot N it reads every pending event and re-stamps as frozen (xid 2)
// every event row visible in N whose id is not (a row of this cluster
// visible in N committed before N, so only a copied row can be such), then
// locks the found aggregates' delivery rows, creates or wakes them as a
// round does in a newer statement, and stores N with this cluster's
// identity. Every event visible in N is then known to delivery, and every
// event not visible in N has an id of this cluster that rounds from N find.
//
// # States of an aggregate (outbox.delivery.state)
//
//	(none) or idle ──(discovery finds an event)──▶ ready ──claim──▶ leased
//	(none) or idle ──(discovery finds an event, dispatches it)──▶ leased
//	leased ──ack──▶ leased (hand-over: next revision committed, holder local)
//	leased ──ack──▶ ready (next revision committed) or idle (nothing follows)
//	leased ──nack──▶ backoff ──(next_attempt_at)──▶ claimable again
//	leased ──nack #MaxFailures, or a permanent nack──▶ parked (waits for an operator)
//	leased ──(TTL passes)──▶ claimable again (expired lease; attempt+1)
//	leased ──(stream ends)──▶ ready (released at once)
//	ready ──claim finds the next revision missing, a later one present──▶ gap
//	gap ──(discovery finds any event of the aggregate)──▶ ready (re-checked)
//
// claimable_at orders claims and is non-NULL exactly for ready, leased and
// backoff: the head event's created_at when ready (oldest pending first), the
// lease expiry when leased, the next attempt when backing off. The claim
// index holds only such aggregates, keyed (stream, state, claimable_at), so a
// claim's cost follows the pending aggregates of the streams its session
// takes, never the event backlog nor other streams' work. A claim reads, for
// each stream it takes (named, or found by stepping from stream to stream in
// the index, the excluded ones left out), the first ClaimBatch rows of three
// ranges: every ready aggregate, and the leased and backing-off ones whose
// claimable_at has passed; it merges them in claim order and locks them in
// that order with SKIP LOCKED until it has ClaimBatch.
//
// A ready aggregate is claimable whatever its claimable_at: a database clock
// that stepped back leaves created_at ahead of now(), and ready work must not
// wait for the clock. A lease expiry or next attempt is a wall-clock time: a
// step back delays it by the step, but by no more than twice max(MaxLeaseTTL,
// BackoffCap), since a claimable_at further ahead than that can only follow
// a step and counts as due (outbox.claim_ranges). Twice, so that a lease
// granted for the longest TTL keeps its holder through any step shorter
// than that TTL. Epochs stay
// fenced across a step: each is above the previous one.
//
// # RPCs
//
// Acks come by Ack calls or as requests on an AckStream, which a relay
// keeps open so that acking one delivery at a time does not pay a call's
// set-up each time; both reach the same code (relayService.Ack), request by
// request. The stream is served by internal/multisource's router
// (ServeAckStream); a Server registered on its own (Register) answers it
// UNIMPLEMENTED, and relays fall back to Ack calls.
//
// Subscribe opens a session with a credit (max_in_flight). The session loop
// claims up to its free credit (outbox.claim: lock delivery rows FOR UPDATE
// SKIP LOCKED, lease each one's next revision, epoch+1) and sends one
// delivery per lease. After a claim that came back short it claims again
// only when work may have appeared for it: credit freed without a
// hand-over, a lease found gone, its poll group asking (a wake-up, the
// group's poll; see Wake-ups); a hand-over alone is no reason, nor is the
// reconcile tick (a lease it finds gone is). Credit an ack frees is claimed
// with only if the ack's batch, probing the claim index once it had
// applied, saw some aggregate claimable (outbox.ack returns how long until
// the first would be); otherwise a claim would find nothing as of that
// probe, so the session waits as after a short claim, and claims no later
// than that time. Work made claimable after the probe wakes the sessions
// (a discovery round that made it ready, a release) or is seen by the
// next batch's probe. Most acks of a steady replica end a lease with
// nothing following, and their empty claims were most of its claims. A
// holder the batch hands at least as many events as it acked frees no
// credit, so it is not probed (its hint says "claim", never read): every
// ack of a hot aggregate hands the next event over, and the probe was a
// sixth of the database's work per event there. The
// probe is per session: the acker passes every local session's stream
// filter (outbox.ack's p_filter_*), and the probe reads the claim index of
// those streams alone (outbox.claim_probe), so a ready aggregate of a stream
// no connected relay takes neither makes acks claim nor bounds a wait. A
// holder the acker does not describe counts as taking every stream.
// Credit comes back only when the database says the lease
// is gone: an ack or nack on this replica signals the session directly; one
// on another replica sends NOTIFY outbox_released with the holder's session
// id; and every ReconcileInterval the session rechecks its leases (which also
// catches expired leases claimed by someone else). When the stream ends,
// outbox.release gives its leases back at once. A claim the session sees
// fail may still have committed (it timed out reading its rows): the session
// then releases every lease it holds but did not send, at once and again at
// its next reconcile tick.
//
// Batched sending: a relay that set accept_batches gets every delivery the
// session loop has ready at once (a claim's, or the leases ack batches and
// discovery rounds handed it since the loop last looked) in one message
// (SubscribeResponse.deliveries, up to 1 MiB), in the order they would have
// gone one by one; a lone delivery, and every delivery to a relay that did
// not set it, goes in a message of its own. Batching changes no lease and
// no order: it saves a message, a socket write and a relay's read per
// delivery.
//
// Ack verifies each token's HMAC (any replica can: the key is in the
// database) and hands the ids to a group committer, which applies every ack
// queued for it in one call of outbox.ack. Under load (acks of several relay
// connections interleave, and the replica's sessions hold deliveries besides
// this batch's) a batch may wait up to Config.AckLinger (3 ms by default;
// serve --ack-linger) for more, and no longer than until every delivery
// outstanding as it began is acked: a statement costs about as much to start
// as a dozen acks to apply. The acks of one relay process (whose next call
// waits for this answer), a hot aggregate's acks handed over one by one, and
// a trickle commit at once. Config.AckCommitters committers
// (one by default; serve --ack-committers) apply batches at once, each on
// its own connection; a lease (its epoch and aggregate) picks its committer,
// so the acks of one window queue in one committer in the order they came
// and are applied in that order. A batch runs outbox.ack: lock the pending
// events in id order, then their delivery rows in key order (no deadlocks
// between batches), mark each event published if it is still its aggregate's
// next revision and not skipped, advance the cursor, and make the aggregate
// ready or idle. A batch of one ack with no window in play (every event of
// a hot aggregate, any batch that holds one ack) is decided in one-row
// statements of its own, the same decisions at about 40 % less cost: the
// batch statements' executor start-up cost more than their work on one row.
//
// Hand-over: the batch also passes this replica's open sessions (with their
// lease TTLs) unless the server is stopping. When an ack ends the lease of
// one of them and the aggregate's next revision is committed and not
// skipped, the same statement leases that event to the same session (epoch
// raised as by a claim, attempt 1, expiry now + the session's TTL) instead
// of making the aggregate ready, and the acker gives the lease to the
// session together with the freed credit, in one step: credit-neutral, and
// sent at once with no claim in between. The next event is of the same
// aggregate and so of the same stream: the session's stream filter admits
// it. It does not jump the claim order either: while older work is
// claimable in the streams the session takes and the session has no credit
// beyond the lease the ack ends, nothing is handed over and the aggregate is
// made ready, so a hot aggregate cannot hold a session's credit while older
// work waits. A session with credit to spare (HandOverTarget.Spare: a
// window of 1, and fewer outstanding deliveries, with what discovery rounds
// borrowed of its credit, than its max_in_flight) is not probed for it: its
// claims take the older work with that credit, woken by what made it
// claimable, or, for work no one announces (a lease that expired, a backoff
// that fell due), by its poll group's poll, within PollInterval, while the
// hot aggregate goes on. The probe of the claim index was a fifth of the
// database's work for each event of a hot aggregate. A gap or a skipped
// next revision hands nothing over; the aggregate is made ready and the
// claim applies its rules. An ack on another replica hands nothing over
// (that replica's sessions are not the holder). A
// session whose stream ends first refuses hand-overs (under its lock) before
// its release runs, so the release covers every lease it accepted; a lease
// it refused is released by the acker at once.
//
// Window: a relay that asks for max_in_flight_per_aggregate W > 1 gets
// leases that cover up to W consecutive revisions of an aggregate, one
// epoch for all of them (delivery.leased_through is the last). A claim
// gives every aggregate it locks its next event before any a second, and so
// on, within the session's free credit: each event counts against
// max_in_flight. An ack batch applies an aggregate's acks in revision order
// (one whose earlier revision is pending answers out_of_order, LEASE_LOST to
// the relay); a lease whose window reaches past the new cursor goes on,
// same epoch, and for a local holder slides forward by as many events as
// its acks freed, plus what the session lends of the credit it offers
// while waiting (so a window that started small can grow to W). Nack must
// name the lease's head (the relay lands the acks before it first) and
// ends the whole window; its credit comes back at once, by event and
// epoch, so a new lease of the same event is not freed by mistake. A
// window never spans a skipped or missing revision, and an operator's skip
// of any revision it covers ends it. An event of a window too large to
// send parks the aggregate at that revision (parked_revision): the acks of
// the revisions before it still land and leave it parked. When an ack
// batch's answer is lost, the sessions it may have handed leases sweep
// their orphans, and a lease stays only if the session knows both its head
// and the last event it covers: a window the lost batch slid forward is
// given back, since sliding it again would send revisions past events the
// relay never got. The sweep's release locks every lease of the session
// before it judges them, so a batch still committing is waited for and
// judged as it left the lease. A claim leases at most four times ClaimBatch events. Discovery still dispatches one event
// per aggregate; the first acks grow the window. The relay publishes an
// aggregate's events one at a time, in the order sent, and drops the rest
// of a window whose event failed (SubscribeResponse.lease_epoch tells it
// which deliveries belong to that lease); the window saves the round trip
// to the server between one event and the next.
//
// Nack and ExtendLease must name the current epoch: a stale lease cannot
// push back or prolong the current holder's delivery. ExtendLease may name
// any event the lease covers and not yet acked; it extends the whole lease.
//
// # Why the invariants hold
//
//   - Per-aggregate order (3): a lease always starts at
//     delivered_revision+1 (a window covers consecutive revisions from
//     there), and delivered_revision advances only when that event is
//     published (ack, in revision order) or skipped (operator). At most one
//     lease exists per aggregate because the delivery row is locked while
//     leasing and the state says leased until ack, nack, release or expiry.
//     A window's events reach one relay, in order, which publishes them one
//     at a time and stops at the first failure.
//   - One holder, fencing (4): every lease raises the epoch (to the larger of
//     epoch+1 and the clock in microseconds); Nack and ExtendLease check it.
//     A claim commits without waiting for its WAL flush: a lease lost in a
//     PostgreSQL crash just means the event is offered again, and the
//     clock-based epoch is never handed out twice. So does an ack: an ack
//     lost that way leaves its event pending, delivered again with the same
//     event_id (at-least-once allows it), and since WAL is replayed in
//     order, a later ack that survived means every earlier one did, so
//     first copies stay in revision order.
//   - Ack-gated marking (5): published_at is set only by outbox.ack, only for
//     ids whose token the server signed for that exact event. A token whose
//     lease has expired still marks the event while it is pending: the relay's
//     broker did accept it, so recording that is true and spares a
//     redelivery; the event is still the aggregate's next revision (no lease
//     is ever issued past it), so order holds. A repeated ack answers
//     ALREADY_PUBLISHED; a skipped event answers LEASE_LOST and stays
//     unpublished.
//   - Liveness (6): an expired lease is claimable again (claimable_at is its
//     expiry). Notifications only cut latency; every poll group with a
//     session waiting with credit polls (one of them claims), and a session
//     takes the same streams as the others of its group, so a lost NOTIFY
//     or a dropped LISTEN connection delays an event by at most the poll
//     interval, or about twice that where an idle replica's probe let a
//     poll skip its claim (the check interval and one and a half poll
//     intervals where quiet checks come less often than every half poll
//     interval: see Wake-ups).
//   - Gaps (8): when the next revision is missing but a later one exists, the
//     claim holds the aggregate in state gap (gap_revision says which one) and
//     never skips it; discovery wakes it when any event of it commits, and the
//     claim checks again.
//   - Nothing missed by an idle replica's check (6): it only reads, and
//     rounds depend on nothing but S; an event committed after the check's
//     snapshot was not visible in S either, so the next check sees it as
//     new (see Discovery).
//   - Nothing missed between discovery and delivery (6): an ack or claim that
//     finds no next event sets the aggregate idle (or gap) in a statement
//     whose snapshot is newer than its lock on the delivery row. A discovery
//     round locks the rows it wakes; one that locked the row first had its
//     events committed before that snapshot, so they are seen; one that comes
//     after finds the row idle and wakes it. Such a round decides only on
//     events still pending after its locks: one the ack published
//     meanwhile is the ack's to follow up, so it neither wakes the row nor
//     counts as late (outbox.late_event holds only pending events found at
//     or below the cursor, which no rule delivers). Hand-over changes only what the
//     ack does when it does find the next event: it leases it rather than
//     making the row ready, decided in that same statement, so the argument
//     is unchanged. Dispatch changes only what a round does with an idle
//     row it has locked: it leases the next event instead of making the
//     row ready, decided in a statement after the lock, so the same
//     argument covers it. The next event need not have been discovered yet: a
//     later round that finds it sees the row leased (or already past it)
//     and leaves it alone, as it does for a row an ack made ready. Hence the
//     functions refuse to run at REPEATABLE READ (where a statement after a
//     lock reads an older snapshot), and the server pins READ COMMITTED on
//     its connections.
//   - Hand-over keeps one lease per aggregate (it replaces the lease the ack
//     ended, on the same locked row) and fencing (its epoch is raised like
//     a claim's, so the previous lease's token can no longer nack or extend;
//     its ack answers ALREADY_PUBLISHED).
//   - outbox.stranded counts pending events no rule will deliver, from the
//     producers' counters and the events rather than from delivery's states,
//     so a bug in the above shows in GetLag and metrics instead of hiding.
//     Trusting no state, it reads every aggregate, so it is an audit that
//     every lag reader shares: it runs again only when the last one is older
//     than Config.StrandedAuditInterval (1 min; 20 times its own length when
//     that is longer), and GetLag says when it began (strandedAudit).
//
// # Wake-ups
//
// Producers NOTIFY only while a replica's discovery sleeps (see Discovery),
// never under load: NOTIFY takes a global lock at commit that would
// serialise every producer. A discovery round that made aggregates ready
// (rather than dispatching them) wakes this replica's idle sessions directly
// and the others' through one NOTIFY outbox_wakeup. While rounds find
// events, the next follows after a pause as long as the last one took
// once it found 32 events or more (that share of it for fewer),
// Config.DiscoveryInterval at least and Config.DiscoveryPaceMax at most:
// a round's cost is mostly fixed (its statements' start-up, the locks,
// the wake-ups of the sessions it dispatches to), so under load, where
// rounds back to back 1 ms apart kept the discovery connection busy nine
// tenths of the time, the next round collects what arrived while the last
// ran and carries about twice the events for that cost, and the acks that
// follow its dispatches come in larger batches too (BENCHMARKS.md). A light
// load's rounds find a few events each and go on after DiscoveryInterval,
// or a small share of their length, so its latency is not paid for a
// saving it would not make (on a machine that half load keeps 90 % busy,
// rounds take long enough that the share is not small: commit→sink p99 at
// half load rose from 20-25 to 37-40 ms there; BENCHMARKS.md); a round as
// large as its bound (Config.DiscoveryMaxEvents, or the credit its
// sessions offered: a backlog taken in parts) is followed after
// DiscoveryInterval, and a
// lone event in a trickle after half the idle interval (see Discovery).
// Pacing is the replica's own: with several replicas, another one's loop
// may take its turn of the discovery lock during the pause.
// Each turn that finds nothing doubles the pause, up to
// Config.DiscoveryIdleInterval. For a loop that cannot sleep (another
// replica sleeps, or producer_wakeups keeps it awake) the idle interval is
// the longest a first event after an idle spell waits to be found, and an
// idle replica pays one statement per idle interval for it (the check
// above); a sleeping loop is woken by the producer's commit instead.
//
// A replica's sessions that take the same streams (the same stream filter)
// would all find the same work, so they wait as one poll group
// (server/wakeup.go). A session waiting with credit free is idle in its
// group. A wake-up wakes one idle session of each group whose filter takes
// a stream the round made ready (every group, for a NOTIFY from another
// replica or an operator's action); a claim that got all it asked for
// wakes the next idle one, so the work, not the number of relays, decides
// how many sessions claim. A wake-up that finds no session of a group idle
// (all claiming, or without credit: a claim under way may have started
// before the work was made claimable) is kept, and the next session of the
// group to wait with credit claims at once; one signalled to a session
// that then stops waiting without claiming (its credit went to a
// hand-over, its stream ended), or that wakes to find no credit to claim
// with (lent to a discovery round meanwhile, or taken by leases given to
// it), goes to another. The group polls in the
// same way, one session at a time, backing off from 2 ms after a poll
// found work to Config.PollInterval: an idle replica makes one claim per
// stream filter per poll interval, whatever the number of relays, and a
// lost notification only delays an event. Work that a wake-up, an ack or
// another claim announced leaves the backoff where it is: only a poll
// that finds work shows work no wake-up announces. The poll is armed when
// the group gets an idle member and stays where it is until it fires (or
// a poll finds work, which brings it forward to the shortest delay): a member
// that waits again (after a hand-over, an ack, a reconcile tick) does not
// move it, so members that keep waking cannot starve it.
// A reconcile tick makes a session check its leases, never claim by
// itself: only a lease found gone frees credit to claim with.
//
// An idle replica's discovery checks (see Discovery), while a group has a
// member waiting, also probe the claims in the same statement (at most
// every half PollInterval, and always on the check a loop makes as it falls
// asleep, whose probe must cover the polls until its next check a second or
// more later: outbox.probe_claims over every stream, whether an aggregate
// is claimable and when the first will be). A poll that finds
// such a probe younger than PollInterval (than the check interval and half
// a PollInterval, where a replica's budget of quiet checks spread over many
// sources makes them rarer than every half PollInterval: every poll
// between two checks then still finds a probe), with nothing claimable and
// nothing due since, skips its claim and backs off as after an empty one
// (pollCovered): what became claimable after the probe is announced (a
// round dispatches or wakes, an ack or release here tells its session, one
// elsewhere or an operator's action NOTIFYs), or due at a time the probe
// gave, or, for a NOTIFY lost with the LISTEN connection, seen by the next
// probe, after which the polls claim again; a poll skips only on a probe
// younger than that bound. So a lost notification delays work by at most
// about twice PollInterval (the check interval and one and a half
// PollIntervals for a rarely checked source), and a quiet source with idle relays pays one
// statement per check instead of one more per stream filter and
// PollInterval. A busy loop does not check, and its groups claim on every
// poll.
//
// A round's own NOTIFY comes back on the replica's LISTEN connection. The
// round tells the listener the process id of its database backend before it
// commits; a wake-up from that backend while the round is open, or the
// first one after it ended (a backend's notifications arrive in commit
// order), is the round's and is not acted on a second time, unless the
// LISTEN connection was lost in between (then nothing is held back).
//
// # Operator actions
//
// Nothing but SkipEvent makes a pending event undeliverable, and it is
// recorded (outbox.skipped_event). It locks the event row before the delivery
// row, the order outbox.ack uses, so a concurrent ack either commits first
// (the skip then fails: already published) or finds the skip and answers
// LEASE_LOST; a lease on the skipped head event ends and its holder is
// notified. RetryAggregate with accept_gap takes the producers' order lock
// before the delivery row (the producers' order), so no producer can be
// between inserting a missing revision and committing it while the cursor
// moves past it (also when a round woke the aggregate out of its gap and
// the revision is still missing); the revisions given up are recorded in
// outbox.accepted_gap and are refused afterwards as "at or below the
// delivery cursor" (or, if a REPEATABLE READ producer's stale read let one
// in, reported as stranded).
//
// Bulk retry and skip (server/deadletter.go) run the RetryAggregate and
// SkipEvent transactions one aggregate at a time, so they take the same
// locks in the same order. Republish rewinds an aggregate under its
// delivery row's lock: the published events from the chosen revision to the
// cursor become pending again (the published_at guard allows it only under
// the transaction-local setting outbox.republishing), the cursor moves back
// and any lease ends; delivery then treats them as any pending events, so
// order, fencing, ack-gated marking and purge's refusal hold as they are.
// docs/design.md has the reasoning and what it refuses.
//
// Purge and the retention janitor delete only published events, in keyset
// batches over (created_at, event_id), each batch its own statement, so no
// transaction stays open across batches to hold back vacuum; the table's
// delete trigger refuses pending events whatever the caller.
//
// Lag is counted through outbox.pending_by_stream(), outbox.pending_of()
// over the delivery rows of aggregates with pending work, so its cost
// follows the backlog and not the table. Every statement of the delivery
// and operator paths reaches rows by key whatever the planner's statistics
// say (docs/design.md, "Costs follow the work"): a plan cached while a table
// was small never turns into a scan of it. The delivery rate comes from outbox.delivered_count, which
// outbox.ack adds to as it marks events published, because an index on
// published_at would make every ack a non-HOT update. Relay sessions are recorded in
// outbox.relay_session by their replica and refreshed every
// Config.SessionRefreshInterval, so ListRelays sees every replica's relays;
// the refresh has its own loop, so a long purge by the janitor cannot let
// them go stale. A token limited to some streams sees only those in GetLag
// and ListRelays, and may act only on them.
//
// # Partitions and their owners
//
// Every aggregate falls in one of 256 partitions (outbox.partition_of, a
// hash PostgreSQL keeps stable), and each partition has at most one owner
// at a time: a replica process (its replica id and Server.instance, so a
// process restarted under the same id is another owner), for as long as
// its membership in outbox.partition_member lasts, under an epoch every
// takeover raises. A replica with relay sessions wants partitions and owns
// about 256/members of them; ownPartitions calls outbox.own_partitions
// every third of Config.PartitionTTL and at once when the replica's first
// session arrives or its last leaves. The call renews the membership (one
// row, only while unexpired: a lapsed member joins anew and takes even its
// old partitions again under higher epochs) and takes free partitions and
// those of expired members. A takeover deletes the expired memberships it
// relies on and frees their partitions in one statement, skipping rows
// another transaction holds, so a renewal and a takeover racing on one
// membership are serialised by its row lock and exactly one wins, and no
// owned partition's owner is ever without a membership: an owner absent
// from a takeover's snapshot is a process joining concurrently, not a dead
// one. Free partitions another takeover has locked are skipped. The call
// commits synchronously, so an ownership the replica acts on survives a
// crash. The replica's belief (ownedPartitions) lasts until its last
// successful renewal was sent plus the TTL, by its own clock: the
// database's lease began after that send, so the belief ends first and
// nobody takes a partition over while its owner still believes in it (on
// one clock; replicas on other hosts need the TTL to exceed their clocks'
// drift). It errs toward owning less: partitions given back count as gone
// whether or not the release's answer arrived, and a replica whose
// statement may have taken partitions it did not hear about gives back, at
// shutdown, everything the table records as its own
// (outbox.leave_partitions). It leaves at shutdown whenever its membership
// may still be recorded, also when it owns nothing by then (its last
// session ended first, as in a rolling restart): the next process under
// its replica id would be refused until that membership expired. Nothing
// in delivery reads the ownership yet: it is the fence under which a later
// engine keeps its partitions' leases in memory.
//
// # Shutdown
//
// Stop closes Server.stopping, which every session loop reads at the top of
// each iteration: from then on no session claims, and each ends
// (UNAVAILABLE, its relay reconnects elsewhere) as soon as its last
// delivery is acked or nacked. Every statement that can lease (a session's
// claim, a discovery round that dispatches, an ack batch that hands over)
// checks stopping under Server.leaseGate, held shared until the statement
// has returned and its leases are with their sessions, and Stop closes
// stopping holding it exclusively: a statement that checked just before
// Stop began has returned by the time stopping is closed, so an event
// committed after that is leased by no session of the replica, whatever the
// scheduling. Stop waits for such a statement only until its deadline (they
// are bounded by their own timeouts anyway); meanwhile claims wait for it,
// while ack batches and discovery rounds, which run as well without
// leasing, go ahead at once and hand over and dispatch nothing, so that no
// ack waits for a claim. Subscribe is refused, checked under the same mutex
// Stop closes the channel under, so no session is added behind Stop's back.
// At Stop's deadline the sessions still holding deliveries are aborted and
// release their leases. A session blocked in Send to a relay that stopped
// reading cannot see the abort, so Stop returns anyway after a short grace
// and says so; closing the connections (grpc.Server.Stop, which
// internal/app's shutdown does next) fails that Send and the session
// releases its leases. Acks keep landing while Stop waits, by Ack calls or
// on AckStream streams; internal/app ends those streams (UNAVAILABLE, see
// ServeAckStream) once every engine's Stop has returned, before its
// graceful stop, which would otherwise wait for relays to close them.
package server
