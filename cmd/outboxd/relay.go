package main

import (
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

func relayCommand(g *globalFlags) *cobra.Command {
	var (
		client      clientFlags
		sinkURL     string
		relayID     string
		streams     []string
		maxInFlight int
		leaseTTL    time.Duration
		drain       time.Duration
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

It reconnects while the server is unavailable, and exits with an error when the
server refuses its token (UNAUTHENTICATED, PERMISSION_DENIED) on any call. On
SIGTERM or SIGINT it stops taking deliveries, lets publishes under way finish for
up to --drain-timeout while keeping their leases, acks them, and then closes its
stream: the leases of publishes still running are released without counting a
failure against their events.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			log, err := g.logger(os.Stderr)
			if err != nil {
				return err
			}
			stopTracing, err := startTracing(ctx, "outboxd-relay", log)
			if err != nil {
				return err
			}
			defer stopTracing()
			if sinkURL == "" {
				return fmt.Errorf("--sink is required (stdout://, nats://host:port, amqp://user:pass@host:port/?exchange=..., redis://host:port/0, https://host/path?secret_file=..., kafka://host:port)")
			}
			if relayID == "" {
				host, _ := os.Hostname()
				relayID = fmt.Sprintf("%s-%d", host, os.Getpid())
			}
			s, err := sink.Open(ctx, sinkURL, sink.Options{Logger: log})
			if err != nil {
				return err
			}
			defer s.Close()
			conn, err := dialServer(cmd, &client)
			if err != nil {
				return err
			}
			defer conn.Close()
			r, err := relay.NewRunner(relay.Config{
				Conn: conn, Publisher: s, RelayID: relayID, Streams: streams,
				MaxInFlight: maxInFlight, LeaseTTL: leaseTTL, DrainTimeout: drain, Logger: log,
				MessagingSystem: sink.MessagingSystem(sinkURL),
			})
			if err != nil {
				return err
			}
			log.Info("relay running", "server", client.server, "sink", sink.Redact(sinkURL), "relay_id", relayID)
			return r.Run(ctx)
		},
	}
	fl := cmd.Flags()
	client.register(fl)
	fl.StringVar(&sinkURL, "sink", "", "where to publish: stdout://, nats://host:port, amqp://user:pass@host:port/vhost?exchange=..., redis://host:port/db, https://host/path?secret_file=..., kafka://host:port")
	fl.StringVar(&relayID, "relay-id", "", "name shown to operators (default hostname-pid)")
	fl.StringSliceVar(&streams, "streams", nil, "streams to relay (default all)")
	fl.IntVar(&maxInFlight, "max-in-flight", 64, "deliveries outstanding at once (the relay's credit)")
	fl.DurationVar(&leaseTTL, "lease-ttl", 0, "lease TTL to ask for (default: the server's)")
	fl.DurationVar(&drain, "drain-timeout", relay.DefaultDrainTimeout, "on shutdown, how long publishes under way may take to finish")
	return cmd
}
