package review15

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// Control: the happy path. pick -> pay -> bill -> ship, bill's command
// sent in pay's reply's update (Stats.Chained counts it), each effect once.
func TestHappyPathRemoteAfterRemote(t *testing.T) {
	t.Parallel()
	r := newRig(t, "happy", nil)
	def := r.def(1)
	r.start(t, nil, def)
	st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
	require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
	require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, st.ID))
	require.Equal(t, 1, r.sent(t, st.ID, "bill"))
	var o ord
	require.NoError(t, json.Unmarshal(in.State, &o))
	require.Equal(t, "pay-o-1", o.Paid, "OnReply's state reached the Command and the end")
	require.GreaterOrEqual(t, r.engine.Stats().Chained, int64(1))
	var noteLen int
	require.NoError(t, r.part.Pool.QueryRow(context.Background(), "SELECT note_len FROM "+r.part.Table("calls")+
		" WHERE saga_id = $1 AND kind = 'bill'", st.ID).Scan(&noteLen))
	require.Equal(t, len("pay-o-1"), noteLen, "bill's Command saw OnReply's state")
}

// A pause or a cancel committed while pay's OnReply runs (gate in
// OnReply), or while bill's Command runs in the reply's transaction (gate
// in the Command). The held function waits up to a second for its ctx,
// then returns success anyway.
//
// pause: "A saga that is paused (also by a pause that committed while the
// reply was applied) ... takes the usual way instead: the next step's
// command waits": nothing of bill reaches the participant's topic until
// Resume; then bill is sent once and the saga completes.
//
// cancel: "No later step runs": bill is never sent; pay is refunded and
// pick undone; OnReply's effect, if kept, is with a completed pay.
func TestOperatorWhilePayReplyOrBillCommandRuns(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"pause", "cancel"} {
		for _, at := range []string{"onreply", "billcmd"} {
			name := op + at
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				r := newRig(t, name, nil)
				gate := testkit.NewGate()
				t.Cleanup(gate.Open)
				hold := func(ctx context.Context) {
					_ = gate.Pass(context.Background())
					awaitCancel(ctx)
				}
				if at == "onreply" {
					r.onPayReply = func(ctx context.Context, _ *saga.StepRun, _ *ord) error { hold(ctx); return nil }
				} else {
					r.billCmd = func(ctx context.Context, _ *saga.StepRun, o *ord) (any, error) {
						hold(ctx)
						return cmd{ID: o.ID}, nil
					}
				}
				def := r.def(1)
				r.start(t, nil, def)
				ctx := context.Background()
				st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
				require.NoError(t, err)
				testkit.ActWhileHeld(t, r.engine, st.ID, op, gate, wait)

				if op == "pause" {
					sagatest.Wait(t, r.engine, st.ID, sagatest.Event("step_completed:pay"), &sagatest.WaitOpts{Timeout: wait})
					testkit.Hold(t, 1500*time.Millisecond, "bill is not sent while paused", func() bool {
						return r.sent(t, st.ID, "bill") == 0
					})
					in := r.get(t, st.ID)
					require.NotNil(t, in.Paused, "%v", types(in))
					require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
					require.NoError(t, r.engine.Resume(ctx, st.ID, "ok"))
					in = r.ended(t, st.ID)
					require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
					require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
					require.Equal(t, 1, r.sent(t, st.ID, "bill"), "bill sent once")
					require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, st.ID))
					return
				}
				in := r.ended(t, st.ID)
				require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
				require.Equal(t, saga.CodeCancelled, in.LastError.Code)
				require.NotContains(t, types(in), "command_sent:bill", "%v", types(in))
				testkit.WaitFor(t, wait, "pay's refund", func() bool { return len(r.calls(t, st.ID)) >= 2 })
				testkit.Hold(t, time.Second, fmt.Sprintf("bill never sent (%v)", types(in)), func() bool {
					return r.sent(t, st.ID, "bill") == 0
				})
				require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID), "%v", types(in))
				fx := r.fx.List(t, st.ID)
				require.NotContains(t, fx, "ship")
				require.Equal(t, "unpick", fx[len(fx)-1], "%v", fx)
				require.LessOrEqual(t, r.fx.Count(t, st.ID, "paid"), 1, "%v", fx)
				require.Equal(t, 1, r.fx.Count(t, st.ID, "pick"))
			})
		}
	}
}
