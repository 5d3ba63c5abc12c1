package review5_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// A concurrency key PostgreSQL cannot store (NUL, invalid UTF-8, 10 kB) is
// refused with ErrInvalidInput, never a raw database error.
func TestConcurrencyKeyBadBytes(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	e, err := saga.New(pool, &saga.Config{Schema: schema, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	d := saga.Define("lim", saga.Step[st]{Name: "a", Action: noop}).WithConcurrency(1)
	require.NoError(t, e.Register(d))
	for label, key := range map[string]string{"nul": "a\x00b", "utf8": "a\xffb", "10kB": strings.Repeat("k", 10000)} {
		_, err := saga.Start(ctx, e, d, st{}, &saga.StartOpts{ConcurrencyKey: key})
		if !errors.Is(err, saga.ErrInvalidInput) {
			t.Errorf("%s: got %v, want ErrInvalidInput", label, err)
		}
	}
}
