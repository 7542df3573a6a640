package main

import (
	"runtime"
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
	cfg, err := pgxpool.ParseConfig(testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := newSourcePool(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	trimmer.remove(pool) // this test trims it itself
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
}
