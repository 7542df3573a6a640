// Package connstring hides the secrets of a PostgreSQL connection string
// before a log line or an error shows it. pgx (like libpq) takes a password
// in three places, and each is hidden: the URL's user information
// (postgres://user:PASSWORD@host/db), its query (?password=PASSWORD, also
// sslpassword, which unlocks a client key), and a key=value string
// (host=h password=PASSWORD, a quoted value included).
package connstring

import (
	"regexp"
	"strings"
)

// Hidden replaces every secret Redact hides.
const Hidden = "xxxxx"

var (
	// A password or sslpassword parameter of a URL's query, up to the next
	// parameter or the fragment. (Keys in any case: libpq reads only lower
	// case, but hiding more than it reads costs nothing.)
	queryPassword = regexp.MustCompile(`(?i)([?&](?:ssl)?password=)[^&#]*`)
	// A password or sslpassword key of a key=value string, with white space
	// around the '=' and a value bare or single-quoted (with backslash
	// escapes), as libpq parses it.
	keywordPassword = regexp.MustCompile(`(?i)(^|\s)((?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|\S*)`)
)

// HasPassword reports whether conn carries a password where Redact hides
// one.
func HasPassword(conn string) bool { return Redact(conn) != conn }

// Redact returns conn with its passwords replaced by Hidden, whether conn is
// a URL or a key=value string; everything else is kept as written. A URL's
// user information ends at its last '@' before the first '/', '?' or '#',
// since a password may hold an '@' (url.Parse would refuse it unescaped, but
// an error may still have to name the string).
func Redact(conn string) string {
	scheme, rest, ok := strings.Cut(conn, "://")
	if !ok {
		return keywordPassword.ReplaceAllString(conn, "$1${2}"+Hidden)
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	if at := strings.LastIndex(rest[:end], "@"); at >= 0 {
		if user, _, hasPassword := strings.Cut(rest[:at], ":"); hasPassword {
			rest = user + ":" + Hidden + rest[at:]
		}
	}
	return scheme + "://" + queryPassword.ReplaceAllString(rest, "${1}"+Hidden)
}
