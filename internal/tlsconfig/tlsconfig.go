// Package tlsconfig builds the TLS configurations of outboxd's gRPC server
// and clients from PEM files, and picks up renewed certificates without a
// restart.
//
// # Reloading
//
// Certificates are short-lived and renewed by tools (cert-manager, certbot,
// Vault agents) that replace the files. Instead of watching them, every TLS
// handshake stats the files (a few microseconds, negligible next to the
// handshake itself) and reloads them when the modification time, size or
// file identity changed. A change is therefore in force from the very next
// connection, with no goroutine, no signal and no window in which a watcher
// has not fired yet. Connections already established keep the certificate
// they were made with.
//
// A reload that fails (a half-written file, a key that does not match the
// certificate yet) keeps the previous certificate and logs the error once;
// the next change to the files is tried again. Only New* fails on bad files.
//
// Server: the certificate and key, and with ClientCAFile the CA bundle
// client certificates must chain to (mutual TLS), are reloaded. Client: the
// client certificate and key are reloaded; the CA bundle that verifies the
// server is read once, at NewClient (rotating that CA means restarting the
// client, as for any trust-root change).
package tlsconfig

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// ServerConfig names the files of a server's TLS configuration.
type ServerConfig struct {
	// CertFile and KeyFile hold the server's PEM certificate chain (leaf
	// first) and private key. Required.
	CertFile, KeyFile string
	// ClientCAFile, when set, holds PEM CA certificates; clients must then
	// present a certificate that chains to one of them (mutual TLS), or the
	// handshake fails.
	ClientCAFile string
	// Logger receives reloads and reload failures. Nil discards.
	Logger *slog.Logger
}

// NewServer returns a TLS configuration for a gRPC server
// (credentials.NewTLS), serving the current files on each handshake. It
// fails if the files cannot be loaded now.
func NewServer(cfg ServerConfig) (*tls.Config, error) {
	if cfg.CertFile == "" || cfg.KeyFile == "" {
		return nil, errors.New("tlsconfig: server needs both a certificate file and a key file")
	}
	src := &source{
		what: "server", isServer: true, certFile: cfg.CertFile, keyFile: cfg.KeyFile, caFile: cfg.ClientCAFile,
		log: logger(cfg.Logger),
	}
	if err := src.init(); err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2"},
		// A per-handshake config rather than GetCertificate, so that the
		// client CA pool is swapped together with the certificate.
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return src.current().server, nil
		},
	}, nil
}

// ClientConfig names the files of a client's TLS configuration.
type ClientConfig struct {
	// CAFile holds the PEM CA certificates that verify the server. Empty
	// means the system's roots.
	CAFile string
	// CertFile and KeyFile hold a client certificate and key for mutual
	// TLS: both or neither.
	CertFile, KeyFile string
	// ServerName, when set, is the name the server's certificate must carry,
	// instead of the host of the address dialled (for connecting by IP or
	// through a proxy).
	ServerName string
	// Logger receives reloads of the client certificate and their failures.
	// Nil discards.
	Logger *slog.Logger
}

// NewClient returns a TLS configuration for a gRPC client
// (credentials.NewTLS). It fails if the files cannot be loaded now.
func NewClient(cfg ClientConfig) (*tls.Config, error) {
	if (cfg.CertFile == "") != (cfg.KeyFile == "") {
		return nil, errors.New("tlsconfig: a client certificate needs both a certificate file and a key file")
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cfg.ServerName, NextProtos: []string{"h2"}}
	if cfg.CAFile != "" {
		pool, err := loadPool(cfg.CAFile)
		if err != nil {
			return nil, err
		}
		c.RootCAs = pool
	}
	if cfg.CertFile != "" {
		src := &source{what: "client", certFile: cfg.CertFile, keyFile: cfg.KeyFile, log: logger(cfg.Logger)}
		if err := src.init(); err != nil {
			return nil, err
		}
		c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return src.current().cert, nil
		}
	}
	return c, nil
}

func logger(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}

// source holds the current certificate (and CA pool) loaded from files.
type source struct {
	what                      string // "server" or "client", for logs
	isServer                  bool
	certFile, keyFile, caFile string
	log                       *slog.Logger

	cur atomic.Pointer[material]

	mu         sync.Mutex // serialises reloads
	failedAt   []os.FileInfo
	lastStatEr string // last stat error logged, to log each once
}

