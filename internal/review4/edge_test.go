package review4_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// Definitions that misuse Wait are refused by Register with
// ErrInvalidDefinition, never a panic.
func TestWaitDefinitionsRefused(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	noop := func(context.Context, *saga.StepRun, *state) error { return nil }
	child := saga.Define("c", saga.Step[kid]{Name: "a", Action: func(context.Context, *saga.StepRun, *kid) error { return nil }})
	in := func(context.Context, *saga.StepRun, *state) (kid, *saga.StartOpts, error) { return kid{}, nil, nil }
	done := func(context.Context, *saga.StepRun, *state, kid) error { return nil }
	cases := map[string]saga.Step[state]{
		"action and wait":  {Name: "a", Action: noop, Wait: saga.Sleep[state](time.Second)},
		"empty signal":     {Name: "a", Wait: saga.OnSignal("", appendSig(v))},
		"nil handler":      {Name: "a", Wait: saga.OnSignal[state, ev]("x", nil)},
		"nil child def":    {Name: "a", Wait: saga.Child[state, kid](nil, in, done)},
		"nil child input":  {Name: "a", Wait: saga.Child(child, nil, done)},
		"nil sleep fn":     {Name: "a", Wait: saga.SleepFor[state](nil)},
		"negative sleep":   {Name: "a", Wait: saga.Sleep[state](-time.Hour)},
		"negative timeout": {Name: "a", Wait: saga.OnSignal("x", appendSig(v)).Timeout(-time.Hour)},
		"timeout on timer": {Name: "a", Wait: saga.Sleep[state](time.Hour).Timeout(time.Minute)},
	}
	var accepted []string
	for name, step := range cases {
		var err error
		require.NotPanics(t, func() { err = v.e.Register(saga.Define("def-"+name, step)) }, name)
		if err == nil {
			accepted = append(accepted, name)
			continue
		}
		require.ErrorIs(t, err, saga.ErrInvalidDefinition, name)
	}
	// Only definitions whose meaning is arguable may pass.
	for _, name := range accepted {
		require.Contains(t, []string{"negative sleep", "timeout on timer", "nil child input"}, name,
			"Register accepted a broken wait")
	}
	// A negative sleep is documented (Sleep): it does not wait.
	for _, name := range accepted {
		require.Equal(t, "negative sleep", name, "Register accepted a broken wait")
	}
}

// Waits of absurd lengths: a timer past PostgreSQL's timestamp range, the
// longest Duration as a sleep, a signal time limit and a deadline. Each is
// either refused with a clear error or waits; none panics, none fires at
// once, none breaks the engine for other sagas.
func TestAbsurdWaitLengths(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	far := time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)
	mk := func(name string, w *saga.Wait[state]) *saga.Definition[state] {
		return saga.Define(name,
			saga.Step[state]{Name: "w", Wait: w},
			saga.Step[state]{Name: "after", Action: act[state](v, "after")})
	}
	defs := []*saga.Definition[state]{
		mk("far-until", saga.SleepUntil(func(*state) time.Time { return far })),
		mk("max-sleep", saga.Sleep[state](math.MaxInt64)),
		mk("max-limit", saga.OnSignal("x", appendSig(v)).Timeout(math.MaxInt64)),
		mk("max-deadline", saga.OnSignal("x", appendSig(v))).WithDeadline(math.MaxInt64),
	}
	ok := saga.Define("ok", saga.Step[state]{Name: "a", Action: act[state](v, "ok")})
	all := []saga.AnyDefinition{ok}
	for _, d := range defs {
		all = append(all, d)
	}
	v.run(t, all...)
	ctx := context.Background()
	var notes []string
	for _, d := range defs {
		st, err := saga.Start(ctx, v.e, d, state{}, nil)
		if err != nil {
			notes = append(notes, d.Name()+": start refused: "+err.Error())
			continue
		}
		in := sagatest.Wait(t, v.e, st.ID, sagatest.Cond("wait or end", func(in *saga.Instance) bool {
			return in.Wait != nil || in.Status.Terminal()
		}), wopts)
		require.Equal(t, 0, v.effects(t, st.ID, "after"), "%s went on at once: %s", d.Name(), sagatest.Describe(in))
		if in.Status.Terminal() {
			notes = append(notes, d.Name()+": ended "+string(in.Status)+" "+in.LastError.Code+": "+in.LastError.Message)
		}
	}
	o, err := saga.Start(ctx, v.e, ok, state{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, v.e, o.ID, wopts).Status)
	if len(notes) > 0 {
		t.Logf("absurd waits: %v", notes)
	}
}

// A wait step's Compensate runs when a later step fails for good.
func TestWaitStepCompensated(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("waitcomp",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v)), Compensate: act[state](v, "undo-a")},
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Millisecond), Compensate: act[state](v, "undo-nap")},
		saga.Step[state]{Name: "boom", Action: func(context.Context, *saga.StepRun, *state) error {
			return steps.Permanent(errors.New("boom"))
		}},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1"})
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-a"))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-nap"))
}

