package main

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/pflag"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/connstring"
	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/migrations"
)

// sourceHelp documents --source on every command that takes it.
const sourceHelp = `NAME=URL, repeatable: a further source database, whose streams are addressed NAME/STREAM (bare names are the source "default", --database-url); NAME is 1 to 32 of a-z 0-9 _, starting with a letter. With --source, there is a default source only if --database-url or $DATABASE_URL is given`

// source is one source database a command works on.
type source struct {
	name, url string
}

// addSourceFlag registers --source on fs.
func addSourceFlag(fs *pflag.FlagSet, specs *[]string) {
	fs.StringArrayVar(specs, "source", nil, sourceHelp)
}

// sources resolves the source databases of a command: the default one
// (--database-url, $DATABASE_URL, or, when no --source is given, the local
// default) and each --source NAME=URL. Every problem is a usage error that
// names the flag at fault, with any password hidden.
func (g *globalFlags) sources(specs []string) ([]source, error) {
	var out []source
	explicit := g.databaseURL
	if explicit == "" {
		explicit = os.Getenv(devdb.EnvVar)
	}
	switch {
	case explicit != "":
		out = append(out, source{multisource.Default, explicit})
	case len(specs) == 0:
		out = append(out, source{multisource.Default, devdb.LocalURL})
	}
	seen := map[string]bool{}
	if len(out) > 0 {
		seen[multisource.Default] = true
	}
	named, err := parseSourceSpecs(specs, seen)
	return append(out, named...), err
}

// parseSourceSpecs parses --source NAME=URL entries, none of whose names
// may be in seen (the sources there are already); it adds theirs.
func parseSourceSpecs(specs []string, seen map[string]bool) ([]source, error) {
	var out []source
	for _, spec := range specs {
		name, url, ok := strings.Cut(spec, "=")
		if !ok || url == "" {
			return nil, usageError("--source %q: want NAME=URL", connstring.Redact(spec))
		}
		if err := multisource.ValidName(name); err != nil {
			// The URL redacted on its own: a key=value string's password=
			// may come first, right after the '='.
			return nil, usageError("--source %s=%s: %v", name, connstring.Redact(url), err)
		}
		if seen[name] {
			if name == multisource.Default {
				return nil, usageError("--source %s: the source default is already --database-url (or $DATABASE_URL); give it once", name)
			}
			return nil, usageError("--source %s: given twice", name)
		}
		seen[name] = true
		out = append(out, source{name, url})
	}
	return out, nil
}

// label names the source in messages about it, when there are several.
func (s source) label(all []source) string {
	if len(all) == 1 {
		return ""
	}
	return "source " + s.name + ": "
}

// poolConfig parses the source's URL: an error says the URL is wrong, not
// that its database does not answer.
func (s source) poolConfig(all []source) (*pgxpool.Config, error) {
	poolCfg, err := pgxpool.ParseConfig(s.url)
	if err == nil {
		return poolCfg, nil
	}
	if s.name == multisource.Default {
		return nil, fmt.Errorf("%s--database-url: %w", s.label(all), err)
	}
	return nil, fmt.Errorf("%s--source %s: %w", s.label(all), s.name, err)
}

// openSource opens a source's pool of at most maxConns connections, and
// checks that it answers and that its schema is current.
func openSource(ctx context.Context, s source, all []source, maxConns int32) (*sourcePool, error) {
	fail := func(err error) error { return fmt.Errorf("%s%w", s.label(all), err) }
	poolCfg, err := s.poolConfig(all)
	if err != nil {
		return nil, err
	}
	configureSourcePool(poolCfg, s.url, maxConns)
	store.ConfigurePool(poolCfg)
	pool, err := newSourcePool(ctx, poolCfg)
	if err != nil {
		return nil, fail(fmt.Errorf("database: %w", err))
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fail(fmt.Errorf("database %s: %w", connstring.Redact(s.url), err))
	}
	if err := requireMigrated(ctx, s.url); err != nil {
		pool.Close()
		return nil, fail(err)
	}
	return pool, nil
}

