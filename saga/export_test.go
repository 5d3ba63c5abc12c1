package saga

import (
	"context"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/store"
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
