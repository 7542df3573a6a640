package sink_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/outboxd/outboxd/relay/sink"
)

func TestEscapeSubjectToken(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"order-42":  "order-42",
		"a.b":       "a%2Eb",
		"x*y":       "x%2Ay",
		"p>q":       "p%3Eq",
		"has space": "has%20space",
		"100%":      "100%25",
		"%2E":       "%252E",
		"":          "%",
		"tab\there": "tab%09here",
		"é":         "%C3%A9",
		"\x00\x7f":  "%00%7F",
		"~!$_{}":    "~!$_{}",
	}
	for in, want := range cases {
		got := sink.EscapeSubjectToken(in)
		if got != want {
			t.Errorf("EscapeSubjectToken(%q) = %q, want %q", in, got, want)
		}
		back, err := sink.UnescapeSubjectToken(got)
		if err != nil || back != in {
			t.Errorf("UnescapeSubjectToken(%q) = %q, %v; want %q", got, back, err, in)
		}
	}
}

func TestUnescapeSubjectTokenRejectsNonCanonical(t *testing.T) {
	t.Parallel()
	for _, tok := range []string{
		"",       // NATS tokens are never empty
		"a%",     // truncated
		"a%2",    // truncated
		"a%2e",   // lower-case hex
		"a%ZZ",   // not hex
		"%41",    // escapes 'A', which is never escaped
		"a.b",    // raw separator
		"a b",    // raw space
		"a*",     // raw wildcard
		"%%",     // '%' must start an escape
		"é",      // raw non-ASCII
		"ab%3E>", // raw '>' after a valid escape
	} {
		if got, err := sink.UnescapeSubjectToken(tok); err == nil {
			t.Errorf("UnescapeSubjectToken(%q) = %q, want an error", tok, got)
		}
	}
}

// FuzzSubjectTokenRoundTrip checks the escaping invariants for arbitrary
// bytes: the token is one valid, printable-ASCII NATS token and decodes to
// the input.
func FuzzSubjectTokenRoundTrip(f *testing.F) {
	for _, s := range []string{"", "a.b", "*", ">", "%", "%25", " ", "ключ", "\xff\xfe", "a..b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tok := sink.EscapeSubjectToken(s)
		if tok == "" || strings.ContainsAny(tok, ".*> \t\r\n") || !utf8.ValidString(tok) {
			t.Fatalf("EscapeSubjectToken(%q) = %q, not a valid single token", s, tok)
		}
		for i := 0; i < len(tok); i++ {
			if tok[i] <= ' ' || tok[i] >= 0x7F {
				t.Fatalf("EscapeSubjectToken(%q) = %q has byte 0x%02X", s, tok, tok[i])
			}
		}
		back, err := sink.UnescapeSubjectToken(tok)
		if err != nil || back != s {
			t.Fatalf("round trip of %q via %q gave %q, %v", s, tok, back, err)
		}
	})
}
