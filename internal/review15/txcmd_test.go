package review15

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// bill's Command writes "billtx" through run.Tx ("its statements on run.Tx
// ... commit with the send, and are rolled back when it fails"), and a
// pause or a cancel commits while it runs (held, then it returns its
// payload whatever its ctx says).
//
// pause: nothing of bill is sent until Resume; after it, bill is sent
// once and "billtx" is there once (a write kept from the held build AND
// one from a build at the resume would double it).
// cancel: bill is never sent, so nothing "commits with the send": no
// "billtx"; pay refunded, pick undone, OnReply's "paid" at most once.
func TestOperatorWhileATxBillCommandRuns(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"pause", "cancel"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "txcmd"+op, nil)
			gate := testkit.NewGate()
			t.Cleanup(gate.Open)
			var builds counter
			r.billCmd = func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
				builds.Add(o.ID)
				if err := r.fx.Record(context.WithoutCancel(ctx), run, "billtx"); err != nil {
					return nil, err
				}
				_ = gate.Pass(context.Background())
				awaitCancel(ctx)
				return cmd{ID: o.ID}, nil
			}
			def := r.def(1)
			r.start(t, nil, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			testkit.ActWhileHeld(t, r.engine, st.ID, op, gate, wait)
			if op == "pause" {
				sagatest.Wait(t, r.engine, st.ID, sagatest.Event("step_completed:pay"), &sagatest.WaitOpts{Timeout: wait})
				testkit.Hold(t, time.Second, "bill held while paused", func() bool { return r.sent(t, st.ID, "bill") == 0 })
				require.NoError(t, r.engine.Resume(ctx, st.ID, "ok"))
				in := r.ended(t, st.ID)
				require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
				require.Equal(t, 1, r.sent(t, st.ID, "bill"))
				require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
				require.Equal(t, 1, r.fx.Count(t, st.ID, "billtx"), "builds %d: %v %v", builds.Get("o"), r.fx.List(t, st.ID), timeline(in))
				require.Equal(t, []string{"pick", "paid", "ship"}, without(r.fx.List(t, st.ID), "billtx"))
				return
			}
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
			testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, st.ID)) == 2 })
			require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID))
			require.Zero(t, r.sent(t, st.ID, "bill"))
			require.Zero(t, r.fx.Count(t, st.ID, "billtx"), "%v %v", r.fx.List(t, st.ID), timeline(in))
			require.LessOrEqual(t, r.fx.Count(t, st.ID, "paid"), 1)
			require.Equal(t, 1, r.fx.Count(t, st.ID, "pick"))
			require.Equal(t, 1, r.fx.Count(t, st.ID, "unpick"))
		})
	}
}
