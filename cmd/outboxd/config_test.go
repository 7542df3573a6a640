package main_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/testdb"
)

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "outboxd.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// configHTTPGet fetches url, retrying (bounded by ctx) until something answers.
func configHTTPGet(t *testing.T, ctx context.Context, url string) (int, string) {
	t.Helper()
	client := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := client.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			return resp.StatusCode, string(body)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("GET %s: %v (last error %v)", url, ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// One setting from each source, each beaten by the one above it: the
// gRPC address is in the file, the environment and a flag (the flag wins),
// the HTTP address in the file and the environment (the environment wins,
// and so does the database URL over $DATABASE_URL), and --console=false
// only in the file (the file beats the default). The build-info metric is on /metrics.
func TestConfigPrecedence(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	fileGRPC, envGRPC, flagGRPC := freeAddr(t), freeAddr(t), freeAddr(t)
	fileHTTP, envHTTP := freeAddr(t), freeAddr(t)
	cfg := writeConfig(t, "listen: "+fileGRPC+"\nhttp-listen: "+fileHTTP+"\nconsole: false\nlog-format: json\n")
	// The test database's URL holds a password, which the file refuses.
	p := startEnv(t, []string{"OUTBOXD_LISTEN=" + envGRPC, "OUTBOXD_HTTP_LISTEN=" + envHTTP,
		"OUTBOXD_DATABASE_URL=" + testdb.New(t), "DATABASE_URL=postgres://nobody@127.0.0.1:1/none"},
		"serve", "--config", cfg, "--listen", flagGRPC)
	defer p.signal(os.Interrupt)

	// Ready once the first health check has run (bounded by ctx).
	for {
		code, body := configHTTPGet(t, ctx, "http://"+envHTTP+"/readyz")
		if code == http.StatusOK {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("/readyz on the environment's HTTP address: %d %s", code, body)
		case <-time.After(50 * time.Millisecond):
		}
	}
	if c, err := net.DialTimeout("tcp", flagGRPC, 2*time.Second); err != nil {
		t.Errorf("not listening on the flag's gRPC address: %v", err)
	} else {
		c.Close()
	}
	for _, addr := range []string{fileGRPC, envGRPC, fileHTTP} {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			t.Errorf("listening on %s, which a higher-precedence source overrode", addr)
		}
	}
	if code, _ := configHTTPGet(t, ctx, "http://"+envHTTP+"/"); code != http.StatusNotFound {
		t.Errorf("GET / answered %d: the file's console: false did not beat the default (console on)", code)
	}
	if _, body := configHTTPGet(t, ctx, "http://"+envHTTP+"/metrics"); !strings.Contains(body, "outboxd_build_info{") {
		t.Error("/metrics has no outboxd_build_info")
	}
}

// runOutboxd runs the binary to completion and returns its exit code and
// combined output.
func runOutboxd(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if exit, ok := errors.AsType[*exec.ExitError](err); ok {
		return exit.ExitCode(), out.String()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, out.String()
}

// Mistakes in the file stop the process with exit code 2 and say what is
// wrong, before anything starts: an unknown key (a typo must not be
// ignored), a key of the other command, a password in plain text (and the
// message does not repeat it), a value the flag rejects, and --config on a
// command it does not apply to.
func TestConfigRejects(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, cmd, file string
		env             []string
		want            []string
	}{
		{"typo", "serve", "lisen: 127.0.0.1:1\nmax-db-conns: 4\n", nil, []string{"unknown key(s) lisen", "outboxd serve"}},
		{"other command's key", "relay", "sink: stdout://\nlisten: 127.0.0.1:1\n", nil, []string{"unknown key(s) listen", "outboxd relay"}},
		{"database password", "serve", "database-url: postgres://app:hunter2@db/outbox\n", nil, []string{"database-url holds a password", "OUTBOXD_DATABASE_URL"}},
		{"database password as a URL parameter", "serve", "database-url: postgres://app@db/outbox?sslmode=require&password=hunter2\n", nil, []string{"database-url holds a password"}},
		{"database password as a keyword", "serve", "database-url: host=db user=app password=hunter2 dbname=outbox\n", nil, []string{"database-url holds a password"}},
		// libpq's sslpassword= unlocks the client key: a secret like password=.
		{"client key password as a keyword", "serve", "database-url: host=db user=app sslkey=/k sslpassword=hunter2 dbname=outbox\n", nil, []string{"database-url holds a password"}},
		// A NATS URL's user info alone is a token.
		{"NATS token in a route", "relay", "route: [\"orders=nats://hunter2@nats:4222\"]\n", nil, []string{"route holds a password"}},
		{"database password in a source", "serve", "source: [\"orders=postgres://app:hunter2@db/orders\"]\n", nil, []string{"source holds a password", "OUTBOXD_SOURCE"}},
		{"broker password in a route", "relay", "route: [\"orders=amqp://app:hunter2@mq:5672/?exchange=x\"]\n", nil, []string{"route holds a password"}},
		{"bad value", "serve", "lease-ttl: soon\n", nil, []string{"lease-ttl", "soon"}},
		{"bad environment value", "relay", "sink: stdout://\n", []string{"OUTBOXD_MAX_IN_FLIGHT=many"}, []string{`$OUTBOXD_MAX_IN_FLIGHT: "many" is not a valid int`}},
		{"bad number", "serve", "max-db-conns: many\n", nil, []string{`max-db-conns: "many" is not a valid int32`}},
		{"mapping", "serve", "listen:\n  host: x\n", nil, []string{"listen: want a value or a list"}},
		// A key left empty is a mistake, not the string "<nil>".
		{"no value", "serve", "listen:\n", nil, []string{"listen: no value"}},
		// A list for a one-value flag is refused, not its last entry taken.
		{"list for one value", "serve", "listen: [127.0.0.1:1, 127.0.0.1:2]\n", nil, []string{"listen: want one value, not a list of 2"}},
		{"not configurable", "lag", "", nil, []string{"--config applies to serve and relay only"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, out := runOutboxd(t, tc.env, tc.cmd, "--config", writeConfig(t, tc.file))
			if code != 2 {
				t.Errorf("exit code %d, want 2 (usage)\n%s", code, out)
			}
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("output does not say %q:\n%s", w, out)
				}
			}
			if strings.Contains(out, "hunter2") {
				t.Errorf("the error repeats the password:\n%s", out)
			}
		})
	}
}

