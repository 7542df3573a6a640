package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

func relayCommand(g *globalFlags) *cobra.Command {
	var (
		client       clientFlags
		sinkURL      string
		routes       []string
		relayID      string
		streams      []string
		exclude      []string
		maxInFlight  int
		perAggregate int
		leaseTTL     time.Duration
		drain        time.Duration
		sourcesEvery time.Duration
	)
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Run a relay: subscribe to outboxd, publish to a broker, ack on durable acceptance",
		Long: `relay publishes every delivered event to --sink and acks it once the broker has
durably accepted it. Sinks: stdout:// (JSON lines), nats://host:port
(JetStream), amqp://user:pass@host:port/vhost?exchange=... (RabbitMQ),
redis://host:port/db?stream=... (Redis Streams),
https://host/path?secret_file=... (signed webhooks) and
kafka://host:port?topic=... (Kafka);
see the README's sink table or relay/sink for their parameters.

--route STREAMS=URL, given several times, serves several sinks from one
process: STREAMS is a comma-separated list of stream names, or * for every
stream no other route names (the server excludes those). Each route is its own
Subscribe stream with its own --max-in-flight credit, so a slow broker holds
back only its own streams. Routes must not overlap, and names are exact: the
server selects streams by name, not by pattern.

Against a server with several source databases (serve --source NAME=URL),
a stream of a source other than default is written SOURCE/STREAM
(--route orders/sales_order=nats://..., --streams orders/sales_order), and
SOURCE/* is every stream of that source that no other route names (* alone
is default's). A Subscribe stream serves one source, so a route, or
--streams, naming streams of several sources opens one stream per source
(each with its own --max-in-flight credit), sharing the route's sink; its
relay id gets the streams of each (relay-id/orders/sales_order). A bad
route or stream name (a source name that is not 1 to 32 lower-case letters,
digits and _, or a stream pattern such as orders/pay*) exits 2 at start.

A source of * means every source the server serves to the relay's token:
--route '*/payments=URL' (or --streams '*/payments') is payments of each,
--route '*/*=URL' every stream of each that no other route names. The relay
asks the server which sources it serves where the token allows the route's
streams (ListSources; a server that predates it serves default alone) at start, every --sources-interval and
whenever its connection comes back, opens one Subscribe stream per source (each with its own --max-in-flight
credit, sharing the route's sink; relay-id/SOURCE/payments), starts one for
a source added while it runs, and stops, as at shutdown, the one of a
source removed. A route naming the source itself takes precedence over a
* route for that source: orders/payments=URL2 beside */payments=URL sends
orders' payments to URL2, and orders/*=URL3 takes every stream of orders,
payments included. */payments beats */*, as a named stream beats a
catch-all. Naming */payments twice, two */* routes, a stream twice in
--streams or --exclude-streams, or --exclude-streams with a * source exits 2
at start. A pattern that matches no source is logged as a warning.

It reconnects while the server is unavailable, and exits with an error when the
server refuses its token (UNAUTHENTICATED, PERMISSION_DENIED) on any call, but
for a subscription of a * source refused PERMISSION_DENIED (an older server
lists sources where the token has other streams only): that one is logged as
a warning and left stopped until the server's list of sources changes. On
SIGTERM, SIGINT or SIGHUP it stops taking deliveries, lets publishes under
way finish for up to --drain-timeout while keeping their leases, acks them,
and then closes its stream: the leases of publishes still running are
released without counting a failure against their events.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// A hang-up (the terminal closed, or a SIGHUP sent to every
			// outboxd process after editing tokens) stops the relay as
			// SIGTERM does: its default, an exit on the spot, would drop
			// the publishes under way unacked, to be delivered again.
			ctx, stopOnHUP := signal.NotifyContext(cmd.Context(), syscall.SIGHUP)
			defer stopOnHUP()
			var rules flagRules
			rules.want(maxInFlight >= 1, "--max-in-flight %d: want 1 or more", maxInFlight)
			rules.want(perAggregate >= 1 && perAggregate <= max(maxInFlight, 1),
				"--max-in-flight-per-aggregate %d: want 1 to --max-in-flight (%d)", perAggregate, maxInFlight)
			rules.want(leaseTTL >= 0, "--lease-ttl %v: want 0 (the server's) or more", leaseTTL)
			rules.want(drain >= 0, "--drain-timeout %v: want 0 or more", drain)
			rules.want(sourcesEvery > 0, "--sources-interval %v: want more than 0", sourcesEvery)
			if err := rules.err(); err != nil {
				return err
			}
			log, err := g.logger(os.Stderr)
			if err != nil {
				return err
			}
			stopTracing, err := startTracing(ctx, "outboxd-relay", log)
			if err != nil {
				return err
			}
			defer stopTracing()
			var rs []route
			switch {
			case len(routes) > 0 && (sinkURL != "" || len(streams) > 0 || len(exclude) > 0):
				return usageError("--route replaces --sink, --streams and --exclude-streams; give the streams in each route")
			case len(routes) > 0:
				if rs, err = parseRoutes(routes); err != nil {
					return withExitCode(exitUsage, err)
				}
			case sinkURL == "":
				return usageError("--sink (or --route) is required (stdout://, nats://host:port, amqp://user:pass@host:port/?exchange=..., redis://host:port/0, https://host/path?secret_file=..., kafka://host:port)")
			default:
				if rs, err = streamsRoutes(streams, exclude, sinkURL); err != nil {
					return withExitCode(exitUsage, err)
				}
			}
			if relayID == "" {
				host, _ := os.Hostname()
				relayID = fmt.Sprintf("%s-%d", host, os.Getpid())
			}
			// Open every sink before serving any, so a bad URL or an
			// unreachable broker stops the relay at start.
			conn, err := dialServer(cmd, &client)
			if err != nil {
				return err
			}
			defer conn.Close()
			sinks := map[int]relay.Sink{} // by --route: its sources share it
			for _, rt := range rs {
				if sinks[rt.index] == nil {
					s, err := sink.Open(ctx, rt.sinkURL, sink.Options{Logger: log})
					if err != nil {
						return err
					}
					defer s.Close()
					sinks[rt.index] = s
				}
			}
			fixed, wild := spansSources(rs)
			// newRunner builds the runner of one route (fixed or expanded
			// from a * route) and returns what runs it, saying so first.
			newRunner := func(rt route) (func(context.Context) error, error) {
				id := relayID
				if len(routes) > 0 || len(rs) > 1 || len(wild) > 0 {
					// relay_id is at most 128 characters.
					id = relayID + "/" + rt.label()
					id = id[:min(len(id), 128)]
				}
				r, err := relay.NewRunner(relay.Config{
					Conn: conn, Publisher: sinks[rt.index], RelayID: id, Streams: rt.streams, ExcludeStreams: rt.exclude,
					MaxInFlight: maxInFlight, MaxInFlightPerAggregate: perAggregate,
					LeaseTTL: leaseTTL, DrainTimeout: drain, Logger: log.With("route", rt.label()),
					MessagingSystem: sink.MessagingSystem(rt.sinkURL),
				})
				if err != nil {
					return nil, err
				}
				return func(ctx context.Context) error {
					log.Info("relay starting", "server", client.server, "sink", sink.Redact(rt.sinkURL), "relay_id", id,
						"source", rt.source, "streams", rt.label(), "exclude_streams", rt.exclude)
					return r.Run(ctx)
				}, nil
			}
			runs := make([]func(context.Context) error, len(fixed))
			for i, rt := range fixed {
				if runs[i], err = newRunner(rt); err != nil {
					return err
				}
			}
			// One route failing (refused credentials) stops them all: a
			// relay that serves only some of its routes (or sources)
			// would look alive.
			eg, egCtx := errgroup.WithContext(ctx)
			for _, run := range runs {
				eg.Go(func() error { return run(egCtx) })
			}
			if len(wild) > 0 {
				if _, err := newRunner(route{index: wild[0].index, source: multisource.Default, sinkURL: wild[0].sinkURL}); err != nil {
					return err // a bad flag (--max-in-flight): say so at start
				}
				sf := &sourceFollower{
					client: outboxv1.NewRelayServiceClient(conn), conn: conn, fixed: fixed, wild: wild, every: sourcesEvery,
					log: log.With("component", "relay"),
					run: func(ctx context.Context, rt route) error {
						run, err := newRunner(rt)
						if err != nil {
							return err
						}
						return run(ctx)
					},
				}
				eg.Go(func() error { return sf.Run(egCtx) })
			}
			finished := announceDrain(ctx, log, drain)
			err = eg.Wait()
			finished(err)
			if status.Code(err) == codes.Unauthenticated && client.tokenSource == "" {
				err = fmt.Errorf("%w; outboxd sent no token: give it with --token-file FILE or in $%s", err, auth.DefaultClientEnvVar)
			}
			return err
		},
	}
	fl := cmd.Flags()
	client.register(fl)
	fl.StringVar(&sinkURL, "sink", "", "where to publish: stdout://, nats://host:port, amqp://user:pass@host:port/vhost?exchange=..., redis://host:port/db, https://host/path?secret_file=..., kafka://host:port")
	fl.StringVar(&relayID, "relay-id", "", "name shown to operators (default hostname-pid)")
	fl.StringSliceVar(&streams, "streams", nil, "streams to relay (default all of source default); source/name for another source's, source/* for all of it, */name or */* for every source the server serves; one subscription per source")
	fl.StringSliceVar(&exclude, "exclude-streams", nil, "streams never to relay (for a catch-all beside relays that take them)")
	fl.StringArrayVar(&routes, "route", nil, "STREAMS=SINK_URL, repeatable: serve several sinks, each for its streams (comma-separated names, source/name for a source other than default, */name for every source, or * / source/* / */* for the rest of a source); replaces --sink and --streams")
	fl.IntVar(&maxInFlight, "max-in-flight", relay.DefaultMaxInFlight, "deliveries outstanding at once (the relay's credit), and so the most publishes under way and payloads held; lower it for a receiver that takes few requests at once")
	fl.IntVar(&perAggregate, "max-in-flight-per-aggregate", 1, "events of one aggregate outstanding at once (its window); each aggregate's events are still published one at a time, in order, but the next needs no server round trip")
	fl.DurationVar(&leaseTTL, "lease-ttl", 0, "lease TTL to ask for (default: the server's)")
	fl.DurationVar(&sourcesEvery, "sources-interval", DefaultSourcesInterval, "with routes or --streams of every source (*/payments), how often to ask the server which sources it serves")
	fl.DurationVar(&drain, "drain-timeout", relay.DefaultDrainTimeout, "on shutdown, how long publishes under way may take to finish")
	return cmd
}

// announceDrain says when ctx ends that the drain has started, and returns
// what says, once the relay's work has returned, that it is over: a relay
// that goes quiet for up to --drain-timeout at shutdown otherwise looks hung.
// context.AfterFunc runs its function in a goroutine of its own, so once that
// has started (stop reports false) finished waits for its line: "relay
// stopped" never comes first, nor alone because the process exited before
// that goroutine ran.
func announceDrain(ctx context.Context, log *slog.Logger, drain time.Duration) (finished func(err error)) {
	saidStopping := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(saidStopping)
		log.Info("relay stopping: publishes under way may finish and be acked", "drain_timeout", drain)
	})
	return func(err error) {
		if stop() {
			return // the work ended by itself (an error): no drain to report
		}
		<-saidStopping
		if err == nil {
			log.Info("relay stopped")
		}
	}
}
