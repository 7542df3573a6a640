package main

import (
	"reflect"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/outboxd/outboxd/server"
)

// Every serve flag that configures the engine reaches server.Config: a flag
// parsed and then dropped on the way (--ack-linger was, in a mutation, with
// no test failing) leaves the engine at its default while --help promises
// otherwise. Each value differs from the flag's default.
func TestServeFlagsReachTheEngine(t *testing.T) {
	var f serveFlags
	cmd := &cobra.Command{Use: "serve"}
	f.register(cmd)
	if err := cmd.ParseFlags([]string{
		"--replica-id=r9", "--lease-ttl=41s", "--max-failures=7", "--max-deliveries=9",
		"--backoff-base=3s", "--backoff-cap=9m", "--poll-interval=4s", "--retention=36h",
		"--janitor-interval=2m", "--stranded-audit-interval=3m", "--max-subscriptions-per-relay=5",
		"--ack-committers=3", "--ack-linger=7ms", "--discovery-max-events=5000",
		"--partition-ttl=20s",
	}); err != nil {
		t.Fatal(err)
	}
	want := server.Config{
		ReplicaID: "r9", DefaultLeaseTTL: 41 * time.Second, MaxFailures: 7, MaxDeliveries: 9,
		BackoffBase: 3 * time.Second, BackoffCap: 9 * time.Minute, PollInterval: 4 * time.Second,
		Retention: 36 * time.Hour, JanitorInterval: 2 * time.Minute, StrandedAuditInterval: 3 * time.Minute,
		MaxSubscriptionsPerRelay: 5, AckCommitters: 3, AckLinger: 7 * time.Millisecond,
		DiscoveryMaxEvents: 5000, PartitionTTL: 20 * time.Second,
	}
	if got := f.engineConfig(); !reflect.DeepEqual(got, want) {
		t.Errorf("server.Config from the serve flags:\n got %+v\nwant %+v", got, want)
	}
	// A flag added later is either given above (and so compared) or named
	// here as one that configures something other than the engine.
	notEngine := map[string]bool{}
	for _, name := range serveFlagsBesideTheEngine {
		notEngine[name] = true
	}
	cmd.Flags().VisitAll(func(fl *pflag.Flag) {
		if !fl.Changed && !notEngine[fl.Name] {
			t.Errorf("serve flag --%s is neither given in this test nor listed in serveFlagsBesideTheEngine: "+
				"if it configures the engine, pass it to engineConfig and give it here", fl.Name)
		}
	})
}

// --ack-linger's default is the engine's, and --ack-linger=0 turns the
// linger off: the engine reads a zero AckLinger as its default, so serve
// must say off in the engine's terms (negative).
func TestServeAckLingerDefaultAndOff(t *testing.T) {
	for _, c := range []struct {
		args []string
		want time.Duration
	}{
		{nil, server.DefaultAckLinger},
		{[]string{"--ack-linger=0"}, -1},
	} {
		var f serveFlags
		cmd := &cobra.Command{Use: "serve"}
		f.register(cmd)
		if err := cmd.ParseFlags(c.args); err != nil {
			t.Fatal(err)
		}
		if got := f.engineConfig().AckLinger; got != c.want {
			t.Errorf("serve %v: Config.AckLinger %v, want %v", c.args, got, c.want)
		}
	}
}

// serveFlagsBesideTheEngine configure the sources, listeners, authentication, the
// pools, health and shutdown (internal/app), not server.Config.
var serveFlagsBesideTheEngine = []string{
	"listen", "source", "http-listen", "health-interval", "shutdown-timeout", "max-db-conns", "idle-checks-per-second",
	"reflection", "reflection-needs-token", "token-file", "insecure-no-auth", "tls-cert", "tls-key",
	"tls-client-ca", "pprof", "console",
}
