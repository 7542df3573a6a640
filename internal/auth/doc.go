// Package auth authenticates outboxd's gRPC callers with bearer tokens and
// authorizes them by role and stream.
//
// # Tokens
//
// A token file holds one token per line:
//
//	# name         roles        secret                                                                   [streams=pattern,...]
//	billing-relay  relay        sha256:28587cb3a1a5d40861abe5a2511672464e997a3ee5b807e7a19fea134498bd0c  streams=billing.*
//	orders-relay   relay        mKX2v8Qm3cYb7n1Zr0pL4sTq9wUeHjAa                                         streams=sales_order
//	ops            admin,relay  sha256:89e1fa8725570a68730f193a5e77f446dbc0ce0b4c4789b531d457513ba6321d  # on-call
//	dashboard      viewer       sha256:f00ec0c4415d21f851a6fe4289457d89abb2fdc4f3f6f41e34f57dfe26bb217b  # console, read-only
//
// Blank lines and text after '#' are ignored. Fields are separated by spaces
// or tabs:
//
//   - name: who holds the token, 1 to 128 of A-Z a-z 0-9 _ . @ -, starting
//     with a letter or digit. It is the identity logs and audit records show
//     (the actor); the secret never appears anywhere but the file. A name may
//     appear on several lines only with the same roles and streams, to hold
//     an old and a new secret during rotation.
//   - roles: relay (RelayService: Subscribe, Ack, Nack, ExtendLease,
//     ListSources), admin (AdminService), viewer (the read-only
//     AdminService methods, see ReadOnlyAdminMethods: GetLag, ListRelays,
//     GetAggregate, ListEvents, ListAggregates, ListAttempts,
//     ListOperatorActions; what the console's pages need), or several
//     separated by commas. Admin does not imply
//     relay; it implies everything viewer grants.
//   - secret: the token itself, 16 to 1024 of A-Z a-z 0-9 - . _ ~ + / with
//     optional trailing '=' (RFC 6750; e.g. openssl rand -base64 32), or
//     "sha256:" and the 64 hex digits of its SHA-256 (printf %s "$TOKEN" |
//     sha256sum; HashToken), so the file need not hold secrets. SHA-256
//     without salt is enough because tokens are random, not passwords; the
//     16-byte minimum can only be checked for plaintext secrets. No two lines
//     may hold the same secret.
//   - streams= (optional): comma-separated stream patterns the token is
//     limited to. A pattern is a stream name in which '*' matches any run of
//     characters: "billing.*", "sales_order", "*" (a run such as "**" is
//     refused: it would match everything without being "*", which alone
//     grants every stream). Without it the token may
//     access every stream. On a server with several source databases a
//     pattern may name a source, with '*' allowed there too:
//     "orders/billing.*", "*/payments", "orders/*"; a pattern without one is
//     of the source "default", and "*" alone is still every stream of every
//     source (see Principal.ForSource).
//
// The same entries can come from an environment variable (conventionally
// OUTBOXD_TOKENS, see Config.EnvVar), separated by newlines or ';' (a '#'
// comment there ends at the next ';'):
//
//	OUTBOXD_TOKENS='ci-relay relay mKX2v8Qm3cYb7n1Zr0pL4sTq9wUeHjAa streams=ci.*; ops admin sha256:89e1fa8725570a68730f193a5e77f446dbc0ce0b4c4789b531d457513ba6321d'
//
// Errors name the source and line ("tokens:3: roles: unknown role \"rley\"")
// and describe a bad secret without printing it; every problem in a file is
// reported at once.
//
// # Rotation
//
// Authenticator.Watch rereads the sources on SIGHUP and when the token
// file's directory changes, and swaps the whole set atomically: a removed
// token is refused from the next request on, and the streams it opened (a
// relay's Subscribe) are closed with codes.Unauthenticated. A file that
// fails to parse leaves the previous set in force (the error is logged). To
// rotate without a gap: add the new secret under the same name, move clients
// over, remove the old line.
//
// # Policy
//
// /outbox.v1.RelayService/* needs relay, the read-only AdminService
// methods need viewer or admin, the rest of /outbox.v1.AdminService/* needs
// admin, /grpc.health.v1.Health/* needs nothing, /grpc.reflection.* needs
// nothing unless Config.ProtectReflection (then any valid token), and any
// other method needs admin (closed by default). Missing, malformed or
// unknown tokens get codes.Unauthenticated; a valid token without the role
// gets codes.PermissionDenied. Streams are checked by the handlers, which
// know which streams a request touches: AuthorizeStreams,
// AuthorizeAllStreams, Principal.AllowsStream.
//
// # Wiring
//
//	a, err := auth.New(auth.Config{File: *tokenFile, EnvVar: auth.DefaultEnvVar, Logger: log})
//	eg.Go(func() error { return a.Watch(ctx) }) // SIGHUP and file changes
//	grpc.NewServer(
//		grpc.ChainUnaryInterceptor(recovery..., a.UnaryServerInterceptor()),
//		grpc.ChainStreamInterceptor(recovery..., a.StreamServerInterceptor()),
//	)
//
// Put recovery (and logging or metrics, if added) before the auth
// interceptors, so refusals are recorded and a panic anywhere is recovered,
// and request validation after them, so that unauthenticated callers learn
// nothing about what a valid request looks like.
//
// When auth is disabled no interceptor is installed, PrincipalFrom returns
// false, and the Authorize helpers allow everything.
//
// Clients read their token with LoadClientToken (a file, or
// $OUTBOXD_TOKEN), send it with WithBearerToken, and ask CheckTransport
// whether it may go over plaintext: only to a loopback address or when the
// operator insists.
package auth
