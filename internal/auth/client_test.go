package auth

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestIsLoopback(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string]bool{
		"127.0.0.1:7070":       true,
		"127.0.0.1:0":          true,
		"127.1.2.3:7070":       true,
		"[::1]:0":              true,
		"[::1]:7070":           true,
		"localhost:7070":       true,
		"LocalHost:7070":       true,
		"[::ffff:127.0.0.1]:1": true,
		"127.0.0.1":            true,
		"::1":                  true,
		"[::1]":                true,
		"localhost":            true,
		":7070":                false, // every interface
		"0.0.0.0:7070":         false,
		"[::]:7070":            false,
		"10.0.0.1:7070":        false,
		"[fe80::1%lo]:7070":    false,
		"example.com:7070":     false,
		"localhost.evil.com:1": false,
		"dns:///localhost:1":   false, // not resolved: fail closed
		"":                     false,
		"[::1":                 false,
		"127.0.0.1:7070:1":     false,
	} {
		if got := IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v, want %v", addr, got, want)
		}
	}
}

func TestCheckTransport(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		addr          string
		useTLS, insec bool
		allow         bool
		wantErr       bool
		description   string
	}{
		{"db.example:7070", true, false, false, false, "TLS: always, token needs TLS"},
		{"127.0.0.1:7070", true, false, false, false, "TLS to loopback: still needs TLS"},
		{"127.0.0.1:7070", false, false, true, false, "plaintext to loopback"},
		{"db.example:7070", false, false, false, true, "plaintext to a remote host: refused"},
		{"db.example:7070", false, true, true, false, "plaintext insisted on"},
	} {
		allow, err := CheckTransport(tc.addr, tc.useTLS, tc.insec)
		if allow != tc.allow || (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, ErrInsecureToken)) {
			t.Errorf("%s: got %v, %v", tc.description, allow, err)
		}
	}
}

func TestLoadClientToken(t *testing.T) {
	const v = "OUTBOXD_TEST_CLIENT_TOKEN"
	dir := t.TempDir()
	good := writeFile(t, dir, "good", "  "+relaySecret+"\n")
	t.Setenv(v, billingSecret+"\n")

	if tok, err := LoadClientToken(good, v); err != nil || tok != relaySecret {
		t.Errorf("file first: %q, %v", tok, err)
	}
	if tok, err := LoadClientToken("", v); err != nil || tok != billingSecret {
		t.Errorf("then the variable: %q, %v", tok, err)
	}
	if tok, err := LoadClientToken("", ""); err != nil || tok != "" {
		t.Errorf("neither: %q, %v", tok, err)
	}
	if tok, err := LoadClientToken("", "OUTBOXD_TEST_UNSET_VARIABLE"); err != nil || tok != "" {
		t.Errorf("unset variable: %q, %v", tok, err)
	}
	for name, content := range map[string]string{
		"two-lines": relaySecret + "\n" + adminSecret + "\n",
		"a-line":    "r relay " + relaySecret,
		"empty":     "\n",
	} {
		path := writeFile(t, dir, name, content)
		tok, err := LoadClientToken(path, v)
		if err == nil || !strings.Contains(err.Error(), path) || strings.Contains(err.Error(), relaySecret) {
			t.Errorf("%s: %q, %v", name, tok, err)
		}
	}
	if _, err := LoadClientToken(filepath.Join(dir, "missing"), v); err == nil {
		t.Error("missing file accepted")
	}
	t.Setenv(v, "not a token")
	if _, err := LoadClientToken("", v); err == nil || !strings.Contains(err.Error(), "$"+v) {
		t.Errorf("bad variable: %v", err)
	}
}

