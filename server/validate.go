package server

import (
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/outboxd/outboxd/internal/limits"
)

var streamName = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,127}$`)

const (
	maxSubscribeStreams = 64
	maxAckItems         = limits.MaxAckItems
	maxRelayIDLen       = 128
)

// fieldErrors collects field violations into one InvalidArgument status with
// errdetails.BadRequest, so a client sees every problem at once.
type fieldErrors struct {
	violations []*errdetails.BadRequest_FieldViolation
}

func (f *fieldErrors) add(field, format string, args ...any) {
	f.violations = append(f.violations, &errdetails.BadRequest_FieldViolation{
		Field: field, Description: fmt.Sprintf(format, args...),
	})
}

func (f *fieldErrors) err() error {
	if len(f.violations) == 0 {
		return nil
	}
	msg := "invalid request: " + f.violations[0].Field + ": " + f.violations[0].Description
	if n := len(f.violations) - 1; n > 0 {
		msg += fmt.Sprintf(" (and %d more)", n)
	}
	st, err := status.New(codes.InvalidArgument, msg).WithDetails(&errdetails.BadRequest{FieldViolations: f.violations})
	if err != nil {
		return status.Error(codes.InvalidArgument, msg)
	}
	return st.Err()
}

func checkPrintableASCII(f *fieldErrors, field, v string, maxLen int) {
	if v == "" || len(v) > maxLen {
		f.add(field, "must be 1 to %d characters", maxLen)
		return
	}
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			f.add(field, "must be printable ASCII")
			return
		}
	}
}

// checkText validates text a request sends on to PostgreSQL as a text
// value, and is where every admin text field is checked for it: text
// cannot hold a NUL byte and must be valid UTF-8 (otherwise the statement
// fails, which a caller would see as the database's fault, after earlier
// statements of the call may have written), and every field has a bound.
// An empty value passes; the caller says whether one is required. It
// reports whether v passed.
func checkText(f *fieldErrors, field, v string, maxBytes int) bool {
	switch {
	case len(v) > maxBytes:
		f.add(field, "must be at most %d bytes, got %d", maxBytes, len(v))
	case !utf8.ValidString(v):
		f.add(field, "must be valid UTF-8")
	case strings.IndexByte(v, 0) >= 0:
		f.add(field, "must not contain a NUL byte (PostgreSQL text cannot hold one)")
	default:
		return true
	}
	return false
}

func checkStream(f *fieldErrors, field, v string) {
	if !streamName.MatchString(v) {
		f.add(field, "%q is not a stream name (^[a-z][a-z0-9_.-]{0,127}$)", truncate(v, 140))
	}
}

// checkStreamPattern validates a stream filter as every listing and bulk
// action accepts it: a stream name, a prefix pattern ("billing.*": every
// stream whose name starts with "billing."), or "*" for every stream. It
// returns the name, or the prefix with prefix set ("" for every stream).
func checkStreamPattern(f *fieldErrors, field, v string) (nameOrPrefix string, prefix bool) {
	base, isPattern := strings.CutSuffix(v, ".*")
	switch {
	case v == "*":
		return "", true
	case isPattern && streamName.MatchString(base):
		return base + ".", true
	case !isPattern && streamName.MatchString(v):
		return v, false
	}
	f.add(field, `%q is neither a stream name (^[a-z][a-z0-9_.-]{0,127}$) nor a pattern: want a name ("billing.invoice"), a prefix ending in ".*" ("billing.*"), or "*" for every stream`,
		truncate(v, 140))
	return v, false
}

// checkDuration validates an optional duration within [lo, hi]; nil yields def.
func checkDuration(f *fieldErrors, field string, d *durationpb.Duration, def, lo, hi time.Duration) time.Duration {
	if d == nil {
		return def
	}
	if err := d.CheckValid(); err != nil {
		f.add(field, "is not a valid duration")
		return def
	}
	v := d.AsDuration()
	if v < lo || v > hi {
		f.add(field, "must be between %v and %v, got %v", lo, hi, v)
		return def
	}
	return v
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
