package relay

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// Two runners split the streams as `outboxd relay --route` does: one takes
// billing, a catch-all takes every stream but billing (ExcludeStreams). Each
// event reaches exactly the runner its stream routes to, never both.
func TestRunnersSplitStreamsWithExclusion(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	want := map[string]string{} // event id -> "billing" or "rest"
	var ids []string
	for _, key := range []string{"a", "b", "c"} {
		for _, stream := range []string{"billing", "orders", "shipping"} {
			id := e.emit(t, stream, key)
			ids = append(ids, id)
			want[id] = map[bool]string{true: "billing", false: "rest"}[stream == "billing"]
		}
	}
	billing, rest := newPublisher(), newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: billing, Streams: []string{"billing"}}, hooks{})
	start(t, Config{Conn: e.srv.Conn, Publisher: rest, ExcludeStreams: []string{"billing"}}, hooks{})
	e.waitPublished(t, ids...)
	for _, id := range ids {
		got := map[string]int{"billing": billing.attemptsOf(id), "rest": rest.attemptsOf(id)}
		if got[want[id]] == 0 || got[map[string]string{"billing": "rest", "rest": "billing"}[want[id]]] != 0 {
			t.Errorf("event %s of %s: published by billing %d times, by the catch-all %d times", id, want[id], got["billing"], got["rest"])
		}
	}
}

// exclude_streams follows the rules of streams, and a name in both is
// refused: the request could mean nothing.
func TestSubscribeRejectsBadExcludeStreams(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	for _, c := range []struct {
		streams, exclude []string
		want             string
	}{
		{[]string{"billing"}, []string{"billing"}, `exclude_streams[0]: "billing" is also in streams`},
		{nil, []string{"Bad Name"}, "exclude_streams[0]"},
		{nil, []string{"a", "a"}, `exclude_streams[1]: "a" is listed twice`},
	} {
		st, err := e.srv.Relay.Subscribe(context.Background(), &outboxv1.SubscribeRequest{
			RelayId: "t", Streams: c.streams, ExcludeStreams: c.exclude, MaxInFlight: 1,
		})
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Subscribe(streams %v, exclude %v) = %v; want INVALID_ARGUMENT mentioning %q", c.streams, c.exclude, err, c.want)
		}
	}
}
