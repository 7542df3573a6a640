// Command stmt-cpu measures what one producer statement costs the database
// backend that runs it, in CPU time, robustly on a busy machine: each arm
// gets its own connection, the arms run interleaved in batches of -k
// single-statement transactions (synchronous_commit off), and around each
// batch it reads the backend's on-CPU time from /proc/<pid>/schedstat (so
// it must run on the database's machine, as a user who may read it). Other
// work only adds to a batch's time, so the low percentiles of the batches
// compare arms best; it prints the minimum, 25th percentile and median, and
// each arm's p25 ratio to the first arm's.
//
// An arm is NAME=SQL, run in -database-url's database, or NAME@b=SQL, run in
// -database-url-b's (for instance one migrated by another build). The SQL
// gets $1, an aggregate key drawn from 1..-aggregates, and $2, the
// ~200-byte JSON payload of bench/pgbench/producer-and-ack.sh. For example
// (BENCHMARKS.md, "Producer path, 2026-12-02"):
//
//	go run ./cmd/stmt-cpu -database-url postgres://postgres@127.0.0.1:5432/before \
//	  -database-url-b postgres://postgres@127.0.0.1:5432/after \
//	  "plain=INSERT INTO scratch.ceiling (stream, aggregate_key, event_type, payload) VALUES ('bench', \$1, 'created', \$2::jsonb)" \
//	  "trigger=INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('bench', \$1, 'created', \$2::jsonb) RETURNING event_id, revision" \
//	  "emit=SELECT * FROM outbox.emit('bench', \$1, 'created', \$2::jsonb)" \
//	  "emit-after@b=SELECT * FROM outbox.emit('bench', \$1, 'created', \$2::jsonb)"
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

const payload = `{"order_id":12345,"customer":"c-00042","amount":"199.90","currency":"EUR","items":[{"sku":"sku-1","qty":2},{"sku":"sku-2","qty":1}],"note":"benchmark payload xxxxxxxxxxxxxxxx"}`

type arm struct {
	name, sql string
	conn      *pgx.Conn
	pid       int
	us        []float64 // backend CPU µs per statement, one per batch
}

func main() {
	dbURL := flag.String("database-url", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "database of the arms named NAME")
	dbURLB := flag.String("database-url-b", "", "database of the arms named NAME@b")
	batches := flag.Int("batches", 40, "batches per arm")
	k := flag.Int("k", 150, "statements per batch")
	aggregates := flag.Int("aggregates", 10000, "aggregate keys to draw from")
	flag.Parse()
	if flag.NArg() == 0 {
		log.Fatal("stmt-cpu: name at least one arm, NAME=SQL or NAME@b=SQL")
	}
	ctx := context.Background()
	var arms []*arm
	for _, spec := range flag.Args() {
		name, sql, ok := strings.Cut(spec, "=")
		if !ok {
			log.Fatalf("stmt-cpu: arm %q is not NAME=SQL", spec)
		}
		u := *dbURL
		if n, ok := strings.CutSuffix(name, "@b"); ok {
			if *dbURLB == "" {
				log.Fatalf("stmt-cpu: arm %s needs -database-url-b", name)
			}
			name, u = n, *dbURLB
		}
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			log.Fatal(err)
		}
		defer conn.Close(ctx)
		a := &arm{name: name, sql: sql, conn: conn}
		if _, err := conn.Exec(ctx, "SET synchronous_commit = off"); err != nil {
			log.Fatal(err)
		}
		if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&a.pid); err != nil {
			log.Fatal(err)
		}
		arms = append(arms, a)
	}
	for _, a := range arms {
		a.run(ctx, 300, *aggregates) // plans, caches, the counter rows
	}
	for range *batches {
		for _, a := range arms {
			before := onCPU(a.pid)
			a.run(ctx, *k, *aggregates)
			a.us = append(a.us, float64(onCPU(a.pid)-before)/float64(*k)/1000)
		}
	}
	var first float64
	for i, a := range arms {
		slices.Sort(a.us)
		p := func(q float64) float64 { return a.us[int(q*float64(len(a.us)-1))] }
		if i == 0 {
			first = p(0.25)
		}
		fmt.Printf("%-16s backend µs per statement: min %6.1f  p25 %6.1f  p50 %6.1f   first arm's p25 ÷ this p25 %.2f\n",
			a.name, p(0), p(0.25), p(0.5), first/p(0.25))
	}
}

func (a *arm) run(ctx context.Context, n, aggregates int) {
	for range n {
		rows, err := a.conn.Query(ctx, a.sql, strconv.Itoa(rand.IntN(aggregates)+1), payload)
		if err == nil {
			for rows.Next() {
			}
			err = rows.Err()
		}
		if err != nil {
			log.Fatalf("stmt-cpu: %s: %v", a.name, err)
		}
	}
}

// onCPU is the time in ns the process has run on a CPU.
func onCPU(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		log.Fatalf("stmt-cpu: read the backend's CPU time (run it on the database's machine): %v", err)
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		log.Fatalf("stmt-cpu: /proc/%d/schedstat is empty", pid)
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		log.Fatal(err)
	}
	return ns
}
