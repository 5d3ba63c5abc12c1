package review4_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// A signal wait without a time limit has no deadline: the rescuer leaves it
// alone however much time passes, and the signal still completes it.
func TestUnlimitedSignalWaitOutlivesTime(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("forever", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))})
	ctl := v.controlDef()
	v.run(t, def, ctl)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	in := waitingFor(t, v.e, st.ID, "signal", "x")
	require.Nil(t, in.Wait.Until)
	c, err := saga.Start(ctx, v.e, ctl, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, c.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, 1000*time.Hour))
	sagatest.WaitEnded(t, v.e, c.ID, wopts)
	r, err := v.e.RescueNow(ctx)
	require.NoError(t, err)
	in = get(t, v.e, st.ID)
	require.Equal(t, saga.StatusRunning, in.Status, sagatest.Describe(in))
	require.NotNil(t, in.Wait)
	require.Equal(t, 0, r.FailedOver)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1"})
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, v.e, st.ID, wopts).Status)
}

// A handler that fails leaves its signal undelivered for the next attempt;
// it is delivered once, on the attempt that commits.
func TestSignalHandlerRetried(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	fails := make(chan struct{}, 1)
	fails <- struct{}{}
	def := saga.Define("retry", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x",
		func(ctx context.Context, run *saga.StepRun, s *state, p ev) error {
			if err := v.effect(ctx, run, "tried"); err != nil { // rolled back on failure
				return err
			}
			select {
			case <-fails:
				return errors.New("flaky")
			default:
			}
			s.Got = append(s.Got, p.V)
			return nil
		}), Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return time.Hour }}})
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1", Payload: ev{V: "one"}})
	require.NoError(t, err)
	sagatest.Wait(t, v.e, st.ID, sagatest.Event("step_failed:a"), wopts)
	ss := signals(t, v.e, st.ID)
	require.Equal(t, "pending", ss[0].Status, "a failed attempt leaves the signal undelivered")
	require.NoError(t, v.clock().Advance(ctx, time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"one"}, s.Got)
	require.Equal(t, 1, v.effects(t, st.ID, "tried"))
	require.Equal(t, 1, count(in, "signal_received:a"))
	require.Equal(t, "delivered", signals(t, v.e, st.ID)[0].Status)
}

// Signal.SagaID wins over Saga and BusinessKey ("when SagaID is not set").
func TestSignalAddressedTwice(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("addr", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))})
	v.run(t, def)
	ctx := context.Background()
	a, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "a"})
	require.NoError(t, err)
	b, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "b"})
	require.NoError(t, err)
	r, err := sig(t, v.e, saga.Signal{SagaID: a.ID, Saga: "addr", BusinessKey: "b", Name: "x", ID: "1"})
	require.NoError(t, err)
	require.Equal(t, a.ID, r.SagaID)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, v.e, a.ID, wopts).Status)
	require.Empty(t, signals(t, v.e, b.ID))
}

// TimeoutThen with a handler: it runs in the step's transaction when nothing
// came in time, and the saga goes on.
func TestTimeoutThenHandler(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("then",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v)).TimeoutThen(time.Hour, act[state](v, "fallback"))},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")
	require.NoError(t, v.clock().Advance(ctx, time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "fallback"))
	require.Equal(t, 1, v.effects(t, st.ID, "after"))
	require.Equal(t, 0, v.effects(t, st.ID, "sig:a"))
	require.Equal(t, 1, count(in, "wait_timed_out:a"))
}

// Cancelled while signals wait for it: the saga compensates; signals sent
// afterwards are rejected.
func TestCancelWithPendingSignals(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("cancelsig",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("y", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "y", ID: "early"})
	require.NoError(t, err)
	require.NoError(t, v.e.Cancel(ctx, st.ID, "stop"))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "late"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 2)
	require.Equal(t, "rejected", ss[1].Status)
	if ss[0].Status == "pending" {
		t.Skipf("FINDING (doc gap): a signal kept for a later await of a saga that then ended stays %q "+
			"forever in Engine.Signals; the docs say neither that it is rejected at the saga's end nor "+
			"that 'pending' may mean 'never to be delivered'", ss[0].Status)
	}
}

// The parent passes its deadline while it waits for its child: the child is
// cancelled too.
func TestParentDeadlineCancelsChild(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "pdeadline", 0)
	f.parent.WithDeadline(time.Hour)
	v.run(t, f.parent, f.childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	waitingFor(t, v.e, child.ID, "signal", "go")
	require.NoError(t, v.clock().Advance(ctx, 2*time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeDeadline, in.LastError.Code)
	c := sagatest.WaitEnded(t, v.e, child.ID, wopts)
	require.Equal(t, saga.StatusCompensated, c.Status, sagatest.Describe(c))
	require.Equal(t, 1, v.effects(t, child.ID, "child-undo"))
}

// A child whose step fails with a retryable error and then exhausts its
// attempts: the parent is woken (child_ended) and compensates.
func TestChildExhaustsRetries(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	childDef := saga.Define("flaky-child", saga.Step[kid]{Name: "work",
		Action: func(context.Context, *saga.StepRun, *kid) error { return steps.RetryAfter(time.Minute, errors.New("busy")) },
		Retry:  &saga.RetryPolicy{MaxAttempts: 2}})
	parent := saga.Define("flaky-parent",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "spawn", Wait: saga.Child(childDef,
			func(context.Context, *saga.StepRun, *state) (kid, *saga.StartOpts, error) { return kid{}, nil, nil },
			func(context.Context, *saga.StepRun, *state, kid) error { return nil })},
	)
	v.run(t, parent, childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	sagatest.Wait(t, v.e, child.ID, sagatest.Event("step_failed:work"), wopts)
	require.NoError(t, v.clock().Advance(ctx, time.Minute))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeChildFailed, in.LastError.Code)
	require.Equal(t, 1, count(in, "child_ended:spawn"))
}
