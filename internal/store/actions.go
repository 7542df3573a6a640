package store

// The record of operators' actions (outbox.operator_action and, per
// aggregate changed, outbox.operator_action_aggregate): written by the
// actions themselves, read by ListOperatorActions.

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Action names, as outbox.operator_action.action stores them.
const (
	ActionRetry     = "retry"
	ActionSkip      = "skip"
	ActionBulkRetry = "bulk_retry"
	ActionBulkSkip  = "bulk_skip"
	ActionRepublish = "republish"
)

// ActionNames lists every action name, for validating filters.
var ActionNames = []string{ActionRetry, ActionSkip, ActionBulkRetry, ActionBulkSkip, ActionRepublish}

// recordOwnAction records, inside tx, an action on one aggregate that is
// not part of a bulk action, finished at once, and returns its id.
func recordOwnAction(ctx context.Context, tx pgx.Tx, a OperatorAction, aggregates, events int64) (int64, error) {
	req, err := json.Marshal(a.Request)
	if err != nil {
		return 0, err
	}
	var id int64
	err = tx.QueryRow(ctx, `
		INSERT INTO outbox.operator_action (action, actor, reason, request, stream, aggregates, events, finished_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, clock_timestamp())
		RETURNING action_id`, a.Action, a.Actor, a.Reason, req, a.Stream, aggregates, events).Scan(&id)
	return id, err
}

// linkAction records what action actionID did to one aggregate.
func linkAction(ctx context.Context, tx pgx.Tx, actionID int64, stream, key string, detail map[string]any) error {
	d, err := json.Marshal(detail)
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `
		INSERT INTO outbox.operator_action_aggregate (action_id, stream, aggregate_key, detail) VALUES ($1, $2, $3, $4)
		ON CONFLICT (action_id, stream, aggregate_key) DO UPDATE
		SET detail = outbox.operator_action_aggregate.detail || excluded.detail`,
		actionID, stream, key, d)
	return err
}

// recordRetry records a retry that changed the aggregate (it was in state
// from): as its own action unless p.ActionID names the bulk retry it is
// part of. accepted holds the revisions an accepted gap gave up (zeros if
// none).
func recordRetry(ctx context.Context, tx pgx.Tx, p RetryParams, from string, accepted [2]int64) error {
	detail := map[string]any{"state": from}
	if accepted[0] != 0 {
		detail["accepted_gap"] = map[string]int64{"from_revision": accepted[0], "to_revision": accepted[1]}
	}
	id := p.ActionID
	if id == 0 {
		var err error
		id, err = recordOwnAction(ctx, tx, OperatorAction{Action: ActionRetry, Actor: p.Actor, Reason: p.Reason,
			Stream: p.Stream, Request: map[string]any{"stream": p.Stream, "aggregate_key": p.AggregateKey, "accept_gap": p.AcceptGap}},
			1, 0)
		if err != nil {
			return err
		}
	}
	return linkAction(ctx, tx, id, p.Stream, p.AggregateKey, detail)
}

// recordSkip records a skip: as its own action unless actionID names the
// bulk skip it is part of.
func recordSkip(ctx context.Context, tx pgx.Tx, actionID int64, stream, key string, id uuid.UUID, revision int64, reason, actor string) error {
	if actionID == 0 {
		var err error
		actionID, err = recordOwnAction(ctx, tx, OperatorAction{Action: ActionSkip, Actor: actor, Reason: reason,
			Stream: stream, Request: map[string]any{"event_id": id}}, 1, 1)
		if err != nil {
			return err
		}
	}
	return linkAction(ctx, tx, actionID, stream, key, map[string]any{"event_id": id, "revision": revision})
}

// ActionRecord is one operator action as recorded.
type ActionRecord struct {
	ID                    int64
	Action, Actor, Reason string
	// Stream is the stream the action named, or a bulk filter's pattern.
	Stream string
	// Request is the request as the server understood it (JSON).
	Request    string
	Aggregates int64
	Events     int64
	StartedAt  time.Time
	// FinishedAt is zero while the action runs (or if it was cut short
	// before it could record its end).
	FinishedAt time.Time
	// Detail is what the action did to the aggregate a listing named
	// (JSON); empty otherwise.
	Detail string
}

// ListActionsParams filters and pages ListActions. Every set field must
// match.
type ListActionsParams struct {
	// Stream keeps actions that named this stream or changed an aggregate
	// of it.
	Stream string
	// AggregateKey, with Stream, keeps actions that changed this aggregate.
	AggregateKey string
	// Action keeps actions of this name (ActionNames).
	Action string
	// Since keeps actions started at or after it.
	Since time.Time
	// Before continues a listing: only actions with a smaller id.
	Before int64
	Limit  int
}

// ListActions lists recorded operator actions, newest first.
func (s *Store) ListActions(ctx context.Context, p ListActionsParams) ([]ActionRecord, error) {
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return fmt.Sprintf("$%d", len(args))
	}
	from, detail := "outbox.operator_action a", "''"
	var where []string
	switch {
	case p.AggregateKey != "":
		from = "outbox.operator_action_aggregate t JOIN outbox.operator_action a ON a.action_id = t.action_id"
		detail = "t.detail::text"
		where = append(where, "t.stream = "+arg(p.Stream), "t.aggregate_key = "+arg(p.AggregateKey))
	case p.Stream != "":
		st := arg(p.Stream)
		where = append(where, "(a.stream = "+st+` OR EXISTS (
			SELECT 1 FROM outbox.operator_action_aggregate t WHERE t.action_id = a.action_id AND t.stream = `+st+"))")
	}
	if p.Action != "" {
		where = append(where, "a.action = "+arg(p.Action))
	}
	if !p.Since.IsZero() {
		where = append(where, "a.started_at >= "+arg(p.Since))
	}
	if p.Before > 0 {
		where = append(where, "a.action_id < "+arg(p.Before))
	}
	sql := `SELECT a.action_id, a.action, a.actor, a.reason, a.stream, a.request::text, a.aggregates, a.events,
	               a.started_at, a.finished_at, ` + detail + ` FROM ` + from
	if len(where) > 0 {
		sql += " WHERE " + strings.Join(where, " AND ")
	}
	sql += " ORDER BY a.action_id DESC LIMIT " + arg(p.Limit)
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("store: list actions: %w", err)
	}
	list, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ActionRecord, error) {
		var r ActionRecord
		var finished *time.Time
		err := row.Scan(&r.ID, &r.Action, &r.Actor, &r.Reason, &r.Stream, &r.Request, &r.Aggregates, &r.Events,
			&r.StartedAt, &finished, &r.Detail)
		r.FinishedAt = deref(finished)
		return r, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: list actions: %w", err)
	}
	return list, nil
}
