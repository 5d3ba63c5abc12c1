package review15

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// pay's OnReply misbehaves: "abort" runs a failing statement on run.Tx and
// returns nil (the transaction is aborted under the engine's feet); "err"
// returns an error. Either way the saga must end (no loop), bill must be
// sent at most once, pay's effect at the participant must be undone
// (refund) if the saga compensates, and OnReply's effect never doubled.
func TestPayOnReplyAbortsOrFails(t *testing.T) {
	t.Parallel()
	for _, c := range []string{"abort", "err"} {
		t.Run(c, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "onreply"+c, nil)
			var runs counter
			r.onPayReply = func(ctx context.Context, run *saga.StepRun, o *ord) error {
				runs.Add(o.ID)
				if c == "abort" {
					if _, err := run.Tx.Exec(ctx, "SELECT 1/0"); err == nil {
						t.Error("1/0 did not fail")
					}
					return nil
				}
				return errors.New("cannot apply the payment")
			}
			def := r.def(1)
			r.start(t, nil, def)
			st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			in := r.ended(t, st.ID)
			t.Logf("%s: %v %+v", c, timeline(in), in.LastError)
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
			require.Equal(t, "pay", in.LastError.Step, "%+v", in.LastError)
			require.Zero(t, r.sent(t, st.ID, "bill"), "%v", timeline(in))
			testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, st.ID)) == 2 })
			require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID))
			require.Equal(t, []string{"pick", "unpick"}, r.fx.List(t, st.ID), "OnReply's writes rolled back: %v", timeline(in))
			require.LessOrEqual(t, runs.Get("o"), int32(3))
		})
	}
}

// pay's reply delivered twice: once after the saga completed ("after"),
// and once while bill's Command runs in the first reply's transaction
// ("during"). The duplicate is dropped: OnReply's effect once, bill sent
// and run once, the saga completed.
func TestPayReplyDeliveredTwice(t *testing.T) {
	t.Parallel()
	for _, when := range []string{"during", "after"} {
		t.Run(when, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "dup"+when, nil)
			gate := testkit.NewGate()
			t.Cleanup(gate.Open)
			var builds counter
			if when == "during" {
				r.billCmd = func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
					builds.Add(o.ID)
					_ = gate.Pass(context.Background())
					return cmd{ID: o.ID}, nil
				}
			} else {
				gate.Open()
			}
			def := r.def(1)
			r.start(t, nil, def)
			st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			if when == "during" {
				testkit.WaitFor(t, wait, "bill's Command", func() bool { return gate.Entered() == 1 })
				testkit.CopyReplies(t, r.part, r.stepKey(t, st.ID, "pay"))
				time.Sleep(300 * time.Millisecond) // the copy published and consumed (it finds the saga busy)
				gate.Open()
			}
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
			if when == "after" {
				testkit.CopyReplies(t, r.part, r.stepKey(t, st.ID, "pay"))
				testkit.CopyReplies(t, r.part, r.stepKey(t, st.ID, "bill"))
			}
			testkit.Hold(t, 1500*time.Millisecond, "nothing doubled", func() bool {
				return r.sent(t, st.ID, "bill") == 1 && r.fx.Count(t, st.ID, "paid") == 1
			})
			in = r.get(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status)
			require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
			require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, st.ID))
			n := 0
			for _, e := range in.History {
				if e.Type == "reply_received" {
					n++
				}
			}
			require.Equal(t, 2, n, "one reply_received per step: %v", timeline(in))
			if when == "during" {
				require.LessOrEqual(t, builds.Get("o"), int32(2), "%v", timeline(in))
			}
			require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM "+r.orders.Table("dead_letters")), fmt.Sprint(timeline(in)))
		})
	}
}
