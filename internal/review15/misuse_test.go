package review15

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// The worst user: bill's Command commits or rolls back run.Tx ("do not
// commit or roll it back") before returning its payload, beside healthy
// sagas. Whatever the engine makes of it, pay's reply must not be applied
// twice (OnReply's "paid" once), bill must not be sent twice, the saga must
// end, and the healthy sagas must complete untouched.
func TestBillCommandCommitsOrRollsBackRunTx(t *testing.T) {
	t.Parallel()
	r := newRig(t, "misuse", nil)
	r.billCmd = func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
		switch {
		case strings.HasPrefix(o.ID, "commit"):
			_ = r.fx.Record(ctx, run, "billtx")
			_ = run.Tx.Commit(ctx)
		case strings.HasPrefix(o.ID, "rollback"):
			_ = r.fx.Record(ctx, run, "billtx")
			_ = run.Tx.Rollback(ctx)
		}
		return cmd{ID: o.ID}, nil
	}
	def := r.def(2)
	r.start(t, func(cfg *saga.Config) { cfg.BatchSize = 16 }, def)
	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	for i, k := range []string{"ok", "commit", "ok", "rollback", "ok", "ok"} {
		n := fmt.Sprintf("%s-%d", k, i)
		st, err := saga.Start(ctx, r.engine, def, ord{ID: n}, nil)
		require.NoError(t, err)
		ids[n] = st.ID
	}
	for n, id := range ids {
		in := r.ended(t, id)
		// Observed at 5422ab8: the engine survives both (the Tx is a
		// savepoint of the reply's transaction); every saga completes.
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", n, timeline(in), in.LastError)
		require.Equal(t, 1, r.fx.Count(t, id, "paid"), "%s: %v %v", n, r.fx.List(t, id), timeline(in))
		require.Equal(t, 1, r.sent(t, id, "bill"), "%s: %v", n, timeline(in))
		require.Equal(t, []string{"pay", "bill"}, r.calls(t, id), n)
		require.LessOrEqual(t, r.fx.Count(t, id, "billtx"), 1, n)
		require.Equal(t, []string{"pick", "paid", "ship"}, without(r.fx.List(t, id), "billtx"), n)
	}
}
