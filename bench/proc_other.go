//go:build !linux

package bench

import (
	"os/exec"
	"time"
)

// Outside Linux there is no /proc to read: process and PostgreSQL CPU, peak
// RSS and machine load are reported as not measured.

func processCPU(int) (time.Duration, bool) { return 0, false }

func processName(int) string { return "" }

func peakRSS(int) (int64, bool) { return 0, false }

func selfCPU() time.Duration { return 0 }

type machineCPU struct {
	busy, iowait, total int64
	ok                  bool
}

func readMachineCPU() machineCPU { return machineCPU{} }

func setDeathSignal(*exec.Cmd) {}
