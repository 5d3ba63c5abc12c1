package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// This file holds the statements of pauses (migration 010). A pause is a
// row of saga_pauses; while it exists, a trigger on the outbox holds every
// step command of the paused sagas at 'infinity' (see 010_pause.up.sql).

// Pause kinds and codes.
const (
	PauseSaga = "saga"
	PauseType = "type"

	PauseCodeOperator  = "operator"
	PauseCodeExhausted = "retries_exhausted"
)

// Pause is a row of saga_pauses.
type Pause struct {
	Kind     string // PauseSaga or PauseType
	SagaID   *uuid.UUID
	SagaName string
	Code     string
	Reason   string
	StepName *string
	At       time.Time
}

// typeRows is the predicate of the outbox rows of saga type $1, every
// version (see 011_versions.up.sql for how a version names its commands).
const typeRows = `(o.aggregatetype = 'saga.' || $1::text OR starts_with(o.aggregatetype, 'saga.' || $1::text || '@'))`

// heldRows is the predicate of the outbox rows a pause holds: a saga's step
// commands (local and remote) and its wake-ups, still pending.
const heldRows = `o.status = 'pending' AND o.saga_id IS NOT NULL AND (o.step_key IS NOT NULL OR o.type = 'sagaflow.wake')`

// insertSagaPauseSQL pauses one saga, unless it is paused already.
func (s *Store) insertSagaPauseSQL() string {
	return `INSERT INTO ` + quoteSchema(s.schema) + `.saga_pauses (kind, saga_id, saga_name, code, reason, step_name)
		VALUES ('saga', $1, $2, $3, $4, $5) ON CONFLICT (saga_id) WHERE kind = 'saga' DO NOTHING`
}

// HoldPaused writes m (a step command or wake-up consumed from Kafka for a
// paused saga) back to the outbox, held until the pause is lifted.
func (s *Store) HoldPaused(ctx context.Context, db DBTX, m *Message) error {
	args := s.outboxArgs(m)
	_, err := db.Exec(ctx, `INSERT INTO `+quoteSchema(s.schema)+`.outbox
		(id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, created_at, available_at, paused_from)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, clock_timestamp(), 'infinity', clock_timestamp())`, args[:10]...)
	if err != nil {
		return fmt.Errorf("store: hold command of paused saga: %w", err)
	}
	return nil
}

// HoldClaimed holds the claimed direct command id of a paused saga where it
// is, until the pause is lifted.
func (s *Store) HoldClaimed(ctx context.Context, db DBTX, id uuid.UUID) error {
	_, err := db.Exec(ctx, `UPDATE `+quoteSchema(s.schema)+`.outbox SET paused_from = clock_timestamp(), available_at = 'infinity'
		WHERE id = $1`, pgID(id))
	if err != nil {
		return fmt.Errorf("store: hold command of paused saga: %w", err)
	}
	return nil
}

// InsertPause records p in tx (the pause of saga p.SagaID, or of every
// saga named p.SagaName) and holds the commands already written. It reports
// false when the same pause was recorded already (then nothing changes).
func (s *Store) InsertPause(ctx context.Context, tx pgx.Tx, p *Pause) (bool, error) {
	q := quoteSchema(s.schema)
	conflict := `(saga_id) WHERE kind = 'saga'`
	if p.Kind == PauseType {
		conflict = `(saga_name) WHERE kind = 'type'`
	}
	var inserted bool
	err := tx.QueryRow(ctx, `INSERT INTO `+q+`.saga_pauses (kind, saga_id, saga_name, code, reason, step_name)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT `+conflict+` DO NOTHING RETURNING true`,
		p.Kind, pgIDPtr(p.SagaID), p.SagaName, p.Code, p.Reason, p.StepName).Scan(&inserted)
	if err == pgx.ErrNoRows {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("store: pause: %w", err)
	}
	where := `o.saga_id = $1`
	arg := any(pgIDPtr(p.SagaID))
	if p.Kind == PauseType {
		where, arg = typeRows, p.SagaName
	}
	// Rows claimed right now are skipped, not waited for: the step that
	// claimed them runs on, and the engine holds a paused saga's command
	// it claims (see LockedSaga.Paused).
	if _, err := tx.Exec(ctx, `UPDATE `+q+`.outbox SET paused_from = available_at, available_at = 'infinity'
		WHERE id IN (SELECT o.id FROM `+q+`.outbox o
			WHERE `+where+` AND `+heldRows+` AND o.available_at <> 'infinity' FOR UPDATE SKIP LOCKED)`, arg); err != nil {
		return false, fmt.Errorf("store: pause: hold commands: %w", err)
	}
	return true, nil
}

