package review4_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// Many sagas asleep: Advance by less than the wait fires none, by exactly the
// rest fires each once, and advancing further fires nothing again. While
// they sleep, Instance.Wait and ListOpts.Waiting say so.
func TestTimersFireOnceByTheDatabaseClock(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("sleepers",
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Hour)},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	ctl := v.controlDef()
	v.run(t, def, ctl)
	ctx := context.Background()
	const n = 25
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, v.e, def, state{}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	for _, id := range ids {
		in := waitingFor(t, v.e, id, "timer", "")
		require.NotNil(t, in.Wait.Until)
		require.WithinDuration(t, in.CreatedAt.Add(time.Hour), *in.Wait.Until, 5*time.Second)
	}
	page, err := v.e.List(ctx, &saga.ListOpts{Name: "sleepers", Waiting: true})
	require.NoError(t, err)
	require.Len(t, page.Sagas, n)

	// Less than the wait: the control (1 minute) fires, the sleepers do not.
	c, err := saga.Start(ctx, v.e, ctl, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, c.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, 59*time.Minute))
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, v.e, c.ID, wopts).Status)
	for _, id := range ids {
		in := get(t, v.e, id)
		require.Equal(t, 0, count(in, "timer_fired:nap"), sagatest.Describe(in))
		require.NotNil(t, in.Wait)
	}

	// Exactly the rest of the wait.
	require.NoError(t, v.clock().Advance(ctx, time.Minute))
	for _, id := range ids {
		in := sagatest.WaitEnded(t, v.e, id, wopts)
		require.Equal(t, saga.StatusCompleted, in.Status)
		require.Nil(t, in.Wait)
	}
	// Much more: nothing fires again.
	c2, err := saga.Start(ctx, v.e, ctl, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, c2.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, 48*time.Hour))
	sagatest.WaitEnded(t, v.e, c2.ID, wopts)
	for _, id := range ids {
		in := get(t, v.e, id)
		require.Equal(t, 1, count(in, "timer_fired:nap"), sagatest.Describe(in))
		require.Equal(t, 1, v.effects(t, id, "after"))
	}
	page, err = v.e.List(ctx, &saga.ListOpts{Name: "sleepers", Waiting: true})
	require.NoError(t, err)
	require.Empty(t, page.Sagas)
}

// A timer outlives the engine that started it: stopped, time passes, a new
// engine on the schema fires it once.
func TestTimerAcrossEngineRestart(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	mk := func() *saga.Definition[state] {
		return saga.Define("restart",
			saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](2 * time.Hour)},
			saga.Step[state]{Name: "after", Action: act[state](v, "after")},
		)
	}
	def := mk()
	require.NoError(t, v.e.Register(def))
	ctx := context.Background()
	require.NoError(t, v.e.Start(ctx))
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "timer", "")
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, v.e.Stop(stopCtx))

	require.NoError(t, sagatest.NewClock(v.pool, v.schema).Advance(ctx, 3*time.Hour))
	e2 := newEngine(t, v.pool, v.schema)
	startEngine(t, e2, mk())
	in := sagatest.WaitEnded(t, e2, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, count(in, "timer_fired:nap"))
	require.Equal(t, 1, v.effects(t, st.ID, "after"))
}

// SleepUntil a time already past, SleepFor zero or negative, Sleep(0): none
// waits.
func TestSleepInThePast(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("past",
		saga.Step[state]{Name: "until", Wait: saga.SleepUntil(func(*state) time.Time { return time.Now().Add(-time.Hour) })},
		saga.Step[state]{Name: "zero-time", Wait: saga.SleepUntil(func(*state) time.Time { return time.Time{} })},
		saga.Step[state]{Name: "negative", Wait: saga.SleepFor(func(*state) time.Duration { return -time.Hour })},
		saga.Step[state]{Name: "zero", Wait: saga.Sleep[state](0)},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "after"))
}

// An operator cancels a sleeping saga: it compensates at once, and its timer
// never fires later.
func TestCancelWhileSleeping(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("cancelnap",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Hour)},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	ctl := v.controlDef()
	v.run(t, def, ctl)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "timer", "")
	require.NoError(t, v.e.Cancel(ctx, st.ID, "customer changed their mind"))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Nil(t, in.Wait)

	c, err := saga.Start(ctx, v.e, ctl, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, c.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, 2*time.Hour))
	sagatest.WaitEnded(t, v.e, c.ID, wopts)
	in = get(t, v.e, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, 0, count(in, "timer_fired:nap"), sagatest.Describe(in))
	require.Equal(t, 0, v.effects(t, st.ID, "after"))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
}

