package review11_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Guarantee 10: a cancel request "goes ahead of the saga's next command,
// whatever that is, so no step after it runs". A request recorded by an
// operator tool (RequestCancel, no definition) on a saga whose branch is
// lost, while no worker runs: then the rescuer re-sends the branch. When
// workers come back, the request must go first: the branch never runs, and
// the saga ends compensated.
//
// In the second case the request's own message (sagaflow.cancel) is lost
// too: the request is still "durable until applied", in the database, and
// the re-sent branch is the saga's next command: the request goes ahead of
// it.
func TestCancelRequestGoesAheadOfAResentBranch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		loseCancel  bool
		requeueDead bool
	}{
		{"request delivered", false, false},
		{"request's message lost", true, false},
		// The control that tells whose part it is: no rescuer, the operator
		// requeues the parked branch command instead.
		{"request's message lost, branch requeued by the operator", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cancelRequestAheadOfResentBranch(t, tc.loseCancel, tc.requeueDead)
		})
	}
}

func cancelRequestAheadOfResentBranch(t *testing.T, loseCancel, requeueDead bool) {
	ctx := context.Background()
	e := newEnv(t)
	def := fanDef("cancelreq", e.fx, newBehave(), 3, "a", "b")
	if requeueDead {
		e.lose(t, "%/fan.b/%", "sagaflow.branch", "dead", 0, 1)
	} else {
		e.loseBranch(t, "fan.b", 0)
	}
	if loseCancel {
		e.lose(t, "%", "sagaflow.cancel", "delete", 0, 1)
	}
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	stop()
	tool := testkit.NewEngine(t, e.Pool, e.cfg()) // the operator CLI: no definitions
	require.NoError(t, tool.RequestCancel(ctx, id, "customer"))
	t.Logf("after the request:\n%s", e.dump(t, id))
	client := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	if requeueDead {
		page, err := client.DeadMessages(ctx, nil)
		require.NoError(t, err)
		require.Len(t, page.Messages, 1)
		_, err = client.RequeueDead(ctx, &saga.RequeueOpts{MessageIDs: []uuid.UUID{page.Messages[0].ID}})
		require.NoError(t, err)
	} else {
		require.True(t, e.age(t, id, 2*slack))
		res := rescue(t, client)
		t.Logf("rescue %+v\n%s", res, e.dump(t, id))
	}
	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	require.Equal(t, saga.StatusCompensated, testkit.WaitEnded(t, g2, id).Status, e.dump(t, id))
	testkit.Hold(t, 300*time.Millisecond, "fan.b never runs", func() bool {
		if e.fx.Count(t, id, "fan.b") != 0 {
			t.Logf("effects %v\ntimeline %v", e.fx.List(t, id), timeline(t, g2, id))
			return false
		}
		return true
	})
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "undo:fan.a": 1, "undo:pre": 1}, e.fx.Counts(t, id))
}

// The same order for a lost wake-up: a saga waits for "go"; the signal
// comes and its wake-up is lost; an operator tool requests a cancel whose
// message is lost too. The rescuer wakes the saga; the request must go
// ahead of the delivery: the signal's handler never runs.
func TestCancelRequestGoesAheadOfAResentWakeUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("cancelwake",
		saga.Step[order]{Name: "pre",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "pre") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "undo:pre") }},
		saga.Step[order]{Name: "await_go", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error {
			return e.fx.Record(ctx, run, "go")
		})},
	)
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startWaiting(t, g, def)
	stop()
	e.lose(t, "%", "sagaflow.wake", "delete", 0, 1)
	e.lose(t, "%cancel%", "sagaflow.cancel", "delete", 0, 1)
	client := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	signal(t, client, id, "go")
	tool := testkit.NewEngine(t, e.Pool, e.cfg())
	require.NoError(t, tool.RequestCancel(ctx, id, "customer"))
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	res := rescue(t, client)
	t.Logf("rescue %+v\n%s", res, e.dump(t, id))
	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	in := testkit.WaitEnded(t, g2, id)
	require.Equal(t, map[string]int{"pre": 1, "undo:pre": 1}, e.fx.Counts(t, id), "timeline %v", timeline(t, g2, id))
	require.Equal(t, saga.StatusCompensated, in.Status)
}

// A saga deadline that passes while a branch is lost: one RescueNow both
// re-sends the branch and records the deadline's cancel request. "A saga
// past its deadline is cancelled by the rescuer as Engine.Cancel would":
// the request goes ahead of the re-sent branch, which never runs.
func TestDeadlinePassesWhileABranchIsLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	def := fanDef("deadline", e.fx, newBehave(), 3, "a", "b")
	e.loseBranch(t, "fan.b", 0)
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	st, err := saga.Start(ctx, g, def, order{ID: "o"}, &saga.StartOpts{Deadline: time.Hour})
	require.NoError(t, err)
	waitFor(t, "fan.a", func() bool { return e.fx.Count(t, st.ID, "fan.a") == 1 })
	stop()
	client := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	require.NoError(t, e.clk.Advance(ctx, 2*time.Hour))
	res := rescue(t, client)
	t.Logf("rescue %+v\n%s", res, e.dump(t, st.ID))
	require.Equal(t, 1, res.Deadlines, "%+v", res)
	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	in := testkit.WaitEnded(t, g2, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "undo:fan.a": 1, "undo:pre": 1}, e.fx.Counts(t, st.ID), "timeline %v", timeline(t, g2, st.ID))
}
