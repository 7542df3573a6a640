package server

import (
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/store"
)

// A negative DiscoveryMaxFound is refused when the replica is configured,
// not by every discovery round's statement; 0 takes the default.
func TestConfigBoundsDiscoveryMaxFound(t *testing.T) {
	c := Config{Store: store.New(nil), DatabaseURL: "postgres://localhost/x", DiscoveryMaxFound: -1}
	if err := c.setDefaults(); err == nil || !strings.Contains(err.Error(), "DiscoveryMaxFound") {
		t.Fatalf("setDefaults with DiscoveryMaxFound -1: %v, want an error naming it", err)
	}
	c = Config{Store: store.New(nil), DatabaseURL: "postgres://localhost/x"}
	if err := c.setDefaults(); err != nil || c.DiscoveryMaxFound != 10000 {
		t.Fatalf("setDefaults: %v, DiscoveryMaxFound %d, want no error and 10000", err, c.DiscoveryMaxFound)
	}
}

// DiscoveryPaceMax defaults to DiscoveryIdleInterval (the longest pause an
// idle loop takes anyway) and is refused outside [DiscoveryInterval,
// DiscoveryIdleInterval], naming it.
func TestConfigBoundsDiscoveryPaceMax(t *testing.T) {
	c := Config{Store: store.New(nil), DatabaseURL: "postgres://localhost/x", DiscoveryIdleInterval: 40 * time.Millisecond}
	if err := c.setDefaults(); err != nil || c.DiscoveryPaceMax != 40*time.Millisecond {
		t.Fatalf("setDefaults: %v, DiscoveryPaceMax %v, want no error and the idle interval 40ms", err, c.DiscoveryPaceMax)
	}
	for _, pace := range []time.Duration{time.Microsecond, 41 * time.Millisecond} {
		c := Config{Store: store.New(nil), DatabaseURL: "postgres://localhost/x",
			DiscoveryInterval: time.Millisecond, DiscoveryIdleInterval: 40 * time.Millisecond, DiscoveryPaceMax: pace}
		if err := c.setDefaults(); err == nil || !strings.Contains(err.Error(), "DiscoveryPaceMax") {
			t.Fatalf("setDefaults with DiscoveryPaceMax %v: %v, want an error naming it", pace, err)
		}
	}
}

// AckLinger defaults to DefaultAckLinger; a negative value (off) is kept,
// not replaced by the default.
func TestConfigDefaultsAckLinger(t *testing.T) {
	c := Config{Store: store.New(nil), DatabaseURL: "postgres://localhost/x"}
	if err := c.setDefaults(); err != nil || c.AckLinger != DefaultAckLinger {
		t.Fatalf("setDefaults: %v, AckLinger %v, want no error and %v", err, c.AckLinger, DefaultAckLinger)
	}
	c = Config{Store: store.New(nil), DatabaseURL: "postgres://localhost/x", AckLinger: -1}
	if err := c.setDefaults(); err != nil || c.AckLinger != -1 {
		t.Fatalf("setDefaults with AckLinger -1: %v, AckLinger %v, want no error and -1 (off)", err, c.AckLinger)
	}
}
