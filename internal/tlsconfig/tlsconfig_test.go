package tlsconfig

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outboxd/outboxd/internal/tlsconfig/tlstest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// logRecorder keeps log messages for assertions; it never calls t.Log,
// since handshakes may log from server goroutines after a test ends.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *logRecorder) WithGroup(string) slog.Handler            { return r }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	var b strings.Builder
	b.WriteString(rec.Level.String() + " " + rec.Message)
	rec.Attrs(func(a slog.Attr) bool { b.WriteString(" " + a.String()); return true })
	r.mu.Lock()
	r.msgs = append(r.msgs, b.String())
	r.mu.Unlock()
	return nil
}

func (r *logRecorder) count(substr string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, m := range r.msgs {
		if strings.Contains(m, substr) {
			n++
		}
	}
	return n
}

func (r *logRecorder) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.msgs, "\n")
}

// server is a gRPC health server over TLS on loopback that reports the
// serial of each client certificate it sees.
type server struct {
	addr          string
	clientSerials chan *big.Int
}

func serveTLS(t *testing.T, cfg *tls.Config) *server {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &server{addr: lis.Addr().String(), clientSerials: make(chan *big.Int, 100)}
	record := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if p, ok := peer.FromContext(ctx); ok {
			if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
				srv.clientSerials <- info.State.PeerCertificates[0].SerialNumber
			}
		}
		return h(ctx, req)
	}
	g := grpc.NewServer(grpc.Creds(credentials.NewTLS(cfg)), grpc.UnaryInterceptor(record))
	healthpb.RegisterHealthServer(g, health.NewServer())
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	t.Cleanup(func() { g.Stop(); <-done })
	return srv
}

// connect opens a client connection; each one makes its own TLS handshake.
func connect(t *testing.T, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// check calls Health.Check on conn and returns the serial of the server's
// certificate.
func check(t *testing.T, conn *grpc.ClientConn) (*big.Int, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var p peer.Peer
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
		return nil, err
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		t.Fatalf("peer auth info is %T, not TLS", p.AuthInfo)
	}
	return info.State.PeerCertificates[0].SerialNumber, nil
}

// call connects with a fresh client config and checks; it returns the
// server's serial.
func call(t *testing.T, addr string, cfg ClientConfig) (*big.Int, error) {
	t.Helper()
	c, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return check(t, connect(t, addr, credentials.NewTLS(c)))
}

func mustServe(t *testing.T, addr string, cfg ClientConfig, want *big.Int) {
	t.Helper()
	got, err := call(t, addr, cfg)
	if err != nil {
		t.Fatalf("call: %v", err)
	}
	if got.Cmp(want) != 0 {
		t.Fatalf("server presented serial %x, want %x", got, want)
	}
}

// mustFail checks that the call fails at the transport (TLS), not later.
func mustFail(t *testing.T, what string, addr string, cfg ClientConfig) {
	t.Helper()
	_, err := call(t, addr, cfg)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("%s: got %v, want a failed handshake (Unavailable)", what, err)
	}
	t.Logf("%s: refused as expected: %v", what, err)
}

func TestServerTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca, other := tlstest.NewCA(t, "test CA"), tlstest.NewCA(t, "other CA")
	srvLeaf := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	sf := tlstest.WriteLeaf(t, dir, "server", srvLeaf)
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, cfg)
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	otherFile := tlstest.WriteCA(t, dir, "other.pem", other)
	bundle := tlstest.WriteCA(t, dir, "bundle.pem", other, ca)

	mustServe(t, srv.addr, ClientConfig{CAFile: caFile}, srvLeaf.Serial)
	mustServe(t, srv.addr, ClientConfig{CAFile: bundle}, srvLeaf.Serial)
	mustServe(t, srv.addr, ClientConfig{CAFile: caFile, ServerName: "localhost"}, srvLeaf.Serial)
	if len(srv.clientSerials) != 0 {
		t.Error("a client certificate was sent without mutual TLS")
	}
	mustFail(t, "CA not trusted", srv.addr, ClientConfig{CAFile: otherFile})
	mustFail(t, "system roots", srv.addr, ClientConfig{})
	mustFail(t, "wrong server name", srv.addr, ClientConfig{CAFile: caFile, ServerName: "outboxd.example"})
	if _, err := check(t, connect(t, srv.addr, insecure.NewCredentials())); status.Code(err) != codes.Unavailable {
		t.Fatalf("plaintext client: %v", err)
	}
}

func TestMutualTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca, other := tlstest.NewCA(t, "test CA"), tlstest.NewCA(t, "other CA")
	srvLeaf := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	sf := tlstest.WriteLeaf(t, dir, "server", srvLeaf)
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key, ClientCAFile: caFile})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, cfg)

	good := ca.Issue(t, "relay-1", x509.ExtKeyUsageClientAuth)
	gf := tlstest.WriteLeaf(t, dir, "good", good)
	mustServe(t, srv.addr, ClientConfig{CAFile: caFile, CertFile: gf.Cert, KeyFile: gf.Key}, srvLeaf.Serial)
	if got := <-srv.clientSerials; got.Cmp(good.Serial) != 0 {
		t.Fatalf("server saw client serial %x, want %x", got, good.Serial)
	}

	mustFail(t, "no client certificate", srv.addr, ClientConfig{CAFile: caFile})
	of := tlstest.WriteLeaf(t, dir, "foreign", other.Issue(t, "relay-1", x509.ExtKeyUsageClientAuth))
	mustFail(t, "client certificate from another CA", srv.addr, ClientConfig{CAFile: caFile, CertFile: of.Cert, KeyFile: of.Key})
	wf := tlstest.WriteLeaf(t, dir, "wrong-usage", ca.Issue(t, "relay-1", x509.ExtKeyUsageServerAuth))
	mustFail(t, "certificate not for client auth", srv.addr, ClientConfig{CAFile: caFile, CertFile: wf.Cert, KeyFile: wf.Key})
	if n := len(srv.clientSerials); n != 0 {
		t.Fatalf("%d refused clients reached a handler", n)
	}
}

// The server certificate is renewed under a running server; new connections
// get the new one, established connections keep working.
func TestServerCertificateRotation(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "test CA")
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	first := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	sf := tlstest.WriteLeaf(t, dir, "server", first)
	logs := &logRecorder{}
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, cfg)
	client := ClientConfig{CAFile: caFile}
	mustServe(t, srv.addr, client, first.Serial)
	cc, err := NewClient(client)
	if err != nil {
		t.Fatal(err)
	}
	established := connect(t, srv.addr, credentials.NewTLS(cc))
	if got, err := check(t, established); err != nil || got.Cmp(first.Serial) != 0 {
		t.Fatalf("established connection: %v %v", got, err)
	}

	// Renewal: both files replaced.
	second := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	tlstest.WriteLeaf(t, dir, "server", second)
	mustServe(t, srv.addr, client, second.Serial)
	if got, err := check(t, established); err != nil || got.Cmp(first.Serial) != 0 {
		t.Fatalf("established connection after rotation: %v %v", got, err)
	}

	// Half-way through a renewal the certificate does not match the key:
	// the previous pair is kept and the failure logged once.
	third := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	tlstest.Replace(t, sf.Cert, third.CertPEM)
	mustServe(t, srv.addr, client, second.Serial)
	mustServe(t, srv.addr, client, second.Serial)
	if n := logs.count("reload failed"); n != 1 {
		t.Fatalf("reload failure logged %d times, want 1:\n%s", n, logs)
	}
	tlstest.Replace(t, sf.Key, third.KeyPEM)
	mustServe(t, srv.addr, client, third.Serial)

	// Garbage and a missing file are survived too.
	tlstest.Replace(t, sf.Cert, []byte("not a certificate"))
	mustServe(t, srv.addr, client, third.Serial)
	if err := os.Remove(sf.Cert); err != nil {
		t.Fatal(err)
	}
	mustServe(t, srv.addr, client, third.Serial)
	mustServe(t, srv.addr, client, third.Serial)
	if n := logs.count("cannot read server certificate files"); n != 1 {
		t.Fatalf("missing file logged %d times, want 1:\n%s", n, logs)
	}
	fourth := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	tlstest.WriteLeaf(t, dir, "server", fourth)
	mustServe(t, srv.addr, client, fourth.Serial)
	if n := logs.count("certificate reloaded"); n != 3 {
		t.Fatalf("%d reloads logged, want 3:\n%s", n, logs)
	}
}

