package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// This file holds the statements of parallel groups (migration 012).

// WaitBranches is the wait of a saga whose group's branches run.
const WaitBranches = "branches"

// Branch statuses.
const (
	BranchRunning   = "running"
	BranchCompleted = "completed"
	BranchFailed    = "failed"
	BranchCancelled = "cancelled"
)

// Branch is a row of saga_branches.
type Branch struct {
	SagaID    uuid.UUID
	Epoch     int
	Step      string
	Name      string
	Status    string
	Attempt   int
	Result    []byte
	LastError *string
	ErrorCode *string
	StartedAt time.Time
	EndedAt   *time.Time
}

// QueueEnterGroup queues, on b, the rows of a group's branches as the saga
// enters it: a branch that completed before in this epoch (a resumed saga)
// stays completed; every other is running again.
func (s *Store) QueueEnterGroup(b *pgx.Batch, id uuid.UUID, epoch int, step string, branches []string) {
	b.Queue(`INSERT INTO `+quoteSchema(s.schema)+`.saga_branches AS b (saga_id, epoch, step, branch, status)
		SELECT $1, $2, $3, unnest($4::text[]), 'running'
		ON CONFLICT (saga_id, epoch, step, branch) DO UPDATE SET status = 'running', ended_at = NULL, started_at = now(),
			attempt = 0, last_error = NULL, error_code = NULL
			WHERE b.status <> 'completed'`, pgID(id), int32(epoch), step, branches)
}

// QueueCancelBranches queues, on b, the end of a group's branches that still
// run (the group failed, or the saga was cancelled), and the deletion of
// their pending commands that no one runs right now.
func (s *Store) QueueCancelBranches(b *pgx.Batch, id uuid.UUID, epoch int, step string) {
	q := quoteSchema(s.schema)
	b.Queue(`UPDATE `+q+`.saga_branches SET status = 'cancelled', ended_at = now()
		WHERE saga_id = $1 AND epoch = $2 AND step = $3 AND status = 'running'`, pgID(id), int32(epoch), step)
	b.Queue(`DELETE FROM `+q+`.outbox WHERE id IN (SELECT id FROM `+q+`.outbox
		WHERE saga_id = $1 AND type = 'sagaflow.branch' AND status = 'pending' FOR UPDATE SKIP LOCKED)`, pgID(id))
}

// Branches returns a group's branch rows, in no particular order.
func (s *Store) Branches(ctx context.Context, db DBTX, id uuid.UUID, epoch int, step string) ([]Branch, error) {
	rows, err := db.Query(ctx, `SELECT saga_id, epoch, step, branch, status, attempt, result, last_error, error_code, started_at, ended_at
		FROM `+quoteSchema(s.schema)+`.saga_branches WHERE saga_id = $1 AND epoch = $2 AND step = $3`, pgID(id), int32(epoch), step)
	if err != nil {
		return nil, fmt.Errorf("store: branches of saga %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Branch, error) {
		var b Branch
		var sid [16]byte
		err := r.Scan(&sid, &b.Epoch, &b.Step, &b.Name, &b.Status, &b.Attempt, &b.Result, &b.LastError, &b.ErrorCode, &b.StartedAt, &b.EndedAt)
		b.SagaID = sid
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: branches of saga %s: %w", id, err)
	}
	return out, nil
}

// SagaBranches returns every branch row of saga id, by epoch, step and start.
func (s *Store) SagaBranches(ctx context.Context, db DBTX, id uuid.UUID) ([]Branch, error) {
	rows, err := db.Query(ctx, `SELECT saga_id, epoch, step, branch, status, attempt, result, last_error, error_code, started_at, ended_at
		FROM `+quoteSchema(s.schema)+`.saga_branches WHERE saga_id = $1 ORDER BY epoch, step, branch`, pgID(id))
	if err != nil {
		return nil, fmt.Errorf("store: branches of saga %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Branch, error) {
		var b Branch
		var sid [16]byte
		err := r.Scan(&sid, &b.Epoch, &b.Step, &b.Name, &b.Status, &b.Attempt, &b.Result, &b.LastError, &b.ErrorCode, &b.StartedAt, &b.EndedAt)
		b.SagaID = sid
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: branches of saga %s: %w", id, err)
	}
	return out, nil
}

// BranchAttempt records a failed attempt of a branch that is retried; code
// "" stores none.
func (s *Store) BranchAttempt(ctx context.Context, db DBTX, id uuid.UUID, epoch int, step, branch string, attempt int, msg, code string) error {
	_, err := db.Exec(ctx, `UPDATE `+quoteSchema(s.schema)+`.saga_branches SET attempt = $5, last_error = $6, error_code = NULLIF($7, '')
		WHERE saga_id = $1 AND epoch = $2 AND step = $3 AND branch = $4 AND status = 'running'`,
		pgID(id), int32(epoch), step, branch, int32(attempt), msg, code)
	if err != nil {
		return fmt.Errorf("store: record branch attempt: %w", err)
	}
	return nil
}

// EndBranch ends a running branch with status (completed, with its result,
// or failed, with its error). It reports false when the branch was not
// running any more.
func (s *Store) EndBranch(ctx context.Context, db DBTX, id uuid.UUID, epoch int, step, branch, status string, attempt int, result []byte, msg, code *string) (bool, error) {
	tag, err := db.Exec(ctx, `UPDATE `+quoteSchema(s.schema)+`.saga_branches
		SET status = $5, attempt = $6, result = $7, last_error = $8, error_code = $9, ended_at = now()
		WHERE saga_id = $1 AND epoch = $2 AND step = $3 AND branch = $4 AND status = 'running'`,
		pgID(id), int32(epoch), step, branch, status, int32(attempt), result, msg, code)
	if err != nil {
		return false, fmt.Errorf("store: end branch %s of saga %s: %w", branch, id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// GroupEntry is a saga entering a parallel step (see [Transition]).
type GroupEntry struct {
	Step     string
	Branches []string
}
