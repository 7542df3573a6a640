package auth

import (
	"path"
	"strings"
	"testing"
)

// fuzzMarker stands in for a secret wherever the fuzzer puts "§". It is
// longer than any value an error message may quote, and no escape sequence
// of %q starts with 'S', so it can appear in an error only if a secret was
// printed.
const fuzzMarker = "SECRETMARKER0123456789"

// FuzzParseTokens checks that parsing any token file or variable never
// panics, never prints a secret in an error, and, when it succeeds, accepts
// exactly the secrets written on its lines under their names. Seeds are in
// testdata/fuzz/FuzzParseTokens.
func FuzzParseTokens(f *testing.F) {
	f.Add("a relay §\n", false)
	f.Add("a rley §\nb relay short\n", false)
	f.Add("a § relay", false)
	f.Add("§ relay "+relaySecret, false)
	f.Add("a relay "+relaySecret+" streams=billing.*,sales_order # c\nb admin,relay "+HashToken(adminSecret), false)
	f.Add("a relay §; b admin §", true)
	f.Add("a relay § streams=§", false)
	f.Fuzz(func(t *testing.T, data string, env bool) {
		content := strings.ReplaceAll(data, "§", fuzzMarker)
		entries, err := parseText(content, env)
		if err != nil {
			if strings.Contains(err.Error(), fuzzMarker) {
				t.Fatalf("error prints a secret:\n%v", err)
			}
			return
		}
		set := &tokenSet{entries: entries}
		a := &Authenticator{}
		a.set.Store(set)
		content = strings.TrimPrefix(content, "\ufeff")
		if env {
			content = strings.ReplaceAll(content, ";", "\n")
		}
		lines := 0
		for line := range strings.SplitSeq(content, "\n") {
			fields := strings.Fields(line)
			for i, fl := range fields {
				if strings.HasPrefix(fl, "#") {
					fields = fields[:i]
					break
				}
			}
			if len(fields) == 0 {
				continue
			}
			lines++
			name, secret := fields[0], fields[2]
			if strings.HasPrefix(secret, hashPrefix) {
				continue
			}
			p, ok := a.authenticate(secret)
			if !ok || p.Name != name {
				t.Fatalf("line %q: secret authenticates as %v, %v; want %s", line, p, ok, name)
			}
			if len(p.Roles) == 0 || !validName(p.Name) {
				t.Fatalf("line %q: accepted as %+v", line, *p)
			}
			for _, pat := range p.Streams {
				if !validPattern(pat) {
					t.Fatalf("line %q: accepted pattern %q", line, pat)
				}
			}
		}
		if lines != len(entries) {
			t.Fatalf("%d token lines gave %d entries", lines, len(entries))
		}
	})
}

// FuzzParseAuthorization checks the authorization header parser: it never
// panics, accepts only well-formed bearer tokens (which round-trip), and
// never echoes the header in an error.
func FuzzParseAuthorization(f *testing.F) {
	f.Add("Bearer "+relaySecret, false)
	f.Add("bearer  abc==", false)
	f.Add("Basic dXNlcjpwYXNz", false)
	f.Add("Bearer "+relaySecret, true)
	f.Add("Bearer a b", false)
	f.Add("", false)
	f.Fuzz(func(t *testing.T, value string, twice bool) {
		values := []string{value}
		if twice {
			values = append(values, value)
		}
		token, err := parseAuthorization(values)
		if err != nil {
			_, rest, _ := strings.Cut(value, " ")
			if rest = strings.TrimSpace(rest); len(rest) >= MinSecretLen && strings.Contains(err.Error(), rest) {
				t.Fatalf("error %q echoes the token", err)
			}
			return
		}
		if twice {
			t.Fatal("two authorization headers accepted")
		}
		if token == "" || len(token) > MaxSecretLen || !validToken(token) {
			t.Fatalf("accepted token %q", token)
		}
		if !strings.HasSuffix(value, " "+token) || !strings.EqualFold(value[:6], "bearer") {
			t.Fatalf("token %q is not what %q carries", token, value)
		}
		if again, err := parseAuthorization([]string{"Bearer " + token}); err != nil || again != token {
			t.Fatalf("token %q does not round-trip: %q, %v", token, again, err)
		}
	})
}

// FuzzGlobMatch checks the stream pattern matcher against path.Match, which
// means the same over stream-name characters.
func FuzzGlobMatch(f *testing.F) {
	f.Add("billing.*", "billing.invoice")
	f.Add("*a*b", "aab")
	f.Add("a*b*c", "acb")
	f.Fuzz(func(t *testing.T, pattern, name string) {
		got := globMatch(pattern, name) // must not panic on any input
		if !validPattern(pattern) || strings.ContainsAny(name, "*/[]\\?") {
			return
		}
		if want, err := path.Match(pattern, name); err != nil || got != want {
			t.Fatalf("globMatch(%q, %q) = %v; path.Match says %v, %v", pattern, name, got, want, err)
		}
	})
}
