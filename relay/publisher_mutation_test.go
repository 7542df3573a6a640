package relay

import "testing"

// MessageID, the id brokers deduplicate on, is the event id for the
// default source (named or left empty) and is qualified by any other
// source's name, since event ids are unique within one source only.
func TestMessageIDQualifiesOnlyOtherSources(t *testing.T) {
	t.Parallel()
	const id = "0af76519-16cd-43dd-8448-eb211c80319c"
	for _, tc := range []struct{ source, want string }{
		{"", id}, {"default", id}, {"eu", "eu/" + id},
	} {
		if got := (Event{ID: id, Source: tc.source}).MessageID(); got != tc.want {
			t.Errorf("MessageID with source %q = %q, want %q", tc.source, got, tc.want)
		}
	}
}
