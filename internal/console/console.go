package console

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"time"

	"google.golang.org/grpc"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/ration"
)

// Defaults of Config.
const (
	DefaultSampleInterval = 10 * time.Second
	DefaultHistory        = time.Hour
	DefaultSessionTTL     = 12 * time.Hour
	DefaultIdleTimeout    = time.Hour
	// maxSessions bounds the session table; the oldest session goes first.
	maxSessions = 10000
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config configures a Console.
type Config struct {
	// Conn reaches the AdminService; every page and action is a call on it
	// with the session's token. Required.
	Conn grpc.ClientConnInterface
	// Authenticator checks tokens at login and on every request. Nil means
	// the server runs without tokens: see Open.
	Authenticator *auth.Authenticator
	// Open, without an Authenticator, serves the console without login,
	// as serve does gRPC on loopback. Without it (and without tokens) every
	// page is refused with an explanation.
	Open bool
	// Lag samples lag for the chart, without authentication (the samples
	// are filtered per viewer). Nil: the chart shows only what the page
	// polls itself.
	Lag func(context.Context, *outboxv1.GetLagRequest) (*outboxv1.GetLagResponse, error)
	// SampleInterval is how often Lag is sampled. Default 10s.
	SampleInterval time.Duration
	// History is how far back the chart reaches (the ring holds
	// History/SampleInterval samples). Default 1h.
	History time.Duration
	// SessionTTL is a session's longest life. Default 12h.
	SessionTTL time.Duration
	// IdleTimeout ends a session unused this long. Default 1h.
	IdleTimeout time.Duration
	// PollInterval is how often the overview refreshes, in the browser.
	// Default 5s.
	PollInterval time.Duration
	// Logger receives logins, logouts and actions (names, never tokens).
	// Nil discards.
	Logger *slog.Logger
}

// Console serves the operator console. Create it with New, mount Handler,
// and run Run for the lag sampler.
type Console struct {
	cfg      Config
	log      *slog.Logger
	admin    outboxv1.AdminServiceClient
	pages    map[string]*template.Template
	sessions *sessions
	ring     *lagRing
	mux      *http.ServeMux

	// The sampler's clock (tests replace it).
	now   func() time.Time
	after func(time.Duration) <-chan time.Time
}

// New validates cfg and builds the console.
func New(cfg Config) (*Console, error) {
	if cfg.Conn == nil {
		return nil, errors.New("console: Config.Conn is required")
	}
	cfg.SampleInterval = cmp.Or(cfg.SampleInterval, DefaultSampleInterval)
	cfg.History = cmp.Or(cfg.History, DefaultHistory)
	cfg.SessionTTL = cmp.Or(cfg.SessionTTL, DefaultSessionTTL)
	cfg.IdleTimeout = cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, 5*time.Second)
	for name, d := range map[string]time.Duration{"SampleInterval": cfg.SampleInterval, "History": cfg.History,
		"SessionTTL": cfg.SessionTTL, "IdleTimeout": cfg.IdleTimeout, "PollInterval": cfg.PollInterval} {
		if d < 0 {
			return nil, fmt.Errorf("console: Config.%s %v must not be negative", name, d)
		}
	}
	if cfg.History < cfg.SampleInterval {
		return nil, fmt.Errorf("console: Config.History %v is shorter than Config.SampleInterval %v", cfg.History, cfg.SampleInterval)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	pages, err := parseTemplates()
	if err != nil {
		return nil, err
	}
	c := &Console{
		cfg: cfg, log: log, admin: outboxv1.NewAdminServiceClient(cfg.Conn), pages: pages,
		sessions: newSessions(cfg.SessionTTL, cfg.IdleTimeout),
		ring:     newLagRing(int(cfg.History / cfg.SampleInterval)),
		now:      time.Now,
		after:    time.After,
	}
	c.routes()
	return c, nil
}

// Handler serves the console's pages under "/".
func (c *Console) Handler() http.Handler { return c }

// ServeHTTP applies the headers every response gets, then routes.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// Everything is served from here: no inline script, no framing.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("X-Frame-Options", "DENY")
	c.mux.ServeHTTP(w, r)
}

// sampleTimeout ends a lag sample that runs longer than this. Not the
// interval: a database far behind takes seconds for one (4.3 s of
// PostgreSQL with a million aggregates pending), and a sample cut short at
// the interval would be work wasted every time.
const sampleTimeout = time.Minute

// Run samples lag every SampleInterval until ctx is done, or, when a sample
// is slow, ration.Share times its duration after it began: a lag read costs
// PostgreSQL in proportion to the aggregates pending, and sampled every 10 s
// regardless, a backlog of a million aggregates kept 43 % of a core on the
// console's samples alone while the server worked through it.
func (c *Console) Run(ctx context.Context) error {
	if c.cfg.Lag == nil {
		<-ctx.Done()
		return nil
	}
	for {
		began := c.now()
		c.sample(ctx)
		took := c.now().Sub(began)
		select {
		case <-ctx.Done():
			return nil
		case <-c.after(ration.Pause(c.cfg.SampleInterval, took) - took):
		}
	}
}

func (c *Console) sample(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, sampleTimeout)
	defer cancel()
	lag, err := c.cfg.Lag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		if ctx.Err() == nil {
			c.log.Warn("console: sampling lag", "err", err)
		}
		return
	}
	c.ring.add(time.Now(), lag)
}

func (c *Console) routes() {
	m := http.NewServeMux()
	static, _ := fs.Sub(staticFS, "static")
	m.Handle("GET /static/", http.StripPrefix("/static/", cacheStatic(http.FileServerFS(static))))
	m.HandleFunc("GET /login", c.loginPage)
	m.HandleFunc("POST /login", c.login)
	m.HandleFunc("POST /logout", c.page(c.logout))
	m.HandleFunc("GET /{$}", c.page(c.overview))
	m.HandleFunc("GET /api/lag", c.page(c.lagJSON))
	m.HandleFunc("GET /aggregates", c.page(c.aggregates))
	m.HandleFunc("GET /aggregate", c.page(c.aggregate))
	m.HandleFunc("GET /events", c.page(c.events))
	m.HandleFunc("GET /event", c.page(c.event))
	m.HandleFunc("GET /actions", c.page(c.actions))
	m.HandleFunc("GET /relays", c.page(c.relays))
	m.HandleFunc("GET /bulk", c.page(c.bulkForm))
	m.HandleFunc("POST /bulk", c.page(c.bulkPreview))
	m.HandleFunc("POST /bulk/confirm", c.page(c.bulkApply))
	m.HandleFunc("GET /purge", c.page(c.purgeForm))
	m.HandleFunc("POST /purge", c.page(c.purgeDryRun))
	m.HandleFunc("POST /act/retry", c.page(c.retry))
	m.HandleFunc("POST /act/skip", c.page(c.skip))
	m.HandleFunc("POST /act/accept-gap", c.page(c.acceptGap))
	c.mux = m
}

func cacheStatic(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=300")
		h.ServeHTTP(w, r)
	})
}
