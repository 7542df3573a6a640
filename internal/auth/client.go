package auth

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// BearerToken returns per-RPC credentials sending "authorization: Bearer
// <token>" with every call.
//
// With allowInsecure false, gRPC refuses to send them over a connection
// without transport security (the call fails with "the credentials require
// transport level security"): a bearer token over plaintext is readable and
// replayable by anyone on the path. Pass true only when the connection
// cannot be observed: a loopback address (see IsLoopback) or an operator's
// explicit --insecure choice, e.g. inside a service mesh that already
// encrypts.
//
// The returned value formats as redacted with fmt's %v and %#v, so logging a
// config struct holding it does not print the token.
func BearerToken(token string, allowInsecure bool) credentials.PerRPCCredentials {
	return bearer{header: "Bearer " + token, requireTLS: !allowInsecure}
}

// WithBearerToken is grpc.WithPerRPCCredentials(BearerToken(token,
// allowInsecure)).
func WithBearerToken(token string, allowInsecure bool) grpc.DialOption {
	return grpc.WithPerRPCCredentials(BearerToken(token, allowInsecure))
}

type bearer struct {
	header     string
	requireTLS bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{authorizationHeader: b.header}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.requireTLS }

func (b bearer) String() string   { return "auth.BearerToken(redacted)" }
func (b bearer) GoString() string { return b.String() }

// DefaultClientEnvVar is the environment variable conventionally holding a
// client's token (one bare token, unlike the server's DefaultEnvVar).
const DefaultClientEnvVar = "OUTBOXD_TOKEN"

// LoadClientToken returns the token a client should send: the content of
// file when file is set (surrounding whitespace, such as the final newline,
// removed), else the value of the environment variable envVar when that is
// set, else "" (no token). Errors name the source, never the token.
func LoadClientToken(file, envVar string) (string, error) {
	var token, source string
	switch {
	case file != "":
		b, err := readLimited(file)
		if err != nil {
			return "", fmt.Errorf("auth: token file: %w", err)
		}
		token, source = strings.TrimSpace(string(b)), file
		if token == "" {
			return "", fmt.Errorf("auth: token file %s is empty", file)
		}
	case envVar != "":
		token, source = strings.TrimSpace(os.Getenv(envVar)), "$"+envVar
		if token == "" {
			return "", nil
		}
	default:
		return "", nil
	}
	if len(token) > MaxSecretLen || !validToken(token) {
		return "", fmt.Errorf("auth: %s does not hold one token: want at most %d of A-Z a-z 0-9 - . _ ~ + / and trailing =, on one line", source, MaxSecretLen)
	}
	return token, nil
}

// GenerateToken returns a new random token: 32 bytes from crypto/rand,
// base64url-encoded (43 characters).
func GenerateToken() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("auth: generate token: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// IsLoopback reports whether a listen or dial address ("host:port", or a
// bare host) names only the loopback interface: "localhost", 127.0.0.0/8 or
// ::1 (also in IPv4-mapped form). An empty host (":7070"), 0.0.0.0 and :: mean
// every interface, so they are not loopback. A name other than localhost is
// not resolved and counts as not loopback: the rule this serves ("no auth
// only on loopback") must fail closed.
func IsLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		// A bare host: "127.0.0.1", "::1" or "[::1]".
		host = addr
		if inner, ok := strings.CutPrefix(addr, "["); ok {
			if host, ok = strings.CutSuffix(inner, "]"); !ok {
				return false
			}
		}
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	return ip.Unmap().IsLoopback()
}

// ErrInsecureToken is returned by CheckTransport.
var ErrInsecureToken = errors.New("auth: refusing to send a bearer token in plaintext to a non-loopback address; enable TLS or pass --insecure")

// CheckTransport decides whether a client may send a token over the
// connection it is about to make, for CLI flag handling: with TLS, always;
// without, only to a loopback address or when the operator insisted
// (insecure). The boolean is BearerToken's allowInsecure.
func CheckTransport(serverAddr string, useTLS, insecure bool) (allowInsecure bool, err error) {
	switch {
	case useTLS:
		return false, nil
	case insecure || IsLoopback(serverAddr):
		return true, nil
	default:
		return false, ErrInsecureToken
	}
}
