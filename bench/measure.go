package bench

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

const (
	// waitSampleInterval is how often pg_stat_activity is sampled during a
	// measured window: often enough for a few hundred samples in a short
	// window, rarely enough that the sampling backend costs nothing visible.
	waitSampleInterval = 25 * time.Millisecond
	// cpuSampleEvery is how many wait samples pass between readings of the
	// PostgreSQL processes' CPU times; a backend that starts and ends
	// between two readings is missed.
	cpuSampleEvery = 10
)

// Wait is one kind of thing PostgreSQL backends were doing, as the average
// number of sessions found doing it (average active sessions).
type Wait struct {
	Name        string  `json:"name"`
	AvgSessions float64 `json:"avg_sessions"`
}

// measurement is what one measured window cost. Fields whose ok flag is
// false could not be measured on this machine (no /proc, or a PostgreSQL
// on another host).
type measurement struct {
	elapsed     time.Duration
	benchCPU    time.Duration // this process: producers, relays, sink (and an in-process server)
	serverCPU   time.Duration
	serverOK    bool
	postgresCPU time.Duration
	postgresOK  bool
	machine     machineCPU // delta over the window
	walBytes    int64
	walSyncs    int64
	commits     int64 // xact_commit of the scratch database; lags up to a second
	waits       []Wait
	samples     int
}

// processStats is what the bench can learn about the server process.
type processStats interface {
	// pids are the server's processes: one, or each replica's in the
	// replicas workload.
	pids() []int
}

// serverCPU is the CPU time of every process of the server, false when
// one of them could not be read.
func serverCPU(server processStats) (time.Duration, bool) {
	var sum time.Duration
	for _, pid := range server.pids() {
		cpu, ok := processCPU(pid)
		if !ok {
			return 0, false
		}
		sum += cpu
	}
	return sum, len(server.pids()) > 0
}

// probe measures one window: it snapshots counters when the window opens,
// samples pg_stat_activity while it is open, and snapshots again when it
// closes. Its connection is to the maintenance database, so it never counts
// itself among the scratch database's backends.
type probe struct {
	conn *pgx.Conn
	// dbNames are the databases whose backends and commits count: the
	// arm's scratch database, or every source database of the sources
	// workloads.
	dbNames []string
	server  processStats

	start struct {
		at       time.Time
		bench    time.Duration
		server   time.Duration
		serverOK bool
		machine  machineCPU
		wal      int64
		walSyncs int64
		commits  int64
	}

	// stopCh ends the sampling loop between samples: cancelling a query
	// would make pgx close the connection the closing snapshot needs.
	stopCh chan struct{}
	done   chan struct{}

	mu          sync.Mutex
	samples     int
	waits       map[string]int
	cpuReadings int
	pgCPU       map[int]*cpuSpan
	pgLocal     bool
}

// cpuSpan is one PostgreSQL process's CPU time when first and last seen in
// the window.
type cpuSpan struct{ first, last time.Duration }

// openWindow connects to adminURL and takes the opening snapshot.
func openWindow(ctx context.Context, adminURL, dbName string, server processStats) (*probe, error) {
	return openWindowOver(ctx, adminURL, []string{dbName}, server)
}

// openWindowOver is openWindow over several databases at once: their
// backends, CPU and commits all count.
func openWindowOver(ctx context.Context, adminURL string, dbNames []string, server processStats) (*probe, error) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return nil, fmt.Errorf("bench: connect for measurements: %w", err)
	}
	p := &probe{conn: conn, dbNames: dbNames, server: server, waits: map[string]int{}, pgCPU: map[int]*cpuSpan{}}
	// The opening CPU reading of PostgreSQL's processes is the baseline;
	// processes that appear later started inside the window and count in
	// full.
	if err := p.sample(ctx, true, false); err != nil {
		conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("bench: sample pg_stat_activity: %w", err)
	}
	s := &p.start
	if err := conn.QueryRow(ctx, `SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
		(SELECT wal_sync FROM pg_stat_wal),
		coalesce((SELECT sum(xact_commit)::bigint FROM pg_stat_database WHERE datname = ANY($1)), 0)`, dbNames).
		Scan(&s.wal, &s.walSyncs, &s.commits); err != nil {
		conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("bench: read WAL position: %w", err)
	}
	s.at = time.Now()
	s.bench = selfCPU()
	s.machine = readMachineCPU()
	if server != nil {
		s.server, s.serverOK = serverCPU(server)
	}
	p.stopCh, p.done = make(chan struct{}), make(chan struct{})
	go p.loop(context.WithoutCancel(ctx))
	return p, nil
}

func (p *probe) loop(ctx context.Context) {
	defer close(p.done)
	t := time.NewTicker(waitSampleInterval)
	defer t.Stop()
	for n := 1; ; n++ {
		select {
		case <-p.stopCh:
			return
		case <-t.C:
		}
		if err := p.sample(ctx, n%cpuSampleEvery == 0, true); err != nil {
			return // the closing snapshot reports a dead connection
		}
	}
}

