// Package console is outboxd's operator console: server-rendered pages on
// the HTTP port (streams and their lag, aggregates in trouble with their
// attempts, an events browser, relays, and the operator actions) with a
// little vanilla JavaScript for the live lag chart. Templates, styles and
// script are embedded; nothing is loaded from elsewhere.
//
// # A client, not a back door
//
// The console is a client of the AdminService: every page and action is a
// gRPC call over the replica's in-process connection (app.DialInProcess),
// carrying the logged-in token as its bearer token, so the interceptors
// authorize it exactly as they would a call from `outboxd` on the command
// line, stream limits and audit actor included. The only call that does not
// go through them is the lag sampler's (Config.Lag), which records GetLag
// every SampleInterval (or, when a sample is slow, ration.Share times its
// duration after it began) into a bounded ring for the chart; its samples
// are filtered by the viewer's streams before they are shown.
//
// # Sources
//
// With several source databases (serve --source) the AdminService is
// internal/multisource's router, which sends each call to the source its
// stream's (or event id's) "source/" prefix names, and whose answers name
// their streams the same way. The console learns the sources from
// GetLag.sources and asks with addresses ("orders/" for every stream of
// orders), so every link stays in its source; a page that picks no source
// asks all of them (the source picker's "all sources"); see sources.go.
// With default alone none of this shows.
//
// # Sessions
//
// The login form posts the token once; the console keeps it server-side in
// a session named by a random id in an HttpOnly, SameSite=Strict cookie
// (Secure when the request came over TLS). Sessions end after
// Config.SessionTTL, after Config.IdleTimeout without a request, at logout,
// and when the token is revoked (it is looked up again on every request).
// The token never appears in a URL, a page or a log line.
//
// Every POST needs the session's synchronizer token (a hidden form field)
// and, when the browser sends one, an Origin (or Referer) naming this host.
//
// Without tokens the console follows `serve`'s loopback rule: Config.Open
// (serve sets it on a loopback HTTP address when gRPC does not require
// client certificates; --insecure-no-auth never does) serves it without
// login, actions recorded as "console@<address>"; otherwise it refuses every
// page. Without login it also refuses peers that are not loopback and
// requests whose Host is not a loopback name, against DNS rebinding.
package console
