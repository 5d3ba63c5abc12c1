package review15

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

// A cancel or a pause that commits just before pay's OnReply or bill's
// Command returns (the held function returns as soon as the gate opens,
// right after Cancel/Pause returned, before the engine may have heard of
// it). Engine.Cancel: "The request is durable once Cancel returns nil ...
// No later step runs"; the package doc: a saga "paused (also by a pause
// that committed while the reply was applied), or asked to cancel, takes
// the usual way instead: the next step's command waits". Eight sagas one
// after the other per case; none may have bill sent while paused or after
// the cancel.
func TestOperatorJustBeforeTheReplyOrCommandReturns(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"pause", "cancel"} {
		for _, at := range []string{"onreply", "billcmd"} {
			name := "race" + op + at
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				r := newRig(t, name, nil)
				var gate atomic.Pointer[testkit.Gate]
				if at == "onreply" {
					r.onPayReply = func(context.Context, *saga.StepRun, *ord) error {
						return gate.Load().Pass(context.Background())
					}
				} else {
					r.billCmd = func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
						return cmd{ID: o.ID}, gate.Load().Pass(context.Background())
					}
				}
				def := r.def(1)
				r.start(t, nil, def)
				ctx := context.Background()
				var bad []string
				for i := 0; i < 8; i++ {
					g := testkit.NewGate()
					gate.Store(g)
					st, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprint(i)}, nil)
					require.NoError(t, err)
					testkit.WaitFor(t, wait, "the held function", func() bool { return g.Entered() == 1 })
					if op == "cancel" {
						require.NoError(t, r.engine.Cancel(ctx, st.ID, "stop"))
						g.Open()
						in := r.ended(t, st.ID)
						require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
						testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, st.ID)) >= 2 })
						if n := r.sent(t, st.ID, "bill"); n > 0 {
							bad = append(bad, fmt.Sprintf("saga %d: bill sent %d× after Cancel returned: %v, participant %v",
								i, n, timeline(in), r.calls(t, st.ID)))
						}
						continue
					}
					require.NoError(t, r.engine.Pause(ctx, st.ID, "look"))
					g.Open()
					sagatest.Wait(t, r.engine, st.ID, sagatest.Event("step_completed:pay"), &sagatest.WaitOpts{Timeout: wait})
					time.Sleep(300 * time.Millisecond)
					if n := r.sent(t, st.ID, "bill"); n > 0 {
						bad = append(bad, fmt.Sprintf("saga %d: bill sent while paused: %v", i, timeline(r.get(t, st.ID))))
					}
					require.NoError(t, r.engine.Resume(ctx, st.ID, "ok"))
					in := r.ended(t, st.ID)
					require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
					require.Equal(t, 1, r.sent(t, st.ID, "bill"))
				}
				require.Empty(t, bad)
			})
		}
	}
}
