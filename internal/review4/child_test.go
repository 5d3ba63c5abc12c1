package review4_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type kid struct {
	Key  string `json:"key,omitempty"`
	Fail bool   `json:"fail,omitempty"`
	Done string `json:"done,omitempty"`
}

// family is a child definition (its "work" step fails for good when Fail,
// that is when the parent's state has N == 1; its "hold" step awaits signal
// "go") and a parent that starts it, with the parent's Got[0] as the child's
// business key when there is one.
type family struct {
	parent   *saga.Definition[state]
	childDef *saga.Definition[kid]
}

func newFamily(v *env, name string, limit time.Duration) family {
	childDef := saga.Define(name+"-child",
		saga.Step[kid]{Name: "work", Action: func(ctx context.Context, run *saga.StepRun, k *kid) error {
			if k.Fail {
				return steps.Permanent(errors.New("child refuses"))
			}
			return v.effect(ctx, run, "child-work")
		}, Compensate: act[kid](v, "child-undo")},
		saga.Step[kid]{Name: "hold", Wait: saga.OnSignal("go", func(_ context.Context, _ *saga.StepRun, k *kid, p ev) error {
			k.Done = p.V
			return nil
		})},
	)
	w := saga.Child(childDef,
		func(_ context.Context, _ *saga.StepRun, s *state) (kid, *saga.StartOpts, error) {
			k := kid{Fail: s.N == 1}
			var opts *saga.StartOpts
			if len(s.Got) > 0 {
				opts = &saga.StartOpts{BusinessKey: s.Got[0]}
			}
			return k, opts, nil
		},
		func(ctx context.Context, run *saga.StepRun, s *state, k kid) error {
			s.Got = append(s.Got, "child:"+k.Done)
			return v.effect(ctx, run, "parent-done")
		})
	if limit > 0 {
		w = w.Timeout(limit)
	}
	parent := saga.Define(name,
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "spawn", Wait: w},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	return family{parent: parent, childDef: childDef}
}

// childOf waits for the parent to wait for its child and returns the child.
func childOf(t *testing.T, e *saga.Engine, parent uuid.UUID) *saga.Instance {
	t.Helper()
	in := waitingFor(t, e, parent, "child", "")
	id, err := uuid.Parse(in.Wait.For)
	require.NoError(t, err, "WaitInfo.For names the child's id")
	child := get(t, e, id)
	require.NotNil(t, child.ParentID)
	require.Equal(t, parent, *child.ParentID)
	return child
}

func TestChildCompletesAndWakesParent(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "ok", 0)
	v.run(t, f.parent, f.childDef)
	st, err := saga.Start(context.Background(), v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	waitingFor(t, v.e, child.ID, "signal", "go")
	_, err = sig(t, v.e, saga.Signal{SagaID: child.ID, Name: "go", ID: "1", Payload: ev{V: "yes"}})
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"child:yes"}, s.Got)
	require.Equal(t, 1, count(in, "child_started:spawn"))
	require.Equal(t, 1, count(in, "child_ended:spawn"))
	require.Equal(t, 1, v.effects(t, st.ID, "parent-done"))
	require.Equal(t, 1, v.effects(t, child.ID, "child-work"))
}

// The child fails for good: it compensates, and the parent's step fails with
// CodeChildFailed and the parent compensates.
func TestChildFails(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "fails", 0)
	v.run(t, f.parent, f.childDef)
	st, err := saga.Start(context.Background(), v.e, f.parent, state{N: 1}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeChildFailed, in.LastError.Code)
	require.Equal(t, "spawn", in.LastError.Step)
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	require.Equal(t, 0, v.effects(t, st.ID, "after"))
}

