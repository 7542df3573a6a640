package store

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// The channels the outbox schema's functions and this package's operator
// actions notify on. Producers never notify.
const (
	// ChannelWakeup: aggregates were made ready (a discovery round, a
	// release, an operator's retry).
	ChannelWakeup = "outbox_wakeup"
	// ChannelReleased: a lease ended away from its holder's replica (an ack
	// there, an operator's skip); the payload is the holder's session id.
	ChannelReleased = "outbox_released"
)

// Listen opens a connection of its own to databaseURL, named
// applicationName (operators find it in pg_stat_activity), LISTENs on
// channels, calls ready once it listens, and then notified for each
// notification (with the process id of the backend that sent it), until ctx
// ends or the connection fails; it returns why. Not
// one of the pool's connections: a LISTEN binds its session, and waiting for
// notifications holds the connection for good.
func Listen(ctx context.Context, databaseURL, applicationName string, channels []string,
	ready func(), notified func(pid uint32, channel, payload string)) error {
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return err
	}
	cfg.RuntimeParams["application_name"] = applicationName
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, ch := range channels {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
			return err
		}
	}
	ready()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		notified(n.PID, n.Channel, n.Payload)
	}
}
