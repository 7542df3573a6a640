package tlsconfig

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"

	"google.golang.org/grpc/credentials"
)

// ServerCredentials returns the gRPC transport credentials of a server TLS
// configuration (NewServer) that log every handshake the server refuses,
// with the peer and the reason: a client certificate missing or of another
// CA, a plaintext client, an expired certificate.
//
// The log is where an operator learns why a relay was turned away: with TLS
// 1.3 the client finishes its half of the handshake before the server has
// checked its certificate, so the client often sees only a reset or a
// closed pipe when it next writes, never the server's alert. A peer that
// connects and closes without a byte (a TCP health probe, a port scan) is
// logged at debug level only.
func ServerCredentials(c *tls.Config, log *slog.Logger) credentials.TransportCredentials {
	return &refusalLogger{TransportCredentials: credentials.NewTLS(c), log: logger(log)}
}

type refusalLogger struct {
	credentials.TransportCredentials
	log *slog.Logger
}

func (r *refusalLogger) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	out, info, err := r.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		level := slog.LevelWarn
		if errors.Is(err, io.EOF) {
			level = slog.LevelDebug
		}
		// No request context exists yet during the handshake.
		r.log.Log(context.Background(), level, "tls: handshake refused", "peer", conn.RemoteAddr().String(), "err", err)
	}
	return out, info, err
}

func (r *refusalLogger) Clone() credentials.TransportCredentials {
	return &refusalLogger{TransportCredentials: r.TransportCredentials.Clone(), log: r.log}
}
