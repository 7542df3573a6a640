package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// needTool finds a command the deploy tests run. Locally a missing tool
// skips the test with a message naming it; in CI (CI=true) it fails, since
// .ci/run installs every one of them.
func needTool(t *testing.T, name, install string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is not on PATH; CI must install it (%s)", name, install)
	}
	t.Skipf("%s is not on PATH (%s); CI runs this", name, install)
	return ""
}

// repoRoot is the repository's top folder (the tests run in deploy/).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

var (
	buildOnce   sync.Once
	builtBinary string
	buildErr    error
	buildOut    []byte
)

// outboxdBinary builds cmd/outboxd once for the package's tests, the way
// `make release` does: static (no cgo), -trimpath, for this machine's
// architecture.
func outboxdBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "outboxd-deploy-test-")
		if err != nil {
			buildErr = err
			return
		}
		builtBinary = filepath.Join(dir, "outboxd-linux-"+runtime.GOARCH)
		cmd := exec.Command("go", "build", "-trimpath", "-o", builtBinary, "./cmd/outboxd")
		cmd.Dir = filepath.Join(mustAbs(".."))
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
		buildOut, buildErr = cmd.CombinedOutput()
	})
	if buildErr != nil {
		t.Fatalf("go build ./cmd/outboxd: %v\n%s", buildErr, buildOut)
	}
	return builtBinary
}

func mustAbs(p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		panic(err)
	}
	return a
}

// removeBuilt deletes the binary outboxdBinary built (from TestMain).
func removeBuilt() {
	if builtBinary != "" {
		os.RemoveAll(filepath.Dir(builtBinary))
	}
}

// commandFlags are the long flag names `outboxd <sub> --help` lists,
// inherited ones included.
func commandFlags(t *testing.T, bin, sub string) map[string]bool {
	t.Helper()
	out, err := exec.Command(bin, sub, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("outboxd %s --help: %v\n%s", sub, err, out)
	}
	flags := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		for _, w := range f[:min(len(f), 2)] {
			if name, ok := strings.CutPrefix(w, "--"); ok {
				flags[name] = true
			}
		}
	}
	if len(flags) < 3 {
		t.Fatalf("outboxd %s --help lists too few flags to be right: %v\n%s", sub, flags, out)
	}
	return flags
}
