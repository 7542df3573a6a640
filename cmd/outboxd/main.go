// Command outboxd is the transactional outbox delivery service: the server
// (serve, dev), a relay worker (relay), schema management (migrate), and
// operator commands (lag, relays, aggregate, events, retry, skip, purge).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Exit codes. Scripts and cron jobs branch on them, so they are part of the
// CLI's contract: never renumber one, only add. exitCodesHelp repeats them
// in the help of every command that can return them.
const (
	exitOK = 0
	// exitFailure: anything unexpected: an internal or database error, the
	// server unavailable or too slow, permission denied.
	exitFailure = 1
	// exitUsage: bad flags or arguments, or a request the server refused as
	// invalid (gRPC InvalidArgument).
	exitUsage = 2
	// exitNotFound: the aggregate or event does not exist (gRPC NotFound).
	exitNotFound = 3
	// exitPrecondition: the target's state does not allow the action, e.g.
	// skipping an event that is already published (gRPC FailedPrecondition).
	exitPrecondition = 4
	// exitLagExceeded: lag --fail-if-older-than found older pending work.
	exitLagExceeded = 5
	// exitNotConfirmed: purge was not confirmed (answered no, or stdin is not
	// a terminal and --yes was not given).
	exitNotConfirmed = 6
	// exitUnauthenticated: the server did not accept the credential: no
	// token was sent, or not one it knows (gRPC Unauthenticated). A token
	// it knows without the needed role is permission denied: exitFailure.
	exitUnauthenticated = 7
)

// exitCodesHelp documents the exit codes in command help.
const exitCodesHelp = `Exit codes:
  0  success
  1  unexpected error (internal, database or server unavailable, timeout)
  2  usage error, or the server refused the request as invalid
  3  not found
  4  failed precondition (e.g. skipping an event that is already published)
  5  lag --fail-if-older-than: the oldest pending event is older than that
  6  purge, bulk action or republish not confirmed
  7  not authenticated: no token (--token-file, $OUTBOXD_TOKEN), or one the
     server does not accept`

// exitError is an error that ends the process with a specific exit code.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// withExitCode wraps err so that the process exits with code; nil stays nil.
func withExitCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &exitError{code: code, err: err}
}

// usageError is a usage mistake: exit code 2.
func usageError(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

// exitCode is the process exit code for the error a command returned.
func exitCode(err error) int {
	if err == nil {
		return exitOK
	}
	if e, ok := errors.AsType[*exitError](err); ok {
		return e.code
	}
	// A relay the server refused (its token, or its subscription as
	// invalid: streams, max_in_flight) ends with the server's status, and
	// exits as an admin command refused the same way would.
	switch status.Code(err) {
	case codes.Unauthenticated:
		return exitUnauthenticated
	case codes.InvalidArgument:
		return exitUsage
	}
	return exitFailure
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := rootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outboxd:", err)
	}
	os.Exit(exitCode(err))
}
