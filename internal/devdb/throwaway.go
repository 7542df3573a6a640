package devdb

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outboxd/outboxd/internal/freeport"
)

// binDirPatterns are where distributions put versioned server binaries that
// are usually not on PATH (Debian only puts client wrappers there).
var binDirPatterns = []string{
	"/usr/lib/postgresql/*/bin",         // Debian, Ubuntu
	"/usr/pgsql-*/bin",                  // RHEL, Fedora, Rocky (PGDG packages)
	"/usr/local/pgsql/bin",              // builds from source
	"/opt/homebrew/opt/postgresql*/bin", // Homebrew on Apple silicon
	"/usr/local/opt/postgresql*/bin",    // Homebrew on Intel
}

// Timeouts for the throwaway cluster. initdb and startup take a second or two
// on a laptop; the bounds only stop a wedged machine from hanging `dev`.
const (
	commandWaitDelay = 5 * time.Second
	startTimeoutSecs = 60
	readyTimeout     = 15 * time.Second
)

// binaries are the server programs a throwaway cluster needs.
type binaries struct {
	initdb, pgCtl string
}

// serverUser is the OS user that runs initdb, pg_ctl and postgres when the
// current user cannot (root); nil means the current user.
type serverUser struct {
	name     string
	uid, gid uint32
}

// startThrowaway creates a cluster in a fresh temporary directory and starts
// it on 127.0.0.1 and a free port with trust auth for the postgres role.
// Everything it creates lives in that directory, which Close removes.
func startThrowaway(ctx context.Context, logger *slog.Logger, settings ...string) (_ *Database, err error) {
	bins, err := findBinaries(exec.LookPath, binDirPatterns)
	if err != nil {
		return nil, err
	}
	su, err := lookupServerUser()
	if err != nil {
		return nil, err
	}

	dir, err := os.MkdirTemp("", "outboxd-dev-pg-")
	if err != nil {
		return nil, fmt.Errorf("creating a temporary directory for the cluster: %w", err)
	}
	dataDir := filepath.Join(dir, "data")
	logFile := filepath.Join(dir, "postgres.log")
	started := false
	stop := func(ctx context.Context) error {
		var errs []error
		if started {
			if _, err := runServerCmd(ctx, su, dir, bins.pgCtl, "stop", "-D", dataDir, "-m", "fast", "-w"); err != nil {
				// The postmaster rechecks its lock file every minute and exits
				// once the directory below is gone, so it will not linger.
				errs = append(errs, fmt.Errorf("stopping the throwaway PostgreSQL: %w", err))
			}
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, fmt.Errorf("removing the throwaway PostgreSQL directory: %w", err))
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			// ctx may be what failed; cleanup still needs time to run.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			err = errors.Join(err, stop(cctx))
		}
	}()

	if su != nil {
		if err := checkReachable(dir, su); err != nil {
			return nil, err
		}
		// MkdirTemp made the directory 0700 and root's: hand it over so the
		// server user can create the data directory, socket and log in it.
		if err := os.Chown(dir, int(su.uid), int(su.gid)); err != nil {
			return nil, fmt.Errorf("giving %s to OS user %q: %w", dir, su.name, err)
		}
	}

	// -U postgres gives the superuser the conventional name whatever the OS
	// user is, so the URL is the same everywhere. Trust auth is acceptable
	// because the server only listens on loopback and lives for one dev run.
	// --no-sync and --no-locale make initdb fast and independent of the
	// machine's (possibly broken) locale settings.
	if _, err := runServerCmd(ctx, su, dir, bins.initdb,
		"-D", dataDir, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale", "--no-sync"); err != nil {
		return nil, err
	}

	port, err := freePort()
	if err != nil {
		return nil, err
	}
	// Settings go in postgresql.conf rather than pg_ctl -o because pg_ctl
	// passes -o through a shell, which would mangle unusual temp paths.
	// Durability is pointless for data deleted on exit; skipping it keeps
	// the dev loop fast.
	conf := fmt.Sprintf(`
# Added by outboxd dev for a throwaway cluster.
listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = '%s'
fsync = off
synchronous_commit = off
full_page_writes = off
`, port, strings.ReplaceAll(dir, "'", "''"))
	for _, setting := range settings {
		conf += setting + "\n"
	}
	if err := appendFile(filepath.Join(dataDir, "postgresql.conf"), conf); err != nil {
		return nil, fmt.Errorf("configuring the throwaway cluster: %w", err)
	}

	// -l matters beyond logging: without it postgres would inherit this
	// command's output pipes and keep them open, hanging the wait.
	started = true
	if _, err := runServerCmd(ctx, su, dir, bins.pgCtl,
		"start", "-D", dataDir, "-l", logFile, "-w", "-t", strconv.Itoa(startTimeoutSecs)); err != nil {
		return nil, fmt.Errorf("%w\nserver log %s:\n%s", err, logFile, tail(logFile, 20))
	}

	connURL := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	if err := waitReady(ctx, connURL); err != nil {
		return nil, fmt.Errorf("throwaway PostgreSQL started but does not accept connections at %s: %w\nserver log %s:\n%s",
			connURL, err, logFile, tail(logFile, 20))
	}

	attrs := []any{"url", connURL, "dir", dir, "bin", filepath.Dir(bins.initdb)}
	if su != nil {
		attrs = append(attrs, "os_user", su.name)
	}
	logger.Info("started throwaway PostgreSQL; its data is deleted on exit", attrs...)
	return &Database{
		URL:    connURL,
		Source: SourceThrowaway,
		dir:    dir,
		pgCtl: func(ctx context.Context, action string) error {
			var args []string
			switch action {
			case "start":
				args = []string{"start", "-D", dataDir, "-w", "-l", logFile, "-t", strconv.Itoa(startTimeoutSecs)}
			case "crash":
				// Immediate mode: every process exits at once, nothing is
				// flushed, and the next start runs crash recovery.
				args = []string{"stop", "-D", dataDir, "-w", "-m", "immediate"}
			default:
				args = []string{action, "-D", dataDir, "-w", "-m", "fast"}
			}
			_, err := runServerCmd(ctx, su, dir, bins.pgCtl, args...)
			return err
		},
		stop: func(ctx context.Context) error {
			err := stop(ctx)
			if err == nil {
				logger.Info("stopped throwaway PostgreSQL", "dir", dir)
			}
			return err
		},
	}, nil
}

