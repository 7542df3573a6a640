package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// Ownership is a replica's share of the aggregates' partitions, as
// outbox.own_partitions leaves it: the partitions it owns (ascending), the
// fencing epoch of each, and how many it should own.
type Ownership struct {
	Share      int
	Partitions []int32
	Epochs     []int64
}

// OwnPartitions renews the membership of replicaID's process instance for
// ttl, and so its partitions, and, below its share, takes free partitions
// and those of expired members (outbox.own_partitions). wants says the replica
// has relay sessions: it shares the partitions with the other replicas that
// said so within their TTL; without, its share is none.
func (s *Store) OwnPartitions(ctx context.Context, replicaID string, instance uuid.UUID, wants bool, ttl time.Duration) (Ownership, error) {
	var o Ownership
	if err := s.pool.QueryRow(ctx, `SELECT share, partitions, epochs FROM outbox.own_partitions($1, $2, $3, $4)`,
		replicaID, instance, wants, ttl).Scan(&o.Share, &o.Partitions, &o.Epochs); err != nil {
		return Ownership{}, fmt.Errorf("store: own partitions: %w", err)
	}
	return o, nil
}

// ReleasePartitions gives back those of partitions the process instance
// owns and returns how many it gave back.
func (s *Store) ReleasePartitions(ctx context.Context, instance uuid.UUID, partitions []int32) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT outbox.release_partitions($1, $2)`, instance, partitions).Scan(&n); err != nil {
		return 0, fmt.Errorf("store: release partitions: %w", err)
	}
	return n, nil
}

// LeavePartitions gives back every partition of the process instance and
// ends its membership; it returns how many partitions it gave back.
func (s *Store) LeavePartitions(ctx context.Context, instance uuid.UUID) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT outbox.leave_partitions($1)`, instance).Scan(&n); err != nil {
		return 0, fmt.Errorf("store: leave partitions: %w", err)
	}
	return n, nil
}