// Grandchildren: cancelling the grandparent cancels its child, which cancels
// its own child.
func TestCancelReachesGrandchild(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "gc", 0) // f.parent is the middle saga; f.childDef the leaf
	mid := f.parent
	top := saga.Define("gc-top", saga.Step[state]{Name: "spawn", Wait: saga.Child(mid,
		func(context.Context, *saga.StepRun, *state) (state, *saga.StartOpts, error) { return state{}, nil, nil },
		func(context.Context, *saga.StepRun, *state, state) error { return nil })})
	v.run(t, top, mid, f.childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, top, state{}, nil)
	require.NoError(t, err)
	m := childOf(t, v.e, st.ID)
	leaf := childOf(t, v.e, m.ID)
	waitingFor(t, v.e, leaf.ID, "signal", "go")
	require.NoError(t, v.e.Cancel(ctx, st.ID, "stop all"))
	require.Equal(t, saga.StatusCompensated, sagatest.WaitEnded(t, v.e, st.ID, wopts).Status)
	require.Equal(t, saga.StatusCompensated, sagatest.WaitEnded(t, v.e, m.ID, wopts).Status)
	require.Equal(t, saga.StatusCompensated, sagatest.WaitEnded(t, v.e, leaf.ID, wopts).Status)
	require.Equal(t, 1, v.effects(t, leaf.ID, "child-undo"))
	require.Equal(t, 1, v.effects(t, m.ID, "undo-first"))
}

// A Child input that fails: the step fails (the docs name CodeChildStart for
// "bad input"), the saga compensates; no child is started.
func TestChildInputFails(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "badin", 0)
	def := saga.Define("badin-parent",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "spawn", Wait: saga.Child(f.childDef,
			func(context.Context, *saga.StepRun, *state) (kid, *saga.StartOpts, error) {
				return kid{}, nil, steps.Permanent(errors.New("no input"))
			},
			func(context.Context, *saga.StepRun, *state, kid) error { return nil })},
	)
	v.run(t, def, f.childDef)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	require.Equal(t, 0, count(in, "child_started:spawn"))
	page, err := v.e.List(context.Background(), &saga.ListOpts{Name: "badin-child"})
	require.NoError(t, err)
	require.Empty(t, page.Sagas)
	t.Logf("failed child input ends the parent with code %q", in.LastError.Code)
}

// Payloads of odd Go types: one that cannot be encoded is refused with an
// error (not a panic, nothing written); a nil payload decodes to the zero
// value; []byte that is not JSON is refused.
func TestSignalPayloadGoTypes(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("types",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", func(ctx context.Context, run *saga.StepRun, s *state, p int) error {
			s.N = p + 100
			return nil
		})},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	for name, p := range map[string]any{"chan": make(chan int), "func": func() {}, "bytes": []byte("not json")} {
		require.NotPanics(t, func() {
			_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", Payload: p})
		}, name)
		require.ErrorIs(t, err, saga.ErrInvalidInput, name)
	}
	require.Empty(t, signals(t, v.e, st.ID))
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "nil"})
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, 100, s.N)
}

// A saga whose deadline passes while it compensates is left to finish
// (WithDeadline's doc): the rescuer counts no deadline for it.
func TestDeadlineWhileCompensating(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	g := newGate()
	def := saga.Define("dl-comp",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: func(ctx context.Context, run *saga.StepRun, _ *state) error {
			if err := g.wait(ctx); err != nil {
				return err
			}
			return v.effect(ctx, run, "undo-first")
		}},
		saga.Step[state]{Name: "boom", Action: func(context.Context, *saga.StepRun, *state) error {
			return steps.Permanent(errors.New("boom"))
		}},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{Deadline: time.Second})
	require.NoError(t, err)
	g.started(t)
	in := get(t, v.e, st.ID)
	require.NotNil(t, in.Deadline)
	deadline := time.Now().Add(30 * time.Second)
	for { // until the database's clock is past the saga's deadline
		var past bool
		require.NoError(t, v.pool.QueryRow(ctx, "SELECT now() > $1", *in.Deadline).Scan(&past))
		if past {
			break
		}
		require.True(t, time.Now().Before(deadline))
		time.Sleep(50 * time.Millisecond) // poll
	}
	r, err := v.e.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, r.Deadlines)
	close(g.release)
	in = sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	require.NotEqual(t, saga.CodeDeadline, in.LastError.Code)
	require.Equal(t, 0, count(in, "cancel_requested:boom")+count(in, "cancel_requested:first"), sagatest.Describe(in))
}

// The deadline comes before the end of a sleep: the saga is cancelled with
// CodeDeadline and its timer never fires.
func TestDeadlineBeforeTimer(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("dl-nap",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](2 * time.Hour)},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	).WithDeadline(time.Hour)
	ctl := v.controlDef()
	v.run(t, def, ctl)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, 90*time.Minute))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeDeadline, in.LastError.Code)
	c, err := saga.Start(ctx, v.e, ctl, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, c.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, time.Hour))
	sagatest.WaitEnded(t, v.e, c.ID, wopts)
	in = get(t, v.e, st.ID)
	require.Equal(t, 0, count(in, "timer_fired:nap"), sagatest.Describe(in))
	require.Equal(t, 0, v.effects(t, st.ID, "after"))
}
