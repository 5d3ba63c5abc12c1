package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// EventCancelRequested is the history event of a recorded cancel request
// (the engine's constant of the same name).
const EventCancelRequested = "cancel_requested"

// Statuses of a signal (saga_signals.status).
const (
	SignalPending   = "pending"
	SignalDelivered = "delivered"
	SignalRejected  = "rejected"
)

type waitStatements struct {
	deletePending, deliverSignal, cancelChild, insertSignal, findSignal, probeSignal, dbNow, deadlineDue, signals, deleteOrphans string
}

func newWaitStatements(s string) waitStatements {
	return waitStatements{
		deletePending: `DELETE FROM ` + s + `.outbox WHERE id = ANY($1) AND status = 'pending'`,
		deliverSignal: `UPDATE ` + s + `.saga_signals SET status = CASE WHEN $4::text IS NULL THEN 'delivered' ELSE 'rejected' END,
				error = $4, delivered_at = clock_timestamp(), step_name = $2, epoch = $3
			WHERE seq = $1 AND status = 'pending'`,
		// A child the parent no longer waits for is asked to cancel, in
		// the parent's transition; a child that ended, or has a request
		// already, is left as it is.
		cancelChild: `WITH r AS (
				INSERT INTO ` + s + `.saga_cancel_requests (saga_id, epoch, reason, code)
				SELECT id, epoch, $2, $3 FROM ` + s + `.saga_instances WHERE id = $1 AND status = 'running'
				ON CONFLICT (saga_id) DO NOTHING
				RETURNING saga_id, epoch
			)
			INSERT INTO ` + s + `.saga_history (saga_id, event, epoch, error, error_code)
			SELECT saga_id, $4, epoch, $2, $3 FROM r`,
		insertSignal: `INSERT INTO ` + s + `.saga_signals (saga_id, target, name, signal_id, payload, status, error)
			VALUES ($1, $2, $3, $4, $5, $6, $7)
			ON CONFLICT ((coalesce(saga_id::text, target)), signal_id) DO NOTHING
			RETURNING seq`,
		findSignal: `SELECT seq, status, coalesce(error, '') FROM ` + s + `.saga_signals
			WHERE coalesce(saga_id::text, target) = $1 AND signal_id = $2`,
		// The oldest pending signal of a name, and the database's clock.
		probeSignal: `SELECT clock_timestamp(), g.seq, g.payload, g.signal_id
			FROM (SELECT 1) one
			LEFT JOIN LATERAL (SELECT seq, payload, signal_id FROM ` + s + `.saga_signals
				WHERE saga_id = $1 AND name = $2 AND status = 'pending' ORDER BY seq LIMIT 1) g ON true`,
		dbNow: `SELECT clock_timestamp()`,
		deadlineDue: `SELECT s.id FROM ` + s + `.saga_instances s
			WHERE s.status = 'running' AND s.deadline_at <= now() AND s.saga_name = ANY($1)
				AND NOT EXISTS (SELECT 1 FROM ` + s + `.saga_cancel_requests r WHERE r.saga_id = s.id)
				AND NOT ` + pausedSQL(s) + `
			ORDER BY s.deadline_at LIMIT $2`,
		deleteOrphans: `DELETE FROM ` + s + `.saga_signals WHERE seq IN (
				SELECT seq FROM ` + s + `.saga_signals WHERE saga_id IS NULL AND created_at < now() - $1 * interval '1 microsecond'
				ORDER BY created_at LIMIT $2)`,
		signals: `SELECT seq, name, signal_id, payload, status, coalesce(error, ''), step_name, epoch, created_at, delivered_at
			FROM ` + s + `.saga_signals WHERE coalesce(saga_id::text, target) = $1::text ORDER BY seq LIMIT $2`,
	}
}

// SignalRow is a signal to insert with [Store.InsertSignal].
type SignalRow struct {
	SagaID   *uuid.UUID // nil when no saga matched Target
	Target   string     // the address as given: a saga id, or name/business key
	Name     string
	SignalID string
	Payload  []byte
	Status   string
	Error    string
}

// InsertSignal records a signal. It reports false, writing nothing, when a
// signal with the same id was recorded for the same saga (or, with no
// saga, the same target) before; then the earlier one's status and error
// are returned.
func (s *Store) InsertSignal(ctx context.Context, db DBTX, r *SignalRow) (seq int64, inserted bool, status, why string, err error) {
	err = db.QueryRow(ctx, s.w.insertSignal, pgIDPtr(r.SagaID), r.Target, r.Name, r.SignalID, r.Payload, r.Status,
		nullStr(r.Error)).Scan(&seq)
	if err == nil {
		return seq, true, r.Status, r.Error, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return 0, false, "", "", fmt.Errorf("store: insert signal %q: %w", r.Name, err)
	}
	scope := r.Target
	if r.SagaID != nil {
		scope = r.SagaID.String()
	}
	if err := db.QueryRow(ctx, s.w.findSignal, scope, r.SignalID).Scan(&seq, &status, &why); err != nil {
		return 0, false, "", "", fmt.Errorf("store: find signal %q: %w", r.SignalID, err)
	}
	return seq, false, status, why, nil
}

