package main_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"net/http/cookiejar"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/connstring"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/internal/tlsconfig/tlstest"
)

// outboxd runs the binary to completion and returns its output and exit
// code.
func outboxd(t *testing.T, env []string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return string(out), ee.ExitCode()
		}
		t.Fatal(err)
	}
	return string(out), 0
}

// serve refuses an address other machines can reach without tokens, unless
// told that something else authenticates.
func TestServeRefusesNonLoopbackWithoutAuth(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	out, code := outboxd(t, []string{"OUTBOXD_TOKENS="}, "serve", "--database-url", url, "--listen", "0.0.0.0:0", "--http-listen", "")
	if code == 0 || !strings.Contains(out, "refusing to serve") || !strings.Contains(out, "--insecure-no-auth") {
		t.Fatalf("serve on 0.0.0.0 without auth: exit %d\n%s", code, out)
	}
}

// The production shape with security on: mutual TLS with certificates made
// here, bearer tokens from a file, the CLI and a relay as clients.
func TestMutualTLSAndTokensEndToEnd(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	dir := t.TempDir()
	ca, other := tlstest.NewCA(t, "outboxd test CA"), tlstest.NewCA(t, "someone else")
	srv := tlstest.WriteLeaf(t, dir, "server", ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth))
	cli := tlstest.WriteLeaf(t, dir, "client", ca.Issue(t, "ops", x509.ExtKeyUsageClientAuth))
	rogue := tlstest.WriteLeaf(t, dir, "rogue", other.Issue(t, "ops", x509.ExtKeyUsageClientAuth))
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const adminTok, relayTok = "admin-secret-0123456789abcdef", "relay-secret-0123456789abcdef"
	tokens := write("tokens", "ops admin "+adminTok+"\norders relay "+relayTok+" streams=sales_order\n")
	adminFile, relayFile := write("admin.token", adminTok+"\n"), write("relay.token", relayTok+"\n")

	addr, httpAddr := freeAddr(t), freeAddr(t)
	serve := start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", httpAddr,
		"--token-file", tokens, "--tls-cert", srv.Cert, "--tls-key", srv.Key, "--tls-client-ca", caFile)
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('sales_order', 'o-' || a, 'T', '{}') FROM generate_series(1, 10) a`); err != nil {
		t.Fatal(err)
	}
	tlsArgs := []string{"--server", addr, "--tls-ca", caFile, "--tls-cert", cli.Cert, "--tls-key", cli.Key}
	eventually(t, "lag over mutual TLS with the admin token", func() bool {
		out, code := outboxd(t, nil, append([]string{"lag", "--token-file", adminFile}, tlsArgs...)...)
		return code == 0 && strings.Contains(out, "sales_order")
	})
	// Each refusal for its own reason: the TLS layer for certificates and
	// plaintext (before any token is looked at), then authentication, then
	// the role. The client cannot always tell a TLS refusal's reason: with
	// TLS 1.3 it finishes its half of the handshake before the server
	// checks its certificate, and if its first write comes before the
	// server's alert it sees the connection closed (a reset when the server
	// closed with that write unread) instead. So the client must see a
	// transport refusal, and the server's log says why.
	transportRefused := []string{"write: broken pipe", "connection reset by peer"}
	for _, c := range []struct {
		name string
		args []string
		want []string // the output contains one of these
		// serverLog: what serve logs for a TLS refusal.
		serverLog string
	}{
		{"no client certificate", []string{"lag", "--server", addr, "--tls-ca", caFile, "--token-file", adminFile},
			append([]string{"tls: certificate required"}, transportRefused...),
			"client didn't provide a certificate"},
		{"a certificate of another CA", []string{"lag", "--server", addr, "--tls-ca", caFile, "--tls-cert", rogue.Cert, "--tls-key", rogue.Key, "--token-file", adminFile},
			append([]string{"tls: unknown certificate authority"}, transportRefused...),
			"certificate signed by unknown authority"},
		// The TLS server reads the plaintext preface as a bad handshake
		// and closes the connection: the client sees the close as EOF, or
		// as a reset when the server closed with its preface unread.
		{"plaintext", []string{"lag", "--server", addr, "--token-file", adminFile},
			[]string{"error reading server preface: EOF", "error reading server preface: connection reset by peer"},
			"first record does not look like a TLS handshake"},
		{"no token", append([]string{"lag"}, tlsArgs...),
			[]string{"GetLag: missing bearer token"}, ""},
		{"the relay token (wrong role)", append([]string{"lag", "--token-file", relayFile}, tlsArgs...),
			[]string{`GetLag: token "orders" lacks the admin or viewer role`}, ""},
	} {
		out, code := outboxd(t, nil, c.args...)
		// Exit 1: refused by the transport or the server, not a usage
		// error; 7 when the server saw no token.
		wantCode := 1
		if c.name == "no token" {
			wantCode = 7
		}
		ok := code == wantCode && slices.ContainsFunc(c.want, func(w string) bool { return strings.Contains(out, w) })
		if c.serverLog != "" {
			// Refused by TLS: the server answered no call at all.
			ok = ok && strings.Contains(out, "is unavailable:") && !strings.Contains(out, "GetLag:")
		}
		if !ok {
			t.Errorf("lag with %s: exit %d, want %d with one of %q:\n%s", c.name, code, wantCode, c.want, out)
		}
		// gRPC's words do not name the flag that is missing; the CLI does.
		if c.name == "plaintext" && !strings.Contains(out, "the server may require TLS: connect with --tls") {
			t.Errorf("lag without TLS against a TLS server does not point at --tls:\n%s", out)
		}
		if strings.Contains(out, "tls: certificate required") && !strings.Contains(out, "give --tls-cert and --tls-key") {
			t.Errorf("lag without a client certificate does not point at --tls-cert:\n%s", out)
		}
		if c.serverLog != "" {
			eventually(t, "serve logs the refused handshake of lag with "+c.name, func() bool {
				return serve.hasOutput(c.serverLog)
			})
		}
	}
	consoleLogin(t, "http://"+httpAddr, adminTok)
	// A relay with its own token, limited to sales_order, drains it over TLS.
	start(t, "relay", "--sink", "stdout://", "--token-file", relayFile, "--streams", "sales_order",
		"--server", addr, "--tls-ca", caFile, "--tls-cert", cli.Cert, "--tls-key", cli.Key)
	waitPublished(t, pool, 10)
}

// A request over the size limit is refused before it is decoded, and the
// server goes on serving.
func TestOversizedRequestRefused(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := outboxv1.NewAdminServiceClient(conn)
	eventually(t, "server up", func() bool {
		_, err := admin.GetLag(t.Context(), &outboxv1.GetLagRequest{})
		return err == nil
	})
	big := &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: "x", LeaseToken: strings.Repeat("A", 2<<20)}}}
	if _, err := outboxv1.NewRelayServiceClient(conn).Ack(t.Context(), big); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("2 MiB Ack: %v, want ResourceExhausted", err)
	}
	if _, err := admin.GetLag(t.Context(), &outboxv1.GetLagRequest{}); err != nil {
		t.Fatalf("after the oversized request: %v", err)
	}
}

// consoleLogin logs in to the console of a serve with tokens and mutual
// TLS: the console reaches the AdminService over the in-process
// connection, which needs no client certificate, and the token decides.
func consoleLogin(t *testing.T, base, token string) {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	get := func(path string) (int, string) {
		resp, err := c.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("/")
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(body)
	if code != http.StatusOK || m == nil || !strings.Contains(body, `name="token"`) {
		t.Fatalf("console without a session: %d, want the login page\n%.1000s", code, body)
	}
	resp, err := c.PostForm(base+"/login", neturl.Values{"csrf": {m[1]}, "token": {token}})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `href="/events?state=pending&amp;stream=sales_order"`) {
		t.Fatalf("console after login: %d, want the streams page listing sales_order\n%.2000s", resp.StatusCode, b)
	}
}

// With mutual TLS and no tokens, the console stays closed even on loopback:
// its in-process connection skips TLS, so an open console would be a way
// around the client certificates.
func TestConsoleClosedBesideMutualTLSWithoutTokens(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "outboxd test CA")
	srv := tlstest.WriteLeaf(t, dir, "server", ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth))
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	addr, httpAddr := freeAddr(t), freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", httpAddr,
		"--tls-cert", srv.Cert, "--tls-key", srv.Key, "--tls-client-ca", caFile)
	var code int
	var body string
	eventually(t, "the HTTP port answers", func() bool {
		code, body = httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK
	})
	code, body = httpGet("http://" + httpAddr + "/")
	if code != http.StatusForbidden || !strings.Contains(body, "needs tokens") {
		t.Fatalf("console beside mutual TLS without tokens: %d, want 403 asking for tokens\n%.1000s", code, body)
	}
}

// A database that cannot be reached is named in the error without its
// password, wherever the connection string carries one: the URL's user
// information, its query, a key=value string, a --source of either form.
// The error goes to a terminal, a CI log or a log pipeline.
func TestUnreachableDatabaseErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	const secret = "s3cretPW"
	for _, args := range [][]string{
		{"migrate", "--database-url", "postgres://postgres:" + secret + "@127.0.0.1:1/x?sslmode=disable"},
		{"migrate", "--database-url", "postgres://postgres@127.0.0.1:1/x?password=" + secret + "&sslmode=disable"},
		{"migrate", "--database-url", "host=127.0.0.1 port=1 user=postgres password=" + secret + " dbname=x sslmode=disable"},
		{"migrate", "--source", "b=host=127.0.0.1 port=1 user=postgres password='" + secret + "' dbname=x sslmode=disable"},
		{"rescan", "--database-url", "postgres://postgres@127.0.0.1:1/x?sslpassword=" + secret + "&sslmode=disable"},
		// A name the command refuses, before any connection: the usage error names the source.
		{"migrate", "--source", "B!=password=" + secret + " host=127.0.0.1 port=1"},
	} {
		out, code := outboxd(t, nil, args...)
		if code == 0 {
			t.Fatalf("%q against a closed port (or with a bad source name) succeeded:\n%s", args, out)
		}
		if strings.Contains(out, secret) {
			t.Errorf("%q shows the password:\n%s", args, out)
		}
		if !strings.Contains(out, connstring.Hidden) {
			t.Errorf("%q does not name the database (with the password hidden):\n%s", args, out)
		}
	}
}
