package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/relay"
)

// serverStartTimeout bounds how long a server may take to answer its health
// check after it starts.
const serverStartTimeout = 20 * time.Second

// serverHandle is a running outboxd server on a loopback port.
type serverHandle interface {
	processStats
	// addrs are the server's gRPC addresses: one, or each replica's in the
	// replicas workload.
	addrs() []string
	// peakRSS is the server process's peak resident set; false when the
	// server shares this process.
	peakRSS() (int64, bool)
	// died returns an error when the server ended without being asked to.
	died() error
	// stop shuts the server down gracefully: no new claims, outstanding acks
	// land, leases are released, streams close.
	stop(ctx context.Context) error
}

// childServer is `outboxd serve` in a child process: the shipped binary with
// its default settings, whose CPU time and memory are its own.
type childServer struct {
	cmd     *exec.Cmd
	address string
	stderr  *tailWriter

	done    chan struct{}
	waitErr error
	mu      sync.Mutex
	stopped bool
}

// startChildServer runs `binary serve` on a free loopback port against
// dbURL and waits until it reports SERVING. The server's warnings go to
// logw.
func startChildServer(ctx context.Context, binary string, flags []string, dbURL string, logw io.Writer) (*childServer, error) {
	var lastErr error
	// The port is found free, then handed to the child: another process may
	// take it in between, so try a few.
	for range 3 {
		addr, err := freeLoopbackAddr()
		if err != nil {
			return nil, err
		}
		s, err := launchChildServer(ctx, binary, flags, addr, dbURL, logw)
		if err == nil {
			return s, nil
		}
		lastErr = err
		if !strings.Contains(err.Error(), "address already in use") {
			break
		}
	}
	return nil, lastErr
}

func launchChildServer(ctx context.Context, binary string, flags []string, addr, dbURL string, logw io.Writer) (*childServer, error) {
	s := &childServer{address: addr, stderr: newTailWriter(logw, "outboxd serve: "), done: make(chan struct{})}
	s.cmd = exec.Command(binary, append(serveArgs(binary, addr, dbURL), flags...)...)
	if dbURL == "" {
		// Only the --source flags name databases: no default source, not
		// even one $DATABASE_URL would name.
		s.cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, devdb.EnvVar+"=") })
	}
	s.cmd.Stdout = io.Discard
	s.cmd.Stderr = s.stderr
	setDeathSignal(s.cmd)
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start %s serve: %w", binary, err)
	}
	go func() {
		s.waitErr = s.cmd.Wait()
		close(s.done)
	}()
	if err := waitServing(ctx, addr, s.done); err != nil {
		_ = s.stop(ctx)
		return nil, fmt.Errorf("bench: outboxd serve did not start: %w%s", err, s.stderr.tail())
	}
	return s, nil
}

var (
	serveHelpMu sync.Mutex
	serveHelp   = map[string][]byte{}
)

// serveArgs are the arguments of the child's serve command. Flags that not
// every version of serve has are passed only when its --help lists them.
// Without dbURL the server has no default source: its databases are the
// --source flags among the extra flags.
func serveArgs(binary, addr, dbURL string) []string {
	serveHelpMu.Lock()
	help, ok := serveHelp[binary]
	if !ok {
		help, _ = exec.Command(binary, "serve", "--help").Output()
		serveHelp[binary] = help
	}
	serveHelpMu.Unlock()
	args := []string{"serve", "--listen", addr, "--log-level", "warn"}
	if dbURL != "" {
		args = append(args, "--database-url", dbURL)
	}
	if bytes.Contains(help, []byte("--http-listen")) {
		// The benchmark reads no metrics, and the endpoint's fixed default
		// port may belong to a dev server.
		args = append(args, "--http-listen=")
	}
	return args
}

func (s *childServer) addr() string    { return s.address }
func (s *childServer) addrs() []string { return []string{s.address} }
func (s *childServer) pid() int        { return s.cmd.Process.Pid }
func (s *childServer) pids() []int     { return []int{s.pid()} }

func (s *childServer) peakRSS() (int64, bool) { return peakRSS(s.pid()) }

func (s *childServer) died() error {
	select {
	case <-s.done:
		s.mu.Lock()
		defer s.mu.Unlock()
		if !s.stopped {
			return fmt.Errorf("bench: outboxd serve exited during the run (%v)%s", s.waitErr, s.stderr.tail())
		}
	default:
	}
	return nil
}

// stop sends SIGTERM, which serve answers with its graceful shutdown, and
// kills the process if that takes too long.
func (s *childServer) stop(context.Context) error {
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
	select {
	case <-s.done:
		return nil
	default:
	}
	if err := s.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		_ = s.cmd.Process.Kill()
	}
	select {
	case <-s.done:
		return nil
	case <-time.After(30 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
		return errors.New("bench: outboxd serve did not stop within 30s of SIGTERM; killed")
	}
}

