package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestSystemdUnits checks the units in deploy/systemd with `systemd-analyze
// verify` (any warning fails: systemd ignores a directive it cannot parse,
// which would silently drop a sandboxing line), and that each keeps its
// sandbox and starts outboxd with flags the binary has. ExecStart's binary
// path is pointed at the one this package built, since verify checks that
// it is executable.
func TestSystemdUnits(t *testing.T) {
	t.Parallel()
	analyze := needTool(t, "systemd-analyze", "apt-get install systemd")
	bin := outboxdBinary(t)
	dir := t.TempDir()
	for _, tc := range []struct{ file, instance, sub string }{
		{"outboxd.service", "outboxd.service", "serve"},
		{"outboxd-relay@.service", "outboxd-relay@nats.service", "relay"},
	} {
		t.Run(tc.file, func(t *testing.T) {
			raw, err := os.ReadFile(filepath.Join("systemd", tc.file))
			if err != nil {
				t.Fatal(err)
			}
			unit := string(raw)
			settings := map[string][]string{}
			for _, line := range strings.Split(unit, "\n") {
				if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
					settings[k] = append(settings[k], v)
				}
			}
			for k, want := range map[string]string{
				"DynamicUser": "yes", "ProtectSystem": "strict", "NoNewPrivileges": "yes",
				"ProtectHome": "yes", "PrivateTmp": "yes", "CapabilityBoundingSet": "", "KillSignal": "SIGTERM",
			} {
				if got := settings[k]; len(got) != 1 || got[0] != want {
					t.Errorf("%s=%q, want %s=%s", k, got, k, want)
				}
			}
			// The relay drains and exits 0 on SIGHUP as on SIGTERM: only
			// Restart=always starts it again after a reload (or a SIGHUP
			// sent to every outboxd process), where on-failure left it
			// stopped. serve reloads in place.
			if tc.sub == "relay" {
				if got := settings["Restart"]; len(got) != 1 || got[0] != "always" {
					t.Errorf("Restart=%q: the relay exits 0 after a SIGHUP's drain and must be started again: want always", got)
				}
				if got := settings["ExecReload"]; len(got) != 1 || !strings.Contains(got[0], "-HUP $MAINPID") {
					t.Errorf("ExecReload=%q, want a SIGHUP (a graceful restart)", got)
				}
				// Each reload is a start: under the default limit (5 in
				// 10 s) a few quick reloads would leave it failed.
				if got := settings["StartLimitIntervalSec"]; len(got) != 1 || got[0] != "0" {
					t.Errorf("StartLimitIntervalSec=%q, want 0", got)
				}
			}
			// Neither process keeps state on disk, so neither gets a
			// writable directory.
			for _, k := range []string{"StateDirectory", "ReadWritePaths", "LogsDirectory", "CacheDirectory"} {
				if v, ok := settings[k]; ok {
					t.Errorf("%s=%q: outboxd %s writes nothing to disk", k, v, tc.sub)
				}
			}
			start := strings.Fields(settings["ExecStart"][0])
			if start[0] != "/usr/local/bin/outboxd" || start[1] != tc.sub {
				t.Fatalf("ExecStart=%q, want /usr/local/bin/outboxd %s ...", settings["ExecStart"][0], tc.sub)
			}
			known := commandFlags(t, bin, tc.sub)
			for _, a := range start[2:] {
				name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				if !strings.HasPrefix(a, "--") || !known[name] {
					t.Errorf("ExecStart passes %q: not a flag of outboxd %s", a, tc.sub)
				}
			}

			if err := os.WriteFile(filepath.Join(dir, tc.file),
				[]byte(strings.ReplaceAll(unit, "/usr/local/bin/outboxd", bin)), 0o644); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, analyze, "verify", "--man=no", filepath.Join(dir, tc.instance))
			out, err := cmd.CombinedOutput()
			if err != nil || len(strings.TrimSpace(string(out))) > 0 {
				t.Errorf("systemd-analyze verify %s: %v\n%s", tc.file, err, out)
			}
		})
	}
}