// PendingSignal is the oldest undelivered signal of a name for a saga.
type PendingSignal struct {
	Seq      int64
	Payload  []byte
	SignalID string
}

// ProbeSignal returns the database's clock and the oldest pending signal
// named name for saga id (nil when there is none).
func (s *Store) ProbeSignal(ctx context.Context, db DBTX, id uuid.UUID, name string) (time.Time, *PendingSignal, error) {
	var now time.Time
	var seq *int64
	var payload []byte
	var sid *string
	if err := db.QueryRow(ctx, s.w.probeSignal, pgID(id), name).Scan(&now, &seq, &payload, &sid); err != nil {
		return now, nil, fmt.Errorf("store: signals of saga %s: %w", id, err)
	}
	if seq == nil {
		return now, nil, nil
	}
	return now, &PendingSignal{Seq: *seq, Payload: payload, SignalID: *sid}, nil
}

// Now returns the database's clock.
func (s *Store) Now(ctx context.Context, db DBTX) (time.Time, error) {
	var now time.Time
	if err := db.QueryRow(ctx, s.w.dbNow).Scan(&now); err != nil {
		return now, fmt.Errorf("store: read the clock: %w", err)
	}
	return now, nil
}

// DeadlineDue returns up to limit running sagas of the named definitions
// whose deadline has passed and that have no cancel request yet.
func (s *Store) DeadlineDue(ctx context.Context, db DBTX, names []string, limit int) ([]uuid.UUID, error) {
	rows, err := db.Query(ctx, s.w.deadlineDue, names, limit)
	if err != nil {
		return nil, fmt.Errorf("store: sagas past their deadline: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("store: sagas past their deadline: %w", err)
	}
	return ids, nil
}

// ClearDeadline removes the deadline of saga id, with a history entry of
// event saying why: a saga past its pivot only goes forward.
func (s *Store) ClearDeadline(ctx context.Context, db DBTX, id uuid.UUID, event string) error {
	_, err := db.Exec(ctx, `WITH c AS (UPDATE `+quoteSchema(s.schema)+`.saga_instances SET deadline_at = NULL WHERE id = $1 AND deadline_at IS NOT NULL RETURNING id, step_name, epoch)
		INSERT INTO `+quoteSchema(s.schema)+`.saga_history (saga_id, event, step_name, direction, epoch, error, error_code)
		SELECT id, $2, step_name, 'forward', epoch, 'the saga passed its deadline after its pivot: it goes forward until it completes', 'past_pivot' FROM c`, id, event)
	if err != nil {
		return fmt.Errorf("store: clear deadline of %s: %w", id, err)
	}
	return nil
}

// Signal is a row of saga_signals, as [Store.Signals] reads it.
type Signal struct {
	Seq         int64
	Name        string
	SignalID    string
	Payload     []byte
	Status      string
	Error       string
	StepName    *string
	Epoch       *int
	CreatedAt   time.Time
	DeliveredAt *time.Time
}

// Signals returns up to limit signals sent to saga id, oldest first: those
// it has, and those addressed to its id that matched no saga.
func (s *Store) Signals(ctx context.Context, db DBTX, id uuid.UUID, limit int) ([]Signal, error) {
	rows, err := db.Query(ctx, s.w.signals, id.String(), limit)
	if err != nil {
		return nil, fmt.Errorf("store: signals of saga %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Signal, error) {
		var g Signal
		err := r.Scan(&g.Seq, &g.Name, &g.SignalID, &g.Payload, &g.Status, &g.Error, &g.StepName, &g.Epoch, &g.CreatedAt, &g.DeliveredAt)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: signals of saga %s: %w", id, err)
	}
	return out, nil
}

// DeleteOrphanSignals deletes up to limit signals that matched no saga and
// were recorded longer than window ago. (A saga's own signals go with it:
// see [Store.DeleteFinishedSagas].)
func (s *Store) DeleteOrphanSignals(ctx context.Context, db DBTX, window time.Duration, limit int) (int64, error) {
	tag, err := db.Exec(ctx, s.w.deleteOrphans, micros(window), limit)
	if err != nil {
		return 0, fmt.Errorf("store: delete signals for no saga: %w", err)
	}
	return tag.RowsAffected(), nil
}
