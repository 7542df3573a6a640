package app

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
)

// inProcessBuffer is the in-memory pipe's buffer per direction.
const inProcessBuffer = 1 << 20

// DialInProcess returns a client connection to this replica's own gRPC
// server over an in-memory pipe: every call runs the production interceptor
// chain (metrics, logging, authentication, recovery) exactly as a call over
// the network does, so a caller inside the process, like the console, gets
// the same authorization as a remote one. The caller sends its bearer token
// per call and closes the connection when done. The pipe is served from
// Serve on; calls made before then wait for it.
func (r *Replica) DialInProcess(opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	dial := func(ctx context.Context, _ string) (net.Conn, error) { return r.inproc.DialContext(ctx) }
	return grpc.NewClient("passthrough:///outboxd-in-process", append([]grpc.DialOption{
		grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, opts...)...)
}

// inProcessListener marks the connections it accepts, so that the transport
// credentials know to skip the TLS handshake for them: nothing leaves the
// process, and the console holds no client certificate for mutual TLS.
type inProcessListener struct{ *bufconn.Listener }

func (l inProcessListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return inProcessConn{c}, nil
}

type inProcessConn struct{ net.Conn }

// inProcessAuthInfo is the AuthInfo of an in-process connection.
type inProcessAuthInfo struct{ credentials.CommonAuthInfo }

func (inProcessAuthInfo) AuthType() string { return "in-process" }

// inProcessCreds wraps the listener's transport credentials: connections
// from the in-process pipe skip the handshake, every other connection gets
// the wrapped one.
type inProcessCreds struct {
	credentials.TransportCredentials
}

func (c inProcessCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	if _, ok := conn.(inProcessConn); ok {
		return conn, inProcessAuthInfo{credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity}}, nil
	}
	return c.TransportCredentials.ServerHandshake(conn)
}

func (c inProcessCreds) Clone() credentials.TransportCredentials {
	return inProcessCreds{c.TransportCredentials.Clone()}
}
