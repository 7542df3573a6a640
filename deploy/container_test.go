package deploy_test

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/freeport"
	"github.com/outboxd/outboxd/internal/testdb"
)

// run runs a command (bounded by ctx) and returns its standard output; on
// failure the error carries its standard error.
func run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, stderr.Bytes())
	}
	return out, nil
}

// TestContainerImage builds the image from the Containerfile with buildah,
// around the static binary this package's tests build the way `make
// release` does. Where podman can run containers it runs the server
// against the local PostgreSQL, waits for /readyz, has a relay in a second
// container deliver an event, and stops both with SIGTERM, expecting exit
// code 0. Where it cannot (a sandbox without the rights crun needs) the
// test logs why and checks the image with skopeo instead: its config (user,
// ports, entrypoint, stop signal) and its one layer, which must hold exactly
// the binary (the same bytes, statically linked) and the CA bundle.
func TestContainerImage(t *testing.T) {
	t.Parallel()
	buildah := needTool(t, "buildah", "apt-get install buildah")
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()

	bin := outboxdBinary(t)
	buildDir := t.TempDir()
	binName := "outboxd-linux-" + runtime.GOARCH
	copyFile(t, bin, filepath.Join(buildDir, binName))
	copyFile(t, "/etc/ssl/certs/ca-certificates.crt", filepath.Join(buildDir, "ca-certificates.crt"))

	image := "localhost/outboxd-test:" + rand.Text()[:10]
	if _, err := run(ctx, buildah, "build", "--quiet", "--timestamp=0", "--build-arg=TARGETARCH="+runtime.GOARCH,
		"-f", filepath.Join(repoRoot(t), "Containerfile"), "-t", image, buildDir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if out, err := exec.Command(buildah, "rmi", "--force", image).CombinedOutput(); err != nil {
			t.Logf("buildah rmi %s: %v\n%s", image, err, out)
		}
	})

	if podman, err := exec.LookPath("podman"); err == nil {
		out, err := run(ctx, podman, "run", "--rm", "--network=host", image, "version")
		if err == nil {
			t.Logf("podman runs containers here: %s", bytes.TrimSpace(out))
			runContainers(t, ctx, podman, image)
			return
		}
		t.Logf("podman cannot run containers here, so skopeo checks the image's config and layers instead: %v", err)
	} else {
		t.Log("podman is not installed, so skopeo checks the image's config and layers instead")
	}
	skopeo := needTool(t, "skopeo", "apt-get install skopeo")
	checkImage(t, ctx, skopeo, image, bin)
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	data, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o755); err != nil {
		t.Fatal(err)
	}
}

// checkImage inspects the image without running it.
func checkImage(t *testing.T, ctx context.Context, skopeo, image, bin string) {
	ref := "containers-storage:" + image
	raw, err := run(ctx, skopeo, "inspect", "--config", ref)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Architecture string `json:"architecture"`
		OS           string `json:"os"`
		Config       struct {
			User         string              `json:"User"`
			ExposedPorts map[string]struct{} `json:"ExposedPorts"`
			Entrypoint   []string            `json:"Entrypoint"`
			Cmd          []string            `json:"Cmd"`
			StopSignal   string              `json:"StopSignal"`
		} `json:"config"`
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatalf("skopeo inspect --config: %v\n%s", err, raw)
	}
	c := cfg.Config
	if cfg.OS != "linux" || cfg.Architecture != runtime.GOARCH {
		t.Errorf("image platform %s/%s, want linux/%s", cfg.OS, cfg.Architecture, runtime.GOARCH)
	}
	if c.User == "" || strings.HasPrefix(c.User, "0") || strings.HasPrefix(c.User, "root") {
		t.Errorf("image runs as user %q, want a non-root numeric user", c.User)
	}
	for _, p := range []string{"7070/tcp", "7071/tcp"} {
		if _, ok := c.ExposedPorts[p]; !ok {
			t.Errorf("image does not expose %s (exposes %v)", p, c.ExposedPorts)
		}
	}
	if !slices.Equal(c.Entrypoint, []string{"/usr/local/bin/outboxd"}) {
		t.Errorf("entrypoint %q, want the binary itself (so it is PID 1 and gets SIGTERM)", c.Entrypoint)
	}
	if !slices.Contains(c.Cmd, "--http-listen=0.0.0.0:7071") || !slices.Contains(c.Cmd, "--listen=0.0.0.0:7070") || len(c.Cmd) == 0 || c.Cmd[0] != "serve" {
		t.Errorf("default command %q does not serve on the exposed ports", c.Cmd)
	}
	if c.StopSignal != "SIGTERM" {
		t.Errorf("stop signal %q, want SIGTERM (the signal outboxd drains on)", c.StopSignal)
	}
	if len(cfg.RootFS.DiffIDs) != 1 {
		t.Errorf("image has %d layers, want 1 on an empty base", len(cfg.RootFS.DiffIDs))
	}

	// The layer's files: exactly the binary and the CA bundle.
	dir := t.TempDir()
	if _, err := run(ctx, skopeo, "copy", "--quiet", ref, "dir:"+dir); err != nil {
		t.Fatal(err)
	}
	var manifest struct {
		Layers []struct {
			Digest string `json:"digest"`
		} `json:"layers"`
	}
	raw, err = os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err == nil {
		err = json.Unmarshal(raw, &manifest)
	}
	if err != nil {
		t.Fatalf("image manifest: %v", err)
	}
	files := map[string][]byte{}
	var modes = map[string]int64{}
	for _, l := range manifest.Layers {
		f, err := os.Open(filepath.Join(dir, strings.TrimPrefix(l.Digest, "sha256:")))
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(f)
		var r io.Reader = br
		if magic, _ := br.Peek(2); bytes.Equal(magic, []byte{0x1f, 0x8b}) {
			if r, err = gzip.NewReader(br); err != nil {
				t.Fatal(err)
			}
		}
		tr := tar.NewReader(r)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("layer %s: %v", l.Digest, err)
			}
			if h.Typeflag == tar.TypeDir {
				continue
			}
			name := strings.TrimPrefix(h.Name, "./")
			data, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files[name], modes[name] = data, h.Mode
		}
		f.Close()
	}
	var names []string
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	if want := []string{"etc/ssl/certs/ca-certificates.crt", "usr/local/bin/outboxd"}; !slices.Equal(names, want) {
		t.Errorf("image files %q, want exactly %q (an empty base)", names, want)
	}
	got := files["usr/local/bin/outboxd"]
	want, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if sha256.Sum256(got) != sha256.Sum256(want) {
		t.Errorf("the image's binary is not the one built (sha256 %s, want %s)", hexSum(got), hexSum(want))
	}
	if modes["usr/local/bin/outboxd"]&0o111 == 0 {
		t.Errorf("the image's binary is not executable (mode %o)", modes["usr/local/bin/outboxd"])
	}
	if ef, err := elf.NewFile(bytes.NewReader(got)); err != nil {
		t.Errorf("the image's binary is not ELF: %v", err)
	} else {
		for _, p := range ef.Progs {
			if p.Type == elf.PT_INTERP {
				t.Error("the image's binary is dynamically linked (it has an ELF interpreter); an empty base has no libc")
			}
		}
	}
}

