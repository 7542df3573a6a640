package freeport_test

import (
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/outboxd/outboxd/internal/freeport"
)

// A port is free to listen on, below the kernel's range for outgoing
// connections (where a connection could take it), and never handed out
// twice by one process.
func TestPortIsFreeBelowTheEphemeralRangeAndNotRepeated(t *testing.T) {
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		low, _ = strconv.Atoi(strings.Fields(string(b))[0])
	}
	seen := map[int]bool{}
	for range 200 {
		p, err := freeport.Port()
		if err != nil {
			t.Fatal(err)
		}
		if p >= low {
			t.Fatalf("port %d is in the ephemeral range (from %d)", p, low)
		}
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
	}
	addr, err := freeport.Addr()
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listening on %s: %v", addr, err)
	}
	l.Close()
}
