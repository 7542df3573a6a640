package migrations_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/testdb"
)

// The functions the server calls to deliver keep one plan per statement
// for the connection's life. Under plan_cache_mode = auto,
// PostgreSQL plans a statement with parameters as custom plans five times,
// then keeps the generic plan only if it looks no dearer; where it looks
// dearer (the delivery functions turn sequential scans off, which makes
// every generic plan look costly; a statement over jsonb and arrays may
// too), it plans the statement again on every call, for good. That cost
// more than running it: 0.5 ms of an ack's 1.1 ms once, and in
// discover_round, which lacked the setting, 70-90 microseconds of a trickled
// round's 600, its statement listing each stream's takers planned anew in
// every round. So every PL/pgSQL function of the schema carries
// plan_cache_mode = force_generic_plan, but for those named below, each for
// a stated reason; a new function must carry it or join the list.
func TestDeliveryFunctionsKeepTheirPlans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)

	exempt := map[string]string{
		// Producers' paths: their statements are probes by key that settle
		// on the generic plan under auto, and a SET clause costs every
		// producer's call.
		"emit":                "producer's function",
		"emit_event":          "producer's function",
		"event_before_insert": "producer's insert trigger",
		// Triggers that guard or refuse: no statements of their own, or
		// only on an error path.
		"event_guard_published": "guard trigger without statements",
		"event_immutable":       "guard trigger without statements",
		"event_keep_pending":    "guard trigger without statements",
		"continue_attempts":     "trigger for aggregates an operator republished, a lease's first attempt",
		"trim_attempts":         "statement trigger without parameters, on the failure path",
		// Called once, by an operator or on an error.
		"discover":               "a round without dispatch, for operators and tests",
		"rescan_discovery":       "an operator's one-off re-scan",
		"discovery_stop_reason":  "runs when discovery stops",
		"discovery_stopped":      "runs when discovery stops",
		"require_read_committed": "raises an error",
		"pending_by_stream":      "planned for each call's streams on purpose (force_custom_plan), a lag read",
	}
	rows, err := pool.Query(ctx, `
		SELECT p.proname, coalesce(p.proconfig, '{}')
		FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
		WHERE p.pronamespace = 'outbox'::regnamespace AND l.lanname = 'plpgsql'
		ORDER BY p.proname`)
	if err != nil {
		t.Fatal(err)
	}
	type function struct {
		Name   string
		Config []string
	}
	functions, err := pgx.CollectRows(rows, pgx.RowToStructByPos[function])
	if err != nil {
		t.Fatal(err)
	}
	seen := make(map[string]bool)
	for _, f := range functions {
		seen[f.Name] = true
		if _, ok := exempt[f.Name]; ok {
			continue
		}
		if !slices.Contains(f.Config, "plan_cache_mode=force_generic_plan") {
			t.Errorf("outbox.%s runs with %v, without SET plan_cache_mode = force_generic_plan", f.Name, f.Config)
		}
	}
	// The delivery path's own, by name: a rename must not drop one from the
	// check.
	for _, name := range []string{"discover_round", "discover_scan", "discover_apply", "lock_deliveries",
		"claim", "lease_heads", "ack", "probe_claims", "waiting_streams", "record_expired", "undiscovered"} {
		if !seen[name] {
			t.Errorf("outbox.%s is not a PL/pgSQL function any more; update this test", name)
		}
	}
	for name := range exempt {
		if !seen[name] {
			t.Errorf("outbox.%s is exempted here but is not a PL/pgSQL function of the schema", name)
		}
	}

	// A SQL function is planned with its caller only when PostgreSQL
	// inlines it, which it never does for one that writes (VOLATILE): such a
	// function's body is planned on every call, two thirds of a release's
	// time when release was one. So the schema's writing functions are
	// PL/pgSQL, covered above.
	var volatile []string
	if err := pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(p.proname ORDER BY p.proname), '{}')
		FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
		WHERE p.pronamespace = 'outbox'::regnamespace AND l.lanname = 'sql' AND p.provolatile = 'v'`).Scan(&volatile); err != nil {
		t.Fatal(err)
	}
	for _, name := range volatile {
		t.Errorf("outbox.%s is a VOLATILE SQL function, planned on every call; make it PL/pgSQL", name)
	}
}
