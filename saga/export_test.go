package saga

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/store"
)

// SetBeforeCommit installs a hook that runs before each batch commits; an
// error from it aborts the batch the way a crash at that point would.
func (e *Engine) SetBeforeCommit(h func(ctx context.Context, tx pgx.Tx) error) {
	e.hooks.beforeCommit = h
}

// SetBeforeRescueUpdate installs a hook that runs between the rescuer's read
// of a stuck saga and its guarded update.
func (e *Engine) SetBeforeRescueUpdate(h func(id uuid.UUID)) {
	e.hooks.beforeRescueUpdate = func(sg *store.Saga) { h(sg.ID) }
}

// SetOutcomeHook installs a hook that may change the error text of each
// step's outcome before it is written (to one PostgreSQL refuses, say).
func (e *Engine) SetOutcomeHook(h func(sagaID uuid.UUID, lastError *string) *string) {
	e.hooks.outcome = func(tr *store.Transition) { tr.LastError = h(tr.ID, tr.LastError) }
}

// SetBeforeRecordAbandoned installs a hook that runs after an abandoned
// attempt's connection was closed and before the attempt is recorded.
func (e *Engine) SetBeforeRecordAbandoned(h func(sagaID uuid.UUID)) {
	e.hooks.beforeRecordAbandoned = h
}

// WaitUnlocked waits until no transaction holds saga id's execution lock:
// a worker's commit is visible a moment before its locks are released.
func (e *Engine) WaitUnlocked(ctx context.Context, id uuid.UUID) error {
	return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.st.LockSaga(ctx, tx, id) })
}

// SetIdle installs a hook that runs when a direct worker is done with its
// batches, before it looks for the next due command.
func (e *Engine) SetIdle(h func()) {
	e.hooks.idle = h
}

// LockSaga takes saga id's execution lock in tx, as a worker's batch does,
// until tx ends.
func (e *Engine) LockSaga(ctx context.Context, tx pgx.Tx, id uuid.UUID) error {
	return e.st.LockSaga(ctx, tx, id)
}

// SetReadAhead installs a hook that runs when a batch of Kafka messages has
// read and locked their sagas together, before any of them runs, with the
// sagas it found.
func (e *Engine) SetReadAhead(h func(ids []uuid.UUID)) {
	e.hooks.readAhead = h
}

// SetCancelRead installs a hook that runs when Cancel has read a saga and
// won its execution lock, before the fenced update that applies the
// cancel.
func (e *Engine) SetCancelRead(h func(id uuid.UUID)) {
	e.hooks.cancelRead = h
}