// The saga's deadline passes while its signal handler runs: the running step
// is interrupted ("as Engine.Cancel would"), and the saga compensates with
// CodeDeadline. The deadline is a real 2 s one, because Clock.Advance cannot
// run while a step holds its transaction (see TestClockAdvanceDuringRunningStep).
func TestDeadlineWhileSignalHandlerRuns(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	g := newGate()
	def := saga.Define("deadline",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", func(ctx context.Context, run *saga.StepRun, s *state, p ev) error {
			if err := g.wait(ctx); err != nil {
				return err
			}
			return v.effect(ctx, run, "handled")
		})},
	).WithDeadline(time.Hour)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{Deadline: 2 * time.Second})
	require.NoError(t, err)
	in := waitingFor(t, v.e, st.ID, "signal", "x")
	require.NotNil(t, in.Deadline)
	require.WithinDuration(t, in.CreatedAt.Add(2*time.Second), *in.Deadline, time.Second, "StartOpts.Deadline overrides")
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "s"})
	require.NoError(t, err)
	g.started(t)
	until := time.Now().Add(30 * time.Second)
	for {
		r, err := v.e.RescueNow(ctx)
		require.NoError(t, err)
		if r.Deadlines > 0 {
			break
		}
		require.True(t, time.Now().Before(until), "the rescuer never saw the deadline")
		time.Sleep(50 * time.Millisecond) // poll interval
	}
	in = sagatest.WaitEnded(t, v.e, st.ID, wopts)
	close(g.release)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, 0, v.effects(t, st.ID, "handled"))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	require.Equal(t, 1, count(in, "cancel_requested:a"), sagatest.Describe(in))
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 1)
	require.NotEqual(t, "delivered", ss[0].Status, "its step was rolled back")
	require.NotNil(t, in.LastError)
	if in.LastError.Code != saga.CodeDeadline {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN: a saga cancelled for its deadline ends with LastError.Code %q, not CodeDeadline "+
			"(%q) as guarantee 12 and StartOpts.Deadline say; only the cancel_requested entry carries it",
			in.LastError.Code, saga.CodeDeadline)
	}
}

// A saga past its deadline while it waits (no step running) is cancelled with
// CodeDeadline.
func TestDeadlineWhileWaiting(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("deadline-wait",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
	).WithDeadline(time.Hour)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")
	require.NoError(t, v.clock().Advance(ctx, 2*time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	page, err := v.e.List(ctx, &saga.ListOpts{ErrorCode: saga.CodeDeadline})
	require.NoError(t, err)
	if in.LastError.Code != saga.CodeDeadline {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN: a saga cancelled for its deadline ends with LastError.Code %q, not CodeDeadline (%q) "+
			"as guarantee 12 says; List(ErrorCode: %q) finds %d sagas, so an operator cannot list the sagas "+
			"that missed their deadline", in.LastError.Code, saga.CodeDeadline, saga.CodeDeadline, len(page.Sagas))
	}
	require.Len(t, page.Sagas, 1)
}

// Clock.Advance while a step of a saga runs (holding its transaction).
func TestClockAdvanceDuringRunningStep(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	g := newGate()
	def := saga.Define("busy",
		saga.Step[state]{Name: "slow", Action: func(ctx context.Context, _ *saga.StepRun, _ *state) error {
			return g.wait(ctx)
		}},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	g.started(t)
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err = v.clock().Advance(actx, time.Hour)
	close(g.release)
	sagatest.WaitEnded(t, v.e, st.ID, wopts)
	// Documented (Clock.Advance): it waits for the transactions of running
	// steps, so with a step held past the context's end it gives up.
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// Wait.Timeout: nothing came in time, the step fails for good with
// CodeWaitTimeout and the saga compensates; a signal after that is rejected.
func TestSignalWaitTimeout(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("timeout",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v)).Timeout(time.Hour)},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	in := waitingFor(t, v.e, st.ID, "signal", "x")
	require.NotNil(t, in.Wait.Until)
	require.NoError(t, v.clock().Advance(ctx, 30*time.Minute))
	require.NoError(t, v.clock().Advance(ctx, 31*time.Minute))
	in = sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeWaitTimeout, in.LastError.Code)
	require.Equal(t, 1, count(in, "wait_timed_out:a"), sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "late"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotRunning)
}