// BuildServer builds the outboxd binary (cmd/outboxd of the main module
// this module requires, the working tree next to it under the replace in
// go.mod) into dir and returns its path. It needs the go command.
func BuildServer(ctx context.Context, dir string) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/outboxd/outboxd").Output()
	if err != nil {
		return "", fmt.Errorf("bench: find the main module's source with go list: %w", err)
	}
	src := strings.TrimSpace(string(out))
	bin := filepath.Join(dir, "outboxd")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/outboxd")
	build.Dir = src
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return "", fmt.Errorf("bench: go build ./cmd/outboxd in %s: %w", src, err)
	}
	return bin, nil
}

// waitServing polls the gRPC health service at addr until it says SERVING,
// the process behind it exits (exited closes), or serverStartTimeout passes.
func waitServing(ctx context.Context, addr string, exited <-chan struct{}) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(serverStartTimeout)
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		res, err := health.Check(cctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && res.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no SERVING answer from %s within %v (last: %v)", addr, serverStartTimeout, err)
		}
		select {
		case <-exited:
			return errors.New("the process exited")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func freeLoopbackAddr() (string, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("bench: find a free port: %w", err)
	}
	defer lis.Close()
	return lis.Addr().String(), nil
}

// relayFleet is K relay runners, each on its own gRPC connection (its own
// TCP connection over loopback), publishing to the same sink.
type relayFleet struct {
	conns  []*grpc.ClientConn
	runCtx context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	errs   []error
}

// startRelays starts k runners spread evenly over addrs, as a load
// balancer in front of several replicas would spread them.
func startRelays(ctx context.Context, addrs []string, k, maxInFlight, window int, pub relay.Publisher, log *slog.Logger) (*relayFleet, error) {
	f := newRelayFleet(ctx)
	for i, n := range spread(k, len(addrs)) {
		if err := f.add(addrs[i], n, maxInFlight, window, nil, fmt.Sprintf("bench-relay-r%d", i+1), pub, log); err != nil {
			_ = f.stop()
			return nil, err
		}
	}
	return f, nil
}

// spread is k split over n places as evenly as it goes: k/n each, the
// first k mod n one more.
func spread(k, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = k / n
		if i < k%n {
			out[i]++
		}
	}
	return out
}

func newRelayFleet(ctx context.Context) *relayFleet {
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	return &relayFleet{runCtx: runCtx, cancel: cancel}
}

// add starts k more runners subscribed to streams (nil: every stream of
// the default source), named idPrefix-0, idPrefix-1, ...
func (f *relayFleet) add(addr string, k, maxInFlight, window int, streams []string, idPrefix string, pub relay.Publisher, log *slog.Logger) error {
	for i := range k {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return fmt.Errorf("bench: relay %s-%d: %w", idPrefix, i, err)
		}
		f.conns = append(f.conns, conn)
		r, err := relay.NewRunner(relay.Config{
			Conn: conn, Publisher: pub, RelayID: fmt.Sprintf("%s-%d", idPrefix, i), Streams: streams,
			MaxInFlight: maxInFlight, MaxInFlightPerAggregate: window, Logger: log,
		})
		if err != nil {
			return err
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			if err := r.Run(f.runCtx); err != nil {
				f.mu.Lock()
				f.errs = append(f.errs, err)
				f.mu.Unlock()
			}
		}()
	}
	return nil
}

// stop ends every runner (each finishes and acks the publishes it has under
// way) and closes the connections.
func (f *relayFleet) stop() error {
	f.cancel()
	f.wg.Wait()
	for _, c := range f.conns {
		c.Close()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return errors.Join(f.errs...)
}

// tailWriter forwards a child's log lines, prefixed, and keeps the last few
// for an error message.
type tailWriter struct {
	mu     sync.Mutex
	out    io.Writer
	prefix string
	buf    []byte
	lines  []string
}

const tailLines = 20

func newTailWriter(out io.Writer, prefix string) *tailWriter {
	return &tailWriter{out: out, prefix: prefix}
}

func (w *tailWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := strings.IndexByte(string(w.buf), '\n')
		if i < 0 {
			break
		}
		line := string(w.buf[:i])
		w.buf = w.buf[i+1:]
		if w.out != nil {
			fmt.Fprintln(w.out, w.prefix+line)
		}
		w.lines = append(w.lines, line)
		if len(w.lines) > tailLines {
			w.lines = w.lines[1:]
		}
	}
	return len(p), nil
}

// tail returns the last lines written, as a suffix for an error message.
func (w *tailWriter) tail() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	lines := w.lines
	if len(w.buf) > 0 {
		lines = append(lines, string(w.buf))
	}
	if len(lines) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("; its last output:")
	sc := bufio.NewScanner(strings.NewReader(strings.Join(lines, "\n")))
	for sc.Scan() {
		b.WriteString("\n    " + sc.Text())
	}
	return b.String()
}
