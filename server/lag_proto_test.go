package server

import (
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/store"
)

// GetLag's xmin_horizon carries what the store read of the oldest hold:
// its age, its holder and, when PostgreSQL showed it, since when; none of
// it when nothing holds the horizon back.
func TestLagProtoCarriesTheXminHorizon(t *testing.T) {
	since := time.Date(2026, 12, 4, 3, 0, 0, 0, time.UTC)
	h := lagProto(store.Lag{XminHorizon: store.XminHorizon{Age: 75_000, Holder: "pid 42 (database shop)", Since: since}}, nil).
		GetXminHorizon()
	if h.GetAgeTransactions() != 75_000 || h.GetHolder() != "pid 42 (database shop)" || !h.GetHeldSince().AsTime().Equal(since) {
		t.Fatalf("xmin_horizon %v, want age 75000, holder pid 42 (database shop), held since %v", h, since)
	}
	if h := lagProto(store.Lag{XminHorizon: store.XminHorizon{Age: 75_000, Holder: "replication slot s"}}, nil).
		GetXminHorizon(); h.GetHeldSince() != nil {
		t.Fatalf("xmin_horizon %v: a hold whose start PostgreSQL does not show has no held_since", h)
	}
	if h := lagProto(store.Lag{}, nil).GetXminHorizon(); h != nil {
		t.Fatalf("xmin_horizon %v with nothing holding the horizon back, want none", h)
	}
}
