package review16

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// An operator acts while ship, the step after pay's reply, is slow:
// "reply": while its first run is held on the reply worker (before the
// cut, which may come first on a loaded machine: both outcomes are
// allowed); "cut": from ship's first run the moment its ctx ends (the cut)
// in another goroutine; "worker": while its second run, on an engine worker
// after the hand-off, is held. ship honours ctx throughout (its first run
// waits for ctx; the second waits on a gate the test opens).
//
// cancel: the saga compensates with code cancelled; ship's effect is
// exactly as often as its compensation (0 or 1, never doubled, never kept
// without its undo); pick once and undone once; "paid" at most once; pay
// refunded; no "done".
//
// pause: while paused no "done" and no second ship runs beyond the one
// held; after Resume the saga completes with pick, paid, ship, done once
// each, pay charged once.
func TestOperatorAroundTheCut(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"cancel", "pause"} {
		for _, when := range []string{"reply", "cut", "worker"} {
			t.Run(op+"-"+when, func(t *testing.T) {
				t.Parallel()
				r := newRig(t, "op"+op+when, "", nil)
				ctx := context.Background()
				first := testkit.NewGate()
				second := testkit.NewGate()
				t.Cleanup(first.Open)
				t.Cleanup(second.Open)
				acted := make(chan error, 1)
				var act func() error
				ready := make(chan struct{}) // closed once act is set
				r.ship = func(sctx context.Context, run *saga.StepRun, o *ord, n int32) error {
					if err := r.fx.Record(sctx, run, "ship"); err != nil {
						return err
					}
					switch n {
					case 1:
						if err := first.Pass(sctx); err != nil {
							if when == "cut" {
								go func() { <-ready; acted <- act() }()
							}
							return err
						}
					case 2:
						if err := second.Pass(sctx); err != nil {
							return err
						}
					}
					return nil
				}
				def := r.def(defOpts{})
				r.start(t, nil, def)
				st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
				require.NoError(t, err)
				act = func() error {
					if op == "cancel" {
						return r.engine.Cancel(ctx, st.ID, "stop")
					}
					return r.engine.Pause(ctx, st.ID, "look")
				}
				close(ready)
				switch when {
				case "reply":
					testkit.WaitFor(t, wait, "ship's first run", func() bool { return first.Entered() == 1 })
					require.NoError(t, act())
				case "cut":
					require.NoError(t, testkit.Recv(t, acted, wait, "the act at the cut"))
				case "worker":
					testkit.WaitFor(t, wait, "ship's second run", func() bool { return second.Entered() == 1 })
					require.NoError(t, act())
					second.Open()
				}
				if op == "cancel" {
					second.Open()
					in := r.ended(t, st.ID)
					require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
					require.Equal(t, saga.CodeCancelled, in.LastError.Code, "%+v", in.LastError)
					fx := r.fx.Counts(t, st.ID)
					require.Equal(t, fx["ship"], fx["unship"], "ship kept exactly as often as undone: %v %v", r.fx.List(t, st.ID), timeline(in))
					require.LessOrEqual(t, fx["ship"], 1, "%v", r.fx.List(t, st.ID))
					require.Equal(t, 1, fx["pick"])
					require.Equal(t, 1, fx["unpick"])
					require.LessOrEqual(t, fx["paid"], 1)
					require.Zero(t, fx["done"])
					testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, st.ID)) == 2 })
					require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID))
					return
				}
				// pause
				testkit.WaitFor(t, wait, "paused", func() bool { return r.get(t, st.ID).Paused != nil })
				testkit.Hold(t, 1500*time.Millisecond, "nothing after ship while paused", func() bool {
					return r.fx.Count(t, st.ID, "done") == 0 && r.shipRuns.Get("o") <= 2
				})
				in := r.get(t, st.ID)
				require.Equal(t, saga.StatusRunning, in.Status, "%v", timeline(in))
				require.NoError(t, r.engine.Resume(ctx, st.ID, "ok"))
				second.Open()
				in = r.ended(t, st.ID)
				require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
				require.Equal(t, []string{"pick", "paid", "ship", "done"}, r.fx.List(t, st.ID), "%v", timeline(in))
				require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
				require.Equal(t, 1, r.sent(t, st.ID, "pay"))
			})
		}
	}
}

// A signal sent while ship's first run is held on the reply worker (and
// then cut) or at the cut: "a signal is delivered whether it arrives before
// the saga reaches the await (it is kept ...) or after", "takes effect
// once". The saga completes with ship, go and done once each; a second
// signal with the same ID is a duplicate.
func TestSignalDuringTheHandOff(t *testing.T) {
	t.Parallel()
	for _, when := range []string{"reply", "cut"} {
		t.Run(when, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "sig"+when, "", nil)
			ctx := context.Background()
			first := testkit.NewGate()
			t.Cleanup(first.Open)
			sent := make(chan error, 1)
			var send func() error
			ready := make(chan struct{}) // closed once send is set
			r.ship = func(sctx context.Context, run *saga.StepRun, o *ord, n int32) error {
				if err := r.fx.Record(sctx, run, "ship"); err != nil {
					return err
				}
				if n == 1 {
					if err := first.Pass(sctx); err != nil {
						if when == "cut" {
							go func() { <-ready; sent <- send() }()
						}
						return err
					}
				}
				return nil
			}
			def := r.def(defOpts{await: true})
			r.start(t, nil, def)
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			send = func() error {
				_, err := r.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", ID: "sig-1", Payload: map[string]int{"n": 1}})
				return err
			}
			close(ready)
			if when == "reply" {
				testkit.WaitFor(t, wait, "ship's first run", func() bool { return first.Entered() == 1 })
				require.NoError(t, send())
			} else {
				require.NoError(t, testkit.Recv(t, sent, wait, "the signal at the cut"))
			}
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
			require.Equal(t, []string{"pick", "paid", "ship", "go", "done"}, r.fx.List(t, st.ID), "%v", timeline(in))
			res, err := r.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", ID: "sig-1"})
			if err == nil {
				require.True(t, res.Duplicate, "%+v", res)
			}
			require.GreaterOrEqual(t, r.shipRuns.Get("o"), int32(2), "the first run was cut")
		})
	}
}
