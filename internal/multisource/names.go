package multisource

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/outboxd/outboxd/internal/auth"
)

// Default is the source --database-url names: a bare stream name is one of
// its streams, and its lease tokens carry no source prefix.
const Default = auth.DefaultSource

// MaxNameLen is the longest source name.
const MaxNameLen = 32

var nameRE = regexp.MustCompile(`^[a-z][a-z0-9_]{0,31}$`)

// ValidName returns an error unless name is a valid source name: 1 to 32
// lower-case letters, digits and _, starting with a letter. Names appear in
// stream addresses, token prefixes, metric labels and logs, so they are
// kept to what needs no quoting anywhere.
func ValidName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("source name %.40q: want 1 to %d lower-case letters, digits and _, starting with a letter", name, MaxNameLen)
	}
	return nil
}

// SplitStream splits a stream address "source/stream" into its source and
// stream; a bare name is a stream of Default. The parts are not validated.
func SplitStream(address string) (source, stream string) {
	if src, s, ok := strings.Cut(address, "/"); ok {
		return src, s
	}
	return Default, address
}

// JoinStream is the address of stream in source: the bare name for Default.
func JoinStream(source, stream string) string {
	if source == Default || source == "" {
		return stream
	}
	return source + "/" + stream
}

// tokenSep separates a source from an engine's lease token, which is
// base64url and so never holds it.
const tokenSep = "."

// wrapToken binds an engine's lease token to its source.
func wrapToken(source, token string) string {
	if source == Default {
		return token
	}
	return source + tokenSep + token
}

// unwrapToken returns the source a lease token is bound to and the engine's
// token. A token with no prefix is Default's.
func unwrapToken(token string) (source, inner string) {
	if src, t, ok := strings.Cut(token, tokenSep); ok {
		return src, t
	}
	return Default, token
}