// Replacing the client CA bundle changes which clients are accepted.
func TestClientCARotation(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	oldCA, nextCA := tlstest.NewCA(t, "old client CA"), tlstest.NewCA(t, "new client CA")
	srvCA := tlstest.NewCA(t, "server CA")
	srvLeaf := srvCA.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	sf := tlstest.WriteLeaf(t, dir, "server", srvLeaf)
	clientCAFile := tlstest.WriteCA(t, dir, "clients.pem", oldCA)
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key, ClientCAFile: clientCAFile})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, cfg)
	srvCAFile := tlstest.WriteCA(t, dir, "server-ca.pem", srvCA)
	of := tlstest.WriteLeaf(t, dir, "old", oldCA.Issue(t, "relay", x509.ExtKeyUsageClientAuth))
	nf := tlstest.WriteLeaf(t, dir, "new", nextCA.Issue(t, "relay", x509.ExtKeyUsageClientAuth))
	oldClient := ClientConfig{CAFile: srvCAFile, CertFile: of.Cert, KeyFile: of.Key}
	newClient := ClientConfig{CAFile: srvCAFile, CertFile: nf.Cert, KeyFile: nf.Key}

	mustServe(t, srv.addr, oldClient, srvLeaf.Serial)
	mustFail(t, "new client before the CA change", srv.addr, newClient)
	tlstest.WriteCA(t, dir, "clients.pem", nextCA)
	mustServe(t, srv.addr, newClient, srvLeaf.Serial)
	mustFail(t, "old client after the CA change", srv.addr, oldClient)
}

// A relay's client certificate is renewed; its next connection uses it.
func TestClientCertificateRotation(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "test CA")
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	srvLeaf := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	sf := tlstest.WriteLeaf(t, dir, "server", srvLeaf)
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key, ClientCAFile: caFile})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, cfg)

	first := ca.Issue(t, "relay-1", x509.ExtKeyUsageClientAuth)
	cf := tlstest.WriteLeaf(t, dir, "client", first)
	cc, err := NewClient(ClientConfig{CAFile: caFile, CertFile: cf.Cert, KeyFile: cf.Key})
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(cc) // one config for the client's lifetime
	if _, err := check(t, connect(t, srv.addr, creds)); err != nil {
		t.Fatal(err)
	}
	if got := <-srv.clientSerials; got.Cmp(first.Serial) != 0 {
		t.Fatalf("server saw %x, want %x", got, first.Serial)
	}
	second := ca.Issue(t, "relay-1", x509.ExtKeyUsageClientAuth)
	tlstest.WriteLeaf(t, dir, "client", second)
	if _, err := check(t, connect(t, srv.addr, creds)); err != nil {
		t.Fatal(err)
	}
	if got := <-srv.clientSerials; got.Cmp(second.Serial) != 0 {
		t.Fatalf("after rotation the server saw %x, want %x", got, second.Serial)
	}
}

func TestConfigErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "test CA")
	a := tlstest.WriteLeaf(t, dir, "a", ca.Issue(t, "a", x509.ExtKeyUsageServerAuth))
	b := tlstest.WriteLeaf(t, dir, "b", ca.Issue(t, "b", x509.ExtKeyUsageServerAuth))
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	empty := filepath.Join(dir, "empty.pem")
	tlstest.Replace(t, empty, []byte("# no certificates here\n"))
	missing := filepath.Join(dir, "missing.pem")

	for _, tc := range []struct {
		name string
		err  func() error
		want string
	}{
		{"server without key", func() error { _, err := NewServer(ServerConfig{CertFile: a.Cert}); return err }, "needs both"},
		{"server cert missing", func() error { _, err := NewServer(ServerConfig{CertFile: missing, KeyFile: a.Key}); return err }, missing},
		{"server key mismatch", func() error { _, err := NewServer(ServerConfig{CertFile: a.Cert, KeyFile: b.Key}); return err }, "server certificate " + a.Cert + " with key " + b.Key},
		{"server client CA empty", func() error {
			_, err := NewServer(ServerConfig{CertFile: a.Cert, KeyFile: a.Key, ClientCAFile: empty})
			return err
		}, "CA file " + empty + " holds no PEM certificate"},
		{"server client CA missing", func() error {
			_, err := NewServer(ServerConfig{CertFile: a.Cert, KeyFile: a.Key, ClientCAFile: missing})
			return err
		}, missing},
		{"client cert without key", func() error { _, err := NewClient(ClientConfig{CertFile: a.Cert}); return err }, "needs both"},
		{"client key without cert", func() error { _, err := NewClient(ClientConfig{KeyFile: a.Key}); return err }, "needs both"},
		{"client CA empty", func() error { _, err := NewClient(ClientConfig{CAFile: empty}); return err }, empty},
		{"client key mismatch", func() error {
			_, err := NewClient(ClientConfig{CAFile: caFile, CertFile: a.Cert, KeyFile: b.Key})
			return err
		}, "client certificate " + a.Cert},
	} {
		err := tc.err()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// ServerCredentials logs each refused handshake with its reason, and a
// peer that closes without a byte (a TCP probe) only at debug level.
func TestServerCredentialsLogRefusedHandshakes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "test CA")
	sf := tlstest.WriteLeaf(t, dir, "server", ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth))
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key})
	if err != nil {
		t.Fatal(err)
	}
	logs := &logRecorder{}
	creds := ServerCredentials(cfg, slog.New(logs))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	// handshake lets the client do its part, then runs one server
	// handshake to its end, so the log is complete when it returns.
	handshake := func(client func(net.Conn)) {
		t.Helper()
		c, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s, err := lis.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		client(c)
		c.Close()
		if _, _, err := creds.ServerHandshake(s); err == nil {
			t.Fatal("handshake succeeded")
		}
	}
	handshake(func(net.Conn) {})
	if n := logs.count("DEBUG tls: handshake refused"); n != 1 {
		t.Fatalf("a peer that closed at once: %d debug records, want 1\n%s", n, logs)
	}
	handshake(func(c net.Conn) { _, _ = c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")) })
	if n := logs.count("WARN tls: handshake refused"); n != 1 || logs.count("first record does not look like a TLS handshake") != 1 {
		t.Fatalf("a plaintext client: want one warning with the reason\n%s", logs)
	}
}

// issueSized issues server certificates of ca until one's PEM files have
// the sizes want asks for (an ECDSA signature's length varies, so a few
// tries give any common size), so that a test controls what a change to
// the files looks like to a stat.
func issueSized(t *testing.T, ca *tlstest.CA, want func(certLen, keyLen int) bool) tlstest.Leaf {
	t.Helper()
	for range 1000 {
		l := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
		if want(len(l.CertPEM), len(l.KeyPEM)) {
			return l
		}
	}
	t.Fatal("no certificate of the wanted size in 1000 tries")
	return tlstest.Leaf{}
}

// setModTime sets path's modification time, as a file system whose clock
// ticks coarsely (or a tool that preserves times) leaves it.
func setModTime(t *testing.T, path string, mtime time.Time) {
	t.Helper()
	if err := os.Chtimes(path, mtime, mtime); err != nil {
		t.Fatal(err)
	}
}

// A renewal is noticed whichever one of file identity, size and
// modification time is all that changes: a rename over the files within one
// mtime tick (same size, same time), a rewrite in place of the same size,
// and a rewrite in place of another size within one mtime tick.
func TestServerReloadsAChangeSeenOnlyInIdentitySizeOrTime(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "test CA")
	client := ClientConfig{CAFile: tlstest.WriteCA(t, dir, "ca.pem", ca)}
	first := ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth)
	sf := tlstest.WriteLeaf(t, dir, "server", first)
	cfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveTLS(t, cfg)
	mustServe(t, srv.addr, client, first.Serial)
	sameSize := func(c, k int) bool { return c == len(first.CertPEM) && k == len(first.KeyPEM) }
	mtime := func(path string) time.Time {
		t.Helper()
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return fi.ModTime()
	}

	// Renamed over, same size and time: only the files' identity changed.
	renamed := issueSized(t, ca, sameSize)
	for path, content := range map[string][]byte{sf.Cert: renamed.CertPEM, sf.Key: renamed.KeyPEM} {
		was := mtime(path)
		tmp := path + ".new"
		if err := os.WriteFile(tmp, content, 0o600); err != nil {
			t.Fatal(err)
		}
		setModTime(t, tmp, was)
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	mustServe(t, srv.addr, client, renamed.Serial)

	// Rewritten in place, same size: only the time changed.
	inPlace := issueSized(t, ca, sameSize)
	for path, content := range map[string][]byte{sf.Cert: inPlace.CertPEM, sf.Key: inPlace.KeyPEM} {
		was := mtime(path)
		if err := os.WriteFile(path, content, 0o600); err != nil {
			t.Fatal(err)
		}
		setModTime(t, path, was.Add(time.Second))
	}
	mustServe(t, srv.addr, client, inPlace.Serial)

	// Rewritten in place within the same tick: only the size changed.
	resized := issueSized(t, ca, func(c, _ int) bool { return c != len(first.CertPEM) })
	for path, content := range map[string][]byte{sf.Cert: resized.CertPEM, sf.Key: resized.KeyPEM} {
		was := mtime(path)
		if err := os.WriteFile(path, content, 0o600); err != nil {
			t.Fatal(err)
		}
		setModTime(t, path, was)
	}
	mustServe(t, srv.addr, client, resized.Serial)
}

