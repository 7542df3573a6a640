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

// anySource is the source part of a stream address that stands for every
// source the server lists (*/payments, */*): such a route is expanded into
// one route per source at run time (expandRoutes).
const anySource = "*"

// splitAddress reads a stream address as --route and --streams take it:
// "stream" (of source default) or "source/stream", where stream may be "*"
// for every stream of the source and source may be "*" for every source.
// It returns the source and the stream, or an error that says what is
// wrong with a bad source name.
func splitAddress(name string) (source, stream string, err error) {
	source, stream = multisource.SplitStream(name)
	switch {
	case source == multisource.Default || source == anySource:
		return source, stream, nil
	case strings.Contains(source, "*"):
		return "", "", fmt.Errorf("%q: a source pattern is * alone (*/payments: payments of every source), not part of a name", name)
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
// names. The source may be "*", every source the server lists: "*/payments"
// is payments of each, "*/*" every stream of each that no other route
// names; such a route has source "*" here and is expanded per source at
// run time (expandRoutes), where a route naming the source itself takes
// precedence. Routes must be disjoint: a stream named twice (*/payments
// twice included), a second catch-all of a source (or of "*"), or a
// pattern (the server filters by exact names, so "billing.*" cannot be
// honoured there) is refused with the route at fault. A route naming
// streams of several sources becomes one route per source, in the order
// the sources first appear.
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
					// The server reads "source/*" as every stream of source;
					// "*/*" is expanded per source.
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
// source (a Subscribe stream serves one source); streams of source "*"
// (*/payments, */*) are one route expanded per source at run time, as
// parseRoutes' are. Exclusions belong to a catch-all, so they cannot go
// with streams of several sources or of "*", and are never of source "*"
// themselves; a name given twice in either list is refused.
func streamsRoutes(streams, exclude []string, sinkURL string) ([]route, error) {
	var routes []route
	bySource := map[string]int{}
	for i, n := range streams {
		src, stream, err := splitAddress(n)
		if err != nil {
			return nil, fmt.Errorf("--streams: %w", err)
		}
		if slices.Contains(streams[:i], n) {
			return nil, fmt.Errorf("--streams: %q is given twice", n)
		}
		if src == anySource && !routeStreamName.MatchString(stream) && stream != "*" {
			return nil, fmt.Errorf("--streams: %q is not a stream name (want */name, or */* for every stream of every source)", n)
		}
		j, seen := bySource[src]
		if !seen {
			j = len(routes)
			bySource[src] = j
			routes = append(routes, route{source: src, sinkURL: sinkURL})
		}
		routes[j].streams = append(routes[j].streams, n)
	}
	if j, ok := bySource[anySource]; ok && slices.Contains(routes[j].streams, "*/*") && len(routes[j].streams) > 1 {
		return nil, fmt.Errorf("--streams: */* takes every stream of every source, so it must be the only */ entry")
	}
	for i, n := range exclude {
		src, _, err := splitAddress(n)
		switch {
		case err != nil:
			return nil, fmt.Errorf("--exclude-streams: %w", err)
		case src == anySource:
			return nil, fmt.Errorf("--exclude-streams: %q spans sources, but exclusions belong to the catch-all of one source: name the source (orders/x), or give the rest of each source a --route (*/*=URL beside */x=URL2)", n)
		case slices.Contains(exclude[:i], n):
			return nil, fmt.Errorf("--exclude-streams: %q is given twice", n)
		}
	}
	switch {
	case len(routes) > 1 && len(exclude) > 0:
		return nil, fmt.Errorf("--streams names streams of several sources, each its own subscription; --exclude-streams cannot go with them: give each source a --route (orders/*=URL takes the rest of source orders)")
	case len(routes) == 1 && routes[0].source == anySource && len(exclude) > 0:
		return nil, fmt.Errorf("--streams %s spans sources, each its own subscription; --exclude-streams cannot go with it: name the streams, or give each source a --route", strings.Join(streams, ","))
	case len(routes) == 0:
		routes = []route{{source: multisource.Default, sinkURL: sinkURL}}
	}
	routes[0].exclude = exclude
	return routes, nil
}

// spansSources splits routes into those of one named source and those of
// source "*", to be expanded per source (expandRoutes).
func spansSources(routes []route) (fixed, wild []route) {
	for _, r := range routes {
		if r.source == anySource {
			wild = append(wild, r)
		} else {
			fixed = append(fixed, r)
		}
	}
	return fixed, wild
}

// expandRoutes is the routes of source "*" (wild) as they apply to the
// sources the server lists for each (sources[i] for wild[i]): one route per
// source and wild route, sharing its sink (index), in the order of wild,
// then of sources. A route naming the source
// itself (fixed) takes precedence: a stream fixed names is left out of
// "*/stream" for that source, and a source with a catch-all of its own
// (orders/*, or * for default) gets nothing from wild routes. "*/*" of a
// source is that source's catch-all, without the streams any route names
// for it. A wild route left with no stream for a source yields none.
func expandRoutes(fixed, wild []route, sources [][]string) []route {
	named := map[string]bool{}    // addresses fixed routes name
	catchAll := map[string]bool{} // sources fixed routes take the rest of
	var wildNamed []string        // streams of "*/stream" entries
	for _, r := range fixed {
		if r.streams == nil || len(r.streams) == 1 && strings.HasSuffix(r.streams[0], "/*") {
			catchAll[r.source] = true
			continue
		}
		for _, a := range r.streams {
			named[a] = true
		}
	}
	for _, w := range wild {
		for _, a := range w.streams {
			if _, stream := multisource.SplitStream(a); stream != "*" {
				wildNamed = append(wildNamed, stream)
			}
		}
	}
	var out []route
	for i, w := range wild {
		for _, src := range sources[i] {
			if catchAll[src] {
				continue
			}
			r := route{spec: w.spec, index: w.index, source: src, sinkURL: w.sinkURL}
			if len(w.streams) == 1 && w.streams[0] == "*/*" {
				for a := range named {
					if s, _ := multisource.SplitStream(a); s == src {
						r.exclude = append(r.exclude, a)
					}
				}
				for _, stream := range wildNamed {
					if a := multisource.JoinStream(src, stream); !named[a] {
						r.exclude = append(r.exclude, a)
					}
				}
				slices.Sort(r.exclude)
				if src != multisource.Default {
					r.streams = []string{multisource.JoinStream(src, "*")}
				}
				out = append(out, r)
				continue
			}
			for _, a := range w.streams {
				_, stream := multisource.SplitStream(a)
				if a := multisource.JoinStream(src, stream); !named[a] {
					r.streams = append(r.streams, a)
				}
			}
			if len(r.streams) > 0 {
				out = append(out, r)
			}
		}
	}
	return out
}

// redactRoute hides a password in a route's sink URL.
func redactRoute(spec string) string {
	names, u, ok := strings.Cut(spec, "=")
	if !ok || !strings.Contains(u, "@") {
		return spec
	}
	return names + "=" + sink.Redact(u)
}