// `outboxd version` and `outboxd --version` print the same line.
func TestVersion(t *testing.T) {
	t.Parallel()
	code, cmdOut := runOutboxd(t, nil, "version")
	if code != 0 || !strings.HasPrefix(cmdOut, "outboxd ") || !strings.Contains(cmdOut, "commit ") || !strings.Contains(cmdOut, "built ") {
		t.Fatalf("outboxd version: exit %d, %q", code, cmdOut)
	}
	if code, flagOut := runOutboxd(t, nil, "--version"); code != 0 || flagOut != cmdOut {
		t.Errorf("outboxd --version: exit %d, %q; want %q", code, flagOut, cmdOut)
	}
}

// A list flag set from the environment takes its values separated by
// spaces, as --config's help says (OUTBOXD_STREAMS="a b" is --streams a
// --streams b): here the same stream twice, which relay refuses at start.
func TestConfigEnvironmentListsSplitAtSpaces(t *testing.T) {
	t.Parallel()
	code, out := runOutboxd(t, []string{"OUTBOXD_STREAMS=*/payments */payments"}, "relay", "--server", "127.0.0.1:1", "--sink", "stdout://")
	if code != 2 || !strings.Contains(out, `"*/payments" is given twice`) {
		t.Errorf("OUTBOXD_STREAMS with one stream twice: exit %d, want 2 saying it is given twice\n%s", code, out)
	}
}
