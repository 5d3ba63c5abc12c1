package review14

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// The step chained after a wait's end ignores its context past its Timeout
// and HandlerGrace on its first run: its worker abandons it and closes the
// connection. The wait's end was in that transaction: it must not be
// lost (the signal still takes effect once, the timer fires once), and
// the sagas batched with it must each run once. Then the step runs again
// and the saga completes.
func TestDeafChainedStepIsAbandonedWithoutLosingTheWaitsEnd(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"signal", "early", "timer"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			sleepers := newSleepers(t, 1)
			var acts, handlers tally
			act := func(ctx context.Context, run *saga.StepRun, o *ord) error {
				if acts.add(o.ID) == 1 && o.ID == "deaf" {
					defer sleepers.done()
					time.Sleep(2 * time.Second) // deaf to ctx
				}
				return r.fx.Record(context.WithoutCancel(ctx), run, "act")
			}
			var def *saga.Definition[ord]
			waitStep := "await"
			if kind != "timer" {
				def = chainDef(r, "deaf"+kind, chainOpts{act: act, actRetry: noBackoff(3), actTimeout: 300 * time.Millisecond,
					handler: func(_ context.Context, _ *saga.StepRun, o *ord, _ string) error {
						handlers.add(o.ID)
						return nil
					}})
			} else {
				waitStep = "nap"
				def = saga.Define("deaf"+kind,
					saga.Step[ord]{Name: "prep", Action: rec(r, "prep")},
					saga.Step[ord]{Name: "nap", Wait: saga.Sleep[ord](300 * time.Millisecond)},
					saga.Step[ord]{Name: "act", Action: act, Retry: noBackoff(3), Timeout: 300 * time.Millisecond},
				)
			}
			r.start(t, func(c *saga.Config) {
				c.Workers = 1
				c.BatchSize = 16
				c.HandlerGrace = 300 * time.Millisecond
				c.RescueInterval = time.Second // see TestHostileBytesAroundTheChainedStep
			}, def)
			ctx := context.Background()
			names := []string{"deaf", "h-0", "h-1", "h-2"}
			ids := map[string]uuid.UUID{}
			switch kind {
			case "early": // the signal is kept; the await takes it as it starts
				for _, name := range names {
					st, err := saga.Start(ctx, r.engine, def, ord{ID: name}, nil)
					require.NoError(t, err)
					ids[name] = st.ID
					r.signal(t, st.ID, "go", "sig-"+name, name)
				}
			case "signal":
				for _, name := range names {
					ids[name] = r.startAt(t, def, name, "await")
				}
				_, err := r.engine.PauseType(ctx, def.Name(), "line up")
				require.NoError(t, err)
				for _, name := range names {
					r.signal(t, ids[name], "go", "sig-"+name, name)
				}
				_, err = r.engine.ResumeType(ctx, def.Name())
				require.NoError(t, err)
			default:
				for _, name := range names {
					st, err := saga.Start(ctx, r.engine, def, ord{ID: name}, nil)
					require.NoError(t, err)
					ids[name] = st.ID
				}
			}
			for _, name := range names {
				in := r.ended(t, ids[name])
				require.Equal(t, saga.StatusCompleted, in.Status, "%s\n%s", name, describe(in))
				require.Equal(t, 1, r.fx.Count(t, in.ID, "act"), name)
				require.Equal(t, 1, count(in, "step_completed:act"), "%s\n%s", name, describe(in))
				if kind != "timer" {
					require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, in.ID), name)
					require.Equal(t, 1, count(in, "signal_received:await"), "%s\n%s", name, describe(in))
					requireDelivered(t, r, in.ID, "await")
				} else {
					require.Equal(t, []string{"prep", "act"}, r.fx.List(t, in.ID), name)
					require.Equal(t, 1, count(in, "timer_fired:nap"), "%s\n%s", name, describe(in))
				}
				require.Equal(t, 1, count(in, "step_completed:"+waitStep), "%s\n%s", name, describe(in))
				if name == "deaf" {
					overran := 0
					for _, e := range in.History {
						if e.ErrorCode == saga.CodeAbandonedRunOn {
							overran++
							require.Equal(t, "act", e.Step, describe(in))
						}
					}
					require.Equal(t, 1, overran, describe(in))
				}
			}
			require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned)
			t.Logf("handler runs %v, act runs %v", handlers.snapshot(), acts.snapshot())
		})
	}
}