func TestBearerTokenMetadataAndRedaction(t *testing.T) {
	t.Parallel()
	c := BearerToken(relaySecret, false)
	md, err := c.GetRequestMetadata(context.Background())
	if err != nil || md["authorization"] != "Bearer "+relaySecret {
		t.Fatalf("metadata %v, %v", md, err)
	}
	if !c.RequireTransportSecurity() || BearerToken(relaySecret, true).RequireTransportSecurity() {
		t.Error("RequireTransportSecurity does not follow allowInsecure")
	}
	printed := fmt.Sprintf("%v %+v %#v %s", c, c, c, struct{ C any }{c})
	if strings.Contains(printed, relaySecret) {
		t.Errorf("credentials print the token: %s", printed)
	}
	// What the client sends, the server's parser accepts.
	if tok, err := parseAuthorization([]string{md["authorization"]}); err != nil || tok != relaySecret {
		t.Errorf("round trip: %q, %v", tok, err)
	}
}

func TestParseAuthorization(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		values []string
		want   string // "" means an error
	}{
		{[]string{"Bearer abc"}, "abc"},
		{[]string{"bearer abc"}, "abc"},
		{[]string{"BEARER   abc=="}, "abc=="},
		{[]string{"Bearer a-b.c_d~e+f/g"}, "a-b.c_d~e+f/g"},
		{nil, ""},
		{[]string{}, ""},
		{[]string{"Bearer abc", "Bearer abc"}, ""},
		{[]string{""}, ""},
		{[]string{"Bearer"}, ""},
		{[]string{"Bearer "}, ""},
		{[]string{"Bearer\tabc"}, ""},
		{[]string{"Basic abc"}, ""},
		{[]string{"Bearerabc"}, ""},
		{[]string{" Bearer abc"}, ""},
		{[]string{"Bearer abc "}, ""},
		{[]string{"Bearer a b"}, ""},
		{[]string{"Bearer ==="}, ""},
		{[]string{"Bearer a=b"}, ""},
		{[]string{"Bearer " + strings.Repeat("a", MaxSecretLen)}, strings.Repeat("a", MaxSecretLen)},
		{[]string{"Bearer " + strings.Repeat("a", MaxSecretLen+1)}, ""},
		{[]string{"Bearer é"}, ""},
	} {
		got, err := parseAuthorization(tc.values)
		if got != tc.want || (err != nil) != (tc.want == "") {
			t.Errorf("parseAuthorization(%q) = %q, %v; want %q", tc.values, got, err, tc.want)
		}
		if err != nil && len(tc.values) > 0 {
			_, tok, _ := strings.Cut(tc.values[0], " ")
			if tok = strings.TrimSpace(tok); len(tok) >= 3 && strings.Contains(err.Error(), tok) {
				t.Errorf("error %q echoes the token", err)
			}
		}
	}
}

func TestAuthorizeHelpers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if err := AuthorizeStreams(ctx, "anything"); err != nil {
		t.Errorf("no principal (auth off) must allow: %v", err)
	}
	if err := AuthorizeAllStreams(ctx); err != nil {
		t.Errorf("no principal (auth off) must allow: %v", err)
	}
	if _, ok := PrincipalFrom(ContextWithPrincipal(ctx, nil)); ok {
		t.Error("a nil principal counts as present")
	}
	limited := ContextWithPrincipal(ctx, &Principal{Name: "b", Roles: []Role{RoleRelay}, Streams: []string{"billing.*", "x"}})
	if err := AuthorizeStreams(limited, "billing.a", "x"); err != nil {
		t.Error(err)
	}
	if err := AuthorizeStreams(limited, "billing.a", "y"); status.Code(err) != codes.PermissionDenied {
		t.Errorf("y: %v", err)
	}
	if err := AuthorizeAllStreams(limited); status.Code(err) != codes.PermissionDenied {
		t.Errorf("all streams: %v", err)
	}
	star := ContextWithPrincipal(ctx, &Principal{Name: "s", Streams: []string{"*"}})
	if err := AuthorizeAllStreams(star); err != nil {
		t.Errorf("streams=* is every stream: %v", err)
	}
	p, _ := PrincipalFrom(limited)
	if p.String() != "b" || !p.HasRole(RoleRelay) || p.HasRole(RoleAdmin) || p.AllStreams() {
		t.Errorf("principal accessors: %v", p)
	}
}
