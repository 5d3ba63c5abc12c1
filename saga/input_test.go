package saga_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// A caller's strings with bytes PostgreSQL refuses get a clear error naming
// the field (never a raw SQLSTATE), or are made storable where they are
// only recorded (reasons).
func TestCallerStringsPostgreSQLRefuses(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "input", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) },
		"reserve/compensate": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("stuck"))
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	for _, bad := range []string{"a\x00b", "a\xffb"} {
		_, err := saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{BusinessKey: bad})
		require.ErrorIs(t, err, saga.ErrInvalidInput)
		require.ErrorContains(t, err, "StartOpts.BusinessKey")
		_, err = b.engine.List(ctx, &saga.ListOpts{BusinessKey: bad})
		require.ErrorIs(t, err, saga.ErrInvalidInput)
		require.ErrorContains(t, err, "ListOpts.BusinessKey")
		_, err = b.engine.List(ctx, &saga.ListOpts{ErrorCode: bad})
		require.ErrorIs(t, err, saga.ErrInvalidInput)
		_, err = b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{FailedStep: bad})
		require.ErrorIs(t, err, saga.ErrInvalidInput)
		_, err = b.engine.DeadLetters(ctx, &saga.DeadOpts{Consumer: bad})
		require.ErrorIs(t, err, saga.ErrInvalidInput)
	}
	_, err := saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{BusinessKey: strings.Repeat("k", 10_000)})
	require.ErrorIs(t, err, saga.ErrInvalidInput, "a key past the index's limit")

	// Reasons are only recorded: they are made storable.
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.start(t)
	require.Equal(t, saga.StatusFailed, b.waitTerminal(t, st.ID).Status)
	require.NoError(t, b.engine.Resume(ctx, st.ID, "fixed\x00 it\xff"))
	other, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, b.waitTerminal(t, other.ID).Status)
	require.ErrorIs(t, b.engine.Rerun(ctx, other.ID, "re\x00serve", "again"), saga.ErrInvalidInput)
	require.NoError(t, b.engine.Rerun(ctx, other.ID, "charge", strings.Repeat("r\x00", 5000)))
	require.ErrorIs(t, b.engine.Cancel(ctx, uuid.New(), "\x00"), saga.ErrNotFound)
}
