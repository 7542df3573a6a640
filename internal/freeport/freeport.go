// Package freeport finds a loopback TCP port for a process about to listen
// on it (a test's child serve, a throwaway PostgreSQL cluster).
//
// Asking the kernel for port 0 and closing the listener is not enough: the
// port it returns comes from the range it also hands to outgoing
// connections (ip_local_port_range), so a connection any other test opens
// can take it before the child binds it. CI saw exactly that: a serve under
// test failed "bind: address already in use" on such a port. So the port is
// drawn at random below that range, where the kernel never assigns one by
// itself, and checked free by binding it; ports handed out by this process
// are not handed out again.
package freeport

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// lowest is where the draw starts: above the ports services commonly own.
const lowest = 10000

var (
	mu     sync.Mutex
	handed = map[int]bool{}
)

// Port returns a loopback TCP port that nothing listens on now and that
// this process has not returned before.
func Port() (int, error) {
	high := ephemeralLow()
	if high <= lowest {
		high = 32768
	}
	mu.Lock()
	defer mu.Unlock()
	for range 200 {
		p := lowest + rand.N(high-lowest)
		if handed[p] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		if err := l.Close(); err != nil {
			return 0, fmt.Errorf("freeport: closing the probe of port %d: %w", p, err)
		}
		handed[p] = true
		return p, nil
	}
	return 0, errors.New("freeport: no free loopback port found below the ephemeral range in 200 tries")
}

// Addr is Port as "127.0.0.1:port".
func Addr() (string, error) {
	p, err := Port()
	if err != nil {
		return "", err
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)), nil
}

// ephemeralLow is the first port of the kernel's range for outgoing
// connections, or 0 when it cannot be read (not Linux).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(f[0])
	return n
}
