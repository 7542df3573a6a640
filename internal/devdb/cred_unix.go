//go:build unix

package devdb

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
)

// setCredential makes cmd run as su, with su's primary group only, so that
// the files it creates belong to su.
func setCredential(cmd *exec.Cmd, su *serverUser) {
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: su.uid, Gid: su.gid},
	}
}

// checkReachable reports whether su can traverse every directory above dir.
// Without this check a root-only TMPDIR (e.g. under /root) surfaces as an
// unhelpful "fork/exec: permission denied" from initdb.
func checkReachable(dir string, su *serverUser) error {
	for p := filepath.Dir(dir); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		mode := fi.Mode().Perm()
		ok := mode&0o001 != 0
		if st, isUnix := fi.Sys().(*syscall.Stat_t); isUnix {
			ok = ok || (st.Uid == su.uid && mode&0o100 != 0) || (st.Gid == su.gid && mode&0o010 != 0)
		}
		if !ok {
			return fmt.Errorf("OS user %q cannot enter %s (mode %v), so it cannot use %s: set TMPDIR to a directory it can reach, such as /tmp",
				su.name, p, fi.Mode(), dir)
		}
		if p == filepath.Dir(p) {
			return nil
		}
	}
}
