package server_test

import (
	"context"
	"slices"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A single-source server lists the one source it serves, "default", to a
// relay token over gRPC (a token scoped to default's billing.* included),
// and its engine answers the same in process, but nothing to a principal
// scoped to another source's streams only.
func TestListSourcesOfOneSource(t *testing.T) {
	t.Parallel()
	r := startAuthReplica(t, testdb.New(t))
	for name, token := range map[string]string{"relay": relayToken, "billing.*": billingToken} {
		res, err := outboxv1.NewRelayServiceClient(dialAs(t, r, token)).ListSources(t.Context(), &outboxv1.ListSourcesRequest{})
		if err != nil || !slices.Equal(res.GetSources(), []string{"default"}) {
			t.Errorf("ListSources with the %s token: %v, %v; want [default]", name, res.GetSources(), err)
		}
	}
	engine := r.Server.RelayServer()
	for _, c := range []struct {
		ctx  context.Context
		want []string
	}{
		{t.Context(), []string{"default"}},
		{auth.ContextWithPrincipal(t.Context(), &auth.Principal{Name: "p", Roles: []auth.Role{auth.RoleRelay}, Streams: []string{"billing.*"}}), []string{"default"}},
		{auth.ContextWithPrincipal(t.Context(), &auth.Principal{Name: "o", Roles: []auth.Role{auth.RoleRelay}, Streams: []string{"orders/*"}}), nil},
	} {
		res, err := engine.ListSources(c.ctx, &outboxv1.ListSourcesRequest{})
		if err != nil || !slices.Equal(res.GetSources(), c.want) {
			p, _ := auth.PrincipalFrom(c.ctx)
			t.Errorf("engine ListSources for %v: %v, %v; want %v", p, res.GetSources(), err, c.want)
		}
	}
	// With streams, default is listed only to a token allowing each of them
	// ("*": every stream): billing.* may not have payments nor every stream.
	billing := auth.ContextWithPrincipal(t.Context(), &auth.Principal{Name: "p", Roles: []auth.Role{auth.RoleRelay}, Streams: []string{"billing.*"}})
	for _, c := range []struct {
		ctx     context.Context
		streams []string
		want    []string
	}{
		{billing, []string{"billing.eu"}, []string{"default"}},
		{billing, []string{"billing.eu", "payments"}, nil},
		{billing, []string{"*"}, nil},
		{t.Context(), []string{"*"}, []string{"default"}},
	} {
		res, err := engine.ListSources(c.ctx, &outboxv1.ListSourcesRequest{Streams: c.streams})
		if err != nil || !slices.Equal(res.GetSources(), c.want) {
			p, _ := auth.PrincipalFrom(c.ctx)
			t.Errorf("engine ListSources for %v: %v, %v; want %v", p, res.GetSources(), err, c.want)
		}
	}
}