func hexSum(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// freePort is a loopback port nothing listens on right now.
func freePort(t *testing.T) string {
	t.Helper()
	addr, err := freeport.Addr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// runContainers runs the server and a relay in containers on the host's
// network (loopback only), against a test database.
func runContainers(t *testing.T, ctx context.Context, podman, image string) {
	dbURL := testdb.New(t)
	grpcAddr, httpAddr := freePort(t), freePort(t)
	name := strings.ReplaceAll(strings.TrimPrefix(image, "localhost/"), ":", "-")
	server, relay := name+"-server", name+"-relay"
	t.Cleanup(func() { _ = exec.Command(podman, "rm", "--force", server, relay).Run() })
	if _, err := run(ctx, podman, "run", "--detach", "--network=host", "--name", server, image,
		"serve", "--listen="+grpcAddr, "--http-listen="+httpAddr, "--database-url="+dbURL); err != nil {
		t.Fatal(err)
	}
	logs := func(c string) string { out, _ := exec.Command(podman, "logs", c).CombinedOutput(); return string(out) }
	client := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := client.Get("http://" + httpAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the server container never answered /readyz with 200: %v\n%s", ctx.Err(), logs(server))
		case <-time.After(100 * time.Millisecond):
		}
	}
	if _, err := run(ctx, podman, "run", "--detach", "--network=host", "--name", relay, image,
		"relay", "--server="+grpcAddr, "--sink=stdout://"); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var eventID string
	if err := conn.QueryRow(ctx, `SELECT event_id::text FROM outbox.emit('orders', '1', 'OrderPlaced', '{"n": 1}')`).Scan(&eventID); err != nil {
		t.Fatal(err)
	}
	for !strings.Contains(logs(relay), eventID) {
		select {
		case <-ctx.Done():
			t.Fatalf("the relay container did not deliver event %s: %v\nrelay:\n%s\nserver:\n%s", eventID, ctx.Err(), logs(relay), logs(server))
		case <-time.After(100 * time.Millisecond):
		}
	}
	var published bool
	for !published {
		if err := conn.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, eventID).Scan(&published); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("event %s was printed but never acked", eventID)
		case <-time.After(50 * time.Millisecond):
		}
	}
	for _, c := range []string{relay, server} {
		if _, err := run(ctx, podman, "stop", "--time=30", c); err != nil {
			t.Fatal(err)
		}
		out, err := run(ctx, podman, "inspect", "--format={{.State.ExitCode}}", c)
		if err != nil {
			t.Fatal(err)
		}
		if code := strings.TrimSpace(string(out)); code != "0" {
			t.Errorf("%s exited %s after SIGTERM, want 0 (a clean drain)\n%s", c, code, logs(c))
		}
	}
}
