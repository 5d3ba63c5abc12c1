package review14

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// kid is a child saga's state.
type kid struct {
	Fail bool   `json:"fail"`
	Out  string `json:"out,omitempty"`
}

// A child saga's result, then a local step: the child completes (done
// runs, the step after runs once, chained, with done's state), or fails
// (the parent's wait fails for good with child_failed: done and the step
// after never run, the steps before are compensated). A chained step that
// fails once after the child's result is retried without running done again.
func TestChildResultThenLocalStep(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		childFail bool
		actFails  bool
	}{{"ok", false, false}, {"fails", true, false}, {"actretry", false, true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			var acts, dones tally
			child := saga.Define("kid"+c.name,
				saga.Step[kid]{Name: "c1",
					Action: func(ctx context.Context, run *saga.StepRun, k *kid) error {
						k.Out = "made"
						return r.fx.Record(ctx, run, "c1")
					},
					Compensate: func(ctx context.Context, run *saga.StepRun, _ *kid) error { return r.fx.Record(ctx, run, "unc1") }},
				saga.Step[kid]{Name: "c2", Retry: noBackoff(1), Action: func(ctx context.Context, run *saga.StepRun, k *kid) error {
					if k.Fail {
						return steps.Permanent(errors.New("child gives up"))
					}
					return r.fx.Record(ctx, run, "c2")
				}},
			)
			parent := saga.Define("parent"+c.name,
				saga.Step[ord]{Name: "prep", Action: rec(r, "prep"), Compensate: rec(r, "unprep")},
				saga.Step[ord]{Name: "kid", Compensate: rec(r, "unkid"), Wait: saga.Child(child,
					func(context.Context, *saga.StepRun, *ord) (kid, *saga.StartOpts, error) {
						return kid{Fail: c.childFail}, nil, nil
					},
					func(ctx context.Context, run *saga.StepRun, o *ord, k kid) error {
						dones.add(o.ID)
						o.Got = k.Out
						return r.fx.Record(ctx, run, "done")
					})},
				saga.Step[ord]{Name: "act", Retry: noBackoff(3), Compensate: rec(r, "unact"),
					Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
						if acts.add(o.ID) == 1 && c.actFails {
							return errors.New("once")
						}
						return r.fx.Record(ctx, run, "act:"+o.Got)
					}},
			)
			r.start(t, nil, parent, child)
			st, err := saga.Start(context.Background(), r.engine, parent, ord{ID: "p-1"}, nil)
			require.NoError(t, err)
			in := r.ended(t, st.ID)
			var childID string
			for _, e := range in.History {
				if e.Type == saga.EventChildStarted {
					var d struct {
						ChildID string `json:"child_id"`
					}
					require.NoError(t, json.Unmarshal(e.Detail, &d))
					childID = d.ChildID
				}
			}
			require.NotEmpty(t, childID, describe(in))
			chID, err := uuid.Parse(childID)
			require.NoError(t, err)
			ch := r.ended(t, chID)
			require.Equal(t, 1, count(in, "child_ended:kid"), describe(in))
			if c.childFail {
				require.Equal(t, saga.StatusCompensated, ch.Status, describe(ch))
				require.Equal(t, []string{"c1", "unc1"}, r.fx.List(t, ch.ID))
				require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
				require.Equal(t, saga.CodeChildFailed, in.LastError.Code, describe(in))
				require.Equal(t, []string{"prep", "unprep"}, r.fx.List(t, st.ID))
				require.Zero(t, acts.get("p-1"))
				require.Zero(t, dones.get("p-1"))
				return
			}
			require.Equal(t, saga.StatusCompleted, ch.Status, describe(ch))
			require.Equal(t, []string{"c1", "c2"}, r.fx.List(t, ch.ID))
			require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
			require.Equal(t, []string{"prep", "done", "act:made"}, r.fx.List(t, st.ID))
			require.Equal(t, 1, dones.get("p-1"))
			if c.actFails {
				require.Equal(t, 2, acts.get("p-1"))
				require.Equal(t, 1, r.commandsFor(t, st.ID, "act"), "the retry's command only")
				before(t, in, "child_ended:kid", "step_completed:kid", "step_failed:act", "step_completed:act", "saga_completed")
			} else {
				require.Equal(t, 1, acts.get("p-1"))
				require.Zero(t, r.commandsFor(t, st.ID, "act"), "no command for the step after the child's result")
				require.Equal(t, 1, r.txids(t, st.ID, "done", "act:made"), "done's and act's writes commit together")
				before(t, in, "child_ended:kid", "step_completed:kid", "step_completed:act", "saga_completed")
			}
		})
	}
}