// requireMigrated fails, saying what to run, unless every migration is
// applied to the database at url.
func requireMigrated(ctx context.Context, url string) error {
	return withSQL(ctx, url, func(db *sql.DB) error {
		n, err := migrations.Pending(ctx, db)
		if err == nil && n > 0 {
			err = fmt.Errorf("%d schema migration(s) pending; run `outboxd migrate` first", n)
		}
		return err
	})
}

// migrateSources applies pending migrations to every source in turn,
// printing one line per source (prefixed with its name when there are
// several). It stops at the first failure, which names its source.
func migrateSources(ctx context.Context, all []source, log *slog.Logger, out func(format string, args ...any)) error {
	for _, s := range all {
		err := withSQL(ctx, s.url, func(db *sql.DB) error {
			res, err := migrations.Up(ctx, db, log.With("source", s.name))
			if err != nil {
				return err
			}
			if len(res.Applied) == 0 {
				out("%sschema is up to date at version %d\n", s.label(all), res.Version)
			} else {
				out("%sapplied %v; schema is at version %d\n", s.label(all), res.Applied, res.Version)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("%s%w", s.label(all), err)
		}
	}
	return nil
}

// Connection budget of a source. Each source has its own pool, of
// --max-db-conns connections unless its URL says otherwise with pgx's
// pool_max_conns=N (any pool_* parameter of pgxpool is taken from the URL),
// plus its engine's LISTEN connection.
//
// An idle engine still works its pool: about 40 discovery rounds a second,
// readiness checks, housekeeping. The pool reuses its idle connections in
// turn, so none sits idle long enough for an idle timeout, and the ones a
// chance overlap of that work opened would stay for good (measured: 4 pool
// connections for an idle source). So a quiet source, one that made fewer
// than quietAcquiresPerSecond database calls over the last quietWindow,
// keeps one idle connection: every quarter of quietWindow, the idle
// connections beyond one are closed. It holds 2 (LISTEN and that one) but
// for up to a quarter of a second after an overlap, and opens a connection
// only per overlap.
//
// The trimming is not done in pgxpool's AfterRelease hook: with the hook,
// pgxpool returns a released connection to the pool in a goroutine, so two
// statements in a row (a ping, then a query) found the pool empty and
// opened a connection for the second, which the hook then closed: 47 new
// PostgreSQL sessions a second for 50 idle sources, each a backend start.
// A busy source keeps what it opened, up to its budget, and so does one
// whose discovery found events lately (within DiscoveryQuietAfter, 10 s),
// however few: a source with an event every 200 ms makes about 60 calls
// a second with no relay (one every 20 ms, about 120: the call count is
// no measure of use), but its round, ack and claims overlap, so trimming
// it opened a connection about once a second (measured at 20 events a
// second: 1.2 new sessions a second per such source), each a backend
// start that loads the catalog and compiles and plans outbox's functions
// anew.
const (
	quietWindow            = time.Second
	quietAcquiresPerSecond = 100
)

// sourcePool is a source's pool, trimmed while quiet by the process's
// poolTrimmer.
type sourcePool struct {
	*pgxpool.Pool
	// mu is held while the pool is trimmed and when it closes, so that
	// nothing trims a closed pool.
	mu     sync.Mutex
	closed bool
	// counts are the pool's acquire counts at the trimmer's last four
	// ticks, tick the trimmer's ticks since the pool joined (the
	// trimmer's alone).
	counts [4]int64
	tick   int
	// inUse, once its engine is built (setInUse), says whether the source
	// had events lately: such a pool is not trimmed however few its calls.
	inUse atomic.Pointer[func() bool]
	// opened numbers the pool's connections in the order they were opened
	// (by *pgx.Conn), so that a trim keeps the oldest (see trimIdle).
	opened  sync.Map
	openSeq atomic.Int64
	// checks counts the trimmer's looks at the pool by what it found, for
	// the metrics (see sourcePoolCollector).
	checks [trimOutcomes]atomic.Int64
}

// What the trimmer found when it looked at a pool (trimIfQuiet).
type trimOutcome int

const (
	// trimmedQuiet: few calls and no event lately, so its idle connections
	// but the oldest were closed (none when it had fewer than 2).
	trimmedQuiet trimOutcome = iota
	// keptBusy: enough calls over the last quietWindow.
	keptBusy
	// keptInUse: few calls, but the source had events lately.
	keptInUse
	trimOutcomes
)

// String is the outcome's label value in outboxd_source_pool_trim_checks_total.
func (o trimOutcome) String() string {
	return [trimOutcomes]string{"trimmed", "busy", "in_use"}[o]
}

// setInUse tells the trimmer whether the source had events lately (see
// server.Server.FoundEventsLately).
func (p *sourcePool) setInUse(f func() bool) { p.inUse.Store(&f) }

// followEngine has the trimmer ask the replica's engine of source name
// whether the source had events lately, once that engine exists.
func (p *sourcePool) followEngine(rep *app.Replica, name string) {
	if e := rep.Source(name); e != nil {
		p.setInUse(e.FoundEventsLately)
	}
}

// Close stops trimming the pool and closes it (idempotent).
func (p *sourcePool) Close() {
	trimmer.remove(p)
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.closed = true
		p.Pool.Close()
	}
}

// newSourcePool opens the pool of cfg and has it trimmed (see trimIdle).
func newSourcePool(ctx context.Context, cfg *pgxpool.Config) (*sourcePool, error) {
	p := &sourcePool{}
	afterConnect, beforeClose := cfg.AfterConnect, cfg.BeforeClose
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		if afterConnect != nil {
			if err := afterConnect(ctx, conn); err != nil {
				return err
			}
		}
		p.opened.Store(conn, p.openSeq.Add(1))
		return nil
	}
	cfg.BeforeClose = func(conn *pgx.Conn) {
		p.opened.Delete(conn)
		if beforeClose != nil {
			beforeClose(conn)
		}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	p.Pool = pool
	trimmer.add(p)
	return p, nil
}

// trimmer trims every source pool of the process.
var trimmer = &poolTrimmer{pools: map[*sourcePool]struct{}{}}

// poolTrimmer trims the quiet source pools from one goroutine, every
// quarter of quietWindow, judging quietness over the whole window (the
// acquire counts of its last four quarters). One goroutine for all the
// sources: a replica of 50 idle sources wakes 4 times a second for this,
// not 200 (a wake-up of an idle Go process costs the scheduler more than
// the trim). It runs while it has pools.
type poolTrimmer struct {
	mu      sync.Mutex
	pools   map[*sourcePool]struct{}
	running bool
}

func (t *poolTrimmer) add(p *sourcePool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range p.counts {
		p.counts[i] = p.Stat().AcquireCount()
	}
	t.pools[p] = struct{}{}
	if !t.running {
		t.running = true
		go t.run()
	}
}

// remove stops trimming p (a trim under way finishes first, see Close).
func (t *poolTrimmer) remove(p *sourcePool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.pools, p)
}

