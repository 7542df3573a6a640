// Command wakeup-cost measures what this machine charges a Go process for
// waking up from idle, the figure behind the discovery loop's aligned quiet
// checks and the engine's shared grid of periodic loops (BENCHMARKS.md,
// "Idle sources: quiet checks fall due together"): the process's CPU time
// (getrusage) per wake-up of a loop that sleeps -pause, and per query of a
// loop that runs SELECT 1 through pgx with -pause between queries and with
// none. Compare the lines of one run only; the machine is shared.
//
//	go run ./cmd/wakeup-cost -database-url postgres://postgres@127.0.0.1:5432/postgres
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

func main() {
	url := flag.String("database-url", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL for the query loop")
	pause := flag.Duration("pause", 25*time.Millisecond, "idle time between wake-ups")
	n := flag.Int("n", 200, "wake-ups per loop")
	flag.Parse()

	per := func(f func()) time.Duration {
		c0 := cpu()
		for range *n {
			f()
		}
		return (cpu() - c0) / time.Duration(*n)
	}
	fmt.Printf("sleep %v: %v of CPU per wake-up\n", *pause, per(func() { time.Sleep(*pause) }))

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, *url)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close(ctx)
	query := func() {
		var x int
		if err := conn.QueryRow(ctx, "SELECT 1").Scan(&x); err != nil {
			log.Fatal(err)
		}
	}
	query() // prepare
	fmt.Printf("SELECT 1 back to back: %v of client CPU per query\n", per(query))
	fmt.Printf("SELECT 1 every %v: %v of client CPU per query\n", *pause, per(func() { time.Sleep(*pause); query() }))
}

// cpu is the process's user and system CPU time so far.
func cpu() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		log.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
