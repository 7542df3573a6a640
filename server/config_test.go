package server

import (
	"strings"
	"testing"

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
