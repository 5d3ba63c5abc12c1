package saga_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

// A Postgres-only batch spends no round trip on BEGIN or on COMMIT alone:
// BEGIN goes with the claim, and COMMIT with the batch's tail (leaving its
// savepoints, deleting the commands it ran). Counted on the wire, from the
// pool's tracer.
func TestAStepBatchBeginsWithItsClaimAndCommitsWithItsTail(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	traced, trace := pgtest.Traced(t, b.pool, 4)
	var err error
	b.engine, err = saga.New(traced, &saga.Config{Schema: b.schema, Workers: 1, PollInterval: 100 * time.Millisecond,
		Logger: testLogger(t)})
	require.NoError(t, err)
	def := threeSteps(b, "roundtrips", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)

	ctx := context.Background()
	tx, err := b.pool.Begin(ctx) // the start is the caller's, on a pool not traced
	require.NoError(t, err)
	st, err := saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "o-rt"}, nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)

	committed := 0
	for pid, rts := range trace.ByBackend() {
		open := false
		for i, rt := range rts {
			claim := false
			for _, s := range rt.Stmts {
				claim = claim || strings.Contains(s, "c.aggregatetype, c.type, c.payload")
			}
			if claim {
				require.True(t, pgtest.IsStmt(rt.Stmts[0], "BEGIN"), "backend %d, round trip %d: the claim is not sent with BEGIN: %q", pid, i, rt.Stmts)
				open = true
				continue
			}
			if !open {
				continue
			}
			if len(rt.Stmts) == 1 {
				require.False(t, pgtest.IsStmt(rt.Stmts[0], "COMMIT"), "backend %d, round trip %d: a COMMIT of its own", pid, i)
				if pgtest.IsStmt(rt.Stmts[0], "ROLLBACK") && !strings.Contains(rt.Stmts[0], "SAVEPOINT") {
					open = false // a claim that found nothing
				}
				continue
			}
			last := rt.Stmts[len(rt.Stmts)-1]
			if pgtest.IsStmt(last, "COMMIT") {
				require.True(t, pgtest.IsStmt(rt.Stmts[0], "RELEASE SAVEPOINT"), "backend %d, round trip %d: COMMIT without the tail: %q", pid, i, rt.Stmts)
				committed++
				open = false
			}
		}
	}
	require.GreaterOrEqual(t, committed, 1, "the steps' batches committed with their tails")
}
