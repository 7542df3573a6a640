package relay

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// class is what an RPC's error means for the relay.
type class int

const (
	// classTransient: the server or the network could not answer now
	// (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, and
	// anything that is not a gRPC status, such as a broken connection).
	// Retry with bounded backoff.
	classTransient class = iota
	// classTerminal: the server refuses this relay's credentials
	// (UNAUTHENTICATED, PERMISSION_DENIED). Every other call would be
	// refused too, so the runner stops and Run returns the error.
	classTerminal
	// classLeaseLost: the lease is definitely gone (FAILED_PRECONDITION, or
	// NOT_FOUND for an event that no longer exists). Retrying the same token
	// cannot succeed; the event comes again under a new lease.
	classLeaseLost
	// classRequest: this request, or one item in it, is at fault
	// (INVALID_ARGUMENT, INTERNAL, UNKNOWN and the rest). Retrying it as it
	// is would fail again; an Ack batch is split to find the item.
	classRequest
)

func classify(err error) class {
	st, ok := status.FromError(err)
	if !ok {
		return classTransient
	}
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted, codes.Canceled:
		// Canceled here comes from the other side or the transport: the
		// callers check their own context before classifying.
		return classTransient
	case codes.Unauthenticated, codes.PermissionDenied:
		return classTerminal
	case codes.FailedPrecondition, codes.NotFound:
		return classLeaseLost
	default:
		return classRequest
	}
}

// fatal records the first terminal error of one subscription and tells
// everyone waiting on done.
type fatal struct {
	once sync.Once
	done chan struct{}
	err  error
	stop context.CancelCauseFunc
}

func newFatal(stop context.CancelCauseFunc) *fatal {
	return &fatal{done: make(chan struct{}), stop: stop}
}

// set records err (the first one wins) as the answer to rpc and stops the
// subscription's work.
func (f *fatal) set(rpc string, err error) {
	f.once.Do(func() {
		f.err = fmt.Errorf("relay: %s refused (%s): %w", rpc, status.Code(err), err)
		f.stop(f.err)
		close(f.done)
	})
}

// get returns the recorded error, or nil.
func (f *fatal) get() error {
	select {
	case <-f.done:
		return f.err
	default:
		return nil
	}
}
