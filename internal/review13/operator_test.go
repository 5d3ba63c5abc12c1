package review13

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// operatorDefAt: pick (local) then pay (remote, its Command using run.Tx
// when tx is set) then ship (local). gate holds pick's Action, or pay's
// Command when inCommand is set; the held function then gives the engine
// up to a second to cancel its ctx (awaitCancel) and returns success
// whatever its context says.
func operatorDefAt(r *rig, name string, gate *testkit.Gate, tx, inCommand bool, picks *counter) *saga.Definition[ord] {
	open := testkit.NewGate()
	open.Open()
	pickGate, cmdGate := gate, open
	if inCommand {
		pickGate, cmdGate = open, gate
	}
	return saga.Define(name,
		saga.Step[ord]{Name: "pick", Timeout: wait, Retry: noBackoff(1),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				picks.Add(o.ID)
				_ = pickGate.Pass(context.Background()) // finishes whatever happens meanwhile
				if pickGate == gate {
					awaitCancel(ctx)
				}
				return r.fx.Record(context.WithoutCancel(ctx), run, "pick")
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		saga.Step[ord]{Name: "pay", Timeout: wait, Remote: r.remote(
			func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
				_ = cmdGate.Pass(context.Background())
				if cmdGate == gate {
					awaitCancel(ctx)
				}
				if tx {
					if _, err := run.Tx.Exec(context.WithoutCancel(ctx), "SELECT 1"); err != nil {
						return nil, err
					}
				}
				return payCmd{ID: o.ID}, nil
			})},
		saga.Step[ord]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "ship") }},
	)
}

// A pause that commits while pick runs, for a saga whose next step is
// remote: pick finishes and records its outcome, but pay's command (now
// written in pick's update) waits: nothing reaches the participant until
// the resume, then it is sent once and the saga completes. Both with a
// Command that uses run.Tx and one that does not.
func TestPauseWhileTheLocalStepRunsHoldsTheRemoteCommand(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		tx, inCommand bool
	}{{"pauseplain", false, false}, {"pausetx", true, false}, {"pausecmd", false, true}, {"pausecmdtx", true, true}} {
		name, tx := c.name, c.tx
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, name, nil)
			gate := testkit.NewGate()
			t.Cleanup(gate.Open)
			var picks counter
			def := operatorDefAt(r, name, gate, tx, c.inCommand, &picks)
			r.start(t, nil, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o-1"}, nil)
			require.NoError(t, err)
			testkit.WaitFor(t, wait, "pick (or pay's Command) to run", func() bool { return gate.Entered() == 1 })
			require.NoError(t, r.engine.Pause(ctx, st.ID, "operator looks at it"))
			gate.Open()

			sagatest.Wait(t, r.engine, st.ID, sagatest.Event("step_completed:pick"), &sagatest.WaitOpts{Timeout: wait})
			testkit.Hold(t, 1500*time.Millisecond, "pay's command is held while the saga is paused", func() bool {
				return r.sentTo(t, st.ID) == 0 && len(r.calls(t, st.ID)) == 0
			})
			in := r.get(t, st.ID)
			require.NotNil(t, in.Paused, "still paused: %v", types(in))
			require.NotContains(t, types(in), "reply_received:pay")

			require.NoError(t, r.engine.Resume(ctx, st.ID, "looked at"))
			in = r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
			require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
			require.Equal(t, 1, r.sentTo(t, st.ID), "sent once")
			require.Equal(t, []string{"pick", "ship"}, r.fx.List(t, st.ID))
			require.Equal(t, int32(1), picks.Get("o-1"))
		})
	}
}

// A cancel requested while pick runs, for a saga whose next step is
// remote, and pick returns success anyway: pick is compensated and "no
// later step runs" (Engine.Cancel): pay's command must not reach the
// participant (or, if it did, be refunded). Both Command flavours.
func TestCancelWhileTheLocalStepRunsSendsNoRemoteCommand(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		tx, inCommand bool
	}{{"cancelplain", false, false}, {"canceltx", true, false}} {
		name, tx := c.name, c.tx
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, name, nil)
			gate := testkit.NewGate()
			t.Cleanup(gate.Open)
			var picks counter
			def := operatorDefAt(r, name, gate, tx, c.inCommand, &picks)
			r.start(t, nil, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o-1"}, nil)
			require.NoError(t, err)
			testkit.WaitFor(t, wait, "pick (or pay's Command) to run", func() bool { return gate.Entered() == 1 })
			require.NoError(t, r.engine.Cancel(ctx, st.ID, "customer changed their mind"))
			gate.Open()

			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
			require.Equal(t, saga.CodeCancelled, in.LastError.Code)
			require.Equal(t, int32(1), picks.Get("o-1"))
			require.NotContains(t, types(in), "command_sent:pay", "%v", types(in))
			require.NotContains(t, r.fx.List(t, st.ID), "ship")
			testkit.Hold(t, time.Second, "no command reached the participant", func() bool {
				return r.sentTo(t, st.ID) == 0 && len(r.calls(t, st.ID)) == 0
			})
			require.NotContains(t, types(in), "command_sent:pay", "%v", types(in))
			// pick: rolled back (no effect), or kept and compensated.
			fx := r.fx.List(t, st.ID)
			require.True(t, len(fx) == 0 || (len(fx) == 2 && fx[0] == "pick" && fx[1] == "unpick"), "%v", fx)
		})
	}
}

