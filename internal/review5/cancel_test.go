package review5_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// Cancel while a retriable step after the pivot runs is refused with
// ErrPastPivot.
func TestCancelPastPivotRefused(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	e, err := saga.New(pool, &saga.Config{Schema: schema, PollInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	started, release := make(chan struct{}), make(chan struct{})
	var once bool
	d := saga.Define("piv",
		saga.Step[st]{Name: "charge", Action: noop, Pivot: true},
		saga.Step[st]{Name: "ship", Retriable: true, Action: func(ctx context.Context, _ *saga.StepRun, _ *st) error {
			if !once {
				once = true
				close(started)
			}
			select {
			case <-release:
			case <-ctx.Done():
			}
			return nil
		}})
	require.NoError(t, e.Register(d))
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = e.Stop(c)
	})
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("retriable step never ran")
	}
	err = e.Cancel(ctx, s.ID, "too late")
	close(release)
	require.True(t, errors.Is(err, saga.ErrPastPivot), "got %v", err)
}
