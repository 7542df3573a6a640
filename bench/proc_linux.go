package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTick is the unit of CPU times in /proc: USER_HZ, which Linux fixes at
// 100 for every architecture's user-space ABI (getconf CLK_TCK).
const clockTick = 10 * time.Millisecond

// processCPU returns the user+system CPU time process pid has used, and
// whether it could be read (the process exists and is on this machine).
func processCPU(pid int) (time.Duration, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The command name (field 2) may contain spaces and parentheses; the
	// fields after its closing parenthesis are fixed: state is field 3,
	// utime 14 and stime 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * clockTick, true
}

// processName returns /proc/pid/comm ("postgres" for every PostgreSQL
// process, whatever its title says).
func processName(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// peakRSS returns process pid's peak resident set size (VmHWM) in bytes.
func peakRSS(pid int) (int64, bool) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, false
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(s.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return 0, false
			}
			return kb * 1024, true
		}
	}
	return 0, false
}

// selfCPU returns the CPU time this process has used.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// machineCPU is the machine-wide CPU time split from /proc/stat, in ticks
// summed over all cores.
type machineCPU struct {
	busy, iowait, total int64
	ok                  bool
}

func readMachineCPU() machineCPU {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return machineCPU{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return machineCPU{}
	}
	var v [8]int64 // user nice system idle iowait irq softirq steal
	for i := range v {
		v[i], _ = strconv.ParseInt(f[i+1], 10, 64)
	}
	m := machineCPU{iowait: v[4], ok: true}
	for i, x := range v {
		m.total += x
		if i != 3 && i != 4 {
			m.busy += x
		}
	}
	return m
}

// setDeathSignal makes the kernel send SIGTERM to a child server if the
// benchmark dies first, so a killed run leaves no server behind. The child
// gets its own process group, so a Ctrl-C at the terminal reaches only the
// benchmark, which then stops the server itself, in order.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
}
