package migrations_test

import (
	"bytes"
	"os"
	osexec "os/exec"
	"regexp"
	"testing"

	"github.com/outboxd/outboxd/internal/testdb"
)

// snapshotFile is the schema the migrations produce, as pg_dump prints it:
// reviewed with every change to the schema, and compared here so that it
// cannot go stale. UPDATE_SCHEMA_SNAPSHOT=1 rewrites it (make schema).
const snapshotFile = "testdata/schema.sql"

// The checked-in snapshot is what the migrations produce.
func TestSchemaSnapshot(t *testing.T) {
	t.Parallel()
	if _, err := osexec.LookPath("pg_dump"); err != nil {
		t.Skip("pg_dump is not installed")
	}
	out, err := osexec.Command("pg_dump", "--schema-only", "--no-owner", "--no-privileges",
		"--schema=outbox", "--dbname", testdb.New(t)).Output()
	if err != nil {
		t.Fatalf("pg_dump: %v", err)
	}
	got := normaliseDump(out)
	if os.Getenv("UPDATE_SCHEMA_SNAPSHOT") != "" {
		if err := os.WriteFile(snapshotFile, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(snapshotFile)
	if err != nil {
		t.Fatalf("%v (run make schema)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("migrations/%s is stale: run make schema and review the difference", snapshotFile)
	}
}

// normaliseDump drops what varies between runs and versions: the version
// banner, SET lines, and pg_dump 15.x's \restrict-style keys if any.
func normaliseDump(b []byte) []byte {
	b = regexp.MustCompile(`(?m)^(-- Dumped (from|by) .*|SET .*|SELECT pg_catalog\.set_config.*|\\(un)?restrict .*)\n`).ReplaceAll(b, nil)
	return bytes.TrimSpace(regexp.MustCompile(`\n{3,}`).ReplaceAll(b, []byte("\n\n")))
}