// handshake runs a TLS handshake between client and server over a pipe and
// returns the client's error and the version agreed when it succeeded.
func handshake(t *testing.T, client, server *tls.Config) (uint16, error) {
	t.Helper()
	c, s := net.Pipe()
	defer c.Close()
	defer s.Close()
	srv := tls.Server(s, server)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.HandshakeContext(t.Context())
		s.Close() // a refused client is not left waiting for a reply
	}()
	cli := tls.Client(c, client)
	err := cli.HandshakeContext(t.Context())
	c.Close()
	<-served
	return cli.ConnectionState().Version, err
}

// Neither side speaks a TLS version older than 1.2: a server refuses a
// client that offers at most TLS 1.1, and a client refuses a server that
// answers with it. (Go's own defaults say the same today; the configs
// say it whatever the defaults become.) The same pairs at TLS 1.2 agree,
// so the refusals are the version's, not a cipher's or a certificate's.
func TestNoTLSVersionBelow12(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "test CA")
	sf := tlstest.WriteLeaf(t, dir, "server", ca.Issue(t, "outboxd", x509.ExtKeyUsageServerAuth))
	caFile := tlstest.WriteCA(t, dir, "ca.pem", ca)
	cert, err := tls.LoadX509KeyPair(sf.Cert, sf.Key)
	if err != nil {
		t.Fatal(err)
	}
	serverCfg, err := NewServer(ServerConfig{CertFile: sf.Cert, KeyFile: sf.Key})
	if err != nil {
		t.Fatal(err)
	}
	clientCfg, err := NewClient(ClientConfig{CAFile: caFile, ServerName: "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	oldClient := func(maxVersion uint16) *tls.Config {
		return &tls.Config{MinVersion: tls.VersionTLS10, MaxVersion: maxVersion, InsecureSkipVerify: true, NextProtos: []string{"h2"}}
	}
	oldServer := func(maxVersion uint16) *tls.Config {
		return &tls.Config{MinVersion: tls.VersionTLS10, MaxVersion: maxVersion, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}
	}
	if v, err := handshake(t, oldClient(tls.VersionTLS12), serverCfg); err != nil || v != tls.VersionTLS12 {
		t.Fatalf("server, client at most TLS 1.2: version %x, %v; want TLS 1.2", v, err)
	}
	if _, err := handshake(t, oldClient(tls.VersionTLS11), serverCfg); err == nil || !strings.Contains(err.Error(), "protocol version") {
		t.Fatalf("server, client at most TLS 1.1: %v; want a protocol version refusal", err)
	}
	if v, err := handshake(t, clientCfg, oldServer(tls.VersionTLS12)); err != nil || v != tls.VersionTLS12 {
		t.Fatalf("client, server at most TLS 1.2: version %x, %v; want TLS 1.2", v, err)
	}
	if _, err := handshake(t, clientCfg, oldServer(tls.VersionTLS11)); err == nil || !strings.Contains(err.Error(), "protocol version") {
		t.Fatalf("client, server at most TLS 1.1: %v; want a protocol version refusal", err)
	}
}