// sample looks at every backend of the scratch database and every
// background process: it counts what each is doing (countWaits) and reads
// their CPU times (readCPU).
func (p *probe) sample(ctx context.Context, readCPU, countWaits bool) error {
	rows, err := p.conn.Query(ctx, `
		SELECT pid, backend_type, coalesce(state, ''), coalesce(wait_event_type, ''), coalesce(wait_event, '')
		FROM pg_stat_activity
		WHERE (datname = ANY($1) OR datname IS NULL) AND pid <> pg_backend_pid()`, p.dbNames)
	if err != nil {
		return err
	}
	type backend struct {
		pid                             int
		kind, state, waitType, waitName string
	}
	var seen []backend
	for rows.Next() {
		var b backend
		if err := rows.Scan(&b.pid, &b.kind, &b.state, &b.waitType, &b.waitName); err != nil {
			rows.Close()
			return err
		}
		seen = append(seen, b)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if countWaits {
		p.samples++
	}
	for _, b := range seen {
		if !countWaits {
			break
		}
		if name := waitName(b.kind, b.state, b.waitType, b.waitName); name != "" {
			p.waits[name]++
		}
	}
	if !readCPU {
		return nil
	}
	for _, b := range seen {
		cpu, ok := processCPU(b.pid)
		if !ok || processName(b.pid) != "postgres" {
			continue
		}
		p.pgLocal = true
		switch s := p.pgCPU[b.pid]; {
		case s != nil:
			s.last = cpu
		case p.cpuReadings == 0: // the opening baseline
			p.pgCPU[b.pid] = &cpuSpan{first: cpu, last: cpu}
		default: // started inside the window
			p.pgCPU[b.pid] = &cpuSpan{last: cpu}
		}
	}
	p.cpuReadings++
	return nil
}

// waitName names what one backend is doing, or "" when it is idle.
func waitName(kind, state, waitType, wait string) string {
	if kind == "client backend" {
		switch {
		case state == "idle" || state == "":
			return ""
		case state == "idle in transaction":
			return "idle in transaction"
		case waitType == "":
			return "CPU"
		}
		return waitType + ":" + wait
	}
	switch waitType {
	case "Activity": // a background process waiting for something to do
		return ""
	case "":
		return "CPU (" + kind + ")"
	}
	return waitType + ":" + wait + " (" + kind + ")"
}

// close takes the closing snapshot and returns the window's costs.
func (p *probe) close(ctx context.Context) (measurement, error) {
	var m measurement
	m.elapsed = time.Since(p.start.at)
	m.benchCPU = selfCPU() - p.start.bench
	if end := readMachineCPU(); end.ok && p.start.machine.ok {
		m.machine = machineCPU{
			busy: end.busy - p.start.machine.busy, iowait: end.iowait - p.start.machine.iowait,
			total: end.total - p.start.machine.total, ok: true,
		}
	}
	if p.start.serverOK {
		if cpu, ok := serverCPU(p.server); ok {
			m.serverCPU, m.serverOK = cpu-p.start.server, true
		}
	}
	close(p.stopCh)
	<-p.done
	defer p.conn.Close(context.WithoutCancel(ctx))
	if err := p.sample(ctx, true, false); err != nil {
		return m, fmt.Errorf("bench: sample pg_stat_activity: %w", err)
	}
	var wal, walSyncs, commits int64
	if err := p.conn.QueryRow(ctx, `SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint,
		(SELECT wal_sync FROM pg_stat_wal),
		coalesce((SELECT sum(xact_commit)::bigint FROM pg_stat_database WHERE datname = ANY($1)), 0)`, p.dbNames).
		Scan(&wal, &walSyncs, &commits); err != nil {
		return m, fmt.Errorf("bench: read WAL position: %w", err)
	}
	m.walBytes, m.walSyncs, m.commits = wal-p.start.wal, walSyncs-p.start.walSyncs, commits-p.start.commits

	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pgLocal {
		m.postgresOK = true
		for _, s := range p.pgCPU {
			m.postgresCPU += max(s.last-s.first, 0)
		}
	}
	m.samples = p.samples
	m.waits = topWaits(p.waits, max(p.samples, 1), 8)
	return m, nil
}

// topWaits turns sample counts into average sessions, largest first.
func topWaits(counts map[string]int, samples, n int) []Wait {
	out := make([]Wait, 0, len(counts))
	for name, c := range counts {
		out = append(out, Wait{Name: name, AvgSessions: float64(c) / float64(samples)})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].AvgSessions != out[j].AvgSessions {
			return out[i].AvgSessions > out[j].AvgSessions
		}
		return out[i].Name < out[j].Name
	})
	if len(out) > n {
		out = out[:n]
	}
	return out
}
