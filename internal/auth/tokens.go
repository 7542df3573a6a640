package auth

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Role is a right a token grants. A token holds one or both.
type Role string

const (
	// RoleRelay may call RelayService: Subscribe, Ack, Nack, ExtendLease,
	// ListSources.
	RoleRelay Role = "relay"
	// RoleAdmin may call AdminService. It does not imply RoleRelay; grant
	// both ("admin,relay") to a token that needs both.
	RoleAdmin Role = "admin"
	// RoleViewer may call the read-only AdminService methods (see
	// ReadOnlyAdminMethods) and nothing else: for dashboards and the
	// console's pages. Admin implies everything a viewer may do.
	RoleViewer Role = "viewer"
)

const (
	// MinSecretLen is the shortest plaintext secret accepted: 16 bytes of a
	// random token is 96+ bits even in base64, beyond online guessing.
	MinSecretLen = 16
	// MaxSecretLen bounds a token, in the file and in a request header.
	MaxSecretLen = 1024
	// maxSourceBytes bounds a token file or variable; a real one is a few KB.
	maxSourceBytes = 1 << 20
	// maxNameLen bounds a token's name, which is logged with every request.
	maxNameLen = 128
	// maxPatternLen is the longest stream name (^[a-z][a-z0-9_.-]{0,127}$).
	maxPatternLen = 128
	// maxReportedErrors caps how many problems one load reports.
	maxReportedErrors = 20
	hashPrefix        = "sha256:"
)

// entry is one parsed token line. The plaintext secret is never kept: only
// its SHA-256, so a heap dump or a stray %v cannot print it.
type entry struct {
	hash      [sha256.Size]byte
	principal *Principal
	where     string // "file:line", for errors naming the other line of a duplicate
}

// parser accumulates entries from one or more sources and the problems
// found, checking duplicates across all of them.
type parser struct {
	entries []entry
	errs    []error
	more    int // problems beyond maxReportedErrors
	byHash  map[[sha256.Size]byte]string
	byName  map[string]entry
}

func newParser() *parser {
	return &parser{byHash: map[[sha256.Size]byte]string{}, byName: map[string]entry{}}
}

func (p *parser) fail(where, format string, args ...any) {
	if len(p.errs) >= maxReportedErrors {
		p.more++
		return
	}
	p.errs = append(p.errs, fmt.Errorf("%s: %s", where, fmt.Sprintf(format, args...)))
}

// err returns every problem found, one per line, or nil.
func (p *parser) err() error {
	if len(p.errs) == 0 {
		return nil
	}
	errs := p.errs
	if p.more > 0 {
		errs = append(slices.Clip(errs), fmt.Errorf("and %d more problem(s)", p.more))
	}
	return errors.Join(errs...)
}

// parse reads one source. In a file, entries are lines; in an environment
// variable (env true), ';' separates entries as well, since multi-line
// variables are awkward in many deployment tools. where names the source in
// errors: "path:LINE" for a file, "$VAR entry N" for a variable.
func (p *parser) parse(content, source string, env bool) {
	if len(content) > maxSourceBytes {
		p.fail(source, "is %d bytes; at most %d allowed", len(content), maxSourceBytes)
		return
	}
	content = strings.TrimPrefix(content, "\ufeff")
	if env {
		content = strings.ReplaceAll(content, ";", "\n")
	}
	lines := strings.Split(content, "\n")
	for i, line := range lines {
		where := fmt.Sprintf("%s:%d", source, i+1)
		if env {
			where = fmt.Sprintf("%s entry %d", source, i+1)
		}
		p.line(line, where)
	}
}

