// Package ration paces the background reads whose cost grows with the
// database rather than with the work at hand (the stranded audit, which
// reads every aggregate; the console's lag samples, which read every pending
// aggregate): on a database a million aggregates behind, each such read
// takes seconds of PostgreSQL, and run on a fixed interval they would keep a
// core busy while it catches up.
package ration

import "time"

// Share bounds a rationed read's cost where it is slow: the next one starts
// no sooner than Share times the last one's duration after the last began,
// so that it keeps one database connection busy at most 1/Share of the time.
const Share = 20

// Pause is how long after a read began the next may begin: interval, or
// Share times as long as the read took when that is longer.
func Pause(interval, took time.Duration) time.Duration {
	return max(interval, Share*took)
}
