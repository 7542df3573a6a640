#!/usr/bin/env bash
# Where a producer's insert through outbox.event's trigger goes beyond a
# plain INSERT: the same event inserted, 8 clients, synchronous_commit off
# (CPU-bound, so commits do not hide the difference), into tables that add
# one piece of the outbox's producer path at a time, alternating ROUNDS
# times; each rate also as a ratio to the plain INSERT of its round.
#
#   plain      a table of outbox.event's columns, primary key, unique key
#              and a pending index; the revision from a sequence (the
#              benchmark's ceiling-insert)
#   shape      outbox.event's columns, indexes, CHECK, fillfactor and xid8
#              column; the revision from a sequence; no trigger
#   counter    shape, the revision from a per-aggregate counter row bumped
#              in the same statement (WITH c AS (UPDATE ...) INSERT ...):
#              the least a consecutive revision per aggregate costs
#   trigger    shape, the counter bumped by a PL/pgSQL BEFORE INSERT trigger
#              (the counter's statement through SPI, plus the trigger call)
#   outbox     INSERT INTO outbox.event (client.Emit's statement): the real
#              trigger, its checks, SECURITY DEFINER and SET clauses added
#   emit       SELECT * FROM outbox.emit(...)
#
# Usage: bench/pgbench/producer-anatomy.sh [OUTBOXD_BINARY]
# Needs pgbench and psql, and a PostgreSQL that $ADMIN_URL may CREATE
# DATABASE on (default: the local one as postgres). BENCHMARKS.md quotes its
# figures; compare them within one run only.
set -euo pipefail
bin=${1:-bin/outboxd}
rounds=${ROUNDS:-3}
secs=${SECONDS_PER_RUN:-5}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_anatomy
psql -q "$url" <<'SQL'
CREATE SCHEMA anatomy;
CREATE SEQUENCE anatomy.revision;
CREATE TABLE anatomy.plain (
    event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(), stream text NOT NULL,
    aggregate_key text NOT NULL, revision bigint NOT NULL DEFAULT nextval('anatomy.revision'),
    event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz,
    UNIQUE (stream, aggregate_key, revision)) WITH (fillfactor = 90);
CREATE INDEX ON anatomy.plain (created_at) WHERE published_at IS NULL;
CREATE TABLE anatomy.shape (
    event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(), stream text NOT NULL,
    aggregate_key text NOT NULL, revision bigint NOT NULL DEFAULT nextval('anatomy.revision'),
    event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz,
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    UNIQUE (stream, aggregate_key, revision),
    CHECK (revision > 0 AND revision <= 9007199254740991)) WITH (fillfactor = 50);
CREATE INDEX ON anatomy.shape (created_at, event_id);
CREATE INDEX ON anatomy.shape (xid);
CREATE TABLE anatomy.counter_row (
    stream text, aggregate_key text, last_revision bigint NOT NULL,
    PRIMARY KEY (stream, aggregate_key)) WITH (fillfactor = 50);
INSERT INTO anatomy.counter_row SELECT 'bench', g::text, 0 FROM generate_series(1, 10000) g;
CREATE TABLE anatomy.counter (LIKE anatomy.shape INCLUDING ALL) WITH (fillfactor = 50);
CREATE TABLE anatomy.trigger_row (LIKE anatomy.counter_row INCLUDING ALL) WITH (fillfactor = 50);
INSERT INTO anatomy.trigger_row SELECT * FROM anatomy.counter_row;
CREATE TABLE anatomy.trigger (LIKE anatomy.shape INCLUDING ALL) WITH (fillfactor = 50);
CREATE FUNCTION anatomy.trigger_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE anatomy.trigger_row a SET last_revision = a.last_revision + 1
    WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key
    RETURNING a.last_revision INTO NEW.revision;
    RETURN NEW;
END $$;
CREATE TRIGGER bump BEFORE INSERT ON anatomy.trigger FOR EACH ROW EXECUTE FUNCTION anatomy.trigger_bump();
INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision)
SELECT 'bench', g::text, 0 FROM generate_series(1, 10000) g;
SQL

payload='{"order_id":12345,"customer":"c-00042","amount":"199.90","currency":"EUR","items":[{"sku":"sku-1","qty":2},{"sku":"sku-2","qty":1}],"note":"benchmark payload xxxxxxxxxxxxxxxx"}'
values="'bench', :a::text, 'created', '$payload'"
for t in plain shape trigger; do
	printf '\\set a random(1, 10000)\nINSERT INTO anatomy.%s (stream, aggregate_key, event_type, payload) VALUES (%s);\n' "$t" "$values" >"$work/$t.sql"
done
printf '\\set a random(1, 10000)\nWITH c AS (UPDATE anatomy.counter_row SET last_revision = last_revision + 1 WHERE stream = %s AND aggregate_key = :a::text RETURNING last_revision)\nINSERT INTO anatomy.counter (stream, aggregate_key, revision, event_type, payload) SELECT %s, :a::text, c.last_revision, %s, %s FROM c;\n' \
	"'bench'" "'bench'" "'created'" "'$payload'" >"$work/counter.sql"
printf '\\set a random(1, 10000)\nINSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES (%s) RETURNING event_id, revision;\n' "$values" >"$work/outbox.sql"
printf '\\set a random(1, 10000)\nSELECT * FROM outbox.emit(%s);\n' "$values" >"$work/emit.sql"

tps() { PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$work/$1.sql" "$url" 2>&1 | awk '/^tps/ {printf "%.0f", $3}'; }
echo "producer transactions/s (8 clients, synchronous_commit off), and ÷ plain:"
for ((r = 1; r <= rounds; r++)); do
	line="  round $r:"
	base=
	for t in plain shape counter trigger outbox emit; do
		v=$(tps "$t")
		base=${base:-$v}
		line+=" $t $v ($(awk "BEGIN {printf \"%.2f\", $v / $base}"))"
	done
	echo "$line"
done