// DeletePause lifts the pause of saga id (kind PauseSaga) or of every saga
// named name (PauseType) in tx, and makes the commands it held due when they
// were due before (now, when that has passed), unless another pause still
// holds them. It returns the pause lifted, or nil when there was none.
func (s *Store) DeletePause(ctx context.Context, tx pgx.Tx, kind string, id *uuid.UUID, name string) (*Pause, error) {
	q := quoteSchema(s.schema)
	where, arg := `kind = 'saga' AND saga_id = $1`, any(pgIDPtr(id))
	held := `o.saga_id = $1`
	if kind == PauseType {
		where, arg = `kind = 'type' AND saga_name = $1`, name
		held = typeRows
	}
	p := &Pause{Kind: kind}
	var sid [16]byte
	var hasID bool
	rows, err := tx.Query(ctx, `DELETE FROM `+q+`.saga_pauses WHERE `+where+`
		RETURNING saga_id IS NOT NULL, coalesce(saga_id, '00000000-0000-0000-0000-000000000000'), saga_name, code, reason, step_name, paused_at`, arg)
	if err != nil {
		return nil, fmt.Errorf("store: resume pause: %w", err)
	}
	found := false
	for rows.Next() {
		found = true
		if err := rows.Scan(&hasID, &sid, &p.SagaName, &p.Code, &p.Reason, &p.StepName, &p.At); err != nil {
			rows.Close()
			return nil, fmt.Errorf("store: resume pause: %w", err)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: resume pause: %w", err)
	}
	if !found {
		return nil, nil
	}
	if hasID {
		u := uuid.UUID(sid)
		p.SagaID = &u
	}
	// The trigger holds again what another pause (of the saga, or of its
	// type) still covers.
	if _, err := tx.Exec(ctx, `UPDATE `+q+`.outbox o SET available_at = greatest(o.paused_from, clock_timestamp()), paused_from = NULL
		WHERE `+held+` AND o.paused_from IS NOT NULL AND o.status = 'pending'`, arg); err != nil {
		return nil, fmt.Errorf("store: resume pause: release commands: %w", err)
	}
	return p, nil
}

// Pauses returns the pauses that cover the sagas ids (their own, or their
// type's), by saga id; a saga covered by both gets its own.
func (s *Store) Pauses(ctx context.Context, db DBTX, ids []uuid.UUID) (map[uuid.UUID]*Pause, error) {
	out := map[uuid.UUID]*Pause{}
	if len(ids) == 0 {
		return out, nil
	}
	q := quoteSchema(s.schema)
	rows, err := db.Query(ctx, `SELECT s.id, p.kind, p.saga_name, p.code, p.reason, p.step_name, p.paused_at
		FROM `+q+`.saga_instances s
		JOIN `+q+`.saga_pauses p ON (p.kind = 'saga' AND p.saga_id = s.id) OR (p.kind = 'type' AND p.saga_name = s.saga_name)
		WHERE s.id = ANY($1)
		ORDER BY p.kind DESC`, pgIDs(ids)) // 'type' before 'saga': the saga's own pause wins
	if err != nil {
		return nil, fmt.Errorf("store: read pauses: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id [16]byte
		p := &Pause{}
		if err := rows.Scan(&id, &p.Kind, &p.SagaName, &p.Code, &p.Reason, &p.StepName, &p.At); err != nil {
			return nil, fmt.Errorf("store: read pauses: %w", err)
		}
		u := uuid.UUID(id)
		if p.Kind == PauseSaga {
			p.SagaID = &u
		}
		out[u] = p
	}
	return out, rows.Err()
}

// TypePauses returns the saga types that are paused as a whole.
func (s *Store) TypePauses(ctx context.Context, db DBTX) ([]Pause, error) {
	rows, err := db.Query(ctx, `SELECT saga_name, code, reason, paused_at FROM `+quoteSchema(s.schema)+`.saga_pauses
		WHERE kind = 'type' ORDER BY saga_name`)
	if err != nil {
		return nil, fmt.Errorf("store: read type pauses: %w", err)
	}
	defer rows.Close()
	var out []Pause
	for rows.Next() {
		p := Pause{Kind: PauseType}
		if err := rows.Scan(&p.SagaName, &p.Code, &p.Reason, &p.At); err != nil {
			return nil, fmt.Errorf("store: read type pauses: %w", err)
		}
		out = append(out, p)
	}
	return out, rows.Err()
}

// pausedSQL is a condition, on a saga row aliased s, that is true while the
// saga is paused (by itself or by its type).
func pausedSQL(schema string) string {
	return `EXISTS (SELECT 1 FROM ` + schema + `.saga_pauses p
		WHERE (p.kind = 'saga' AND p.saga_id = s.id) OR (p.kind = 'type' AND p.saga_name = s.saga_name))`
}

// RestartDeadline moves the rescue deadline of saga id, if it has one, to
// at least d from now: a saga whose pause is lifted is not rescued at once
// for the time it spent paused. It does not wait for a step that runs (and
// will set the deadline itself).
func (s *Store) RestartDeadline(ctx context.Context, db DBTX, id uuid.UUID, d time.Duration) error {
	q := quoteSchema(s.schema)
	_, err := db.Exec(ctx, `UPDATE `+q+`.saga_instances
		SET next_check_at = greatest(next_check_at, clock_timestamp() + $2 * interval '1 microsecond')
		WHERE id = (SELECT id FROM `+q+`.saga_instances WHERE id = $1 FOR NO KEY UPDATE SKIP LOCKED)
			AND next_check_at IS NOT NULL`, pgID(id), micros(d))
	if err != nil {
		return fmt.Errorf("store: restart deadline of saga %s: %w", id, err)
	}
	return nil
}

// CommandHeld reports whether the pending command id is held for a pause
// (its available_at moved to 'infinity' by the pause's trigger); false when
// it is not, or is gone.
func (s *Store) CommandHeld(ctx context.Context, db DBTX, id uuid.UUID) (bool, error) {
	var held bool
	err := db.QueryRow(ctx, s.commandHeldSQL(), id).Scan(&held)
	if err != nil {
		return false, fmt.Errorf("store: read whether command %s is held: %w", id, err)
	}
	return held, nil
}

// QueueCommandHeld queues on b what [Store.CommandHeld] reads, into held,
// so that the question rides in a round trip that is made anyway.
func (s *Store) QueueCommandHeld(b *pgx.Batch, id uuid.UUID, held *bool) {
	b.Queue(s.commandHeldSQL(), id).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(held); err != nil {
			return fmt.Errorf("store: read whether command %s is held: %w", id, err)
		}
		return nil
	})
}

