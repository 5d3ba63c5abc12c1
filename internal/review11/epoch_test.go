package review11_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Two parallel steps with the same branch names: a lost p2.a is sent
// again as p2.a, and p1's branches are left as they are.
func TestTwoGroupsSameBranchNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	def := saga.Define("twogroups",
		saga.Step[order]{Name: "p1", Parallel: &saga.Parallel[order]{Branches: branchesOf("p1", e.fx, bh, nil, "a", "b")}},
		saga.Step[order]{Name: "p2", Parallel: &saga.Parallel[order]{Branches: branchesOf("p2", e.fx, bh, nil, "a", "b")}},
	)
	e.loseBranch(t, "p2.a", 0)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	st, err := saga.Start(context.Background(), g, def, order{ID: "o"}, nil)
	require.NoError(t, err)
	waitFor(t, "p2.b", func() bool { return e.fx.Count(t, st.ID, "p2.b") == 1 })
	require.True(t, e.age(t, st.ID, 2*slack))
	res := rescue(t, g)
	require.Equal(t, 1, res.Redriven, "%+v\n%s", res, e.dump(t, st.ID))
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, st.ID).Status)
	require.Equal(t, map[string]int{"p1.a": 1, "p1.b": 1, "p2.a": 1, "p2.b": 1}, e.fx.Counts(t, st.ID))
	require.Equal(t, 1, e.events(t, st.ID, saga.EventSagaRescued, "p2.a"))
	require.Equal(t, 1, branch(t, g, st.ID, "p1", "a", 0).Attempts)
}

// A saga re-run from its group (a new epoch) whose branch command is lost
// in the new epoch: the branch is sent again under the new epoch's key;
// the old epoch's rows are left alone. Then a saga cancelled in the group
// while its branch was lost, re-run from the group: the old epoch's
// cancelled branch never runs; the new epoch's does, once.
func TestLostBranchInANewEpoch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("rerun of a completed saga", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		def := fanDef("rerun", e.fx, newBehave(), 3, "a", "b")
		e.loseBranch(t, "fan.b", 1) // epoch 0's goes; epoch 1's is lost
		g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
		st, err := saga.Start(ctx, g, def, order{ID: "o"}, nil)
		require.NoError(t, err)
		require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, st.ID).Status)
		require.NoError(t, g.Rerun(ctx, st.ID, "fan", "again"))
		waitFor(t, "epoch 1's fan.a", func() bool { return e.fx.Count(t, st.ID, "fan.a") == 2 })
		require.Equal(t, 1, e.dropped(t, "%/fan.b/%"))
		require.True(t, e.age(t, st.ID, 2*slack))
		res := rescue(t, g)
		require.Equal(t, 1, res.Redriven, "%+v\n%s", res, e.dump(t, st.ID))
		require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, st.ID).Status)
		require.Equal(t, map[string]int{"pre": 1, "fan.a": 2, "fan.b": 2, "post": 2}, e.fx.Counts(t, st.ID))
		require.Equal(t, 1, branch(t, g, st.ID, "fan", "b", 0).Attempts)
		require.Equal(t, 2, branch(t, g, st.ID, "fan", "b", 1).Attempts)
		require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM `+e.Table("saga_history")+` WHERE saga_id = $1 AND event = 'saga_rescued' AND epoch = 1`, st.ID))
	})
	t.Run("rerun of a saga cancelled in the group", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		def := fanDef("cancelrerun", e.fx, newBehave(), 3, "a", "b")
		e.loseBranch(t, "fan.b", 0) // epoch 0's is lost
		g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
		id := e.startFan(t, g, def, "a")
		require.NoError(t, g.Cancel(ctx, id, "stop"))
		require.Equal(t, saga.StatusCompensated, testkit.WaitEnded(t, g, id).Status)
		require.NoError(t, g.Rerun(ctx, id, "pre", "again")) // a compensated saga re-runs from its first step
		require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status, e.dump(t, id))
		require.NoError(t, e.clk.Advance(ctx, 2*slack))
		res := rescue(t, g)
		require.Zero(t, res.Redriven+res.FailedOver, "%+v\n%s", res, e.dump(t, id))
		require.Equal(t, "cancelled", branch(t, g, id, "fan", "b", 0).Status)
		require.Equal(t, map[string]int{"pre": 2, "fan.a": 2, "undo:fan.a": 1, "undo:pre": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
	})
}
