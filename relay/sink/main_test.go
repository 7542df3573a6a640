package sink_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package if a sink leaves NATS client goroutines
// running after Close.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
