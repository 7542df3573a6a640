package devdb

import (
	"context"
	"errors"
	"log/slog"
)

// StartThrowaway exposes startThrowaway so tests can start a cluster even
// when a local server would make Resolve choose it.
func StartThrowaway(ctx context.Context, logger *slog.Logger) (*Database, error) {
	return startThrowaway(ctx, logger)
}

// Dir returns a throwaway cluster's temporary directory.
func Dir(d *Database) string { return d.dir }

// FindBinaries runs the binary search with PATH ignored.
func FindBinaries(patterns []string) (initdb, pgCtl string, err error) {
	notFound := func(string) (string, error) { return "", errors.New("not on PATH") }
	b, err := findBinaries(notFound, patterns)
	return b.initdb, b.pgCtl, err
}
