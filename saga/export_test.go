package saga

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// SetBeforeCommit installs a hook that runs before each batch commits; an
// error from it aborts the batch the way a crash at that point would.
func (e *Engine) SetBeforeCommit(h func(ctx context.Context, tx pgx.Tx) error) {
	e.hooks.beforeCommit = h
}
