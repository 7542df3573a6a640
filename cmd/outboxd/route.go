package main

import (
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/relay/sink"
)

// route is one Subscribe stream of a relay: the streams of one source a
// sink serves, or the rest of that source's. One --route naming streams of
// several sources is one route per source, sharing the sink (a Subscribe
// stream serves one source).
type route struct {
	spec    string   // as given, for messages (the URL redacted by the caller)
	index   int      // which --route it came from; routes of one share its sink
	source  string   // the source all its streams are of
	streams []string // addresses as the server takes them; nil for default's catch-all
	exclude []string // a catch-all's: every stream of its source another route names
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

// splitAddress reads a stream address as --route and --streams take it:
// "stream" (of source default) or "source/stream", where stream may be "*"
// for every stream of the source. It returns the source and the stream,
// or an error that says what is wrong with a bad source name.
func splitAddress(name string) (source, stream string, err error) {
	source, stream = multisource.SplitStream(name)
	if source == multisource.Default {
		return source, stream, nil
	}
	if strings.Contains(source, "*") {
		return "", "", fmt.Errorf("%q spans sources: a Subscribe stream serves one source, so name each source (orders/payments,billing/payments)", name)
	}
	if err := multisource.ValidName(source); err != nil {
		return "", "", fmt.Errorf("%q: %w", name, err)
	}
	return source, stream, nil
}

// parseRoutes reads --route values, "STREAMS=URL" where STREAMS is a
// comma-separated list of stream names, each of source default or written
// "source/stream", or a catch-all: "*" for every stream of default no other
// route names, "source/*" for every stream of that source no other route
// names. Routes must be disjoint: a stream named twice, a second catch-all
// of a source, or a pattern (the server filters by exact names, so
// "billing.*" cannot be honoured there) is refused with the route at fault.
// A route naming streams of several sources becomes one route per source,
// in the order the sources first appear.
func parseRoutes(specs []string) ([]route, error) {
	var (
		routes   []route
		owner    = map[string]int{} // address -> spec index
		catchAll = map[string]int{} // source -> index in routes
	)
	for i, spec := range specs {
		names, sinkURL, ok := strings.Cut(spec, "=")
		if !ok || names == "" || sinkURL == "" {
			return nil, fmt.Errorf("--route %q: want STREAMS=SINK_URL, e.g. billing,invoices=kafka://host:9092, orders/sales_order=nats://host:4222 or *=nats://host:4222", redactRoute(spec))
		}
		bySource := map[string]int{} // source -> index in routes, for this spec
		for _, n := range strings.Split(names, ",") {
			src, stream, err := splitAddress(n)
			if err != nil {
				return nil, fmt.Errorf("--route %q: %w", redactRoute(spec), err)
			}
			addr := multisource.JoinStream(src, stream)
			j, seen := bySource[src]
			if !seen {
				j = len(routes)
				bySource[src] = j
				routes = append(routes, route{spec: spec, index: i, source: src, sinkURL: sinkURL})
			}
			r := &routes[j]
			if stream == "*" {
				if k, taken := catchAll[src]; taken {
					return nil, fmt.Errorf("--route %q: a second catch-all (%s) of source %q; route %q already takes every other stream of it", redactRoute(spec), n, src, redactRoute(routes[k].spec))
				}
				if len(r.streams) > 0 {
					return nil, fmt.Errorf("--route %q: %q takes every stream of source %q, so the route must not name others of it", redactRoute(spec), n, src)
				}
				catchAll[src] = j
				if src != multisource.Default {
					// The server reads "source/*" as every stream of source.
					r.streams = []string{addr}
				}
				continue
			}
			switch {
			case strings.ContainsAny(stream, "*>?"):
				return nil, fmt.Errorf("--route %q: %q is a pattern; the server selects streams by exact name, so list them (billing.eu,billing.us) and give the rest to a * (or source/*) route", redactRoute(spec), n)
			case !routeStreamName.MatchString(stream):
				return nil, fmt.Errorf("--route %q: %q is not a stream name (want ^[a-z][a-z0-9_.-]{0,127}$, or source/name)", redactRoute(spec), n)
			}
			if k, ok := catchAll[src]; ok && k == j {
				return nil, fmt.Errorf("--route %q: %q is of source %q, whose catch-all this route already is", redactRoute(spec), n, src)
			}
			if k, taken := owner[addr]; taken {
				return nil, fmt.Errorf("--route %q: stream %q is already routed by %q; routes must not overlap, or an event would go to one sink or the other at random", redactRoute(spec), addr, redactRoute(specs[k]))
			}
			owner[addr] = i
			r.streams = append(r.streams, addr)
		}
	}
	for src, j := range catchAll {
		for addr := range owner {
			if s, _ := multisource.SplitStream(addr); s == src {
				routes[j].exclude = append(routes[j].exclude, addr)
			}
		}
		slices.Sort(routes[j].exclude)
	}
	return routes, nil
}

// streamsRoutes is the routes of --streams and --exclude-streams with one
// --sink: one route unless the streams name several sources, then one per
// source (a Subscribe stream serves one source). Exclusions belong to a
// catch-all, so they cannot go with streams of several sources.
func streamsRoutes(streams, exclude []string, sinkURL string) ([]route, error) {
	var routes []route
	bySource := map[string]int{}
	for _, n := range streams {
		src, _, err := splitAddress(n)
		if err != nil {
			return nil, fmt.Errorf("--streams: %w", err)
		}
		j, seen := bySource[src]
		if !seen {
			j = len(routes)
			bySource[src] = j
			routes = append(routes, route{source: src, sinkURL: sinkURL})
		}
		routes[j].streams = append(routes[j].streams, n)
	}
	for _, n := range exclude {
		if _, _, err := splitAddress(n); err != nil {
			return nil, fmt.Errorf("--exclude-streams: %w", err)
		}
	}
	switch {
	case len(routes) > 1 && len(exclude) > 0:
		return nil, fmt.Errorf("--streams names streams of several sources, each its own subscription; --exclude-streams cannot go with them: give each source a --route (orders/*=URL takes the rest of source orders)")
	case len(routes) == 0:
		routes = []route{{source: multisource.Default, sinkURL: sinkURL}}
	}
	routes[0].exclude = exclude
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