// findBinaries locates initdb and pg_ctl: on PATH first, since that is the
// user's explicit choice, else in the highest-versioned directory matching
// patterns that holds both.
func findBinaries(lookPath func(string) (string, error), patterns []string) (binaries, error) {
	initdb, err1 := lookPath("initdb")
	pgCtl, err2 := lookPath("pg_ctl")
	if err1 == nil && err2 == nil {
		return binaries{initdb: initdb, pgCtl: pgCtl}, nil
	}

	type candidate struct {
		dir     string
		version []int
	}
	var found []candidate
	for _, pattern := range patterns {
		dirs, _ := filepath.Glob(pattern) // patterns are constant and valid
		for _, d := range dirs {
			if isExecutable(filepath.Join(d, "initdb")) && isExecutable(filepath.Join(d, "pg_ctl")) {
				found = append(found, candidate{dir: d, version: versionOf(pattern, d)})
			}
		}
	}
	if len(found) == 0 {
		return binaries{}, fmt.Errorf("initdb and pg_ctl are not on PATH nor in %s: install the PostgreSQL server package (postgresql on Debian/Ubuntu/Homebrew, postgresql-server on RHEL/Fedora) or set %s",
			strings.Join(patterns, ", "), EnvVar)
	}
	best := slices.MaxFunc(found, func(a, b candidate) int { return slices.Compare(a.version, b.version) })
	return binaries{
		initdb: filepath.Join(best.dir, "initdb"),
		pgCtl:  filepath.Join(best.dir, "pg_ctl"),
	}, nil
}

var versionRE = regexp.MustCompile(`\d+(\.\d+)*`)

// versionOf extracts the version from the part of dir that matched a
// wildcard in pattern: 15 from /usr/lib/postgresql/15/bin, 17 from
// /opt/homebrew/opt/postgresql@17/bin. Digits elsewhere in the path are
// ignored. A directory without a version sorts below any versioned one.
func versionOf(pattern, dir string) []int {
	pp := strings.Split(filepath.ToSlash(pattern), "/")
	dp := strings.Split(filepath.ToSlash(dir), "/")
	if len(pp) != len(dp) {
		return nil
	}
	for i, p := range pp {
		if !strings.ContainsAny(p, "*?[") {
			continue
		}
		m := versionRE.FindString(dp[i])
		if m == "" {
			return nil
		}
		var v []int
		for part := range strings.SplitSeq(m, ".") {
			n, err := strconv.Atoi(part)
			if err != nil {
				break
			}
			v = append(v, n)
		}
		return v
	}
	return nil
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// lookupServerUser decides who runs the server. initdb and postgres refuse to
// run as root (a superuser-owned server would hand database users a path to
// root), so as root the work is delegated to the `postgres` OS user that
// distribution packages create.
func lookupServerUser() (*serverUser, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root, and initdb and postgres refuse to run as root; there is no %q OS user to run them as instead (%v): run as a normal user, create that user (useradd --system postgres), or set %s",
			"postgres", err, EnvVar)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("OS user %q has non-numeric uid %q or gid %q", u.Username, u.Uid, u.Gid)
	}
	return &serverUser{name: u.Username, uid: uint32(uid), gid: uint32(gid)}, nil
}

// runServerCmd runs a PostgreSQL program as su (nil: the current user) in dir
// and returns its combined output, which it includes in the error on failure
// since that is where initdb and pg_ctl explain themselves. Running in dir
// matters as root: the server user may not be allowed into the caller's
// working directory.
func runServerCmd(ctx context.Context, su *serverUser, dir, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.WaitDelay = commandWaitDelay
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if su != nil {
		setCredential(cmd, su)
	}
	if err := cmd.Run(); err != nil {
		who := ""
		if su != nil {
			who = fmt.Sprintf(" (as OS user %q)", su.name)
		}
		return out.Bytes(), fmt.Errorf("%s %s%s: %w\n%s", name, strings.Join(args, " "), who, err, bytes.TrimSpace(out.Bytes()))
	}
	return out.Bytes(), nil
}

// freePort finds an unused loopback port (freeport: below the range of
// outgoing connections' ports). Another process could still take it before
// postgres binds it; pg_ctl start then fails with the reason in the server
// log, which the error includes.
func freePort() (int, error) {
	p, err := freeport.Port()
	if err != nil {
		return 0, fmt.Errorf("finding a free port on 127.0.0.1: %w", err)
	}
	return p, nil
}

// waitReady pings connURL until it answers or readyTimeout passes. pg_ctl -w
// has already waited for startup; this confirms the URL itself works.
func waitReady(ctx context.Context, connURL string) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	for {
		err := ping(ctx, connURL, time.Second)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(text)
	return errors.Join(err, f.Close())
}

// tail returns the last n lines of a log file for error messages.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "(no log written)"
	}
	if err != nil {
		return fmt.Sprintf("(unreadable: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
