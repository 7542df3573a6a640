package ration_test

import (
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/ration"
)

func TestPause(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ interval, took, want time.Duration }{
		{time.Minute, 0, time.Minute},
		{time.Minute, time.Second, time.Minute},           // 20 s < 1 min
		{time.Minute, 5 * time.Second, 100 * time.Second}, // a slow read waits 20 times its length
		{0, 10 * time.Millisecond, 200 * time.Millisecond},
	} {
		if got := ration.Pause(tc.interval, tc.took); got != tc.want {
			t.Errorf("Pause(%v, %v) = %v, want %v", tc.interval, tc.took, got, tc.want)
		}
	}
}
