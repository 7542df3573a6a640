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
// one (also one that reads "xxxxx").
func HasPassword(conn string) bool {
	_, found := redact(conn)
	return found
}

// Redact returns conn with its passwords replaced by Hidden, whether conn is
// a URL or a key=value string; everything else is kept as written. A URL's
// user information ends at its last '@' before the first '/', '?' or '#',
// since a password may hold an '@' (url.Parse would refuse it unescaped, but
// an error may still have to name the string).
func Redact(conn string) string {
	redacted, _ := redact(conn)
	return redacted
}

// redact is Redact, and whether it found a password to hide.
func redact(conn string) (redacted string, found bool) {
	hide := func(re *regexp.Regexp, s, with string) string {
		if !re.MatchString(s) {
			return s
		}
		found = true
		return re.ReplaceAllString(s, with)
	}
	scheme, rest, ok := strings.Cut(conn, "://")
	if !ok {
		return hide(keywordPassword, conn, "$1${2}"+Hidden), found
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	if at := strings.LastIndex(rest[:end], "@"); at >= 0 {
		if user, _, hasPassword := strings.Cut(rest[:at], ":"); hasPassword {
			rest, found = user+":"+Hidden+rest[at:], true
		}
	}
	return scheme + "://" + hide(queryPassword, rest, "${1}"+Hidden), found
}
