package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/sagaflow/sagaflow/wire"
)

// opsStatements are the statements of the scheduler, retention and
// operator tools.
type opsStatements struct {
	stuck, raiseChecks, waitsReady, touchSaga, deleteOutbox, deleteInbox, deleteSagas, outboxStatus, extendDeadline string
	branchesLost, lostBranchesOf                                                                                    string
}

// branchLostSQL is true for a running branch b whose command is
// not pending: no outbox row of type sagaflow.branch in status pending has
// its step key (as [wire.Key.String] writes it). A branch that runs right
// now has its command pending and locked; a branch that ended or retries
// wrote that in the transaction that consumed its command; so under one
// snapshot this is true only of a command lost (deleted, or parked dead).
func branchLostSQL(s string) string {
	return `b.status = 'running' AND NOT EXISTS (SELECT 1 FROM ` + s + `.outbox o
		WHERE o.step_key = b.saga_id::text || '/' || b.step || '.' || b.branch || '/forward/' || b.epoch
			AND o.type = 'sagaflow.branch' AND o.status = 'pending')`
}

func newOpsStatements(s string) opsStatements {
	return opsStatements{
		// Sagas past their deadline, oldest first. The try-lock runs in the
		// outer query so that it is taken only for the rows returned: a saga
		// whose lock is held has a step running right now and is not stuck.
		stuck: `SELECT ` + prefixColumns("s.") + `, pg_try_advisory_xact_lock(hashtextextended(s.id::text, $3)),
				(SELECT CASE WHEN o.status = 'published' AND o.published_at > now() - $4 * interval '1 microsecond'
					THEN 'in_flight' ELSE o.status END
					FROM ` + s + `.outbox o WHERE o.id = s.command_id),
				EXTRACT(EPOCH FROM now() - greatest(s.next_check_at, s.due_at))
			FROM (SELECT * FROM ` + s + `.saga_instances s
				WHERE status IN ('running', 'compensating') AND next_check_at < now() AND saga_name = ANY($1)
					AND (due_at IS NULL OR due_at < now())
					AND NOT ` + pausedSQL(s) + `
				ORDER BY next_check_at LIMIT $2) s`,
		// Sagas whose lower bound (next_check_at) has passed but whose
		// deadline (due_at) has not: a step pushed the deadline later
		// without touching the indexed column. Their next check moves to
		// the deadline. A row that a batch has written and not committed
		// is skipped; its transition sets the deadline anyway.
		raiseChecks: `UPDATE ` + s + `.saga_instances u SET next_check_at = u.due_at
			FROM (SELECT id FROM ` + s + `.saga_instances
				WHERE status IN ('running', 'compensating') AND next_check_at < now() AND due_at >= now()
				ORDER BY next_check_at LIMIT $1 FOR NO KEY UPDATE SKIP LOCKED) e
			WHERE u.id = e.id AND u.due_at > u.next_check_at`,
		// Sagas that wait without a time limit (no deadline) for what has
		// happened more than $2 ago, and have not moved since: a signal of
		// the name they wait for is pending, or the child they wait for has
		// ended, and no wake-up of theirs is pending. Their wake-up was lost
		// (deleted, or parked as dead).
		waitsReady: `SELECT ` + prefixColumns("s.") + `
			FROM ` + s + `.saga_instances s
			WHERE s.id IN (
					SELECT g.saga_id FROM ` + s + `.saga_signals g
					WHERE g.status = 'pending' AND g.created_at < now() - $2 * interval '1 microsecond'
					UNION ALL
					SELECT w.id FROM ` + s + `.saga_instances w WHERE w.wait_kind = 'child' AND w.status = 'running')
				AND s.status = 'running' AND s.wait_kind IN ('signal', 'child') AND s.saga_name = ANY($1)
				AND s.updated_at < now() - $2 * interval '1 microsecond'
				AND NOT ` + pausedSQL(s) + `
				AND NOT EXISTS (SELECT 1 FROM ` + s + `.outbox o
					WHERE o.saga_id = s.id AND o.type = 'sagaflow.wake' AND o.status = 'pending')
				AND CASE s.wait_kind
					WHEN 'signal' THEN EXISTS (SELECT 1 FROM ` + s + `.saga_signals g
						WHERE g.saga_id = s.id AND g.name = s.wait_for AND g.status = 'pending'
							AND g.created_at < now() - $2 * interval '1 microsecond')
					ELSE EXISTS (SELECT 1 FROM ` + s + `.saga_instances c
						WHERE c.parent_id = s.id AND c.id::text = s.wait_for AND c.status IN ('completed', 'compensated', 'failed')
							AND c.ended_at < now() - $2 * interval '1 microsecond')
				END
			ORDER BY s.created_at LIMIT $3`,
		// Sagas in a parallel step, not moved for more than $2, with a
		// branch whose command was lost (see branchLostSQL).
		branchesLost: `SELECT ` + prefixColumns("s.") + `
			FROM ` + s + `.saga_instances s
			WHERE s.id IN (SELECT b.saga_id FROM ` + s + `.saga_branches b
					WHERE b.status = 'running' AND b.started_at < now() - $2 * interval '1 microsecond')
				AND s.status = 'running' AND s.wait_kind = 'branches' AND s.direction = 'forward' AND s.saga_name = ANY($1)
				AND s.updated_at < now() - $2 * interval '1 microsecond'
				AND NOT ` + pausedSQL(s) + `
				AND EXISTS (SELECT 1 FROM ` + s + `.saga_branches b
					WHERE b.saga_id = s.id AND b.epoch = s.epoch AND b.step = s.step_name AND ` + branchLostSQL(s) + `)
			ORDER BY s.created_at LIMIT $3`,
		// The branches of saga $1's group (epoch $2, step $3) whose command
		// was lost, with how long ago the group started them.
		lostBranchesOf: `SELECT b.branch, b.attempt, EXTRACT(EPOCH FROM now() - b.started_at)
			FROM ` + s + `.saga_branches b
			WHERE b.saga_id = $1 AND b.epoch = $2 AND b.step = $3 AND ` + branchLostSQL(s) + `
			ORDER BY b.branch`,
		touchSaga: `UPDATE ` + s + `.saga_instances SET updated_at = clock_timestamp() WHERE id = $1 AND version = $2`,
		extendDeadline: `UPDATE ` + s + `.saga_instances SET next_check_at = clock_timestamp() + $3 * interval '1 microsecond',
				due_at = NULL
			WHERE id = $1 AND version = $2`,
		deleteOutbox: `DELETE FROM ` + s + `.outbox WHERE id IN (
				SELECT id FROM ` + s + `.outbox WHERE status = 'published' AND published_at < now() - $1 * interval '1 microsecond'
				ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
		deleteInbox: `DELETE FROM ` + s + `.inbox WHERE (consumer, key) IN (
				SELECT consumer, key FROM ` + s + `.inbox WHERE processed_at < now() - $1 * interval '1 microsecond'
					AND ($3 = '' OR consumer = $3)
				ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
		deleteSagas: `WITH gone AS (
				SELECT id FROM ` + s + `.saga_instances
				WHERE status IN ('completed', 'compensated') AND ended_at < now() - $1 * interval '1 microsecond'
				ORDER BY ended_at LIMIT $2 FOR UPDATE SKIP LOCKED
			), h AS (
				DELETE FROM ` + s + `.saga_history WHERE saga_id IN (SELECT id FROM gone)
			), g AS (
				DELETE FROM ` + s + `.saga_signals WHERE saga_id IN (SELECT id FROM gone)
			), b AS (
				DELETE FROM ` + s + `.saga_branches WHERE saga_id IN (SELECT id FROM gone)
			)
			DELETE FROM ` + s + `.saga_instances WHERE id IN (SELECT id FROM gone)`,
		outboxStatus: `SELECT
				count(*) FILTER (WHERE status = 'pending'),
				EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE status = 'pending')),
				count(*) FILTER (WHERE status = 'dead'),
				count(*) FILTER (WHERE status = 'published'),
				(SELECT count(*) FROM ` + s + `.dead_letters WHERE requeued_at IS NULL)
			FROM ` + s + `.outbox`,
	}
}

// StuckSaga is a saga past its deadline, read by [Store.StuckSagas].
type StuckSaga struct {
	Saga
	// Locked is true when this transaction took the saga's execution lock;
	// false means a step of it is running right now.
	Locked bool
	// CommandStatus is the outbox status of the saga's current command
	// ("pending", "published", "dead"), "in_flight" for one published to a
	// broker within the inFlight window of [Store.StuckSagas] (its consumer
	// may just be behind), or "" when that row no longer exists.
	CommandStatus string
	// Overdue is how long ago the deadline passed.
	Overdue time.Duration
}

// StuckSagas returns up to limit running or compensating sagas of the named
// types whose deadline has passed, oldest deadline first, taking the
// execution lock of each without waiting. A command published to a broker
// less than inFlight ago counts as in flight.
func (s *Store) StuckSagas(ctx context.Context, tx pgx.Tx, names []string, limit int, inFlight time.Duration) ([]StuckSaga, error) {
	rows, err := tx.Query(ctx, s.ops.stuck, names, limit, s.lockNS, micros(inFlight))
	if err != nil {
		return nil, fmt.Errorf("store: find stuck sagas: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StuckSaga, error) {
		var st StuckSaga
		var status *string
		var overdue float64
		err := r.Scan(append(sagaDest(&st.Saga), &st.Locked, &status, &overdue)...)
		if status != nil {
			st.CommandStatus = *status
		}
		st.Overdue = time.Duration(overdue * float64(time.Second))
		return st, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: find stuck sagas: %w", err)
	}
	return out, nil
}

// RaiseChecks moves the next check of up to limit sagas whose lower bound
// (next_check_at) has passed before their deadline (due_at) up to that
// deadline, and returns how many it moved. It runs in a statement of its
// own, so that it holds their rows only for that statement.
func (s *Store) RaiseChecks(ctx context.Context, db DBTX, limit int) (int64, error) {
	tag, err := db.Exec(ctx, s.ops.raiseChecks, limit)
	if err != nil {
		return 0, fmt.Errorf("store: move sagas' checks to their deadlines: %w", err)
	}
	return tag.RowsAffected(), nil
}

// WaitsReady returns up to limit sagas of names that wait without a time
// limit for a signal that is pending, or for a child that has ended, since
// more than after ago, and have not moved for as long: the wake-up that
// should have moved them was lost.
func (s *Store) WaitsReady(ctx context.Context, db DBTX, names []string, after time.Duration, limit int) ([]Saga, error) {
	return querySagas(ctx, db, "find waits whose wake-up was lost", s.ops.waitsReady, names, micros(after), limit)
}

// SagasWithLostBranches returns up to limit running sagas of the named
// definitions that wait in a parallel step, have not moved for longer than
// after, and have a branch whose command was lost (deleted, or parked as
// dead), oldest first.
func (s *Store) SagasWithLostBranches(ctx context.Context, db DBTX, names []string, after time.Duration, limit int) ([]Saga, error) {
	return querySagas(ctx, db, "find branches whose command was lost", s.ops.branchesLost, names, micros(after), limit)
}

// LostBranch is a running branch whose command was lost, read by
// [Store.LostBranches].
type LostBranch struct {
	Name    string
	Attempt int
	// Age is how long ago the group started the branch (database time).
	Age time.Duration
}

// LostBranches returns the running branches of saga id's group (epoch,
// step) whose command was lost, by name. Read it under the saga's row lock:
// every transaction that ends a branch or writes its retry holds that lock.
func (s *Store) LostBranches(ctx context.Context, db DBTX, id uuid.UUID, epoch int, step string) ([]LostBranch, error) {
	rows, err := db.Query(ctx, s.ops.lostBranchesOf, pgID(id), int32(epoch), step)
	if err != nil {
		return nil, fmt.Errorf("store: lost branches of saga %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LostBranch, error) {
		var b LostBranch
		var age float64
		err := r.Scan(&b.Name, &b.Attempt, &age)
		b.Age = time.Duration(age * float64(time.Second))
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: lost branches of saga %s: %w", id, err)
	}
	return out, nil
}

// TouchSaga sets saga id's updated_at to now if it still has version, and
// reports whether it did.
func (s *Store) TouchSaga(ctx context.Context, db DBTX, id uuid.UUID, version int64) (bool, error) {
	tag, err := db.Exec(ctx, s.ops.touchSaga, pgID(id), version)
	if err != nil {
		return false, fmt.Errorf("store: touch saga %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// ExtendDeadline moves a saga's deadline to now + d if the saga still has
// version. It reports whether it did.
func (s *Store) ExtendDeadline(ctx context.Context, db DBTX, id uuid.UUID, version int64, d time.Duration) (bool, error) {
	tag, err := db.Exec(ctx, s.ops.extendDeadline, id, version, micros(d))
	if err != nil {
		return false, fmt.Errorf("store: extend deadline of saga %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// DeletePublishedMessages deletes up to limit outbox rows published longer
// than window ago and returns how many it deleted.
func (s *Store) DeletePublishedMessages(ctx context.Context, db DBTX, window time.Duration, limit int) (int64, error) {
	tag, err := db.Exec(ctx, s.ops.deleteOutbox, micros(window), limit)
	if err != nil {
		return 0, fmt.Errorf("store: delete published messages: %w", err)
	}
	return tag.RowsAffected(), nil
}

// DeleteInboxKeys deletes up to limit inbox keys of consumer ("" for
// every consumer) processed longer than window ago and returns how many it
// deleted.
func (s *Store) DeleteInboxKeys(ctx context.Context, db DBTX, consumer string, window time.Duration, limit int) (int64, error) {
	tag, err := db.Exec(ctx, s.ops.deleteInbox, micros(window), limit, consumer)
	if err != nil {
		return 0, fmt.Errorf("store: delete inbox keys: %w", err)
	}
	return tag.RowsAffected(), nil
}

// DeleteFinishedSagas deletes up to limit completed or compensated sagas
// that ended longer than window ago, with their history and signals, and returns how
// many sagas it deleted. Failed sagas are kept for an operator.
func (s *Store) DeleteFinishedSagas(ctx context.Context, db DBTX, window time.Duration, limit int) (int64, error) {
	tag, err := db.Exec(ctx, s.ops.deleteSagas, micros(window), limit)
	if err != nil {
		return 0, fmt.Errorf("store: delete finished sagas: %w", err)
	}
	return tag.RowsAffected(), nil
}

// OutboxStatus summarises the outbox and the dead letters.
type OutboxStatus struct {
	Pending          int64
	OldestPendingAge time.Duration // 0 when nothing is pending
	// Dead counts outbox rows parked as dead (see [Store.DeadMessages]).
	Dead      int64
	Published int64
	// DeadLetters counts the messages consumers dead-lettered that have not
	// been requeued (see [Store.DeadLetters]).
	DeadLetters int64
}

// OutboxStatus counts pending, dead and published messages, measures the
// age of the oldest pending one, and counts the dead letters not requeued.
func (s *Store) OutboxStatus(ctx context.Context, db DBTX) (OutboxStatus, error) {
	var st OutboxStatus
	var age *float64
	if err := db.QueryRow(ctx, s.ops.outboxStatus).Scan(&st.Pending, &age, &st.Dead, &st.Published, &st.DeadLetters); err != nil {
		return st, fmt.Errorf("store: outbox status: %w", err)
	}
	if age != nil {
		st.OldestPendingAge = time.Duration(*age * float64(time.Second))
	}
	return st, nil
}

// OutboxFilter selects published messages for [Store.RepublishMessages].
// Zero fields do not filter.
type OutboxFilter struct {
	Topic           string
	Type            string
	AggregateID     string
	PublishedAfter  time.Time // inclusive
	PublishedBefore time.Time // exclusive
}

func (f OutboxFilter) where(args *[]any) string {
	arg := func(v any) string {
		*args = append(*args, v)
		return "$" + strconv.Itoa(len(*args))
	}
	conds := []string{"status = 'published'", "delivery = 'relay'"}
	if f.Topic != "" {
		conds = append(conds, "topic = "+arg(f.Topic))
	}
	if f.Type != "" {
		conds = append(conds, "type = "+arg(f.Type))
	}
	if f.AggregateID != "" {
		conds = append(conds, "aggregateid = "+arg(f.AggregateID))
	}
	if !f.PublishedAfter.IsZero() {
		conds = append(conds, "published_at >= "+arg(f.PublishedAfter))
	}
	if !f.PublishedBefore.IsZero() {
		conds = append(conds, "published_at < "+arg(f.PublishedBefore))
	}
	return strings.Join(conds, " AND ")
}

// PublishedMessages returns the ids of up to limit published messages that
// match f, oldest first.
func (s *Store) PublishedMessages(ctx context.Context, db DBTX, f OutboxFilter, limit int) ([]uuid.UUID, error) {
	var args []any
	where := f.where(&args)
	args = append(args, limit)
	rows, err := db.Query(ctx, "SELECT id FROM "+quoteSchema(s.schema)+".outbox WHERE "+where+
		" ORDER BY published_at, id LIMIT $"+strconv.Itoa(len(args)), args...)
	if err != nil {
		return nil, fmt.Errorf("store: select published messages: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("store: select published messages: %w", err)
	}
	return ids, nil
}

// RepublishMessages makes published messages pending again, due now, so the
// relay publishes them once more. It returns how many it changed.
func (s *Store) RepublishMessages(ctx context.Context, db DBTX, ids []uuid.UUID) (int64, error) {
	tag, err := db.Exec(ctx, "UPDATE "+quoteSchema(s.schema)+`.outbox
		SET status = 'pending', available_at = now(), attempts = 0, last_error = NULL, published_at = NULL
		WHERE id = ANY($1) AND status = 'published'`, ids)
	if err != nil {
		return 0, fmt.Errorf("store: republish %d messages: %w", len(ids), err)
	}
	return tag.RowsAffected(), nil
}

// SupersedeMessage parks a message that has not been published yet, with
// the reason, and reports whether it did (false when it was published
// already, or is gone).
func (s *Store) SupersedeMessage(ctx context.Context, db DBTX, id uuid.UUID, reason string) (bool, error) {
	tag, err := db.Exec(ctx, "UPDATE "+quoteSchema(s.schema)+".outbox SET status = 'dead', last_error = $2 WHERE id = $1 AND status = 'pending'", id, reason)
	if err != nil {
		return false, fmt.Errorf("store: supersede message %s: %w", id, err)
	}
	return tag.RowsAffected() == 1, nil
}

// DeleteInBatches calls del with limit until it deletes fewer than limit
// rows, or fails, and returns how many rows it deleted in all: one short
// statement at a time, so that retention never holds many locks.
func DeleteInBatches(limit int, del func(limit int) (int64, error)) (int64, error) {
	var total int64
	for {
		n, err := del(limit)
		total += n
		if err != nil || n < int64(limit) {
			return total, err
		}
	}
}

// LastReply returns the payload of the latest reply written for stepKey
// (a participant's outbox row of type wire.TypeReply), or found false when
// there is none, or retention has deleted it. The predicate repeats the
// partial index's (migration 006) as a literal, so the index serves it.
func (s *Store) LastReply(ctx context.Context, db DBTX, stepKey string) (payload []byte, found bool, err error) {
	err = db.QueryRow(ctx, "SELECT payload FROM "+quoteSchema(s.schema)+".outbox WHERE type = '"+wire.TypeReply+
		"' AND step_key = $1 ORDER BY created_at DESC LIMIT 1", stepKey).Scan(&payload)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("store: last reply for %s: %w", stepKey, err)
	}
	return payload, true, nil
}
