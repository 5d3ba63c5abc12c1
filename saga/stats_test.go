package saga_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestAbandonedAttemptsCountAsFailed(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	b := setup(t, &saga.Config{HandlerGrace: 100 * time.Millisecond, BatchSize: 1})
	var calls atomic.Int32
	def := saga.Define("abandoned-stats", saga.Step[order]{
		Name: "hang", Timeout: 100 * time.Millisecond, Retry: fastRetry,
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if calls.Add(1) == 1 {
				time.Sleep(500 * time.Millisecond) // ignores ctx on purpose
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	s := b.engine.Stats()
	require.Equal(t, int64(1), s.HandlersAbandoned)
	require.Equal(t, int64(1), s.AttemptsFailed, "the abandoned attempt failed")
	require.Equal(t, int64(1), s.StepsSucceeded)
}