// QueueSagaStopped queues on b whether saga id, of type name, is paused
// now (by a pause of its own or of its type: what the pause trigger would
// tell of a command written for it now), into paused, and whether a cancel
// request of it is pending, into cancel.
func (s *Store) QueueSagaStopped(b *pgx.Batch, id uuid.UUID, name string, paused, cancel *bool) {
	q := quoteSchema(s.schema)
	b.Queue(`SELECT EXISTS (SELECT 1 FROM `+q+`.saga_pauses p
			WHERE (p.kind = 'saga' AND p.saga_id = $1) OR (p.kind = 'type' AND p.saga_name = $2)),
		EXISTS (SELECT 1 FROM `+q+`.saga_cancel_requests r WHERE r.saga_id = $1)`, pgID(id), name).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(paused, cancel); err != nil {
			return fmt.Errorf("store: read whether saga %s is paused or asked to cancel: %w", id, err)
		}
		return nil
	})
}

func (s *Store) commandHeldSQL() string {
	return `SELECT EXISTS (SELECT 1 FROM ` + quoteSchema(s.schema) + `.outbox WHERE id = $1 AND paused_from IS NOT NULL)`
}

// LockSagaRow takes saga id's row lock (FOR NO KEY UPDATE) in tx, waiting
// for a transaction that wrote the saga's transition to end. A step's
// transaction holds it from its transition to its commit, when the command
// it wrote (held by a pause, perhaps) becomes visible: lifting a pause after
// taking it sees, and releases, that command. It does not wait for a step's
// handler, which runs before its transition is written.
func (s *Store) LockSagaRow(ctx context.Context, tx pgx.Tx, id uuid.UUID) error {
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+quoteSchema(s.schema)+`.saga_instances WHERE id = $1 FOR NO KEY UPDATE`, id); err != nil {
		return fmt.Errorf("store: lock the row of saga %s: %w", id, err)
	}
	return nil
}

