package console

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// By default the chart's ring holds an hour of samples taken every 10s.
func TestChartCoversAnHourByDefault(t *testing.T) {
	c, err := New(Config{Conn: (*grpc.ClientConn)(nil)})
	if err != nil {
		t.Fatal(err)
	}
	if c.cfg.History != time.Hour || c.cfg.SampleInterval != 10*time.Second || len(c.ring.buf) != 360 {
		t.Fatalf("history %v every %v in %d samples, want an hour every 10s in 360", c.cfg.History, c.cfg.SampleInterval, len(c.ring.buf))
	}
}

// The ring keeps the latest samples, oldest first, and in each the streams
// with the most pending events.
func TestLagRing(t *testing.T) {
	g := newLagRing(3)
	t0 := time.Unix(1_700_000_000, 0)
	lag := func(streams int, pending int64) *outboxv1.GetLagResponse {
		r := &outboxv1.GetLagResponse{}
		for i := range streams {
			r.Streams = append(r.Streams, &outboxv1.StreamLag{Stream: fmt.Sprintf("s%03d", i), PendingEvents: pending + int64(i)})
		}
		return r
	}
	if got := g.samples(); len(got) != 0 {
		t.Fatalf("empty ring: %d samples", len(got))
	}
	for i := range 2 {
		g.add(t0.Add(time.Duration(i)*time.Second), lag(1, int64(i)))
	}
	if got := g.samples(); len(got) != 2 || !got[0].at.Equal(t0) || got[1].streams["s000"].Pending != 1 {
		t.Fatalf("before wrapping: %v", got)
	}
	for i := 2; i < 7; i++ {
		g.add(t0.Add(time.Duration(i)*time.Second), lag(1, int64(i)))
	}
	got := g.samples()
	if len(got) != 3 {
		t.Fatalf("%d samples, want 3", len(got))
	}
	for i, s := range got {
		if want := t0.Add(time.Duration(4+i) * time.Second); !s.at.Equal(want) || s.streams["s000"].Pending != int64(4+i) {
			t.Errorf("sample %d at %v pending %d, want %v and %d", i, s.at, s.streams["s000"].Pending, want, 4+i)
		}
	}
	g.add(t0, lag(maxSampledStreams+10, 0))
	last := g.samples()[2].streams
	if len(last) != maxSampledStreams {
		t.Fatalf("%d streams kept, want %d", len(last), maxSampledStreams)
	}
	if _, ok := last["s000"]; ok {
		t.Error("the least busy stream was kept")
	}
	if _, ok := last[fmt.Sprintf("s%03d", maxSampledStreams+9)]; !ok {
		t.Error("the busiest stream was dropped")
	}
}

// The sampler waits SampleInterval between samples, or ration.Share times a
// slow sample's duration after it began: a lag read costs PostgreSQL in
// proportion to the aggregates pending. The clock is the test's: each sample
// "takes" what the test says, and the sampler's waits are recorded, not
// slept.
func TestSamplerRationsSlowSamples(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	clock := time.Unix(1_700_000_000, 0)
	takes := []time.Duration{time.Millisecond, 2 * time.Second, 100 * time.Millisecond}
	var samples int
	c, err := New(Config{Conn: (*grpc.ClientConn)(nil), SampleInterval: 10 * time.Second,
		Lag: func(context.Context, *outboxv1.GetLagRequest) (*outboxv1.GetLagResponse, error) {
			clock = clock.Add(takes[samples])
			samples++
			return &outboxv1.GetLagResponse{}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	waits := make(chan time.Duration)
	next := make(chan time.Time)
	c.now = func() time.Time { return clock }
	c.after = func(d time.Duration) <-chan time.Time {
		waits <- d
		return next
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	for i, want := range []time.Duration{
		10*time.Second - time.Millisecond,     // a fast sample: the interval from its start
		40*time.Second - 2*time.Second,        // a slow one: 20 times its length from its start
		10*time.Second - 100*time.Millisecond, // and back
	} {
		if got := <-waits; got != want {
			t.Fatalf("after sample %d (%v) the sampler waited %v, want %v", i+1, takes[i], got, want)
		}
		if i < len(takes)-1 {
			next <- clock
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if samples != 3 || len(c.ring.samples()) != 3 {
		t.Fatalf("%d samples taken, %d in the ring; want 3", samples, len(c.ring.samples()))
	}
}
