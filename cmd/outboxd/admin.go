package main

// The operator commands (lag, relays, aggregate, events, retry, skip, purge)
// are thin clients of outbox.v1.AdminService: they parse flags, make the
// calls, and print tables for people or protojson for scripts. This file
// holds what they share: dialing, per-call deadlines, error and exit-code
// mapping, JSON output, and time and duration parsing and formatting.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/term"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/internal/tlsconfig"
)

// defaultServer is where clients (relay, operator commands) dial by default:
// the address `outboxd serve` and `outboxd dev` listen on by default.
const defaultServer = "127.0.0.1:7070"

// clientFlags say how to reach an outboxd server. Every command that dials
// one registers them and dials with dialServer, so connection security
// (TLS, bearer tokens) is added in one place for all of them.
type clientFlags struct {
	server        string
	tokenFile     string
	tls           bool
	tlsCA         string
	tlsCert       string
	tlsKey        string
	tlsServerName string
	insecure      bool

	// tokenSource says where dialServer found the token it sends
	// ("--token-file PATH" or "$OUTBOXD_TOKEN"); empty when it sends none.
	tokenSource string
}

func (f *clientFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&f.server, "server", defaultServer, "outboxd gRPC address")
	fl.StringVar(&f.tokenFile, "token-file", "", "file holding the bearer token (default: $"+auth.DefaultClientEnvVar+" if set)")
	fl.BoolVar(&f.tls, "tls", false, "connect with TLS (implied by any other --tls-* flag)")
	fl.StringVar(&f.tlsCA, "tls-ca", "", "CA certificate file that verifies the server (default: system roots)")
	fl.StringVar(&f.tlsCert, "tls-cert", "", "client certificate file, for servers that require mutual TLS")
	fl.StringVar(&f.tlsKey, "tls-key", "", "client private key file for --tls-cert")
	fl.StringVar(&f.tlsServerName, "tls-server-name", "", "name to verify in the server's certificate (default: the --server host)")
	fl.BoolVar(&f.insecure, "insecure", false, "allow sending the token without TLS to a non-loopback server")
}

// usesTLS says the client connects with TLS: --tls, or any other --tls-*
// flag.
func (f *clientFlags) usesTLS() bool {
	return f.tls || f.tlsCA != "" || f.tlsCert != "" || f.tlsServerName != ""
}

// dialServer returns a client connection to the server f names, with TLS
// and the bearer token when configured. Like grpc.NewClient it connects
// lazily: an unreachable server shows up as the first call failing with
// Unavailable.
func dialServer(_ *cobra.Command, f *clientFlags) (*grpc.ClientConn, error) {
	if f.server == "" {
		return nil, usageError("--server must not be empty")
	}
	if (f.tlsCert == "") != (f.tlsKey == "") {
		return nil, usageError("--tls-cert and --tls-key go together")
	}
	useTLS := f.usesTLS()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if useTLS {
		tc, err := tlsconfig.NewClient(tlsconfig.ClientConfig{
			CAFile: f.tlsCA, CertFile: f.tlsCert, KeyFile: f.tlsKey, ServerName: f.tlsServerName,
		})
		if err != nil {
			return nil, usageError("%v", err)
		}
		opts[0] = grpc.WithTransportCredentials(credentials.NewTLS(tc))
	}
	token, err := auth.LoadClientToken(f.tokenFile, auth.DefaultClientEnvVar)
	if err != nil {
		return nil, usageError("%v", err)
	}
	if token != "" {
		f.tokenSource = "$" + auth.DefaultClientEnvVar
		if f.tokenFile != "" {
			f.tokenSource = "--token-file " + f.tokenFile
		}
		allowPlain, err := auth.CheckTransport(f.server, useTLS, f.insecure)
		if err != nil {
			return nil, usageError("%v", err)
		}
		opts = append(opts, auth.WithBearerToken(token, allowPlain))
	}
	conn, err := grpc.NewClient(f.server, opts...)
	if err != nil {
		return nil, usageError("--server %s: %v", f.server, err)
	}
	return conn, nil
}

// adminFlags are the flags every operator command has.
type adminFlags struct {
	clientFlags
	timeout time.Duration
	json    bool
}

func (f *adminFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	f.clientFlags.register(fl)
	fl.DurationVar(&f.timeout, "timeout", 10*time.Second, "deadline of each call to the server (0: none)")
	fl.BoolVar(&f.json, "json", false,
		"print responses as protojson (proto field names, every field), one JSON document per line")
}

