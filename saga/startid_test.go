package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestStartWithAnExplicitID(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "by-id", nil)
	other := threeSteps(b, "other-id", nil)
	require.NoError(t, b.engine.Register(def, other))
	ctx := context.Background()

	id := uuid.New()
	st, err := saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	require.Equal(t, saga.Started{ID: id}, st)
	// A retried start: same id, same definition, same (no) business key.
	st, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	require.Equal(t, saga.Started{ID: id, Existing: true}, st)

	// The id belongs to another saga: another definition, or another key.
	_, err = saga.Start(ctx, b.engine, other, order{}, &saga.StartOpts{ID: id})
	require.ErrorIs(t, err, saga.ErrSagaIDTaken)
	require.ErrorContains(t, err, `saga: start other-id with id `+id.String())
	require.ErrorContains(t, err, `it belongs to a "by-id" saga`)
	_, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: id, BusinessKey: "k-1"})
	require.ErrorIs(t, err, saga.ErrSagaIDTaken)

	// With a business key as well.
	keyed := uuid.New()
	st, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: keyed, BusinessKey: "k-2"})
	require.NoError(t, err)
	require.Equal(t, saga.Started{ID: keyed}, st)
	st, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: keyed, BusinessKey: "k-2"})
	require.NoError(t, err)
	require.Equal(t, saga.Started{ID: keyed, Existing: true}, st)
	_, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: keyed, BusinessKey: "k-3"})
	require.ErrorIs(t, err, saga.ErrSagaIDTaken)
	// The business key decides first: a start with the key in use returns
	// the saga that has it, whatever id it asked for.
	st, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ID: uuid.New(), BusinessKey: "k-2"})
	require.NoError(t, err)
	require.Equal(t, saga.Started{ID: keyed, Existing: true}, st)

	// Inside the caller's transaction, which stays usable.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	st, err = saga.StartTx(ctx, b.engine, tx, def, order{}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	require.Equal(t, saga.Started{ID: id, Existing: true}, st)
	_, err = saga.StartTx(ctx, b.engine, tx, other, order{}, &saga.StartOpts{ID: id})
	require.ErrorIs(t, err, saga.ErrSagaIDTaken)
	_, err = tx.Exec(ctx, "SELECT 1")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	// Nothing was written twice.
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("saga_history")))
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
}

func TestShortRescueSettingsRescueALostFirstCommandSoon(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{RescueSlack: 200 * time.Millisecond})
	def := saga.Define("quick-rescue", saga.Step[order]{Name: "a", Action: noop, Timeout: 300 * time.Millisecond})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	// The step's timeout and twice the slack: no hidden minute.
	require.WithinDuration(t, in.CreatedAt.Add(700*time.Millisecond), *in.NextCheckAt, 100*time.Millisecond)

	b.deleteCommands(t, st.ID) // the first command is lost
	waitFor(t, 5*time.Second, func() bool {
		res, err := b.engine.RescueNow(ctx)
		require.NoError(t, err)
		return res.Redriven == 1
	}, "the lost first command to be re-driven")
	b.start(t)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
}

// A later step that moves the saga's deadline adds RescueSlack as room, not
// a fixed minute: with short settings the deadline stays short.
func TestMovedDeadlineUsesRescueSlackAsRoom(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{RescueSlack: 300 * time.Millisecond})
	running := make(chan struct{})
	release := make(chan struct{})
	def := saga.Define("room",
		saga.Step[order]{Name: "quick", Timeout: 50 * time.Millisecond, Action: noop},
		saga.Step[order]{Name: "longer", Timeout: 2 * time.Second, Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			close(running)
			<-release
			return nil
		}},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-running
	var left time.Duration
	require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT EXTRACT(EPOCH FROM greatest(next_check_at, due_at) - now())::float8 * interval '1 second' FROM "+
		b.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&left))
	close(release)
	// 2 s of timeout, 300 ms of slack and 300 ms of room from when quick
	// completed: never a minute.
	require.Greater(t, left, 1500*time.Millisecond)
	require.Less(t, left, 2700*time.Millisecond)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
}
