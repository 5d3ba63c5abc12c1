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

// A saga on version 2 of a definition, whose branch command was lost, is
// looked at by an engine that registered version 1 only. In v1 the
// branch has one attempt (a lost attempt would spend it); in v2 it has
// five. The old engine must not judge the saga by v1: no group failed, no
// branch run with v1's code. An engine with v2 then sends it again and
// the saga completes on v2.
func TestLostBranchOfAnUnknownVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	v1 := fanDef("versioned", e.fx, newBehave(), 1, "a", "b")
	v2fx := newBehave()
	v2 := fanDefWith("versioned", e.fx, v2fx, &saga.RetryPolicy{MaxAttempts: 5, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, "a", "b").WithVersion(2)
	e.loseBranch(t, "fan.b", 0)
	gNew, stopNew := testkit.StartEngine(t, e.Pool, e.cfg(), v2)
	st, err := saga.Start(ctx, gNew, v2, order{ID: "v2"}, nil)
	require.NoError(t, err)
	waitFor(t, "fan.a", func() bool { return e.fx.Count(t, st.ID, "fan.a") == 1 })
	stopNew()

	gOld, _ := testkit.StartEngine(t, e.Pool, e.cfg(), v1)
	require.True(t, e.age(t, st.ID, 2*slack))
	res := rescue(t, gOld)
	require.Zero(t, res.FailedOver, "an engine without v2 failed the group of a v2 saga by v1's retry policy: %+v\n%s", res, e.dump(t, st.ID))
	testkit.Hold(t, 500*time.Millisecond, "the old engine runs nothing of the v2 saga", func() bool { return e.fx.Count(t, st.ID, "fan.b") == 0 })
	in, err := gOld.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.Equal(t, 2, in.DefinitionVersion)
	// Whatever the old engine wrote must be for v2 (aggregatetype
	// saga.versioned@v2), so that it never claims it.
	require.Zero(t, e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND status = 'pending' AND aggregatetype <> 'saga.versioned@v2'`, st.ID), e.dump(t, st.ID))

	gNew2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), v2)
	require.True(t, e.age(t, st.ID, 2*slack))
	rescue(t, gNew2)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, gNew2, st.ID).Status, e.dump(t, st.ID))
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, st.ID))
	require.Equal(t, 1, e.events(t, st.ID, saga.EventSagaRescued, "fan.b"), "sent again once")
}

// RescueBatch bounds one rescue transaction. Sagas ahead of a lost branch
// in the sweep's order (branches that started earlier) that the rescuer
// must leave alone (paused, of a type it does not know, or in a long
// backoff) must not keep it from the lost branch behind them.
func TestBranchSweepIsNotStarved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const ahead = 6
	e := newEnv(t)
	known := fanDef("known", e.fx, newBehave(), 3, "a", "b")
	foreign := fanDef("foreign", e.fx, newBehave(), 3, "a", "b")
	slow := newBehave()
	slow.failWith("fan.b", func(attempt int) error {
		if attempt == 1 {
			return errTransient
		}
		return nil
	})
	backoff := fanDefWith("backoff", e.fx, slow, &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 24 * time.Hour }}, "a", "b")
	e.lose(t, "%/fan.b/%", "sagaflow.branch", "delete", 0, 3*ahead)
	e.lose(t, "%/late.b/%", "sagaflow.branch", "delete", 0, 1)
	all, stopAll := testkit.StartEngine(t, e.Pool, e.cfg(), known, foreign, backoff)
	var paused, foreigners, waiting []uuid.UUID
	for range ahead {
		paused = append(paused, e.startFan(t, all, known, "a"))
		foreigners = append(foreigners, e.startFan(t, all, foreign, "a"))
	}
	for _, id := range paused {
		require.NoError(t, all.Pause(ctx, id, "starve"))
	}
	// Stop losing fan.b: the backoff sagas' first attempt runs, fails, and
	// its retry waits a day.
	_, err := e.Pool.Exec(ctx, `UPDATE `+e.Table("lose")+` SET drop = 0 WHERE pattern = '%/fan.b/%'`)
	require.NoError(t, err)
	for range ahead {
		id := e.startFan(t, all, backoff, "a")
		waitFor(t, "fan.b in backoff", func() bool { return e.events(t, id, saga.EventStepFailed, "fan.b") == 1 })
		waiting = append(waiting, id)
	}
	// The one lost branch, whose group started last.
	lateDef := saga.Define("late", saga.Step[order]{Name: "late", Parallel: &saga.Parallel[order]{Branches: branchesOf("late", e.fx, newBehave(), nil, "a", "b")}})
	stopAll()
	cfg := e.cfg()
	cfg.RescueBatch = 3
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), lateDef)
	st, err := saga.Start(ctx, g, lateDef, order{ID: "late"}, nil)
	require.NoError(t, err)
	waitFor(t, "late.a", func() bool { return e.fx.Count(t, st.ID, "late.a") == 1 })
	require.Equal(t, 1, e.dropped(t, "%/late.b/%"))

	// The rescuer under test knows "known", "backoff" and "late"; not "foreign".
	r := testkit.NewEngine(t, e.Pool, cfg, known, backoff, lateDef)
	for _, id := range append(append(append([]uuid.UUID{}, paused...), foreigners...), waiting...) {
		require.True(t, e.age(t, id, 3*slack))
	}
	require.True(t, e.age(t, st.ID, 2*slack))
	var total saga.RescueResult
	for range 3 {
		res := rescue(t, r)
		total.Redriven += res.Redriven
		total.FailedOver += res.FailedOver
	}
	require.Zero(t, total.FailedOver, "%+v", total)
	require.Equal(t, 1, total.Redriven, "only the late saga's branch is lost and may be sent again: %+v\n%s", total, e.dump(t, st.ID))
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, st.ID).Status, e.dump(t, st.ID))
	for _, id := range foreigners {
		require.Zero(t, e.events(t, id, saga.EventSagaRescued, ""), "the rescuer touched a saga of a type it does not know")
	}
	for _, id := range waiting {
		require.Zero(t, e.events(t, id, saga.EventSagaRescued, ""), "a branch in backoff is not lost")
	}
}

// The same for a lost wake-up: a v2 saga waits for "go" (v2's handler
// records "v2:go"); the signal came and its wake-up was lost; an engine
// with only v1 (whose handler records "v1:go") runs the rescuer. The v2
// saga's wait must never be ended by v1's code, and whatever wake-up is
// written must be one only v2 engines claim.
func TestLostWakeUpOfAnUnknownVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	mk := func(v int) *saga.Definition[order] {
		tag := map[int]string{1: "v1:go", 2: "v2:go"}[v]
		return saga.Define("vwait",
			saga.Step[order]{Name: "await_go", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error {
				return e.fx.Record(ctx, run, tag)
			})}).WithVersion(v)
	}
	v1, v2 := mk(1), mk(2)
	gNew, stopNew := testkit.StartEngine(t, e.Pool, e.cfg(), v2)
	id := e.startWaiting(t, gNew, v2)
	stopNew()
	e.lose(t, "%", "sagaflow.wake", "delete", 0, 1)
	signal(t, gNew, id, "go")
	require.Equal(t, 1, e.dropped(t, "%"))

	gOld, _ := testkit.StartEngine(t, e.Pool, e.cfg(), v1)
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	res := rescue(t, gOld)
	t.Logf("the v1 engine's rescue: %+v\n%s", res, e.dump(t, id))
	testkit.Hold(t, 500*time.Millisecond, "v1's handler never ends the v2 saga's wait", func() bool { return e.fx.Count(t, id, "v1:go") == 0 })
	require.Zero(t, e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND status = 'pending' AND aggregatetype <> 'saga.vwait@v2'`, id),
		"a wake-up a v1 engine would claim\n%s", e.dump(t, id))

	gNew2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), v2)
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	rescue(t, gNew2)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, gNew2, id).Status)
	require.Equal(t, map[string]int{"v2:go": 1}, e.fx.Counts(t, id))
}
