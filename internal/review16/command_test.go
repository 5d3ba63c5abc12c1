package review16

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// bill (a remote step) follows pay's reply; its Command writes
// "billtx#n" through run.Tx and, on its first build, waits for its ctx
// (honouring it: it returns ctx's error when it ends) up to 5 s: the send
// after a reply is the step given up at the limit. Doc: "nothing of it
// recorded", "its writes undone", the reply applied again on its own with
// the step's command, a worker runs the step. So billtx#1 never persists,
// billtx#2 once, bill sent once, the participant billed once, "paid" once,
// completed, StepsHandedOff 1, nothing abandoned or failed.
func TestSlowTxCommandAfterReplyIsHandedOff(t *testing.T) {
	t.Parallel()
	slowTxCommand(t, "txcmd", false)
}

// F2: the same, but the first build is the worst user's: it writes
// "billtx#1" through run.Tx, and when its ctx ends (the cut) writes
// "late#1" through run.Tx with a fresh context, sleeps a second more and
// returns a command anyway. The
// outcome is as above, but under -race the detector reports a data race
// between the given-up Command's run.Tx.Exec and the reply worker that
// goes on with the reply (stack: saga.stepTx.flush, steptx.go:579, read by
// the handler; written by saga.(*batch).successThenSend, await.go:471).
// Without -race the test passes.
func TestF2DeafTxCommandAfterTheCutRacesTheReplyWorker(t *testing.T) {
	t.Parallel()
	slowTxCommand(t, "txcmddeaf", true)
}

func slowTxCommand(t *testing.T, name string, deaf bool) {
	r := newRig(t, name, "", nil)
	late := make(chan struct{})
	r.billCmd = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) (any, error) {
		if err := r.fx.Record(ctx, run, fmt.Sprint("billtx#", n)); err != nil {
			return nil, err
		}
		if n == 1 {
			if !deaf {
				if !waitCtx(ctx, 5*time.Second) {
					return nil, fmt.Errorf("not cut")
				}
				return nil, ctx.Err()
			}
			defer close(late) // the test waits for this run, which outlives its step
			<-ctx.Done()
			_ = r.fx.Record(context.Background(), run, "late#1")
			time.Sleep(time.Second)
		}
		return cmd{ID: o.ID, Note: o.Paid}, nil
	}
	def := r.def(defOpts{bill: true})
	r.start(t, nil, def)
	st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o"}, nil)
	require.NoError(t, err)
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
	require.Equal(t, []string{"pick", "paid", "billtx#2", "ship", "done"}, r.fx.List(t, st.ID), "%v", timeline(in))
	require.Equal(t, int32(2), r.billRuns.Get("o"))
	require.Equal(t, 1, r.sent(t, st.ID, "bill"))
	require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
	require.Zero(t, count(in, "step_failed", "bill"), "%v", timeline(in))
	require.Equal(t, 1, count(in, "step_completed", "pay"), "%v", timeline(in))
	s := r.engine.Stats()
	require.Equal(t, int64(1), s.StepsHandedOff)
	require.Zero(t, s.HandlersAbandoned)
	require.Zero(t, s.AttemptsFailed)
	if deaf {
		<-late
	}
}

// A cancel while bill's slow Command (honours ctx) runs after pay's reply
// on the reply worker, before or around the cut: the send must never
// reach the participant, pay is refunded, pick undone, no billtx kept, no
// ship.
func TestCancelWhileSlowCommandAfterReply(t *testing.T) {
	t.Parallel()
	r := newRig(t, "txcmdcancel", "", nil)
	g := testkit.NewGate()
	t.Cleanup(g.Open)
	r.billCmd = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) (any, error) {
		if err := r.fx.Record(ctx, run, "billtx"); err != nil {
			return nil, err
		}
		if err := g.Pass(ctx); err != nil {
			return nil, err
		}
		return cmd{ID: o.ID}, nil
	}
	def := r.def(defOpts{bill: true})
	r.start(t, nil, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, wait, "bill's Command", func() bool { return g.Entered() >= 1 })
	require.NoError(t, r.engine.Cancel(ctx, st.ID, "stop"))
	g.Open()
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
	require.Equal(t, saga.CodeCancelled, in.LastError.Code)
	testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, st.ID)) == 2 })
	testkit.Hold(t, time.Second, "bill never sent", func() bool { return r.sent(t, st.ID, "bill") == 0 })
	require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID))
	fx := r.fx.Counts(t, st.ID)
	require.Zero(t, fx["billtx"], "%v", r.fx.List(t, st.ID))
	require.Zero(t, fx["ship"])
	require.Equal(t, 1, fx["pick"])
	require.Equal(t, 1, fx["unpick"])
	require.LessOrEqual(t, fx["paid"], 1)
}
