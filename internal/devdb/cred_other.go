//go:build !unix

package devdb

import "os/exec"

// setCredential does nothing where there is no root user to step down from:
// lookupServerUser only returns a user when os.Geteuid() is 0, which never
// happens outside Unix.
func setCredential(*exec.Cmd, *serverUser) {}

// checkReachable has nothing to check for the same reason.
func checkReachable(string, *serverUser) error { return nil }
