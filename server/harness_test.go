package server_test

import (
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// replica is one running outboxd server on loopback.
type replica = servertest.Replica

// startReplica runs a server on a loopback port against the database at url
// and returns a client connection to it; everything stops when t ends.
func startReplica(t testing.TB, url string, configure func(*server.Config)) *replica {
	t.Helper()
	return servertest.Start(t, url, servertest.Options{Configure: configure})
}

// quietReplica starts a replica whose sessions are never polled and never
// reconcile: a session claims only when its own credit accounting, or a
// wake-up, says so.
func quietReplica(t testing.TB, url string, configure func(*server.Config)) *replica {
	t.Helper()
	r := startReplica(t, url, configure)
	r.Server.SetNoPolls()
	r.Server.SetReconcileTick(make(chan time.Time)) // never ticks
	return r
}