// line parses "name roles secret [streams=pattern,...]" with an optional
// trailing "# comment".
func (p *parser) line(line, where string) {
	fields := strings.Fields(line)
	for i, f := range fields {
		if strings.HasPrefix(f, "#") {
			fields = fields[:i]
			break
		}
	}
	if len(fields) == 0 {
		return
	}
	if len(fields) < 3 || len(fields) > 4 {
		p.fail(where, "has %d fields; want: name roles secret, then optionally streams= and a comma-separated list of patterns", len(fields))
		return
	}
	name, rolesField, secret := fields[0], fields[1], fields[2]
	bad := len(p.errs) + p.more

	if !validName(name) {
		p.fail(where, "name: want 1 to %d of A-Z a-z 0-9 _ . @ - starting with a letter or digit", maxNameLen)
	}
	roles, problem := parseRoles(rolesField)
	if problem != "" {
		p.fail(where, "roles: %s", problem)
	}
	hash, problem := parseSecret(secret)
	if problem != "" {
		p.fail(where, "secret: %s", problem)
	}
	var streams []string
	if len(fields) == 4 {
		streams, problem = parseStreams(fields[3])
		if problem != "" {
			p.fail(where, "streams: %s", problem)
		}
	}
	if len(p.errs)+p.more > bad {
		return
	}

	if other, dup := p.byHash[hash]; dup {
		p.fail(where, "secret: same secret as %s; every token must be unique", other)
		return
	}
	pr := &Principal{Name: name, Roles: roles, Streams: streams}
	if prev, ok := p.byName[name]; ok {
		// A name may repeat so that an identity keeps its name (and its
		// audit trail) while an old and a new secret are both valid during
		// rotation. Differing grants under one name would make the name
		// ambiguous, so they are refused.
		if !prev.principal.sameGrant(pr) {
			p.fail(where, "name is also used at %s with different roles or streams; a name may repeat only to hold a second secret during rotation", prev.where)
			return
		}
		pr = prev.principal
	}
	p.byHash[hash] = where
	e := entry{hash: hash, principal: pr, where: where}
	p.entries = append(p.entries, e)
	if _, ok := p.byName[name]; !ok {
		p.byName[name] = e
	}
}

func validName(s string) bool {
	if s == "" || len(s) > maxNameLen || !isAlnum(s[0]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !isAlnum(c) && c != '_' && c != '.' && c != '@' && c != '-' {
			return false
		}
	}
	return true
}

func isAlnum(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
}

// roleOrder is every role, in the order a Principal lists them.
var roleOrder = []Role{RoleRelay, RoleViewer, RoleAdmin}

// parseRoles parses "relay", "admin", "viewer", "admin,relay" and so on.
// Roles come back in a fixed order (roleOrder) so that two lines granting
// the same roles compare equal.
func parseRoles(s string) ([]Role, string) {
	seen := map[Role]bool{}
	for r := range strings.SplitSeq(s, ",") {
		role := Role(r)
		if !slices.Contains(roleOrder, role) {
			return nil, fmt.Sprintf("unknown role %s; want relay, admin or viewer, or several separated by commas", shown(r))
		}
		if seen[role] {
			return nil, fmt.Sprintf("%s is listed twice", role)
		}
		seen[role] = true
	}
	var roles []Role
	for _, r := range roleOrder {
		if seen[r] {
			roles = append(roles, r)
		}
	}
	return roles, ""
}

// parseSecret returns the SHA-256 of a plaintext secret, or the digest given
// as "sha256:<hex>". Problems are described without ever quoting the secret.
func parseSecret(s string) (hash [sha256.Size]byte, problem string) {
	if hexDigest, ok := strings.CutPrefix(s, hashPrefix); ok {
		if len(hexDigest) != 2*sha256.Size {
			return hash, fmt.Sprintf("a hashed secret is sha256: then 64 hex digits, got %d characters after the colon", len(hexDigest))
		}
		if _, err := hex.Decode(hash[:], []byte(hexDigest)); err != nil {
			return hash, "a hashed secret is sha256: then 64 hex digits; found a character that is not a hex digit"
		}
		return hash, ""
	}
	if len(s) < MinSecretLen || len(s) > MaxSecretLen {
		return hash, fmt.Sprintf("is %d bytes; want %d to %d (e.g. the output of: openssl rand -base64 32)", len(s), MinSecretLen, MaxSecretLen)
	}
	if !validToken(s) {
		return hash, "has a character outside A-Z a-z 0-9 - . _ ~ + / and trailing ="
	}
	return sha256.Sum256([]byte(s)), ""
}

// validToken reports whether s is an RFC 6750 b64token: the characters a
// bearer token may hold in an HTTP/2 header without quoting. Restricting
// secrets to it also keeps the file format unambiguous (no spaces, '#', ',',
// ';' or ':' in a secret).
func validToken(s string) bool {
	if s == "" {
		return false
	}
	end := len(s)
	for end > 0 && s[end-1] == '=' {
		end--
	}
	if end == 0 {
		return false
	}
	for i := 0; i < end; i++ {
		c := s[i]
		if !isAlnum(c) && c != '-' && c != '.' && c != '_' && c != '~' && c != '+' && c != '/' {
			return false
		}
	}
	return true
}

