package saga_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestStartStopStress(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 3})
	def := threeSteps(b, "lifecycle", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()

	// Sagas keep arriving while the engine is started and stopped from many
	// goroutines at once, softly and hard.
	var started []saga.Started
	for range 30 {
		st, err := saga.Start(ctx, b.engine, def, order{}, nil)
		require.NoError(t, err)
		started = append(started, st)
	}
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			for i := range 25 {
				switch rand.N(4) {
				case 0, 1:
					err := b.engine.Start(ctx)
					if err != nil {
						require.ErrorContains(t, err, "saga: engine: stopping; wait for Stop to return")
					}
				case 2:
					stopCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
					require.NoError(t, b.engine.Stop(stopCtx), "goroutine %d iteration %d", g, i)
					cancel()
				case 3:
					stopCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
					require.NoError(t, b.engine.StopAndCancel(stopCtx))
					cancel()
				}
			}
		})
	}
	wg.Wait()

	// Afterwards the engine still works and finishes every saga exactly once.
	require.NoError(t, b.engine.Start(ctx))
	for _, st := range started {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
		require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	}
	require.NoError(t, b.engine.Stop(ctx))
	require.NoError(t, b.engine.Stop(ctx), "a second Stop is a no-op")
	require.ErrorIs(t, b.engine.Register(threeSteps(b, "late", nil)), saga.ErrEngineStarted)
}

func TestStopDrainsRunningStepsAndHardStopCancelsThem(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered := make(chan struct{}, 1)
	def := threeSteps(b, "drain", map[string]saga.StepFunc[order]{
		"reserve/forward": func(ctx context.Context, run *saga.StepRun, _ *order) error {
			if run.Attempt == 1 {
				entered <- struct{}{}
				select {
				case <-time.After(300 * time.Millisecond):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()

	// A soft stop waits for the running step, which commits.
	require.NoError(t, b.engine.Start(ctx))
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered
	require.NoError(t, b.engine.Stop(ctx))
	require.Equal(t, []string{"reserve/forward"}, b.effects(t, st.ID))

	// A stop whose deadline passes cancels the running step: it rolls back
	// and runs again after a restart.
	st2, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, b.engine.Start(ctx))
	<-entered
	stopCtx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, b.engine.Stop(stopCtx), context.DeadlineExceeded)
	require.Empty(t, b.effects(t, st2.ID))

	b.start(t)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st2.ID).Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st2.ID))
}
