package sink

import (
	"errors"
	"fmt"
	"strings"

	"github.com/outboxd/outboxd/relay"
)

// EscapeSubjectToken turns an arbitrary string into exactly one valid NATS
// subject token, so an event's stream, aggregate key or type can be put in a
// subject without adding tokens (from '.'), turning into a wildcard ('*',
// '>') or breaking the protocol line (whitespace, control bytes).
//
// The rule, which UnescapeSubjectToken reverses exactly:
//   - the bytes '!' (0x21) through '~' (0x7E) are kept, except '.', '*', '>'
//     and '%';
//   - every other byte (those four, space and other ASCII control bytes,
//     DEL, and every byte of a non-ASCII UTF-8 sequence) becomes '%'
//     followed by two upper-case hex digits, as in URL percent-encoding;
//   - the empty string becomes the single token "%", which no non-empty
//     string escapes to, because a NATS token cannot be empty.
//
// Non-ASCII is escaped too, not kept as UTF-8, so that every token is plain
// printable ASCII whatever the input bytes are (invalid UTF-8 and NUL are
// rejected by parts of the NATS server).
func EscapeSubjectToken(s string) string {
	if s == "" {
		return "%"
	}
	n := 0
	for i := 0; i < len(s); i++ {
		if mustEscape(s[i]) {
			n++
		}
	}
	if n == 0 {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 2*n)
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(s); i++ {
		c := s[i]
		if mustEscape(c) {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0x0F])
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

// UnescapeSubjectToken reverses EscapeSubjectToken, for consumers that want
// the original value back from a subject token. It accepts only the
// canonical form EscapeSubjectToken produces (upper-case hex, and only bytes
// that must be escaped are escaped), so every string has exactly one token
// and a token that was not made by EscapeSubjectToken is reported as an
// error instead of being decoded to a value it never came from.
func UnescapeSubjectToken(tok string) (string, error) {
	if tok == "%" {
		return "", nil
	}
	if tok == "" {
		return "", errors.New("empty subject token")
	}
	if !strings.Contains(tok, "%") {
		for i := 0; i < len(tok); i++ {
			if mustEscape(tok[i]) {
				return "", fmt.Errorf("subject token %q: byte 0x%02X at %d should have been escaped", tok, tok[i], i)
			}
		}
		return tok, nil
	}
	b := make([]byte, 0, len(tok))
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		if c != '%' {
			if mustEscape(c) {
				return "", fmt.Errorf("subject token %q: byte 0x%02X at %d should have been escaped", tok, c, i)
			}
			b = append(b, c)
			continue
		}
		if i+2 >= len(tok) {
			return "", fmt.Errorf("subject token %q: truncated escape at %d", tok, i)
		}
		hi, ok1 := unhex(tok[i+1])
		lo, ok2 := unhex(tok[i+2])
		if !ok1 || !ok2 {
			return "", fmt.Errorf("subject token %q: bad escape %q at %d (want %%XX, upper-case hex)", tok, tok[i:i+3], i)
		}
		v := hi<<4 | lo
		if !mustEscape(v) {
			return "", fmt.Errorf("subject token %q: %q at %d escapes a byte that is never escaped", tok, tok[i:i+3], i)
		}
		b = append(b, v)
		i += 2
	}
	return string(b), nil
}

