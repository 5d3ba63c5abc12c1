package review5_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// With limit 1, a NoWait start of a key that holds a running saga fails with
// ErrConcurrencyLimit; a start rolled back with its StartTx holds no slot; a
// second schema (tenant) has its own slots; another key is not limited.
func TestNoWaitLimitAndRollback(t *testing.T) {
	ctx := context.Background()
	mk := func() (*saga.Engine, *saga.Definition[st], func() error) {
		pool, schema := pgtest.NewSchema(t)
		_, err := migrations.Migrate(ctx, pool, schema)
		require.NoError(t, err)
		e, err := saga.New(pool, &saga.Config{Schema: schema, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		d := saga.Define("lim", saga.Step[st]{Name: "a", Action: noop}).WithConcurrency(1)
		require.NoError(t, e.Register(d))
		rolled := func() error {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			_, err = saga.StartTx(ctx, e, tx, d, st{}, &saga.StartOpts{ConcurrencyKey: "k", NoWait: true})
			require.NoError(t, tx.Rollback(ctx))
			return err
		}
		return e, d, rolled
	}
	e, d, rolled := mk()
	require.NoError(t, rolled())
	nw := &saga.StartOpts{ConcurrencyKey: "k", NoWait: true}
	_, err := saga.Start(ctx, e, d, st{}, nw)
	require.NoError(t, err, "a rolled-back StartTx kept the slot")
	_, err = saga.Start(ctx, e, d, st{}, &saga.StartOpts{ConcurrencyKey: "k", NoWait: true})
	require.True(t, errors.Is(err, saga.ErrConcurrencyLimit), "got %v", err)
	_, err = saga.Start(ctx, e, d, st{}, &saga.StartOpts{ConcurrencyKey: "other", NoWait: true})
	require.NoError(t, err)
	e2, d2, _ := mk()
	_, err = saga.Start(ctx, e2, d2, st{}, &saga.StartOpts{ConcurrencyKey: "k", NoWait: true})
	require.NoError(t, err, "the other tenant's schema shares slots")
}