// strayHeldRows is the predicate of the held commands (rows o) that no pause
// covers any more: neither a pause of their saga, nor one of their saga's
// type, matched by the type named in the command (as the trigger and
// ResumeType match it) or by the saga's own row (a branch's command, held
// by the engine that claimed it). A command covered either way stays held.
func strayHeldRows(q string) string {
	return `o.paused_from IS NOT NULL AND o.status = 'pending'
		AND NOT EXISTS (SELECT 1 FROM ` + q + `.saga_pauses p WHERE p.kind = 'saga' AND p.saga_id = o.saga_id)
		AND NOT EXISTS (SELECT 1 FROM ` + q + `.saga_pauses p WHERE p.kind = 'type'
			AND (o.aggregatetype = 'saga.' || p.saga_name OR starts_with(o.aggregatetype, 'saga.' || p.saga_name || '@')
				OR p.saga_name = (SELECT s.saga_name FROM ` + q + `.saga_instances s WHERE s.id = o.saga_id)))`
}

// StrayHeldExists reports whether some held command is covered by no pause
// (see [Store.ReleaseStrayHeld]). It takes no lock: it tells the rescuer
// whether the release, which does, is worth its lock.
func (s *Store) StrayHeldExists(ctx context.Context, db DBTX) (bool, error) {
	q := quoteSchema(s.schema)
	var found bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+q+`.outbox o WHERE `+strayHeldRows(q)+`)`).Scan(&found)
	if err != nil {
		return false, fmt.Errorf("store: look for held commands no pause covers: %w", err)
	}
	return found, nil
}

// ReleaseStrayHeld makes up to limit held commands that no pause covers any
// more due when they were due before (now, when that has passed), as lifting
// a pause does, and returns how many it released. Such a command is one whose
// release was lost to a race: a step, or a batch that held the command it
// claimed, committed it held after the pause's release had looked.
//
// It must not release a command that a pause committed meanwhile covers.
// Pausing holds the commands that are due, not the ones at 'infinity': a
// pause whose hold ran before this release commits, and whose row this
// statement does not see, would leave the command released. So it first
// takes saga_pauses in SHARE mode: that waits for every transaction that
// wrote to saga_pauses (a pause, a resume, a saga's end) to end, and keeps
// new pauses out until tx ends. The statement after it sees every pause
// there is, and a pause that comes after tx's commit holds the released
// command as it holds any command that is due. (A pause's row cannot be
// locked before it exists, and locking the outbox row does not help: a
// pause's hold never touches a held row.) The outbox trigger checks each
// released row once more, and holds again what a pause covers.
//
// The lock conflicts with any write to saga_pauses, which a batch that ends
// a saga makes (its trigger deletes the saga's pause): callers check
// [Store.StrayHeldExists] first, so that it is taken only when there is
// something to release, and bound the wait with lock_timeout. Rows locked by
// another transaction (a batch that holds the command it claimed) are
// skipped, for the next run.
func (s *Store) ReleaseStrayHeld(ctx context.Context, tx pgx.Tx, limit int) (int, error) {
	q := quoteSchema(s.schema)
	if _, err := tx.Exec(ctx, `LOCK TABLE `+q+`.saga_pauses IN SHARE MODE`); err != nil {
		return 0, fmt.Errorf("store: release held commands no pause covers: lock pauses: %w", err)
	}
	var n int
	err := tx.QueryRow(ctx, `WITH released AS (
			UPDATE `+q+`.outbox o SET available_at = greatest(o.paused_from, clock_timestamp()), paused_from = NULL
			WHERE o.id IN (SELECT o.id FROM `+q+`.outbox o WHERE `+strayHeldRows(q)+` LIMIT $1 FOR UPDATE SKIP LOCKED)
			RETURNING o.paused_from)
		SELECT count(*) FROM released WHERE paused_from IS NULL`, limit).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("store: release held commands no pause covers: %w", err)
	}
	return n, nil
}
