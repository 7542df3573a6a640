// Command outboxd is the transactional outbox delivery service: the server
// (serve, dev), a relay worker (relay), and schema management (migrate).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := rootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outboxd:", err)
		os.Exit(1)
	}
}
