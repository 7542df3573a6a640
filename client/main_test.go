package client_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"testing"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/migrations"
)

// databaseURL is a migrated database of this package's own, with the
// sales_order table of the examples; TestMain makes it and drops it.
var databaseURL string

func TestMain(m *testing.M) {
	drop, err := exampleDatabase()
	if err != nil {
		fmt.Fprintln(os.Stderr, "example database:", err)
		os.Exit(1)
	}
	code := m.Run()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "dropping the example database:", err)
	}
	os.Exit(code)
}

// exampleDatabase creates a fresh database on the tests' PostgreSQL server,
// migrates it, adds the examples' business table and sets databaseURL.
// Examples have no *testing.T, so testdb.New cannot make it.
func exampleDatabase() (drop func() error, err error) {
	ctx := context.Background()
	admin, err := sql.Open("pgx", testdb.ServerURL())
	if err != nil {
		return nil, err
	}
	name := "client_example_" + uuid.NewString()[:8]
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		admin.Close()
		return nil, err
	}
	drop = func() error {
		defer admin.Close()
		_, err := admin.ExecContext(context.Background(), "DROP DATABASE "+name+" WITH (FORCE)")
		return err
	}
	u, err := url.Parse(testdb.ServerURL())
	if err != nil {
		return drop, err
	}
	u.Path = "/" + name
	databaseURL = u.String()
	db, err := sql.Open("pgx", databaseURL)
	if err != nil {
		return drop, err
	}
	defer db.Close()
	if _, err := migrations.Up(ctx, db, slog.New(slog.DiscardHandler)); err != nil {
		return drop, err
	}
	_, err = db.ExecContext(ctx, `CREATE TABLE sales_order (order_id bigint PRIMARY KEY, state text NOT NULL);
		INSERT INTO sales_order VALUES (42, 'new')`)
	return drop, err
}
