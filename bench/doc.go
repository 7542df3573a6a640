// Package bench is the benchmark docs/benchmark.md specifies, run against a
// real PostgreSQL by the outboxd-bench command (make bench). It is a module
// of its own so that the outboxd binary links none of its plotting code or
// peer libraries. It compares these arms on the same machine, in the same
// run, with the same producers and the same sink:
//
//   - ceiling-insert: one plain INSERT per transaction into a table shaped
//     like outbox.event, with no trigger: nothing can deliver faster than
//     events are recorded.
//   - ceiling-insert-mark: the same plus a second transaction per event that
//     sets published_at, the least any relay that marks rows must add.
//   - naive-poller: the textbook outbox protocol in SQL by K workers (lock
//     an aggregate FOR UPDATE SKIP LOCKED, select its earliest pending event
//     FOR UPDATE, publish while holding the transaction, mark, commit).
//   - outboxd: producers call client.Emit (a plain INSERT); the real server runs as a child
//     process (`outboxd serve`, its shipped defaults); K relay.Runners
//     connect to it over loopback gRPC, each on its own connection, and
//     publish to the sink.
//   - watermill, watermill-10ms: Watermill SQL's PostgreSQL queue schema,
//     published inside the producer's transaction, one subscriber polling
//     at the library's default interval (1s) or every 10ms.
//   - river: one River job per producer transaction (InsertTx), worked by a
//     River client with its recommended settings.
//
// Workloads: steady (P producers at full speed over 10,000 aggregates),
// latency (open-loop producers at half of outboxd's steady maximum), drain
// (a backlog committed before delivery starts), hot (one aggregate),
// producer (plain INSERT, outbox.emit and client.Emit, an INSERT through
// outbox.event's trigger, nothing delivering) and held-xmin (steady while a transaction id
// stays open in another database, or in a REPEATABLE READ transaction in the
// same one).
//
// # Isolation
//
// The run creates a template database on the given server (outbox
// migrations plus the bench schema for the ceilings and the naive poller)
// and clones a fresh database from it for every arm, so no arm inherits
// another's rows, dead tuples or statistics. Every database is dropped when
// the run ends, also on an error or an interrupt; a killed run leaves
// databases named outboxd_bench_* that the next run points out.
//
// # Correctness accounting
//
// The Ledger records every event a producer committed (its revision, from
// outbox.emit or the naive poller's counter) and every delivery the sink
// received. At first delivery an event is reordered if an earlier revision
// of its aggregate has not arrived, or if its producer committed a later
// event of the same aggregate that already arrived (a sequence number in the
// payload, a check that does not rely on the revision the server reports).
// After the arm stops, the database is read back: a committed event that
// never reached the sink is lost if the database marks it published or no
// longer holds it, and backlog if it is still pending. A repeat delivery is
// a duplicate, which at-least-once delivery allows. Lost or invented events
// fail the run, and so do reordered ones for the arms that promise
// per-aggregate order (outboxd, the naive poller); the peers promise none,
// so their reorders are reported only.
//
// # Measurements
//
// Within each arm's window: delivered events per second; commit→sink and
// commit→published_at percentiles (nearest rank; events still undelivered
// when the arm stops count with the time they had waited, flagged as
// censored); CPU time of this process (getrusage), of the server process and
// of PostgreSQL's processes serving the scratch database plus its background
// processes (/proc, when PostgreSQL runs on this machine); the server's peak
// RSS; WAL bytes (pg_current_wal_insert_lsn), WAL syncs (pg_stat_wal) and
// commits per event; and pg_stat_activity sampled every 25ms, reported as
// the average number of sessions in each wait event.
package bench
