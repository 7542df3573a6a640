package console_test

import (
	"encoding/json"
	"html"
	"net/http"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/advice"
	"github.com/outboxd/outboxd/internal/testdb"
)

// The streams page, and the lag it polls, warn of an xmin horizon held
// back far enough to slow delivery, worded as `outboxd lag` words it.
func TestStreamsPageWarnsOfAHeldXminHorizon(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{noTokens: true, open: true})
	b := h.browser(t)
	testdb.HoldXminHorizon(t, t.Context(), h.url, "report-"+uuid.NewString()[:8], false, advice.XminHorizonWarnAge)
	const said = "PostgreSQL's xmin horizon is held "
	code, body := b.get(t, "/")
	if code != http.StatusOK || !strings.Contains(html.UnescapeString(body), said) {
		t.Fatalf("the streams page (%d) does not warn of the held horizon:\n%s", code, body)
	}
	_, body = b.get(t, "/api/lag")
	var lag struct{ Warnings []string }
	if err := json.Unmarshal([]byte(body), &lag); err != nil {
		t.Fatal(err)
	}
	if len(lag.Warnings) != 1 || !strings.HasPrefix(lag.Warnings[0], said) || !strings.Contains(lag.Warnings[0], "end that transaction") {
		t.Fatalf("/api/lag warnings %q; want one on the held horizon", lag.Warnings)
	}
}
