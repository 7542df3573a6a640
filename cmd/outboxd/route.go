package main

import (
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/outboxd/outboxd/relay/sink"
)

// route is one --route: the streams a sink serves, or the rest.
type route struct {
	spec    string   // as given, for messages (the URL redacted by the caller)
	streams []string // nil for the catch-all
	exclude []string // the catch-all's: every stream another route names
	sinkURL string
}

// label names the route in relay ids and logs.
func (r route) label() string {
	if r.streams == nil {
		return "*"
	}
	return strings.Join(r.streams, ",")
}

var routeStreamName = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,127}$`)

// parseRoutes reads --route values, "STREAMS=URL" where STREAMS is a
// comma-separated list of stream names or "*" for every stream no other
// route names. Routes must be disjoint: a stream named twice, a second
// "*", or a pattern (the server filters by exact names, so "billing.*"
// cannot be honoured there) is refused with the route at fault.
func parseRoutes(specs []string) ([]route, error) {
	var (
		routes   []route
		owner    = map[string]int{} // stream -> route index
		catchAll = -1
	)
	for i, spec := range specs {
		names, sinkURL, ok := strings.Cut(spec, "=")
		if !ok || names == "" || sinkURL == "" {
			return nil, fmt.Errorf("--route %q: want STREAMS=SINK_URL, e.g. billing,invoices=kafka://host:9092 or *=nats://host:4222", redactRoute(spec))
		}
		r := route{spec: spec, sinkURL: sinkURL}
		if names == "*" {
			if catchAll >= 0 {
				return nil, fmt.Errorf("--route %q: a second catch-all (*); route %q already takes every other stream", redactRoute(spec), redactRoute(specs[catchAll]))
			}
			catchAll = i
			routes = append(routes, r)
			continue
		}
		for _, n := range strings.Split(names, ",") {
			switch {
			case strings.ContainsAny(n, "*>?"):
				return nil, fmt.Errorf("--route %q: %q is a pattern; the server selects streams by exact name, so list them (billing.eu,billing.us) and give the rest to a * route", redactRoute(spec), n)
			case !routeStreamName.MatchString(n):
				return nil, fmt.Errorf("--route %q: %q is not a stream name (want ^[a-z][a-z0-9_.-]{0,127}$)", redactRoute(spec), n)
			}
			if j, taken := owner[n]; taken {
				return nil, fmt.Errorf("--route %q: stream %q is already routed by %q; routes must not overlap, or an event would go to one sink or the other at random", redactRoute(spec), n, redactRoute(specs[j]))
			}
			owner[n] = i
			r.streams = append(r.streams, n)
		}
		routes = append(routes, r)
	}
	if catchAll >= 0 {
		for n := range owner {
			routes[catchAll].exclude = append(routes[catchAll].exclude, n)
		}
		slices.Sort(routes[catchAll].exclude)
	}
	return routes, nil
}

// redactRoute hides a password in a route's sink URL.
func redactRoute(spec string) string {
	names, u, ok := strings.Cut(spec, "=")
	if !ok || !strings.Contains(u, "@") {
		return spec
	}
	return names + "=" + sink.Redact(u)
}
