package main

import (
	"fmt"
	"strings"
	"time"
)

// flagRules collects what is wrong with a command's flag values, each
// naming its flag, into one usage error (exit 2). The libraries check the
// same bounds again, but their errors name Config fields, which the user
// of the command never set.
type flagRules []string

// want records the problem format describes unless ok.
func (r *flagRules) want(ok bool, format string, args ...any) {
	if !ok {
		*r = append(*r, fmt.Sprintf(format, args...))
	}
}

func (r flagRules) err() error {
	if len(r) == 0 {
		return nil
	}
	return usageError("%s", strings.Join(r, "; "))
}

// check refuses serve's (and dev's) flag values that the server would
// refuse, or that would turn a loop's pause to nothing. Where the
// libraries read 0 as "the default" the flag refuses it: its default is
// written in --help, and a 0 that meant 15 s or a minute would surprise.
func (f *serveFlags) check() error {
	var r flagRules
	r.want(f.defaultLeaseTTL >= time.Second && f.defaultLeaseTTL <= time.Hour,
		"--lease-ttl %v: want 1s to 1h", f.defaultLeaseTTL)
	r.want(f.maxFailures >= 1, "--max-failures %d: want 1 or more", f.maxFailures)
	r.want(f.maxDeliveries >= 2, "--max-deliveries %d: want 2 or more", f.maxDeliveries)
	r.want(f.backoffBase > 0, "--backoff-base %v: want more than 0", f.backoffBase)
	r.want(f.backoffCap >= f.backoffBase, "--backoff-cap %v: want at least --backoff-base (%v)", f.backoffCap, f.backoffBase)
	r.want(f.pollInterval > 0, "--poll-interval %v: want more than 0", f.pollInterval)
	r.want(f.partitionTTL >= time.Second, "--partition-ttl %v: want 1s or more", f.partitionTTL)
	r.want(f.shutdownTimeout > 0, "--shutdown-timeout %v: want more than 0", f.shutdownTimeout)
	r.want(f.maxConns >= 1, "--max-db-conns %d: want 1 or more", f.maxConns)
	r.want(f.healthInterval > 0, "--health-interval %v: want more than 0", f.healthInterval)
	r.want(f.idleChecks >= 1, "--idle-checks-per-second %d: want 1 or more", f.idleChecks)
	r.want(f.retention >= 0, "--retention %v: want 0 (keep everything) or more", f.retention)
	r.want(f.janitorInterval > 0, "--janitor-interval %v: want more than 0", f.janitorInterval)
	r.want(f.strandedAuditInterval > 0, "--stranded-audit-interval %v: want more than 0", f.strandedAuditInterval)
	r.want(f.maxSubscriptions >= 1, "--max-subscriptions-per-relay %d: want 1 or more", f.maxSubscriptions)
	r.want(f.ackCommitters >= 1, "--ack-committers %d: want 1 or more", f.ackCommitters)
	r.want(f.ackLinger >= 0, "--ack-linger %v: want 0 (off) or more", f.ackLinger)
	r.want(f.discoveryMaxEvents >= 0, "--discovery-max-events %d: want 0 (no limit) or more", f.discoveryMaxEvents)
	return r.err()
}
