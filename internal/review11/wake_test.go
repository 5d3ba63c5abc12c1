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
	"github.com/sagaflow/sagaflow/sagatest"
)

// waiterDef awaits signal "go", then signal "later", each without a time
// limit, recording "go" and "later".
func waiterDef(name string, fx *testkit.Effects) *saga.Definition[order] {
	rec := func(what string) func(context.Context, *saga.StepRun, *order, json.RawMessage) error {
		return func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error {
			return fx.Record(ctx, run, what)
		}
	}
	return saga.Define(name,
		saga.Step[order]{Name: "await_go", Wait: saga.OnSignal("go", rec("go"))},
		saga.Step[order]{Name: "await_later", Wait: saga.OnSignal("later", rec("later"))},
	)
}

func (e *env) startWaiting(t *testing.T, g *saga.Engine, def *saga.Definition[order]) uuid.UUID {
	t.Helper()
	st, err := saga.Start(context.Background(), g, def, order{ID: "w"}, nil)
	require.NoError(t, err)
	waitFor(t, "the saga waits", func() bool {
		in, err := g.Get(context.Background(), st.ID)
		require.NoError(t, err)
		return in.Wait != nil
	})
	return st.ID
}

func signal(t *testing.T, g *saga.Engine, id uuid.UUID, name string) {
	t.Helper()
	_, err := g.Signal(context.Background(), saga.Signal{SagaID: id, Name: name, ID: name, Payload: json.RawMessage(`{}`)})
	require.NoError(t, err)
}

// A lost wake-up (deleted, or parked as dead) is sent again once the
// signal has been pending for RescueSlack, not before; the signal is
// delivered once.
func TestLostWakeUpIsSentAgain(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"delete", "dead"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newEnv(t)
			def := waiterDef("wake_"+mode, e.fx)
			g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
			id := e.startWaiting(t, g, def)
			e.lose(t, "%", "sagaflow.wake", mode, 0, 1)
			signal(t, g, id, "go")
			require.Equal(t, 1, e.dropped(t, "%"))
			require.NoError(t, e.clk.Advance(ctx, slack/2))
			require.Zero(t, rescue(t, g).Woken, "woken before RescueSlack")
			require.NoError(t, e.clk.Advance(ctx, slack))
			require.Equal(t, 1, rescue(t, g).Woken)
			waitFor(t, "go delivered", func() bool { return e.fx.Count(t, id, "go") == 1 })
			signal(t, g, id, "later")
			require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
			require.Equal(t, map[string]int{"go": 1, "later": 1}, e.fx.Counts(t, id))
		})
	}
}

// The sweep is for what the saga waits for. A signal kept for a later step
// (the saga waits for "go"; "later" came first) is not a lost wake-up: the
// rescuer must not wake the saga, at every RescueSlack, for ever.
func TestPendingSignalOfAnotherNameWakesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	def := waiterDef("othername", e.fx)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startWaiting(t, g, def)
	signal(t, g, id, "later")
	woken := 0
	for range 3 {
		require.NoError(t, e.clk.Advance(ctx, 2*slack))
		woken += rescue(t, g).Woken
	}
	in, err := g.Get(ctx, id)
	require.NoError(t, err)
	require.Equal(t, "await_go", in.Step)
	require.Zero(t, woken, "RescueResult.Woken: sagas that \"waited without a time limit for something that had happened ... their wake-up had been lost\"; this one waits for \"go\", which never came")
	signal(t, g, id, "go")
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
	require.Equal(t, map[string]int{"go": 1, "later": 1}, e.fx.Counts(t, id))
}

