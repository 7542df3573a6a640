package console

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"net/url"
	"path"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// view is what every page template gets.
type view struct {
	Page  string // the template's name, for the navigation
	User  string // the token's name; empty without tokens
	Open  bool   // no login (no tokens)
	CSRF  string
	Flash []flash
	Error string // an error shown at the top of the page
	Data  any
}

var funcs = template.FuncMap{
	"ts":       fmtTime,
	"ago":      ago,
	"dur":      func(d interface{ AsDuration() time.Duration }) string { return humanDuration(d.AsDuration(), true) },
	"state":    aggState,
	"evstate":  eventState,
	"outcome":  outcome,
	"payload":  payloadView,
	"headers":  sortedHeaders,
	"join":     strings.Join,
	"rate":     func(f float64) string { return fmt.Sprintf("%.1f/s", f) },
	"query":    queryOf,
	"troubled": troubled,
	"detail":   actionDetail,
	"sourceOf": sourceOf,
}

func parseTemplates() (map[string]*template.Template, error) {
	names, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		return nil, err
	}
	pages := map[string]*template.Template{}
	for _, n := range names {
		name := strings.TrimSuffix(path.Base(n), ".html")
		if name == "layout" {
			continue
		}
		t, err := template.New(name).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", n)
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", n, err)
		}
		pages[name] = t
	}
	return pages, nil
}

// render writes page with data; a template error becomes a 500 with the
// page unwritten.
func (c *Console) render(w http.ResponseWriter, r *http.Request, code int, page string, q *request, data any) {
	v := view{Page: page, Open: c.cfg.Authenticator == nil, Data: data}
	if q != nil && q.sess != nil {
		v.User, v.CSRF, v.Flash = q.sess.name, q.sess.csrf, c.sessions.takeFlash(q.sess)
	}
	if m, ok := data.(map[string]any); ok {
		if e, ok := m["Error"].(string); ok {
			v.Error = e
		}
	}
	var buf bytes.Buffer
	if err := c.pages[page].ExecuteTemplate(&buf, "layout", v); err != nil {
		c.log.Error("console: rendering", "page", page, "err", err)
		http.Error(w, "console: page failed to render", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_, _ = buf.WriteTo(w)
}

// fail answers with an error page (or JSON for the API).
func (c *Console) fail(w http.ResponseWriter, r *http.Request, sess *session, code int, msg string) {
	if strings.HasPrefix(r.URL.Path, "/api/") {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
		return
	}
	c.render(w, r, code, "error", &request{w: w, r: r, sess: sess}, map[string]any{"Error": msg})
}

// httpCode maps a gRPC status to the page's HTTP status.
func httpCode(err error) int {
	switch status.Code(err) {
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.NotFound:
		return http.StatusNotFound
	case codes.InvalidArgument, codes.FailedPrecondition:
		return http.StatusBadRequest
	default:
		return http.StatusBadGateway
	}
}

// describe turns an AdminService error into a sentence for the page. An
// RPC this server does not implement yet says so instead of failing.
func describe(err error) string {
	st := status.Convert(err)
	if st.Code() == codes.Unimplemented {
		return "This server does not provide this yet (" + st.Message() + "): it needs a newer outboxd."
	}
	return st.Code().String() + ": " + st.Message()
}

func unimplemented(err error) bool { return status.Code(err) == codes.Unimplemented }

func fmtTime(t *timestamppb.Timestamp) string {
	if t == nil || !t.IsValid() || t.AsTime().IsZero() {
		return ""
	}
	return t.AsTime().UTC().Format("2006-01-02 15:04:05Z")
}

func ago(t *timestamppb.Timestamp) string {
	if t == nil || t.AsTime().IsZero() {
		return ""
	}
	return humanDuration(time.Since(t.AsTime()), true) + " ago"
}

// humanDuration prints a duration at a readable precision: "4.2s",
// "3m12s", "2h05m", "3d4h". show false (nothing pending) prints "–".
func humanDuration(d time.Duration, show bool) string {
	if !show {
		return "–"
	}
	d = max(d, 0)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%.1fs", d.Seconds())
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

func aggState(s outboxv1.AggregateState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "AGGREGATE_STATE_"))
}

func eventState(s outboxv1.EventState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "EVENT_STATE_"))
}

func outcome(o outboxv1.AttemptOutcome) string {
	return strings.ToLower(strings.TrimPrefix(o.String(), "ATTEMPT_OUTCOME_"))
}

// troubled reports whether an aggregate needs an operator's look.
func troubled(a *outboxv1.Aggregate) bool {
	switch a.GetState() {
	case outboxv1.AggregateState_AGGREGATE_STATE_PARKED, outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF,
		outboxv1.AggregateState_AGGREGATE_STATE_GAP:
		return true
	}
	return a.GetStalled()
}

// payloadView shows a payload: indented JSON when it is JSON, text when it
// is UTF-8, base64 otherwise.
func payloadView(b []byte) string {
	if len(b) == 0 {
		return "(empty)"
	}
	var out bytes.Buffer
	if json.Valid(b) && json.Indent(&out, b, "", "  ") == nil {
		return out.String()
	}
	if utf8.Valid(b) {
		return string(b)
	}
	return "base64: " + base64.StdEncoding.EncodeToString(b)
}

type header struct{ Key, Value string }

func sortedHeaders(m map[string]string) []header {
	out := make([]header, 0, len(m))
	for k, v := range m {
		out = append(out, header{k, v})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// queryOf builds a link: path, then name/value pairs (empty values left
// out), every part escaped.
func queryOf(p string, kv ...string) template.URL {
	v := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			v.Set(kv[i], kv[i+1])
		}
	}
	if len(v) == 0 {
		return template.URL(p) //nolint:gosec // p is a constant path of the console
	}
	return template.URL(p + "?" + v.Encode()) //nolint:gosec // every value is query-escaped
}
