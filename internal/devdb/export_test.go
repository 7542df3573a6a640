package devdb

import "errors"

// Dir returns a throwaway cluster's temporary directory.
func Dir(d *Database) string { return d.dir }

// FindBinaries runs the binary search with PATH ignored.
func FindBinaries(patterns []string) (initdb, pgCtl string, err error) {
	notFound := func(string) (string, error) { return "", errors.New("not on PATH") }
	b, err := findBinaries(notFound, patterns)
	return b.initdb, b.pgCtl, err
}