func (t *poolTrimmer) run() {
	tk := time.NewTicker(quietWindow / 4)
	defer tk.Stop()
	for range tk.C {
		pools := t.snapshot()
		if pools == nil {
			return
		}
		for _, p := range pools {
			p.trimIfQuiet()
		}
	}
}

// snapshot returns the pools to look at, or nil when none is left (the
// trimmer has stopped; the next add starts it again). The pools are trimmed
// outside the trimmer's lock: closing a connection is network I/O, which
// must not hold up adding or removing another source.
func (t *poolTrimmer) snapshot() []*sourcePool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.pools) == 0 {
		t.running = false
		return nil
	}
	pools := make([]*sourcePool, 0, len(t.pools))
	for p := range t.pools {
		pools = append(pools, p)
	}
	return pools
}

// trimIfQuiet trims p when it made fewer than quietAcquiresPerSecond calls
// over the last quietWindow.
func (p *sourcePool) trimIfQuiet() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	n := p.Stat().AcquireCount()
	outcome := trimmedQuiet
	if n-p.counts[p.tick%4] >= int64(quietAcquiresPerSecond*quietWindow/time.Second) {
		outcome = keptBusy
	} else if f := p.inUse.Load(); f != nil && (*f)() {
		outcome = keptInUse
	}
	p.counts[p.tick%4] = n
	p.tick++
	p.checks[outcome].Add(1)
	if outcome == trimmedQuiet {
		ctx, cancel := context.WithTimeout(context.Background(), quietWindow/4)
		defer cancel()
		p.trimIdle(ctx)
	}
}

