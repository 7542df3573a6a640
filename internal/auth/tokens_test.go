package auth

import (
	"os"
	"os/exec"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// parseText parses content as a file named "t" (env false) or a variable
// "$V" (env true).
func parseText(content string, env bool) ([]entry, error) {
	p := newParser()
	source := "t"
	if env {
		source = "$V"
	}
	p.parse(content, source, env)
	return p.entries, p.err()
}

// The example in the package documentation must stay valid.
func TestDocExampleParses(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	inBlock := false
	for l := range strings.SplitSeq(string(src), "\n") {
		if strings.HasPrefix(l, "//\t# name") {
			inBlock = true
		}
		if inBlock {
			if !strings.HasPrefix(l, "//\t") {
				break
			}
			lines = append(lines, strings.TrimPrefix(l, "//\t"))
		}
	}
	if len(lines) != 5 {
		t.Fatalf("found %d example lines in doc.go, want 5", len(lines))
	}
	_, envExample, ok := strings.Cut(string(src), "//\tOUTBOXD_TOKENS='")
	envExample, _, _ = strings.Cut(envExample, "'")
	if entries, err := parseText(envExample, true); !ok || err != nil || len(entries) != 2 {
		t.Fatalf("the environment example in doc.go: %d entries, %v", len(entries), err)
	}
	a := newFromText(t, strings.Join(lines, "\n"), nil)
	for _, tc := range []struct {
		secret, name string
		roles        []Role
		streams      []string
	}{
		{"billing-relay-secret-0001", "billing-relay", []Role{RoleRelay}, []string{"billing.*"}},
		{"mKX2v8Qm3cYb7n1Zr0pL4sTq9wUeHjAa", "orders-relay", []Role{RoleRelay}, []string{"sales_order"}},
		{"ops-secret-0123456789abcdef", "ops", []Role{RoleRelay, RoleAdmin}, nil},
		{"dashboard-secret-0123456789", "dashboard", []Role{RoleViewer}, nil},
	} {
		p, ok := a.authenticate(tc.secret)
		if !ok {
			t.Fatalf("%s: secret not accepted", tc.name)
		}
		if p.Name != tc.name || !slices.Equal(p.Roles, tc.roles) || !slices.Equal(p.Streams, tc.streams) {
			t.Errorf("got %+v, want name %s roles %v streams %v", *p, tc.name, tc.roles, tc.streams)
		}
	}
}

func TestParseValid(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		content string
		env     bool
		want    []Principal // in order of entries
	}{
		{"empty", "", false, nil},
		{"comments and blanks", "# header\n\n   \t\n  # indented comment\n", false, nil},
		{
			"plain and hashed, CRLF, tabs, inline comment",
			"a\trelay\t" + relaySecret + "\r\n" +
				"b admin,relay " + HashToken(adminSecret) + " # ops\r\n",
			false,
			[]Principal{{Name: "a", Roles: []Role{RoleRelay}}, {Name: "b", Roles: []Role{RoleRelay, RoleAdmin}}},
		},
		{
			"roles normalised, streams sorted and deduplicated",
			"svc@example.com admin,relay " + relaySecret + " streams=sales_order,billing.*,sales_order\n",
			false,
			[]Principal{{Name: "svc@example.com", Roles: []Role{RoleRelay, RoleAdmin}, Streams: []string{"billing.*", "sales_order"}}},
		},
		{
			"name repeated with the same grant (rotation)",
			"r relay " + relaySecret + " streams=b.*\nr relay " + billingSecret + " streams=b.*\n",
			false,
			[]Principal{{Name: "r", Roles: []Role{RoleRelay}, Streams: []string{"b.*"}}, {Name: "r", Roles: []Role{RoleRelay}, Streams: []string{"b.*"}}},
		},
		{
			"hex digest in upper case, secret with base64 padding",
			"a relay sha256:" + strings.ToUpper(strings.TrimPrefix(HashToken(relaySecret), hashPrefix)) + "\nb relay QUJDREVGR0hJSktMTU5PUA==\n",
			false,
			[]Principal{{Name: "a", Roles: []Role{RoleRelay}}, {Name: "b", Roles: []Role{RoleRelay}}},
		},
		{
			"env: ';' and newlines separate entries",
			"a relay " + relaySecret + "; b admin " + adminSecret + "\n;c relay " + billingSecret,
			true,
			[]Principal{{Name: "a", Roles: []Role{RoleRelay}}, {Name: "b", Roles: []Role{RoleAdmin}}, {Name: "c", Roles: []Role{RoleRelay}}},
		},
		{"byte order mark", "\ufeffa relay " + relaySecret, false, []Principal{{Name: "a", Roles: []Role{RoleRelay}}}},
		{
			"viewer, alone and among others, in the fixed order",
			"v viewer " + relaySecret + "\nw admin,viewer,relay " + adminSecret + "\n",
			false,
			[]Principal{{Name: "v", Roles: []Role{RoleViewer}}, {Name: "w", Roles: []Role{RoleRelay, RoleViewer, RoleAdmin}}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			entries, err := parseText(tc.content, tc.env)
			if err != nil {
				t.Fatal(err)
			}
			if len(entries) != len(tc.want) {
				t.Fatalf("got %d entries, want %d", len(entries), len(tc.want))
			}
			for i, e := range entries {
				w := tc.want[i]
				if e.principal.Name != w.Name || !slices.Equal(e.principal.Roles, w.Roles) || !slices.Equal(e.principal.Streams, w.Streams) {
					t.Errorf("entry %d: got %+v, want %+v", i, *e.principal, w)
				}
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 20) // too long to be quoted: might be a secret
	for _, tc := range []struct {
		name    string
		content string
		env     bool
		want    []string // substrings of the error, in order
		hidden  []string // must not appear in the error
	}{
		{"too few fields", "a relay", false, []string{"t:1: has 2 fields"}, nil},
		{"too many fields", "a relay " + relaySecret + " streams=a b", false, []string{"t:1: has 5 fields"}, []string{relaySecret}},
		{"bad name", "-a relay " + relaySecret, false, []string{"t:1: name: want 1 to 128"}, []string{relaySecret}},
		{"name with unicode", "é relay " + relaySecret, false, []string{"t:1: name:"}, nil},
		{"name too long", strings.Repeat("n", 129) + " relay " + relaySecret, false, []string{"t:1: name:"}, nil},
		{"unknown role", "\n\na rley " + relaySecret, false, []string{`t:3: roles: unknown role "rley"`}, nil},
		{"empty role", "a relay, " + relaySecret, false, []string{`t:1: roles: unknown role ""`}, nil},
		{"role twice", "a relay,relay " + relaySecret, false, []string{"t:1: roles: relay is listed twice"}, nil},
		{"admin twice", "a admin,relay,admin " + relaySecret, false, []string{"t:1: roles: admin is listed twice"}, nil},
		{"viewer twice", "a viewer,viewer " + relaySecret, false, []string{"t:1: roles: viewer is listed twice"}, nil},
		{"short secret", "a relay short-secret", false, []string{"t:1: secret: is 12 bytes; want 16 to 1024"}, []string{"short-secret"}},
		{"long secret", "a relay " + strings.Repeat("s", 1025), false, []string{"t:1: secret: is 1025 bytes"}, nil},
		{"bad character", "a relay " + relaySecret + "!x", false, []string{"t:1: secret: has a character outside"}, []string{relaySecret}},
		{"padding only", "a relay ================", false, []string{"t:1: secret: has a character outside"}, nil},
		{"short digest", "a relay sha256:abc", false, []string{"t:1: secret: a hashed secret is sha256: then 64 hex digits, got 3"}, nil},
		{"non-hex digest", "a relay sha256:" + strings.Repeat("g", 64), false, []string{"not a hex digit"}, []string{strings.Repeat("g", 64)}},
		{"long digest", "a relay sha256:" + strings.Repeat("a", 66), false, []string{"t:1: secret: a hashed secret is sha256: then 64 hex digits, got 66"}, nil},
		{"colon in a secret", "a relay " + relaySecret + ":x", false, []string{"t:1: secret: has a character outside"}, []string{relaySecret}},
		{"streams empty", "a relay " + relaySecret + " streams=", false, []string{"t:1: streams: no patterns"}, nil},
		{"streams typo", "a relay " + relaySecret + " stream=a", false, []string{"t:1: streams: the optional fourth field must start with streams="}, nil},
		{"pattern upper case", "a relay " + relaySecret + " streams=a,Billing", false, []string{`t:1: streams: pattern 2 "Billing" is not a stream name`}, nil},
		{"pattern empty", "a relay " + relaySecret + " streams=a,,b", false, []string{`pattern 2 "" is not`}, nil},
		{"pattern starts with digit", "a relay " + relaySecret + " streams=1a", false, []string{`pattern 1 "1a"`}, nil},
		{"pattern too long", "a relay " + relaySecret + " streams=" + strings.Repeat("a", 129), false, []string{"pattern 1 (129 characters, not shown)"}, nil},
		{"pattern with two slashes", "a relay " + relaySecret + " streams=a/b/c", false, []string{`pattern 1 "a/b/c"`}, nil},
		{"source pattern with a dot", "a relay " + relaySecret + " streams=a.b/c", false, []string{`pattern 1 "a.b/c"`}, nil},
		{"source pattern upper case", "a relay " + relaySecret + " streams=Orders/c", false, []string{`pattern 1 "Orders/c"`}, nil},
		{"pattern with a run of stars", "a relay " + relaySecret + " streams=x,**", false, []string{`pattern 2 "**" has a run of *`, `write "*"`}, nil},
		{"source pattern with a run of stars", "a relay " + relaySecret + " streams=or***/b**", false, []string{`pattern 1 "or***/b**" has a run of *`, `write "or*/b*"`}, nil},
		{"source pattern empty", "a relay " + relaySecret + " streams=/c", false, []string{`pattern 1 "/c"`}, nil},
		{"source pattern too long", "a relay " + relaySecret + " streams=" + strings.Repeat("a", 33) + "/c", false, []string{"pattern 1 "}, nil},
		{"stream pattern empty after source", "a relay " + relaySecret + " streams=orders/", false, []string{`pattern 1 "orders/"`}, nil},
		{"pattern with bracket", "a relay " + relaySecret + " streams=a[b]", false, []string{`pattern 1 "a[b]"`}, nil},
		{
			"same secret twice",
			"a relay " + relaySecret + "\n# x\nb relay " + relaySecret,
			false, []string{"t:3: secret: same secret as t:1"}, []string{relaySecret},
		},
		{
			"same secret, once hashed",
			"a relay " + HashToken(relaySecret) + "\nb admin " + relaySecret,
			false, []string{"t:2: secret: same secret as t:1"}, nil,
		},
		{
			"name reused with other roles",
			"a relay " + relaySecret + "\na admin " + adminSecret,
			false, []string{"t:2: name is also used at t:1 with different roles or streams"}, nil,
		},
		{
			"name reused with other streams",
			"a relay " + relaySecret + " streams=x\na relay " + adminSecret + " streams=y",
			false, []string{"t:2: name is also used at t:1"}, nil,
		},
		{
			"every problem reported",
			"a rley " + relaySecret + "\nb relay short\n-c relay " + adminSecret,
			false, []string{"t:1: roles:", "t:2: secret:", "t:3: name:"}, nil,
		},
		{
			"several problems on one line",
			"-a rley short",
			false, []string{"t:1: name:", "t:1: roles:", "t:1: secret:"}, nil,
		},
		{
			"secret in the roles column is not printed",
			"a " + relaySecret + " relay",
			false, []string{"t:1: roles: unknown role (23 characters, not shown)", "t:1: secret: is 5 bytes"}, []string{relaySecret},
		},
		{"long values are never quoted", "a " + long + " " + long + " streams=" + long, false, []string{"t:1: roles:"}, []string{long}},
		{"env entries are numbered", "a relay " + relaySecret + ";b rley " + adminSecret, true, []string{`$V entry 2: roles: unknown role "rley"`}, []string{adminSecret}},
		{"too large", strings.Repeat("#", maxSourceBytes+1), false, []string{"t: is 1048577 bytes; at most 1048576"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseText(tc.content, tc.env)
			if err == nil {
				t.Fatal("no error")
			}
			msg := err.Error()
			rest := msg
			for _, w := range tc.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Fatalf("error %q\ndoes not contain %q (in order)", msg, w)
				}
				rest = rest[i+len(w):]
			}
			for _, h := range tc.hidden {
				if strings.Contains(msg, h) {
					t.Errorf("error %q reveals %q", msg, h)
				}
			}
		})
	}
}

func TestParseCapsReportedErrors(t *testing.T) {
	t.Parallel()
	content := strings.Repeat("a relay short\n", maxReportedErrors+5)
	_, err := parseText(content, false)
	if err == nil {
		t.Fatal("no error")
	}
	msg := err.Error()
	if n := strings.Count(msg, "secret: is 5 bytes"); n != maxReportedErrors {
		t.Errorf("%d problems listed, want %d", n, maxReportedErrors)
	}
	if !strings.HasSuffix(msg, "and 5 more problem(s)") {
		t.Errorf("error does not end with the count of the rest: %q", msg)
	}
}

// HashToken must agree with the command the docs tell operators to run.
func TestHashTokenMatchesSha256sum(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("sha256sum"); err != nil {
		t.Skip("sha256sum not installed")
	}
	cmd := exec.Command("sha256sum")
	cmd.Stdin = strings.NewReader(relaySecret)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := HashToken(relaySecret), "sha256:"+strings.Fields(string(out))[0]; got != want {
		t.Errorf("HashToken = %s, sha256sum says %s", got, want)
	}
}

func TestGenerateToken(t *testing.T) {
	t.Parallel()
	a, err := GenerateToken()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := GenerateToken()
	if a == b || len(a) != 43 || !validToken(a) {
		t.Fatalf("GenerateToken gave %q and %q", a, b)
	}
	if _, err := parseText("x relay "+a+"\ny relay "+HashToken(b), false); err != nil {
		t.Fatalf("generated tokens do not parse: %v", err)
	}
}

func TestGlobMatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		pattern, name string
		want          bool
	}{
		{"sales_order", "sales_order", true},
		{"sales_order", "sales_orders", false},
		{"sales_order", "sales_orde", false},
		{"billing.*", "billing.invoice", true},
		{"billing.*", "billing.", true},
		{"billing.*", "billing.a.b", true},
		{"billing.*", "billing", false},
		{"billing.*", "billingx", false},
		{"billing.*", "sales_order", false},
		{"*", "anything", true},
		{"*", "", true},
		{"*.x", "a.b.x", true},
		{"*.x", "a.b.y", false},
		{"a*b*c", "aXbYc", true},
		{"a*b*c", "abc", true},
		{"a*b*c", "acb", false},
		{"a**", "a", true},
		{"*a*a*a*a*b", strings.Repeat("a", 100), false},
	} {
		if got := globMatch(tc.pattern, tc.name); got != tc.want {
			t.Errorf("globMatch(%q, %q) = %v, want %v", tc.pattern, tc.name, got, tc.want)
		}
		// Over this alphabet path.Match has the same meaning.
		if ref, err := path.Match(tc.pattern, tc.name); err != nil || ref != tc.want {
			t.Errorf("path.Match(%q, %q) = %v, %v; the table is wrong", tc.pattern, tc.name, ref, err)
		}
	}
}