// adminClient is a connected AdminService client with the command's output
// streams and flags.
type adminClient struct {
	rpc    outboxv1.AdminServiceClient
	flags  *adminFlags
	out    io.Writer // results
	errOut io.Writer // prompts, progress, warnings
	in     io.Reader // confirmations
}

// run dials the server, runs fn, and closes the connection.
func (f *adminFlags) run(cmd *cobra.Command, fn func(ctx context.Context, c *adminClient) error) error {
	if f.timeout < 0 {
		return usageError("--timeout must not be negative")
	}
	conn, err := dialServer(cmd, &f.clientFlags)
	if err != nil {
		return err
	}
	defer conn.Close()
	return fn(cmd.Context(), &adminClient{
		rpc:    outboxv1.NewAdminServiceClient(conn),
		flags:  f,
		out:    cmd.OutOrStdout(),
		errOut: cmd.ErrOrStderr(),
		in:     cmd.InOrStdin(),
	})
}

// callCtx bounds one call by --timeout.
func (c *adminClient) callCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	if c.flags.timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.flags.timeout)
}

// call makes one unary AdminService call under --timeout and maps its error.
func call[Req, Resp any](ctx context.Context, c *adminClient, method string,
	fn func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req,
) (Resp, error) {
	cctx, cancel := c.callCtx(ctx)
	defer cancel()
	resp, err := fn(cctx, req)
	if err != nil {
		return resp, c.rpcError(ctx, method, err)
	}
	return resp, nil
}

// rpcError turns a failed call into an error carrying the exit code
// statusExitCode gives, worded for a person: the server's status message and
// any field violations, without gRPC's "rpc error: code = ... desc =" noise.
// ctx is the command's context (not the call's), to tell an interrupt from
// a deadline.
func (c *adminClient) rpcError(ctx context.Context, method string, err error) error {
	if ctx.Err() != nil {
		return withExitCode(exitFailure, errors.New("interrupted"))
	}
	st, ok := status.FromError(err)
	if !ok {
		return withExitCode(exitFailure, err)
	}
	var msg string
	switch st.Code() {
	case codes.Unavailable:
		msg = fmt.Sprintf("outboxd at %s is unavailable: %s", c.flags.server, st.Message()) + tlsHint(&c.flags.clientFlags, st.Message())
	case codes.DeadlineExceeded:
		msg = fmt.Sprintf("no answer from outboxd at %s within --timeout %v", c.flags.server, c.flags.timeout)
	case codes.Unimplemented:
		msg = fmt.Sprintf("outboxd at %s does not implement %s (is it an older version?): %s",
			c.flags.server, method, st.Message())
	case codes.Unauthenticated:
		msg = fmt.Sprintf("%s: %s", method, st.Message())
		if c.flags.tokenSource == "" {
			msg += fmt.Sprintf("; outboxd sent none: give it with --token-file FILE or in $%s", auth.DefaultClientEnvVar)
		} else {
			msg += fmt.Sprintf(" (the token from %s)", c.flags.tokenSource)
		}
	case codes.PermissionDenied:
		msg = fmt.Sprintf("%s: %s", method, st.Message())
	default:
		msg = st.Message()
	}
	return withExitCode(statusExitCode(st.Code()), errors.New(msg+statusDetails(st)))
}

// tlsHint says which TLS flag a connection refused for want of one needs:
// gRPC's own words ("error reading server preface: EOF", "remote error: tls:
// certificate required") do not name it.
func tlsHint(f *clientFlags, msg string) string {
	switch {
	case strings.Contains(msg, "tls: certificate required"):
		return "; the server requires a client certificate: give --tls-cert and --tls-key"
	case !f.usesTLS() && strings.Contains(msg, "error reading server preface"):
		return "; the server may require TLS: connect with --tls (and --tls-ca for a private CA)"
	case f.usesTLS() && strings.Contains(msg, "first record does not look like a TLS handshake"):
		return "; the server does not speak TLS: connect without the --tls flags"
	}
	return ""
}

// statusExitCode maps a gRPC status code to the CLI's exit code.
func statusExitCode(c codes.Code) int {
	switch c {
	case codes.OK:
		return exitOK
	case codes.InvalidArgument, codes.OutOfRange:
		return exitUsage
	case codes.NotFound:
		return exitNotFound
	case codes.FailedPrecondition, codes.AlreadyExists:
		return exitPrecondition
	case codes.Unauthenticated:
		return exitUnauthenticated
	default:
		return exitFailure
	}
}