// F1 (fixed). The Command now runs inside pick's attempt (pick's
// transaction and context). A cancel that commits while it runs is
// recorded (cancel_requested) and cancels its context, but when the Command
// returns its payload anyway, the merged update writes pick's success AND
// pay's command: the command is sent to the participant after Cancel
// returned, and the participant charges. Engine.Cancel promises "No later
// step runs" and the package doc "A saga that is paused, or asked to
// cancel, takes the usual way instead: the next step's command waits" (the
// pause does: see pausecmd above). With a compensation the charge is
// refunded (a needless charge + refund); without one (a remote step with no
// CompensateType), the charge stays although the saga ends "compensated".
func TestCancelWhileTheRemoteCommandIsBuiltSendsNothing(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name       string
		tx, refund bool
	}{{"cxlcmd", false, true}, {"cxlcmdtx", true, true}, {"cxlcmdnorefund", false, false}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, c.name, nil)
			gate := testkit.NewGate()
			t.Cleanup(gate.Open)
			var picks counter
			def := operatorDefAt(r, c.name, gate, c.tx, true, &picks)
			if !c.refund {
				def = operatorDefNoRefund(r, c.name, gate, &picks)
			}
			r.start(t, nil, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o-1"}, nil)
			require.NoError(t, err)
			testkit.WaitFor(t, wait, "pay's Command to run", func() bool { return gate.Entered() == 1 })
			require.NoError(t, r.engine.Cancel(ctx, st.ID, "customer changed their mind"))
			gate.Open()

			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
			require.Equal(t, []string{"pick", "unpick"}, r.fx.List(t, st.ID), "%v", types(in))
			// What matters to the customer: the participant never charged
			// after the cancel (allowing a charge that was refunded would
			// hide the no-compensation case, checked by cxlcmdnorefund).
			if r.sentTo(t, st.ID) > 0 {
				testkit.WaitFor(t, wait, "the participant to run what was sent", func() bool { return len(r.calls(t, st.ID)) > 0 })
				time.Sleep(300 * time.Millisecond) // a refund, if any
			}
			testkit.Hold(t, time.Second, fmt.Sprintf("no pay reached the participant after Cancel returned "+
				"(participant ran %v; history %v)", r.calls(t, st.ID), types(in)), func() bool {
				return r.sentTo(t, st.ID) == 0
			})
			require.Empty(t, r.calls(t, st.ID), "%v", types(in))
			require.NotContains(t, types(in), "command_sent:pay", "%v", types(in))
		})
	}
}

// operatorDefNoRefund is operatorDefAt(inCommand) with pay having no
// compensation.
func operatorDefNoRefund(r *rig, name string, gate *testkit.Gate, picks *counter) *saga.Definition[ord] {
	rem := r.remote(func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
		_ = gate.Pass(context.Background())
		awaitCancel(ctx)
		return payCmd{ID: o.ID}, nil
	})
	rem.CompensateType = ""
	return saga.Define(name,
		saga.Step[ord]{Name: "pick", Timeout: wait, Retry: noBackoff(1),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				picks.Add(o.ID)
				return r.fx.Record(ctx, run, "pick")
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		saga.Step[ord]{Name: "pay", Timeout: wait, Remote: rem},
		saga.Step[ord]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "ship") }},
	)
}

// awaitCancel gives the engine up to a second to cancel ctx (as it does
// for a step whose saga is asked to cancel): the handler then returns
// success anyway, the case Engine.Cancel documents.
func awaitCancel(ctx context.Context) {
	select {
	case <-ctx.Done():
	case <-time.After(time.Second):
	}
}

// F2 (fixed). Engine.Cancel: "The request is durable once Cancel returns
// nil: ... when a step runs, the engine running it cancels the step's
// context, and the request is applied in that step's transaction instead of
// its outcome ... No later step runs." A pick that returns success right
// after Cancel returned (before the engine noticed the request) has its
// success written with pay's command, which is sent: the cancel applies
// only after the participant was called. It is a race (about 3 in 8 runs
// of a single saga), so the test runs eight sagas one after the other and
// fails when any of them sent pay.
func TestCancelJustBeforeTheLocalStepReturnsSendsNothing(t *testing.T) {
	t.Parallel()
	const name = "cxlrace"
	r := newRig(t, name, nil)
	var gate atomic.Pointer[testkit.Gate]
	def := saga.Define(name,
		saga.Step[ord]{Name: "pick", Timeout: wait, Retry: noBackoff(1),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				_ = gate.Load().Pass(context.Background())
				return r.fx.Record(context.WithoutCancel(ctx), run, "pick")
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		saga.Step[ord]{Name: "pay", Timeout: wait, Remote: r.remote(
			func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) { return payCmd{ID: o.ID}, nil })},
	)
	r.start(t, nil, def)
	ctx := context.Background()
	var sent []string
	for i := 0; i < 8; i++ {
		g := testkit.NewGate()
		gate.Store(g)
		st, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprint(i)}, nil)
		require.NoError(t, err)
		testkit.WaitFor(t, wait, "pick to run", func() bool { return g.Entered() == 1 })
		require.NoError(t, r.engine.Cancel(ctx, st.ID, "customer changed their mind"))
		g.Open()
		in := r.ended(t, st.ID)
		require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
		if r.sentTo(t, st.ID) > 0 {
			sent = append(sent, fmt.Sprintf("saga %d: %v", i, types(in)))
		}
	}
	require.Empty(t, sent, "pay was sent after Cancel returned")
}