func TestValidPatternAcceptsStreamNames(t *testing.T) {
	t.Parallel()
	streamName := regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,127}$`)
	for _, s := range []string{"a", "sales_order", "billing.invoice-v2", strings.Repeat("a", 128)} {
		if !streamName.MatchString(s) || !validPattern(s) {
			t.Errorf("stream name %q is not a valid pattern", s)
		}
	}
	for _, s := range []string{"*", "*.x", "a*", "billing.*", "orders/billing.*", "*/payments", "o*/*", strings.Repeat("a", 32) + "/x"} {
		if !validPattern(s) {
			t.Errorf("pattern %q refused", s)
		}
	}
}

// TestForSourceProjectsPatterns: a token's patterns reach the engine of one
// source as that source's patterns without the source; a bare pattern is of
// the default source only; a token with nothing of a source gets nothing.
func TestForSourceProjectsPatterns(t *testing.T) {
	t.Parallel()
	// orders/payments and */payments both give orders "payments", listed once.
	p := &Principal{Name: "r", Streams: []string{"*/payments", "billing.*", "or*/sales", "orders/a", "orders/payments"}}
	for _, tc := range []struct {
		source string
		want   []string
	}{
		{DefaultSource, []string{"billing.*", "payments"}},
		{"orders", []string{"a", "payments", "sales"}},
		{"ordnance", []string{"payments", "sales"}},
		{"shipping", []string{"payments"}},
	} {
		q, ok := p.ForSource(tc.source)
		if !ok || !slices.Equal(q.Streams, tc.want) || q.Name != "r" {
			t.Errorf("ForSource(%q) = %v, %v; want %v", tc.source, q, ok, tc.want)
		}
	}
	only := &Principal{Name: "o", Streams: []string{"orders/*"}}
	if q, ok := only.ForSource(DefaultSource); ok {
		t.Errorf("a token of orders/* reaches default as %v", q.Streams)
	}
	if q, ok := only.ForSource("orders"); !ok || !q.AllStreams() {
		t.Errorf("orders/* is not every stream of orders: %v, %v", q, ok)
	}
	for _, all := range []*Principal{{Name: "all"}, {Name: "star", Streams: []string{"*"}}} {
		if q, ok := all.ForSource("orders"); !ok || q != all {
			t.Errorf("unrestricted %v projected to %v, %v", all.Streams, q, ok)
		}
	}
}

// The documented secret lengths, 16 to 1024, include both ends: a 16-byte
// secret (the entropy floor) and a 1024-byte one are accepted, one byte
// less or more is refused.
func TestSecretLengthBoundsAreInclusive(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		n  int
		ok bool
	}{
		{MinSecretLen - 1, false}, {MinSecretLen, true}, {MaxSecretLen, true}, {MaxSecretLen + 1, false},
	} {
		_, err := parseText("a relay "+strings.Repeat("s", tc.n), false)
		if (err == nil) != tc.ok {
			t.Errorf("a secret of %d bytes: %v, want accepted %v", tc.n, err, tc.ok)
		}
	}
}
