package review5_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// A retriable step is attempted past Retry.MaxAttempts (2 here): its fourth
// attempt runs.
func TestRetriablePastMaxAttempts(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	e, err := saga.New(pool, &saga.Config{Schema: schema, PollInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	var n atomic.Int32
	fourth := make(chan struct{})
	d := saga.Define("ret",
		saga.Step[st]{Name: "charge", Action: noop, Pivot: true},
		saga.Step[st]{Name: "ship", Retriable: true,
			Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
			Action: func(context.Context, *saga.StepRun, *st) error {
				if n.Add(1) < 4 {
					return errors.New("transient")
				}
				close(fourth)
				return nil
			}})
	require.NoError(t, e.Register(d))
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = e.Stop(c)
	})
	_, err = saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	select {
	case <-fourth:
	case <-time.After(40 * time.Second):
		t.Fatalf("retriable step stopped after %d attempts", n.Load())
	}
}