// An operator cancels the child itself: the child ends compensated, which by
// Child's doc fails the parent's step (CodeChildFailed) and the parent
// compensates.
func TestChildCancelledByOperator(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "opcancel", 0)
	v.run(t, f.parent, f.childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	waitingFor(t, v.e, child.ID, "signal", "go")
	require.NoError(t, v.e.Cancel(ctx, child.ID, "operator"))
	require.Equal(t, saga.StatusCompensated, sagatest.WaitEnded(t, v.e, child.ID, wopts).Status)
	require.Equal(t, 1, v.effects(t, child.ID, "child-undo"))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeChildFailed, in.LastError.Code)
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
}

// The parent is cancelled while it waits: the child is cancelled too.
func TestParentCancelledCancelsChild(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "pcancel", 0)
	v.run(t, f.parent, f.childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	waitingFor(t, v.e, child.ID, "signal", "go")
	require.NoError(t, v.e.Cancel(ctx, st.ID, "operator"))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	c := sagatest.WaitEnded(t, v.e, child.ID, wopts)
	require.Equal(t, saga.StatusCompensated, c.Status, sagatest.Describe(c))
	require.Equal(t, 1, v.effects(t, child.ID, "child-undo"))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	// A signal to the cancelled child is rejected.
	_, err = sig(t, v.e, saga.Signal{SagaID: child.ID, Name: "go", ID: "late"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
}

// The child wait's time limit passes: the parent compensates (wait_timeout)
// and the child still running is cancelled.
func TestChildWaitTimeoutCancelsChild(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "ctimeout", time.Hour)
	v.run(t, f.parent, f.childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	waitingFor(t, v.e, child.ID, "signal", "go")
	require.NoError(t, v.clock().Advance(ctx, 2*time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeWaitTimeout, in.LastError.Code)
	c := sagatest.WaitEnded(t, v.e, child.ID, wopts)
	require.Equal(t, saga.StatusCompensated, c.Status, sagatest.Describe(c))
}

// The child's definition is not registered with the engine: the parent's
// step fails for good with CodeChildStart (the docs say the child must be
// registered with the same engine).
func TestChildNotRegistered(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "unreg", 0)
	v.run(t, f.parent) // not f.childDef
	st, err := saga.Start(context.Background(), v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeChildStart, in.LastError.Code)
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
}

// Two parents start children with the same business key. A business key
// makes a second start return the first saga; the docs do not say what the
// second parent then waits for.
func TestChildBusinessKeyCollision(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "collide", 0)
	v.run(t, f.parent, f.childDef)
	ctx := context.Background()
	p1, err := saga.Start(ctx, v.e, f.parent, state{Got: []string{"shared"}}, nil)
	require.NoError(t, err)
	c1 := childOf(t, v.e, p1.ID)
	p2, err := saga.Start(ctx, v.e, f.parent, state{Got: []string{"shared"}}, nil)
	require.NoError(t, err)
	in2 := sagatest.Wait(t, v.e, p2.ID, sagatest.Cond("wait for a child or end", func(in *saga.Instance) bool {
		return in.Status.Terminal() || (in.Wait != nil && in.Wait.Kind == "child")
	}), wopts)
	if in2.Status.Terminal() {
		require.Equal(t, saga.StatusCompensated, in2.Status, sagatest.Describe(in2))
		// As Child's doc says: the step fails for good with CodeChildStart.
		require.Equal(t, saga.CodeChildStart, in2.LastError.Code)
		return
	}
	if in2.Wait.For == c1.ID.String() {
		// The second parent adopted the first parent's child: one signal ends both.
		_, err = sig(t, v.e, saga.Signal{SagaID: c1.ID, Name: "go", ID: "1", Payload: ev{V: "one"}})
		require.NoError(t, err)
		e1 := sagatest.WaitEnded(t, v.e, p1.ID, wopts)
		e2 := sagatest.WaitEnded(t, v.e, p2.ID, wopts)
		t.Fatalf("two parents whose Child input returns the same BusinessKey share one child saga (%s); "+
			"both parents ended %s/%s with the child's result: Child's doc says the second step fails with "+
			"CodeChildStart", c1.ID, e1.Status, e2.Status)
	}
	t.Logf("second parent waits for its own child %s", in2.Wait.For)
}
