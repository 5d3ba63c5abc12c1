package store_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// TestPerMessageReadsKeepAGenericPlan: the reads made once per Kafka
// message (a reply's saga and its execution lock, a cancel request asked
// for before a send) are prepared statements that PostgreSQL plans once per
// connection. With `= ANY($1)` over an array it judged every generic plan
// dearer than a plan for the value at hand and planned them again on each
// execution (0.5 ms of server CPU for the saga's read: more than running
// it). PostgreSQL counts both kinds of plan in pg_prepared_statements.
func TestPerMessageReadsKeepAGenericPlan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, st, id := sagaAtCharge(t, 1, 1)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	const runs = 12 // PostgreSQL tries custom plans for the first five
	for range runs {
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		sagas, err := st.LockSagas(ctx, tx, []uuid.UUID{id}, "")
		require.NoError(t, err)
		require.True(t, sagas[id].Locked)
		var req *store.CancelRequest
		b := &pgx.Batch{}
		st.QueueCancelRequest(b, id, &req)
		require.NoError(t, tx.SendBatch(ctx, b).Close())
		require.Nil(t, req)
		require.NoError(t, tx.Rollback(ctx))
	}

	rows, err := conn.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements`)
	require.NoError(t, err)
	type plans struct{ generic, custom int64 }
	found := map[string]plans{}
	for rows.Next() {
		var text string
		var p plans
		require.NoError(t, rows.Scan(&text, &p.generic, &p.custom))
		switch {
		case strings.Contains(text, "pg_try_advisory_xact_lock") && strings.Contains(text, ".saga_cancel_requests r"):
			found["the saga's read"] = p
		case strings.Contains(text, "FROM "+pgx.Identifier{schema}.Sanitize()+".saga_cancel_requests WHERE"):
			found["the cancel request's read"] = p
		}
	}
	require.NoError(t, rows.Err())
	require.Len(t, found, 2, "both statements prepared on the connection: %v", found)
	for what, p := range found {
		require.Equal(t, int64(runs), p.generic+p.custom, "%s: each run planned or reused once", what)
		require.LessOrEqual(t, p.custom, int64(5), "%s: planned afresh on every run (%d custom plans, %d generic)", what, p.custom, p.generic)
	}
}
