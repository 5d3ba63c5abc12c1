package review16

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Duplicate and out-of-order replies arrive while the step after a reply
// is being handed off. "dup": pay's reply copied (as a participant sends it
// twice) while ship's first run is held on the reply worker: the copy waits
// behind it in the partition, and arrives after the cut, while the reply is
// applied again on its own. "late": in the saga with bill, while ship
// (after bill's reply) is held on the reply worker, both pay's and bill's
// replies are copied: an older step's reply arriving after a newer one,
// during the hand-off. Either way: completed, "paid" once, ship once, each
// step completed once in the history, the participant ran each command
// once, no dead letter, and the saga does not move again after (Hold 1 s).
func TestDuplicateRepliesDuringTheHandOff(t *testing.T) {
	t.Parallel()
	for _, c := range []string{"dup", "late"} {
		t.Run(c, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "dupreply"+c, "", nil)
			first := testkit.NewGate()
			t.Cleanup(first.Open)
			r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
				if n == 1 {
					if err := first.Pass(ctx); err != nil {
						return err
					}
				}
				return r.fx.Record(ctx, run, "ship")
			}
			def := r.def(defOpts{bill: c == "late"})
			r.start(t, nil, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			testkit.WaitFor(t, wait, "ship's first run", func() bool { return first.Entered() == 1 })
			testkit.CopyReplies(t, r.part, r.stepKey(t, st.ID, "pay"))
			if c == "late" {
				testkit.CopyReplies(t, r.part, r.stepKey(t, st.ID, "bill"))
			}
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
			// let the copies be consumed
			testkit.WaitFor(t, wait, "copies published", func() bool {
				return r.part.Count(t, "SELECT count(*) FROM "+r.part.Table("outbox")+" WHERE status = 'pending'") == 0
			})
			before := len(r.get(t, st.ID).History)
			testkit.Hold(t, time.Second, "nothing moves after the end", func() bool {
				return r.get(t, st.ID).Status == saga.StatusCompleted && r.fx.Count(t, st.ID, "ship") == 1
			})
			in = r.get(t, st.ID)
			require.GreaterOrEqual(t, len(in.History), before)
			require.Equal(t, 1, r.fx.Count(t, st.ID, "paid"), "%v", timeline(in))
			require.Equal(t, 1, r.fx.Count(t, st.ID, "ship"), "%v", timeline(in))
			require.Equal(t, 1, r.fx.Count(t, st.ID, "done"), "%v", timeline(in))
			require.Equal(t, 1, count(in, "step_completed", "pay"), "%v", timeline(in))
			require.Equal(t, 1, count(in, "step_completed", "ship"), "%v", timeline(in))
			if c == "late" {
				require.Equal(t, 1, count(in, "step_completed", "bill"), "%v", timeline(in))
				require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
			} else {
				require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
			}
			require.Zero(t, r.deadLetters(t))
			require.Equal(t, int64(1), r.engine.Stats().StepsHandedOff)
		})
	}
}