// A wake-up that is not lost, only waiting in the queue (no worker runs),
// is not a lost wake-up: "Woken ... their wake-up had been lost (deleted,
// or parked as dead)".
func TestQueuedWakeUpIsNotLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	def := waiterDef("queued", e.fx)
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startWaiting(t, g, def)
	stop()
	client := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	signal(t, client, id, "go")
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	res := rescue(t, client)
	wakes := e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND type = 'sagaflow.wake' AND status = 'pending'`, id)
	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	waitFor(t, "go delivered", func() bool { return e.fx.Count(t, id, "go") == 1 })
	require.Equal(t, 1, e.fx.Count(t, id, "go"))
	_ = g2
	require.Zero(t, res.Woken, "the wake-up was pending, not lost; %d wake-ups pending after the rescue", wakes)
}

// A paused saga gets no signal delivery, even when its wake-up was lost
// and the rescuer sends another; after Resume the signal is delivered once.
func TestLostWakeUpOfAPausedSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	def := waiterDef("pausedwake", e.fx)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startWaiting(t, g, def)
	require.NoError(t, g.Pause(ctx, id, "hold"))
	e.lose(t, "%", "sagaflow.wake", "delete", 0, 1)
	signal(t, g, id, "go")
	for range 2 {
		require.NoError(t, e.clk.Advance(ctx, 2*slack))
		rescue(t, g)
	}
	testkit.Hold(t, 500*time.Millisecond, "no delivery while paused", func() bool { return e.fx.Count(t, id, "go") == 0 })
	require.NoError(t, g.Resume(ctx, id, "go on"))
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	rescue(t, g)
	waitFor(t, "go delivered after the resume", func() bool { return e.fx.Count(t, id, "go") == 1 })
	signal(t, g, id, "later")
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
	require.Equal(t, map[string]int{"go": 1, "later": 1}, e.fx.Counts(t, id))
}

// Nested: a parent waits, without a time limit, for a child whose parallel
// step loses a branch command; the child's end then loses the parent's
// wake-up. The rescuer heals both, each effect once.
func TestChildWithLostBranchAndLostParentWakeUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	child := fanDef("kid", e.fx, newBehave(), 3, "a", "b")
	parent := saga.Define("parent",
		saga.Step[order]{Name: "spawn", Wait: saga.Child(child,
			func(ctx context.Context, run *saga.StepRun, s *order) (order, *saga.StartOpts, error) {
				return order{ID: "kid"}, nil, nil
			},
			func(ctx context.Context, run *saga.StepRun, s *order, c order) error {
				return e.fx.Record(ctx, run, "child_done")
			})},
	)
	e.loseBranch(t, "fan.b", 0)
	e.lose(t, "%", "sagaflow.wake", "delete", 0, 1)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), parent, child)
	st, err := saga.Start(ctx, g, parent, order{ID: "p"}, nil)
	require.NoError(t, err)
	var kid uuid.UUID
	waitFor(t, "the child started, its fan.a done", func() bool {
		return e.Count(t, `SELECT count(*) FROM `+e.fx.Table()+` WHERE what = 'fan.a'`) == 1
	})
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT saga_id FROM `+e.fx.Table()+` WHERE what = 'fan.a'`).Scan(&kid))
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	require.Equal(t, 1, rescue(t, g).Redriven)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, kid).Status)
	require.Equal(t, 1, e.dropped(t, "%"), "the parent's wake-up was lost")
	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	require.Equal(t, 1, rescue(t, g).Woken)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, st.ID).Status)
	require.Equal(t, map[string]int{"child_done": 1}, e.fx.Counts(t, st.ID))
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, kid))
}

// A wait with a time limit has a deadline, so the sweep for lost wake-ups
// is not for it. But its signal came in time and only the wake-up was
// lost: when the limit's command fires, the signal is there, pending.
// Guarantee 12, "Waits end once, and none is missed ... a signal is
// delivered whether it arrives before the saga reaches the await ... or
// after": the wait takes the signal rather than timing out.
//
// Two cases: the rescuer runs after RescueSlack (it wakes the saga, which is
// more than promised for a timed wait), or the hour passes before any
// rescue, so that the limit's command is what finds the pending signal.
func TestLostWakeUpOfATimedWait(t *testing.T) {
	t.Parallel()
	for _, rescueFirst := range []bool{true, false} {
		name := map[bool]string{true: "rescuer first", false: "limit first"}[rescueFirst]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			lostWakeUpOfATimedWait(t, rescueFirst)
		})
	}
}

func lostWakeUpOfATimedWait(t *testing.T, rescueFirst bool) {
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("timedwait",
		saga.Step[order]{Name: "pre",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "pre") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "undo:pre") }},
		saga.Step[order]{Name: "await_go", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error {
			return e.fx.Record(ctx, run, "go")
		}).Timeout(time.Hour)},
	)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startWaiting(t, g, def)
	e.lose(t, "%", "sagaflow.wake", "delete", 0, 1)
	signal(t, g, id, "go")
	require.Equal(t, 1, e.dropped(t, "%"))
	if rescueFirst {
		require.NoError(t, e.clk.Advance(ctx, 2*slack))
		t.Logf("rescue after 2×RescueSlack: %+v", rescue(t, g))
	} else {
		require.NoError(t, e.clk.Advance(ctx, time.Hour+time.Second))
	}
	in := testkit.WaitEnded(t, g, id)
	sigs, err := g.Signals(ctx, id)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"pre": 1, "go": 1}, e.fx.Counts(t, id), "the signal came within the hour; timeline %v; signals %+v", sagatestTimeline(in), sigs)
	require.Equal(t, saga.StatusCompleted, in.Status)
}

func sagatestTimeline(in *saga.Instance) []string { return sagatest.Timeline(in) }