// trimIdle closes the pool's idle connections but the oldest. The oldest
// is the one to keep: its backend has loaded the catalog, compiled and
// planned outbox's functions, and pgx has prepared the server's statements
// on it; a connection an overlap just opened has done none of that, and
// keeping it instead (pgxpool hands out the most recently used first)
// made every overlap cost a quiet source all of that again, and more than
// the backend start itself.
func (p *sourcePool) trimIdle(ctx context.Context) {
	if p.Stat().IdleConns() < 2 {
		return
	}
	idle := p.AcquireAllIdle(ctx)
	keep := 0
	for i, c := range idle {
		if p.openOrder(c) < p.openOrder(idle[keep]) {
			keep = i
		}
	}
	for i, c := range idle {
		if i != keep {
			// Released closed, the connection leaves the pool.
			_ = c.Conn().Close(ctx)
		}
		c.Release()
	}
}

// openOrder is c's place in the order the pool's connections were opened.
func (p *sourcePool) openOrder(c *pgxpool.Conn) int64 {
	if n, ok := p.opened.Load(c.Conn()); ok {
		return n.(int64)
	}
	return math.MaxInt64
}

// configureSourcePool applies the source budget to a pool configuration
// parsed from url: a pool_max_conns in url wins over --max-db-conns.
func configureSourcePool(cfg *pgxpool.Config, url string, maxConns int32) {
	if !poolParams(url)["pool_max_conns"] {
		cfg.MaxConns = maxConns
	}
}

// poolParams are the pool_* parameters url sets, of a URL
// (postgres://...?pool_max_conns=4) or of a key=value connection string.
func poolParams(url string) map[string]bool {
	set := map[string]bool{}
	for _, kv := range connParams(url) {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "pool_") {
			set[k] = true
		}
	}
	return set
}

// connParams splits the parameters of url: a URL's query, or a key=value
// connection string's words.
func connParams(url string) []string {
	if i := strings.Index(url, "://"); i >= 0 {
		_, query, _ := strings.Cut(url[i:], "?")
		if query == "" {
			return nil
		}
		return strings.Split(query, "&")
	}
	return strings.Fields(url)
}

// withoutPoolParams is url without its pool_* parameters, for connections
// that are not of a pool (the LISTEN connection, migrations, schema
// checks): pgx.ParseConfig would send them to the server as settings,
// which refuses them (FATAL: unrecognized configuration parameter).
func withoutPoolParams(url string) string {
	if len(poolParams(url)) == 0 {
		return url
	}
	keep := func(kv string) bool { return !strings.HasPrefix(kv, "pool_") }
	if i := strings.Index(url, "://"); i >= 0 {
		base, query, _ := strings.Cut(url, "?")
		params := slices.DeleteFunc(strings.Split(query, "&"), func(kv string) bool { return !keep(kv) })
		if len(params) == 0 {
			return base
		}
		return base + "?" + strings.Join(params, "&")
	}
	return strings.Join(slices.DeleteFunc(strings.Fields(url), func(kv string) bool { return !keep(kv) }), " ")
}