// material is one loaded generation; immutable.
type material struct {
	stamp  []os.FileInfo // of the files it was loaded from
	cert   *tls.Certificate
	server *tls.Config // server side only
}

func (s *source) files() []string {
	if s.caFile != "" {
		return []string{s.certFile, s.keyFile, s.caFile}
	}
	return []string{s.certFile, s.keyFile}
}

func (s *source) stat() ([]os.FileInfo, error) {
	fs := s.files()
	infos := make([]os.FileInfo, len(fs))
	for i, f := range fs {
		fi, err := os.Stat(f)
		if err != nil {
			return nil, err
		}
		infos[i] = fi
	}
	return infos, nil
}

// sameStamp reports whether the files look unchanged: same file (device and
// inode on Unix, so a rename over it counts as a change even within one
// mtime tick), same size and modification time.
func sameStamp(a, b []os.FileInfo) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !os.SameFile(a[i], b[i]) || a[i].Size() != b[i].Size() || !a[i].ModTime().Equal(b[i].ModTime()) {
			return false
		}
	}
	return true
}

func (s *source) init() error {
	stamp, err := s.stat()
	if err != nil {
		return fmt.Errorf("tlsconfig: %w", err)
	}
	m, err := s.load(stamp)
	if err != nil {
		return err
	}
	s.cur.Store(m)
	s.logLoaded("tls: certificate loaded", m)
	return nil
}

// current returns the material to use for a handshake, reloading first if
// the files changed since it was loaded.
func (s *source) current() *material {
	m := s.cur.Load()
	stamp, err := s.stat()
	if err == nil && sameStamp(stamp, m.stamp) {
		return m
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		// Mid-replacement, or deleted: keep serving what we have.
		if msg := err.Error(); msg != s.lastStatEr {
			s.lastStatEr = msg
			s.log.Error("tls: cannot read "+s.what+" certificate files; keeping the previous certificate", "err", err)
		}
		return m
	}
	s.lastStatEr = ""
	if m = s.cur.Load(); sameStamp(stamp, m.stamp) || sameStamp(stamp, s.failedAt) {
		return m // another handshake reloaded it, or these files already failed
	}
	next, err := s.load(stamp)
	if err != nil {
		s.failedAt = stamp
		s.log.Error("tls: reload failed; keeping the previous "+s.what+" certificate", "err", err)
		return m
	}
	s.failedAt = nil
	s.cur.Store(next)
	s.logLoaded("tls: certificate reloaded", next)
	return next
}

// load reads the files as they are now. stamp was taken before reading, so
// the content is at least as new as the stamp; a write racing the read
// changes the stamp again and causes another reload.
func (s *source) load(stamp []os.FileInfo) (*material, error) {
	cert, err := tls.LoadX509KeyPair(s.certFile, s.keyFile)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: %s certificate %s with key %s: %w", s.what, s.certFile, s.keyFile, err)
	}
	m := &material{stamp: stamp, cert: &cert}
	if s.isServer {
		m.server = &tls.Config{
			MinVersion:   tls.VersionTLS12,
			NextProtos:   []string{"h2"},
			Certificates: []tls.Certificate{cert},
		}
		if s.caFile != "" {
			pool, err := loadPool(s.caFile)
			if err != nil {
				return nil, err
			}
			m.server.ClientCAs = pool
			m.server.ClientAuth = tls.RequireAndVerifyClientCert
		}
	}
	return m, nil
}

func (s *source) logLoaded(msg string, m *material) {
	leaf := m.cert.Leaf
	if leaf == nil {
		return
	}
	attrs := []any{"side", s.what, "file", s.certFile, "subject", leaf.Subject.String(),
		"serial", leaf.SerialNumber.Text(16), "not_after", leaf.NotAfter}
	if s.caFile != "" {
		attrs = append(attrs, "client_ca_file", s.caFile)
	}
	s.log.Info(msg, attrs...)
	if now := time.Now(); now.After(leaf.NotAfter) || now.Before(leaf.NotBefore) {
		s.log.Warn("tls: "+s.what+" certificate is not valid now; peers will refuse it",
			"file", s.certFile, "not_before", leaf.NotBefore, "not_after", leaf.NotAfter)
	}
}

// loadPool reads a PEM bundle of CA certificates; a file holding none is an
// error, not an empty pool that would silently trust nothing.
func loadPool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("tlsconfig: CA file %s holds no PEM certificate", path)
	}
	return pool, nil
}