// statusDetails renders the field violations of errdetails.BadRequest and
// PreconditionFailure, one per line, leaving out those the message already
// states.
func statusDetails(st *status.Status) string {
	var lines []string
	add := func(subject, desc string) {
		line := desc
		if subject != "" {
			line = subject + ": " + desc
		}
		if !strings.Contains(st.Message(), line) {
			lines = append(lines, "\n  "+line)
		}
	}
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				add(v.GetField(), v.GetDescription())
			}
		case *errdetails.PreconditionFailure:
			for _, v := range d.GetViolations() {
				add(v.GetSubject(), v.GetDescription())
			}
		}
	}
	return strings.Join(lines, "")
}

// adminCommand builds an operator command whose flag and argument mistakes
// exit with exitUsage, and whose help lists the exit codes.
func adminCommand(use, short, long string, args cobra.PositionalArgs) *cobra.Command {
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Long:  strings.TrimSpace(long) + "\n\n" + exitCodesHelp,
		Args: func(cmd *cobra.Command, a []string) error {
			if err := args(cmd, a); err != nil {
				return usageError("%v (see '%s --help')", err, cmd.CommandPath())
			}
			return nil
		},
	}
	cmd.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return usageError("%v (see '%s --help')", err, cmd.CommandPath())
	})
	return cmd
}

// jsonOptions fix the --json form: proto field names (as in the .proto and
// SQL), every field present even when zero, enums by name.
var jsonOptions = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}

// writeJSON prints m as one line of JSON.
func writeJSON(w io.Writer, m proto.Message) error {
	b, err := jsonOptions.Marshal(m)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// isTerminal reports whether f is an interactive terminal. Values that are
// not files (test doubles) may say so themselves with an IsTerminal method.
func isTerminal(f any) bool {
	switch f := f.(type) {
	case interface{ IsTerminal() bool }:
		return f.IsTerminal()
	case *os.File:
		return term.IsTerminal(int(f.Fd()))
	}
	return false
}

// defaultActor names the operator in audit records when the credential does
// not: the local user name.
func defaultActor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return os.Getenv("USER")
}