// mustEscape reports whether EscapeSubjectToken replaces byte c.
func mustEscape(c byte) bool {
	return c <= ' ' || c >= 0x7F || c == '.' || c == '*' || c == '>' || c == '%'
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// maxSubjectLen bounds a rendered subject. The NATS server closes a
// connection whose protocol line exceeds max_control_line (4096 bytes by
// default), and the HPUB line carries the subject, a reply inbox and two
// sizes; refusing a long subject up front fails one event instead of
// dropping the connection under every in-flight publish. Escaping can triple
// a value's length, so a very long aggregate key can reach this.
const maxSubjectLen = 2048

// Placeholder names accepted in a template.
const (
	phStream       = "{stream}"
	phAggregateKey = "{aggregate_key}"
	phEventType    = "{event_type}"
)

// subjectTemplate is a parsed, validated name template made of
// '.'-separated tokens, each a literal or one placeholder whose value is
// escaped with EscapeSubjectToken. The NATS subject it was first written
// for, the AMQP exchange and routing key and the Redis stream key all use
// it, so one event renders to the same reversible name whatever the broker.
type subjectTemplate struct {
	raw    string
	rules  templateRules
	tokens []templateToken
}

type templateToken struct {
	literal string // set when placeholder is ""
	ph      string // one of the ph* constants, or ""
}

// templateRules is what differs between the names a template can build.
type templateRules struct {
	// what names the template in errors: "subject", "routing key", ...
	what string
	// natsRoot requires a literal first token that NATS does not reserve,
	// so a JetStream subject filter has a fixed root.
	natsRoot bool
	// allowEmpty accepts the empty template (an AMQP routing key may be
	// empty: fanout exchanges ignore it).
	allowEmpty bool
	// maxLen bounds a rendered name, in bytes.
	maxLen int
	// raw substitutes values as they are, unescaped, for names whose
	// legal characters exclude the escape ('%' in a Kafka topic); the
	// sink then checks the rendered name.
	raw bool
}

// natsSubjectRules are the NATS subject's rules.
var natsSubjectRules = templateRules{what: "subject", natsRoot: true, maxLen: maxSubjectLen}

// parseSubjectTemplate parses a NATS subject template.
func parseSubjectTemplate(raw string) (*subjectTemplate, error) {
	return parseTemplate(raw, natsSubjectRules)
}

// parseTemplate validates a template. Each '.'-separated token is either a
// literal token (no wildcards, whitespace or braces) or exactly one
// placeholder: a placeholder sharing a token with other text could not be
// split back into its value, which would break reversibility. With
// rules.natsRoot the first token must be literal so the JetStream stream's
// subject filter has a fixed root and never captures unrelated traffic such
// as _INBOX replies.
func parseTemplate(raw string, rules templateRules) (*subjectTemplate, error) {
	what := rules.what + " template"
	if raw == "" {
		if rules.allowEmpty {
			return &subjectTemplate{raw: raw, rules: rules}, nil
		}
		return nil, fmt.Errorf("%s is empty", what)
	}
	parts := strings.Split(raw, ".")
	t := &subjectTemplate{raw: raw, rules: rules, tokens: make([]templateToken, 0, len(parts))}
	for i, p := range parts {
		switch p {
		case phStream, phAggregateKey, phEventType:
			if i == 0 && rules.natsRoot {
				return nil, fmt.Errorf("%s %q: the first token must be literal, not a placeholder", what, raw)
			}
			t.tokens = append(t.tokens, templateToken{ph: p})
			continue
		}
		if p == "" {
			return nil, fmt.Errorf("%s %q: empty token", what, raw)
		}
		for j := 0; j < len(p); j++ {
			c := p[j]
			switch {
			case c == '{' || c == '}':
				return nil, fmt.Errorf("%s %q: token %q: a placeholder must be a whole token and one of %s, %s, %s",
					what, raw, p, phStream, phAggregateKey, phEventType)
			case c == '*' || c == '>':
				return nil, fmt.Errorf("%s %q: token %q: wildcards cannot be published to", what, raw, p)
			case c <= ' ' || c >= 0x7F:
				return nil, fmt.Errorf("%s %q: token %q: only printable ASCII is allowed in literal tokens", what, raw, p)
			}
		}
		if i == 0 && rules.natsRoot && (p[0] == '$' || p == "_INBOX") {
			return nil, fmt.Errorf("%s %q: %q is reserved by NATS", what, raw, p)
		}
		t.tokens = append(t.tokens, templateToken{literal: p})
	}
	if len(raw) > rules.maxLen {
		return nil, fmt.Errorf("%s %q: longer than %d bytes", what, raw, rules.maxLen)
	}
	return t, nil
}

// render builds the name for ev.
func (t *subjectTemplate) render(ev relay.Event) (string, error) {
	var b strings.Builder
	for i, tok := range t.tokens {
		if i > 0 {
			b.WriteByte('.')
		}
		switch tok.ph {
		case "":
			b.WriteString(tok.literal)
		default:
			v := ev.Stream
			switch tok.ph {
			case phAggregateKey:
				v = ev.AggregateKey
			case phEventType:
				v = ev.Type
			}
			if !t.rules.raw {
				v = EscapeSubjectToken(v)
			}
			b.WriteString(v)
		}
	}
	if b.Len() > t.rules.maxLen {
		// The event never renders shorter: retrying cannot help.
		return "", relay.Permanent(fmt.Errorf("%s is %d bytes after escaping, over the %d-byte limit", t.rules.what, b.Len(), t.rules.maxLen))
	}
	return b.String(), nil
}

// literal reports whether the template has no placeholders, so it renders
// the same name for every event.
func (t *subjectTemplate) literal() bool {
	for _, tok := range t.tokens {
		if tok.ph != "" {
			return false
		}
	}
	return true
}

// filter is the JetStream subject filter matching exactly the subjects the
// template can render: placeholders become '*' (an escaped value is always
// one token). It is narrower than "prefix.>" so the stream does not claim
// subjects another stream or service might own.
func (t *subjectTemplate) filter() string {
	parts := make([]string, len(t.tokens))
	for i, tok := range t.tokens {
		if tok.ph != "" {
			parts[i] = "*"
		} else {
			parts[i] = tok.literal
		}
	}
	return strings.Join(parts, ".")
}

// subjectSubsetOf reports whether every subject matching sub also matches
// filter, so an existing stream whose subjects already cover the template
// is left alone.
func subjectSubsetOf(sub, filter string) bool {
	s := strings.Split(sub, ".")
	f := strings.Split(filter, ".")
	for i, ft := range f {
		if ft == ">" {
			return len(s) > i
		}
		if i >= len(s) {
			return false
		}
		st := s[i]
		if ft == "*" {
			if st == ">" {
				return false
			}
			continue
		}
		if st != ft {
			return false
		}
	}
	return len(s) == len(f)
}
