package pgtest_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// errorsTB records Error calls instead of failing the test.
type errorsTB struct {
	*testing.T
	mu   sync.Mutex
	errs []string
}

func (r *errorsTB) Error(args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprint(args...))
}

func (r *errorsTB) recorded() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.errs...)
}

// The pools of pgtest fail their test when a 64-bit Go value goes to a
// parameter PostgreSQL typed int4 or int2, whatever the value, by a query,
// an exec or a batch; a cast to bigint, a float8 parameter or a Go int is
// not reported. Each statement has a text of its own here (a statement is
// described once per process).
func TestAWideValueToANarrowParameterFailsTheTest(t *testing.T) {
	t.Parallel()
	rec := &errorsTB{T: t}
	pool, _ := pgtest.NewSchema(rec)
	ctx := context.Background()
	tag := fmt.Sprintf("/* %d */ ", time.Now().UnixNano())

	// Reported: an exec, a query and a batch.
	_, err := pool.Exec(ctx, tag+"SELECT 2 * $1", int64(3))
	require.NoError(t, err)
	rows, err := pool.Query(ctx, tag+"SELECT 4 * $1, $2::smallint", uint32(7), time.Duration(8))
	require.NoError(t, err)
	rows.Close()
	require.NoError(t, rows.Err())
	b := &pgx.Batch{}
	b.Queue(tag + "SELECT 1")
	b.Queue(tag+"SELECT 3 * $1 + $2", time.Microsecond, 1)
	require.NoError(t, pool.SendBatch(ctx, b).Close())

	// Not reported: wide to bigint or float8, an int to int4.
	_, err = pool.Exec(ctx, tag+"SELECT 2 * $1::bigint", int64(3))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, tag+"SELECT now() + $1 * interval '1 microsecond'", int64(3))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, tag+"SELECT 5 * $1", 3)
	require.NoError(t, err)
	// Nor a statement that failed, nor one described already.
	_, err = pool.Exec(ctx, tag+"SELECT 2 * $1 FROM nowhere", int64(3))
	require.Error(t, err)
	_, err = pool.Exec(ctx, tag+"SELECT 2 * $1", int64(4))
	require.NoError(t, err)

	errs := rec.recorded()
	require.Len(t, errs, 3, "%q", errs)
	require.Contains(t, errs[0], "$1 is int4 and gets a int64")
	require.Contains(t, errs[0], "SELECT 2 * $1")
	require.Contains(t, errs[1], "$1 is int4 and gets a uint32; $2 is int2 and gets a time.Duration")
	require.Contains(t, errs[2], "$1 is int4 and gets a time.Duration")
	require.NotContains(t, errs[2], "$2 is", "a Go int is not reported")
	for _, e := range errs {
		require.True(t, strings.HasPrefix(e, "pgtest: a 64-bit value goes to a narrower parameter (cast it to bigint)"), e)
	}
}