// parseAge parses a Go duration ("90m", "1h30m") that may start with a
// number of days ("30d", "7d12h"), since retention is usually said in days.
func parseAge(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	var days time.Duration
	if i := strings.IndexByte(s, 'd'); i > 0 {
		n, err := strconv.ParseUint(s[:i], 10, 16)
		if err != nil {
			return 0, fmt.Errorf("invalid duration %q", s)
		}
		days = time.Duration(n) * 24 * time.Hour
		s = s[i+1:]
		if s == "" {
			return days, nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q: want e.g. 90s, 15m, 2h30m or 30d", s)
	}
	if d < 0 {
		return 0, fmt.Errorf("duration %q is negative", s)
	}
	return days + d, nil
}

// parseTimeOrAgo parses an RFC 3339 time, or a duration meaning that long
// before now ("1h" is an hour ago).
func parseTimeOrAgo(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := parseAge(s); err == nil {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("invalid time %q: want RFC 3339 (2006-01-02T15:04:05Z) or a duration ago (90m, 2d)", s)
}

// ageValue is a pflag.Value for parseAge durations.
type ageValue struct {
	d   *time.Duration
	set bool
}

func (v *ageValue) String() string {
	if v.d == nil || !v.set {
		return ""
	}
	return v.d.String()
}

func (v *ageValue) Set(s string) error {
	d, err := parseAge(s)
	if err != nil {
		return err
	}
	*v.d, v.set = d, true
	return nil
}

func (v *ageValue) Type() string { return "duration" }

// timeValue is a pflag.Value for parseTimeOrAgo times; the zero time means
// unset.
type timeValue struct{ t *time.Time }

func (v *timeValue) String() string {
	if v.t == nil || v.t.IsZero() {
		return ""
	}
	return v.t.Format(time.RFC3339)
}

func (v *timeValue) Set(s string) error {
	t, err := parseTimeOrAgo(s, time.Now())
	if err != nil {
		return err
	}
	*v.t = t
	return nil
}

func (v *timeValue) Type() string { return "time" }

// fmtAge formats a duration for people: 350ms, 4.2s, 3m12s, 5h03m, 3d04h.
func fmtAge(d time.Duration) string {
	switch {
	case d < 0:
		return "-" + fmtAge(-d)
	case d == 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < 10*time.Second:
		return d.Round(100 * time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 24*time.Hour:
		d = d.Round(time.Minute)
		return fmt.Sprintf("%dh%02dm", d/time.Hour, d%time.Hour/time.Minute)
	default:
		d = d.Round(time.Hour)
		return fmt.Sprintf("%dd%02dh", d/(24*time.Hour), d%(24*time.Hour)/time.Hour)
	}
}

// fmtDuration formats an optional proto duration; unset is "-".
func fmtDuration(d *durationpb.Duration) string {
	if d == nil {
		return "-"
	}
	return fmtAge(d.AsDuration())
}

// fmtTime formats an optional proto timestamp in local time to the second;
// unset is "-".
func fmtTime(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "-"
	}
	return ts.AsTime().Local().Format(time.RFC3339)
}

// fmtTimeAgo is fmtTime with the age appended: "2026-01-02T15:04:05+01:00 (3m12s ago)".
func fmtTimeAgo(ts *timestamppb.Timestamp, now time.Time) string {
	if ts == nil {
		return "-"
	}
	d := now.Sub(ts.AsTime())
	if d < 0 {
		return fmt.Sprintf("%s (in %s)", fmtTime(ts), fmtAge(-d))
	}
	return fmt.Sprintf("%s (%s ago)", fmtTime(ts), fmtAge(d))
}

// cell makes text safe for one table cell: control characters (tabs and
// newlines would break the table; escape sequences would reach the
// terminal) are escaped, and the text is cut to max runes (0: no limit).
// Empty text is "-".
func cell(s string, max int) string {
	if s == "" {
		return "-"
	}
	if strings.IndexFunc(s, unicode.IsControl) >= 0 || !utf8.ValidString(s) {
		q := strconv.Quote(s)
		s = q[1 : len(q)-1]
	}
	if max > 0 && utf8.RuneCountInString(s) > max {
		r := []rune(s)
		s = string(r[:max-1]) + "…"
	}
	return s
}

// parseEventID checks an EVENT_ID argument: an event id (a UUID), or
// "source/event_id" for an event of a source other than default on a
// server that fronts several (the message id the relay's sinks give it).
func parseEventID(arg string) error {
	src, id, qualified := strings.Cut(arg, "/")
	if !qualified {
		id = arg
	} else if err := multisource.ValidName(src); err != nil {
		return usageError("EVENT_ID %q: %v", arg, err)
	}
	if _, err := uuid.Parse(id); err != nil {
		return usageError("EVENT_ID %q is not an event id (a UUID, or SOURCE/UUID for a source other than default)", arg)
	}
	return nil
}

// sourceOf is the source a stream address names ("orders/billing":
// orders), or "" for default's bare names.
func sourceOf(stream string) string {
	if src, _, ok := strings.Cut(stream, "/"); ok {
		return src
	}
	return ""
}

// eventAddress is how the CLI prints an event id: "source/event_id" for a
// source other than default, as SkipEvent and the other commands take it.
func eventAddress(source, id string) string {
	if source == "" {
		return id
	}
	return multisource.JoinStream(source, id)
}

// listPage is one page of a listing that may span sources.
type listPage interface {
	GetNextPageToken() string
	GetSkippedSources() []*outboxv1.SourceHealth
}

// pageThrough follows a listing's pages from token until limit items (0:
// all) or the last page. fetch asks for the page after token, of at most n
// items, and returns it with its items. pageThrough returns every item,
// every page's skipped_sources and the token that continues the listing
// ("" after the last page). An empty page with a token ends it only with
// stopOnEmpty (a server returning one for every page would loop forever);
// a listing whose pages may be short, even empty, while the server passes
// over items the token may not see, goes on.
func pageThrough[T any, P listPage](token string, limit, pageSize int, stopOnEmpty bool,
	fetch func(token string, n int) (P, []T, error)) (items []T, skipped []*outboxv1.SourceHealth, next string, err error) {
	for {
		n := pageSize
		if limit > 0 {
			n = min(n, limit-len(items))
		}
		page, got, err := fetch(token, n)
		if err != nil {
			return nil, nil, "", err
		}
		items = append(items, got...)
		skipped = append(skipped, page.GetSkippedSources()...)
		token = page.GetNextPageToken()
		if token == "" || (stopOnEmpty && len(got) == 0) || (limit > 0 && len(items) >= limit) {
			return items, skipped, token, nil
		}
	}
}

// noteSkippedSources warns, on stderr, of each source a listing over every
// source left out (skipped_sources: it could not be read, or the token may
// see only some of its streams), so that a table missing a source's rows
// says so.
func noteSkippedSources(w io.Writer, what string, skipped []*outboxv1.SourceHealth) {
	for _, s := range skipped {
		fmt.Fprintf(w, "warning: source %s left out, its %s are not listed: %s\n", s.GetName(), what, s.GetReason())
	}
}