// parseStreams parses "streams=billing.*,sales_order".
func parseStreams(s string) ([]string, string) {
	list, ok := strings.CutPrefix(s, "streams=")
	if !ok {
		return nil, "the optional fourth field must start with streams="
	}
	if list == "" {
		return nil, "no patterns after streams="
	}
	var out []string
	for i, pat := range strings.Split(list, ",") {
		if !validPattern(pat) {
			return nil, fmt.Sprintf("pattern %d %s is not a stream name with optional * wildcards (lower-case letters, digits, _ . - and *, starting with a letter or *, at most %d characters), optionally after a source name with optional * wildcards and a slash (orders/billing.*)", i+1, shown(pat), maxPatternLen)
		}
		if strings.Contains(pat, "**") {
			// A run of '*' matches what one does, but only a pattern that
			// is exactly "*" (or source/*) grants every stream of its
			// sources (AllStreams): "**" would read as everything and be
			// refused what needs everything (a purge of all streams).
			return nil, fmt.Sprintf("pattern %d %s has a run of *: one * already matches any run of characters; write %s", i+1, shown(pat), shown(collapseStars(pat)))
		}
		if !slices.Contains(out, pat) {
			out = append(out, pat)
		}
	}
	slices.Sort(out)
	return out, ""
}

// collapseStars replaces each run of '*' in pat with one.
func collapseStars(pat string) string {
	for strings.Contains(pat, "**") {
		pat = strings.ReplaceAll(pat, "**", "*")
	}
	return pat
}

// validPattern accepts a stream name (^[a-z][a-z0-9_.-]{0,127}$) in which
// any character may be replaced by '*', which matches any run of characters,
// including none, optionally after a source pattern and a slash
// ("orders/billing.*", "*/payments"): a source name (^[a-z][a-z0-9_]{0,31}$)
// in which any character may be '*'. Nothing else is special, so
// "billing.*" means what it reads as and no pattern can fail at match time.
func validPattern(s string) bool {
	if src, stream, ok := strings.Cut(s, "/"); ok {
		return validSourcePattern(src) && validStreamPattern(stream)
	}
	return validStreamPattern(s)
}

func validStreamPattern(s string) bool {
	if s == "" || len(s) > maxPatternLen {
		return false
	}
	if c := s[0]; !('a' <= c && c <= 'z') && c != '*' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z') && !('0' <= c && c <= '9') && c != '_' && c != '.' && c != '-' && c != '*' {
			return false
		}
	}
	return true
}

// maxSourceLen is the longest source name (^[a-z][a-z0-9_]{0,31}$).
const maxSourceLen = 32

func validSourcePattern(s string) bool {
	if s == "" || len(s) > maxSourceLen {
		return false
	}
	if c := s[0]; !('a' <= c && c <= 'z') && c != '*' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z') && !('0' <= c && c <= '9') && c != '_' && c != '*' {
			return false
		}
	}
	return true
}

// globMatch reports whether name matches pattern, where '*' matches any run
// of characters. It runs in O(len(pattern)·len(name)) at worst, with no
// recursion, so a hostile pattern cannot blow up.
func globMatch(pattern, name string) bool {
	px, nx := 0, 0
	nextPx, nextNx := 0, 0
	for px < len(pattern) || nx < len(name) {
		if px < len(pattern) {
			c := pattern[px]
			if c == '*' {
				// Try matching the empty run first; on a later mismatch,
				// come back and let the star swallow one more character.
				nextPx, nextNx = px, nx+1
				px++
				continue
			}
			if nx < len(name) && name[nx] == c {
				px++
				nx++
				continue
			}
		}
		if 0 < nextNx && nextNx <= len(name) {
			px, nx = nextPx, nextNx
			continue
		}
		return false
	}
	return true
}

// shown quotes a value for an error message only when it is too short to be
// an accepted secret. Fields can be misplaced (a secret in the roles column),
// so anything that long is described, never printed.
func shown(v string) string {
	if len(v) < MinSecretLen {
		return fmt.Sprintf("%q", v)
	}
	return fmt.Sprintf("(%d characters, not shown)", len(v))
}

// HashToken returns the "sha256:<hex>" form of token, for a token file that
// should not hold plaintext secrets.
func HashToken(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hashPrefix + hex.EncodeToString(sum[:])
}
