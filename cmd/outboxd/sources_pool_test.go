package main

import (
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// A quiet pool (few calls a second) is trimmed to one idle connection,
// but not while its source had events lately: a source with a trickle of
// events makes few calls, whose overlaps would otherwise open a
// connection (a backend start) about once a second.
func TestPoolOfASourceInUseIsNotTrimmed(t *testing.T) {
	t.Parallel()
	pool := untrimmedSourcePool(t)
	idle := func(n int) {
		t.Helper()
		var conns []*pgxpool.Conn
		for range n {
			c, err := pool.Acquire(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
		}
		for _, c := range conns {
			c.Release()
		}
		deadline := time.Now().Add(10 * time.Second)
		for int(pool.Stat().IdleConns()) != n {
			if time.Now().After(deadline) {
				t.Fatalf("%d idle connections, want %d", pool.Stat().IdleConns(), n)
			}
			runtime.Gosched()
		}
	}
	idle(3)
	inUse := true
	pool.setInUse(func() bool { return inUse })
	pool.trimIfQuiet()
	if n := pool.Stat().IdleConns(); n != 3 {
		t.Fatalf("a source in use: %d idle connections after a trim, want 3 kept", n)
	}
	inUse = false
	pool.trimIfQuiet()
	if n := pool.Stat().IdleConns(); n != 1 {
		t.Fatalf("a quiet source: %d idle connections after a trim, want 1", n)
	}
	// The checks are counted by outcome for the metrics.
	for o, want := range [trimOutcomes]int64{trimmedQuiet: 1, keptBusy: 0, keptInUse: 1} {
		if got := pool.checks[o].Load(); got != want {
			t.Errorf("checks %s: %d, want %d", trimOutcome(o), got, want)
		}
	}
}

// A trim keeps the pool's oldest connection, whose backend has its
// catalog, compiled functions and prepared statements, and closes the ones
// an overlap opened, whichever order the pool holds them in.
func TestTrimKeepsTheOldestConnection(t *testing.T) {
	t.Parallel()
	pool := untrimmedSourcePool(t)
	acquire := func() *pgxpool.Conn {
		t.Helper()
		c, err := pool.Acquire(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	first := acquire()
	oldest := first.Conn().PgConn().PID()
	first.Release()
	for _, oldestReleasedLast := range []bool{false, true} {
		conns := []*pgxpool.Conn{acquire(), acquire(), acquire()} // the oldest and two new ones
		slices.SortFunc(conns, func(a, b *pgxpool.Conn) int {
			isOldest := func(c *pgxpool.Conn) bool { return c.Conn().PgConn().PID() == oldest }
			switch {
			case isOldest(a) == isOldest(b):
				return 0
			case isOldest(a) == oldestReleasedLast:
				return 1
			default:
				return -1
			}
		})
		for _, c := range conns {
			c.Release()
		}
		deadline := time.Now().Add(10 * time.Second)
		for pool.Stat().IdleConns() != 3 {
			if time.Now().After(deadline) {
				t.Fatalf("%d idle connections, want 3", pool.Stat().IdleConns())
			}
			runtime.Gosched()
		}
		pool.trimIdle(t.Context())
		for pool.Stat().TotalConns() != 1 { // closed connections leave the pool in the background
			if time.Now().After(deadline) {
				t.Fatalf("oldest released last %v: %d connections after the trim, want 1", oldestReleasedLast, pool.Stat().TotalConns())
			}
			runtime.Gosched()
		}
		kept := acquire()
		if pid := kept.Conn().PgConn().PID(); pid != oldest {
			t.Errorf("oldest released last %v: the trim kept backend %d, want the oldest, %d", oldestReleasedLast, pid, oldest)
		}
		kept.Release()
	}
}

// untrimmedSourcePool is a source pool on a new database that the
// process's trimmer leaves alone: the test trims it itself.
func untrimmedSourcePool(t *testing.T) *sourcePool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := newSourcePool(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	trimmer.remove(pool)
	return pool
}
