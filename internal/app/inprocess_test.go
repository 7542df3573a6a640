package app_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"math/big"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// selfSigned returns a certificate for 127.0.0.1, valid for an hour.
func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Minute),
		NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// With TLS on the listener, the in-process connection (the console's)
// still works without a handshake, since it holds no client certificate
// and nothing leaves the process, while a plaintext client over the
// network is still refused. (Kills the mutants that make in-process
// connections go through the TLS handshake, by dropping inProcessCreds or
// its check of the connection.)
func TestInProcessConnectionSkipsTLSAndNetworkDoesNot(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	rep, err := app.New(t.Context(), app.Config{
		Server: server.Config{Store: store.New(testdb.NewPoolURL(t, url)), DatabaseURL: url, Logger: servertest.Logger(t)},
		Creds:  credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{selfSigned(t)}, MinVersion: tls.VersionTLS12}),
	})
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := serveLoopback(t, t.Context(), rep)

	conn, err := rep.DialInProcess()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	callCtx, callCancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer callCancel()
	if _, err := outboxv1.NewAdminServiceClient(conn).GetLag(callCtx, &outboxv1.GetLagRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Errorf("GetLag in process with TLS on the listener: %v", err)
	}

	plain := dialPlain(t, addr)
	if _, err := outboxv1.NewAdminServiceClient(plain).GetLag(t.Context(), &outboxv1.GetLagRequest{}); err == nil {
		t.Error("a plaintext client over the network was served by a TLS listener")
	}
}
