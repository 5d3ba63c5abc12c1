package review13

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

// twoRemote: reserve (remote, its OnReply held by gate, then success
// whatever its context says) then pay (remote), both served by the rig's
// participant as "pay" (told apart by step key).
func twoRemote(r *rig, gate *testkit.Gate) *saga.Definition[ord] {
	first := r.remote(func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
		return payCmd{ID: o.ID + "/reserve"}, nil
	})
	first.OnReply = func(ctx context.Context, _ *saga.StepRun, _ *ord, _ json.RawMessage) error {
		_ = gate.Pass(context.Background())
		awaitCancel(ctx)
		return nil
	}
	return saga.Define(r.name,
		saga.Step[ord]{Name: "reserve", Timeout: wait, Remote: first},
		saga.Step[ord]{Name: "pay", Timeout: wait, Remote: r.remote(
			func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) { return payCmd{ID: o.ID + "/pay"}, nil })},
	)
}

func (r *rig) ids(t *testing.T, sagaID fmt.Stringer) []string {
	t.Helper()
	var out []string
	rows, err := r.part.Pool.Query(context.Background(), "SELECT kind || ':' || id FROM "+r.part.Table("calls")+" WHERE saga_id::text = $1 ORDER BY ctid", sagaID.String())
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	return out
}

// A remote step chained after a reply (remote -> remote): a pause taken
// while the reply's OnReply runs holds the second step's send until the
// resume; a cancel taken then sends nothing more and compensates the first
// step (its refund).
func TestOperatorWhileAReplyIsAppliedBeforeARemoteStep(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"pause", "cancel"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "reply"+op, nil)
			gate := testkit.NewGate()
			t.Cleanup(gate.Open)
			def := twoRemote(r, gate)
			r.start(t, nil, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			testkit.ActWhileHeld(t, r.engine, st.ID, op, gate, wait)

			if op == "pause" {
				sagatest.Wait(t, r.engine, st.ID, sagatest.Step("pay"), &sagatest.WaitOpts{Timeout: wait})
				testkit.Hold(t, 1500*time.Millisecond, "pay is not sent while paused", func() bool { return r.sentTo(t, st.ID) == 1 })
				require.Equal(t, []string{"pay:o/reserve"}, r.ids(t, st.ID))
				require.NoError(t, r.engine.Resume(ctx, st.ID, "ok"))
				in := r.ended(t, st.ID)
				require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
				require.Equal(t, []string{"pay:o/reserve", "pay:o/pay"}, r.ids(t, st.ID))
				return
			}
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
			require.Equal(t, saga.CodeCancelled, in.LastError.Code)
			require.NotContains(t, types(in), "command_sent:pay", "%v", types(in))
			testkit.WaitFor(t, wait, "reserve's refund", func() bool { return len(r.ids(t, st.ID)) == 2 })
			testkit.Hold(t, time.Second, "pay never sent", func() bool { return r.sentTo(t, st.ID) == 2 })
			require.Equal(t, []string{"pay:o/reserve", "refund:o/reserve"}, r.ids(t, st.ID))
		})
	}
}
