package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/testdb"
)

// The producer contract as released: what producers in any language call
// and write. It changes only deliberately, and only by addition;
// TestSQLContractOnlyGrows holds the migrated schema to it.
var (
	// outbox.emit's parameters in order: a producer may call it
	// positionally, so a new parameter goes last and has a default.
	contractEmitIn = []sqlParam{
		{"stream", "text", false},
		{"aggregate_key", "text", false},
		{"event_type", "text", false},
		{"payload", "jsonb", false},
		{"headers", "jsonb", true},
		{"revision", "bigint", true},
		{"event_id", "uuid", true},
	}
	// The columns of the table outbox.emit returns, in order.
	contractEmitOut = []sqlParam{
		{"event_id", "uuid", false},
		{"revision", "bigint", false},
	}
	// The columns of outbox.event a producer writes or reads (a plain
	// INSERT from a data-modifying CTE is part of the contract).
	contractEventColumns = []sqlColumn{
		{"event_id", "uuid", false},
		{"stream", "text", false},
		{"aggregate_key", "text", false},
		{"revision", "bigint", false},
		{"event_type", "text", false},
		{"payload", "jsonb", false},
		{"headers", "jsonb", false},
		{"created_at", "timestamp with time zone", false},
		{"published_at", "timestamp with time zone", true},
	}
)

type sqlParam struct {
	name, typ  string
	hasDefault bool
}

type sqlColumn struct {
	name, typ string
	nullable  bool
}

type liveColumn struct {
	sqlColumn
	hasDefault bool
}

func TestSQLContractOnlyGrows(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())

	in, out, err := emitSignature(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range checkParamsGrow("outbox.emit parameter", contractEmitIn, in) {
		t.Error(p)
	}
	for i, p := range in[min(len(in), len(contractEmitIn)):] {
		if !p.hasDefault {
			t.Errorf("outbox.emit parameter %d (%s) was added without a DEFAULT: calls written for the released signature would fail", len(contractEmitIn)+i+1, p.name)
		}
	}
	// Whether a result column has a default means nothing; compare names
	// and types only.
	for i := range out {
		out[i].hasDefault = false
	}
	for _, p := range checkParamsGrow("outbox.emit result column", contractEmitOut, out) {
		t.Error(p)
	}

	cols, err := eventColumns(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]liveColumn{}
	for _, c := range cols {
		byName[c.name] = c
	}
	for _, want := range contractEventColumns {
		got, ok := byName[want.name]
		switch {
		case !ok:
			t.Errorf("outbox.event.%s (%s) is gone: producers write and read it", want.name, want.typ)
		case got.sqlColumn != want:
			t.Errorf("outbox.event.%s changed: released as %s (nullable %v), now %s (nullable %v)",
				want.name, want.typ, want.nullable, got.typ, got.nullable)
		}
	}
	for _, c := range cols {
		if slices.ContainsFunc(contractEventColumns, func(w sqlColumn) bool { return w.name == c.name }) {
			continue
		}
		if !c.nullable && !c.hasDefault {
			t.Errorf("outbox.event.%s was added NOT NULL without a DEFAULT: a producer's INSERT naming only the released columns would fail", c.name)
		}
	}
}

// checkParamsGrow reports where got does not start with want.
func checkParamsGrow(what string, want, got []sqlParam) []string {
	var problems []string
	for i, w := range want {
		if i >= len(got) {
			problems = append(problems, fmt.Sprintf("%s %d (%s %s) is gone", what, i+1, w.name, w.typ))
			continue
		}
		if got[i] != w {
			problems = append(problems, fmt.Sprintf("%s %d changed: released as %+v, now %+v", what, i+1, w, got[i]))
		}
	}
	return problems
}

// emitSignature reads outbox.emit's IN parameters and result columns from
// the catalog. There must be exactly one outbox.emit: an overload would
// make existing calls ambiguous.
func emitSignature(ctx context.Context, conn *pgx.Conn) (in, out []sqlParam, err error) {
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_proc
		WHERE pronamespace = 'outbox'::regnamespace AND proname = 'emit'`).Scan(&n); err != nil {
		return nil, nil, err
	}
	if n != 1 {
		return nil, nil, fmt.Errorf("want exactly one function outbox.emit, found %d (an overload makes existing calls ambiguous)", n)
	}
	rows, err := conn.Query(ctx, `
		SELECT a.mode, a.name, format_type(a.type, NULL), a.ord > p.pronargs - p.pronargdefaults
		FROM pg_proc p,
		     unnest(coalesce(p.proallargtypes, p.proargtypes::oid[]), p.proargnames,
		            coalesce(p.proargmodes, array_fill('i'::"char", ARRAY[p.pronargs])))
		       WITH ORDINALITY AS a(type, name, mode, ord)
		WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = 'emit'
		ORDER BY a.ord`)
	if err != nil {
		return nil, nil, err
	}
	type arg struct {
		mode string
		p    sqlParam
	}
	args, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (arg, error) {
		var a arg
		err := r.Scan(&a.mode, &a.p.name, &a.p.typ, &a.p.hasDefault)
		return a, err
	})
	if err != nil {
		return nil, nil, err
	}
	for _, a := range args {
		switch a.mode {
		case "i":
			in = append(in, a.p)
		case "t", "o":
			out = append(out, a.p)
		default:
			return nil, nil, fmt.Errorf("outbox.emit parameter %s has mode %q", a.p.name, a.mode)
		}
	}
	if len(out) > 0 {
		return in, out, nil
	}
	// No output parameters: the result columns are those of the composite
	// type it returns (outbox.emitted, as PL/pgSQL allows no output column
	// named like a parameter). A scalar result has none, and fails above.
	rows, err = conn.Query(ctx, `
		SELECT a.attname, format_type(a.atttypid, a.atttypmod), false
		FROM pg_proc p
		JOIN pg_type t ON t.oid = p.prorettype
		JOIN pg_attribute a ON a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped
		WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = 'emit'
		ORDER BY a.attnum`)
	if err != nil {
		return nil, nil, err
	}
	out, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (sqlParam, error) {
		var p sqlParam
		err := r.Scan(&p.name, &p.typ, &p.hasDefault)
		return p, err
	})
	return in, out, err
}

func eventColumns(ctx context.Context, conn *pgx.Conn) ([]liveColumn, error) {
	rows, err := conn.Query(ctx, `
		SELECT attname, format_type(atttypid, atttypmod), NOT attnotnull, atthasdef
		FROM pg_attribute
		WHERE attrelid = 'outbox.event'::regclass AND attnum > 0 AND NOT attisdropped
		ORDER BY attnum`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (liveColumn, error) {
		var c liveColumn
		err := r.Scan(&c.name, &c.typ, &c.nullable, &c.hasDefault)
		return c, err
	})
}
