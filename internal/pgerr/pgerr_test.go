package pgerr_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The classes are checked against what a real PostgreSQL returns for the
// bytes it refuses.
func TestContentMatchesWhatPostgreSQLRefuses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE "`+schema+`".k (v text PRIMARY KEY, j jsonb)`)
	require.NoError(t, err)
	insert := `INSERT INTO "` + schema + `".k (v, j) VALUES ($1, $2)`
	for name, args := range map[string][]any{
		"nul in text":         {"a\x00b", nil},
		"invalid utf-8":       {"a\xffb", nil},
		"nul in jsonb":        {"x", `{"a":"\u0000"}`},
		"index row too large": {incompressible(10_000), nil},
	} {
		_, err := pool.Exec(ctx, insert, args...)
		require.Error(t, err, name)
		require.True(t, pgerr.Content(fmt.Errorf("wrapped: %w", err)), "%s: %v", name, err)
		require.False(t, pgerr.Lock(err), name)
	}
	_, err = pool.Exec(ctx, insert, "dup", nil)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, insert, "dup", nil)
	require.False(t, pgerr.Content(err), "a unique violation is not about content: %v", err)
	require.True(t, pgerr.Statement(err))
	require.False(t, pgerr.Content(errors.New("not from postgres")))
	require.False(t, pgerr.Statement(context.DeadlineExceeded))
}

// incompressible returns n bytes of hex that TOAST cannot compress below
// the btree limit.
func incompressible(n int) string {
	b := make([]byte, n/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// A connection whose backend a restart ended fails its next query; Broken
// says so, and RetryRead goes on to the pool's next connection until one
// works. A statement PostgreSQL refuses, or a cancelled context, is not
// retried.
func TestRetryReadGoesPastBrokenConnections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.RecentPool(t, 3)
	require.Equal(t, 3, pgtest.BreakIdle(t, pool))
	var one int
	err := pool.QueryRow(ctx, "SELECT 1").Scan(&one)
	require.Error(t, err, "a query on a connection whose backend ended")
	require.True(t, pgerr.Broken(err), "%v", err)

	require.Equal(t, 2, pgtest.BreakIdle(t, pool), "the failed connection left the pool")
	calls := 0
	require.NoError(t, pgerr.RetryRead(ctx, func(ctx context.Context) error {
		calls++
		return pool.QueryRow(ctx, "SELECT 1").Scan(&one)
	}))
	require.Equal(t, 3, calls, "two broken connections, then a new one")

	calls = 0
	err = pgerr.RetryRead(ctx, func(ctx context.Context) error {
		calls++
		_, err := pool.Exec(ctx, "SELECT * FROM no_such_table_here")
		return err
	})
	require.Error(t, err)
	require.False(t, pgerr.Broken(err), "%v", err)
	require.Equal(t, 1, calls, "a refused statement is not retried")

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	calls = 0
	err = pgerr.RetryRead(cctx, func(ctx context.Context) error {
		calls++
		return pool.QueryRow(ctx, "SELECT 1").Scan(&one)
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 1, calls)
	require.False(t, pgerr.Broken(nil))
}
