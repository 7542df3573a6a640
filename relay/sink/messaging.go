package sink

import (
	"net/url"
	"strings"
)

// messagingSystems maps a sink URL's scheme to the OpenTelemetry
// messaging.system its publish spans carry: the conventions' names where
// they have one (kafka, rabbitmq), the broker's own name otherwise.
var messagingSystems = map[string]string{
	"stdout": "stdout",
	"nats":   "nats",
	"amqp":   "rabbitmq",
	"amqps":  "rabbitmq",
	"redis":  "redis",
	"rediss": "redis",
	"http":   "webhook",
	"https":  "webhook",
	"kafka":  "kafka",
}

// MessagingSystem is the messaging.system of the sink rawURL names (for
// relay.Config.MessagingSystem), or "" when its scheme is not one Open
// knows.
func MessagingSystem(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return ""
	}
	return messagingSystems[strings.ToLower(u.Scheme)]
}
