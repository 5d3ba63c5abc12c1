package review17

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// A parallel step whose branches fail 2, 1 and 0 times (backoffs 100 and
// 250 ms): the group joins and the saga completes promptly, each branch's
// effect and the join once.
func TestParallelBranchesRetry(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	branch := func(name string, fails int, back time.Duration) saga.Branch[ord] {
		return saga.Branch[ord]{Name: name, Retry: backoff(5, back),
			Action: func(ctx context.Context, run *saga.StepRun, o ord) (any, error) {
				if r.add(o.ID+"/"+name) <= fails {
					return nil, errFlaky{fails}
				}
				return name, fx.Record(ctx, run, name)
			}}
	}
	def := saga.Define("par",
		saga.Step[ord]{Name: "prep", Parallel: &saga.Parallel[ord]{
			Branches: []saga.Branch[ord]{branch("a", 2, 100*time.Millisecond), branch("b", 1, 250*time.Millisecond), branch("c", 0, time.Second)},
			Join: func(ctx context.Context, run *saga.StepRun, o *ord, res map[string]json.RawMessage) error {
				o.Tag = fmt.Sprint(len(res))
				return fx.Record(ctx, run, "join")
			}}},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
	for _, workers := range []int{1, 3} {
		e, stop := testkit.StartEngine(t, d.Pool, config(d, workers), def)
		var ids []uuid.UUID
		for i := range 4 {
			st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("p", workers, i)}, nil)
			require.NoError(t, err)
			ids = append(ids, st.ID)
		}
		for i, id := range ids {
			in := endedWithin(t, e, id, prompt)
			require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
			requireOnce(t, fx, id, map[string]int{"a": 1, "b": 1, "c": 1, "join": 1, "done": 1})
			var o ord
			require.NoError(t, in.DecodeState(&o))
			require.Equal(t, "3", o.Tag)
			require.Equal(t, 3, r.n(fmt.Sprint("p", workers, i, "/a")))
			require.Equal(t, 2, r.n(fmt.Sprint("p", workers, i, "/b")))
		}
		stop()
	}
}

// Timers shorter than the poll (saga.Sleep 300 ms, then a step that
// fails once with a 200 ms backoff): fired when due, not before, and not
// at the poll.
func TestShortTimersAndARetryAfterThem(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	const nap = 300 * time.Millisecond
	def := saga.Define("nap",
		saga.Step[ord]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			r.add(o.ID + "/pick")
			return fx.Record(ctx, run, "pick")
		}},
		saga.Step[ord]{Name: "nap", Wait: saga.Sleep[ord](nap)},
		saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", func(*ord) int { return 1 }), Retry: backoff(3, 200*time.Millisecond)},
		saga.Step[ord]{Name: "nap2", Wait: saga.Sleep[ord](nap)},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	var ids []uuid.UUID
	for i := range 5 {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("n", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		in := endedWithin(t, e, id, 2*nap+200*time.Millisecond+prompt)
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		requireOnce(t, fx, id, map[string]int{"pick": 1, "act": 1, "done": 1})
		k := fmt.Sprint("n", i)
		gap := r.times(k + "/act")[0].Sub(r.times(k + "/pick")[0])
		require.GreaterOrEqual(t, gap, nap-30*time.Millisecond, "the timer fired early")
		require.Less(t, gap, nap+lateBy, "the timer fired late")
		require.Less(t, in.EndedAt.Sub(in.CreatedAt), 2*nap+200*time.Millisecond+2*time.Second)
	}
}

// A signal sent while the saga's step runs: its wake-up finds the saga
// held by the step's transaction and is deferred; the step then reaches
// the await, and the deferred wake-up must deliver the signal promptly.
func TestWakeUpDeferredWhileTheStepRuns(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	def := saga.Define("def",
		saga.Step[ord]{Name: "act", Timeout: 10 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			if err := gate.Pass(ctx); err != nil {
				return err
			}
			return fx.Record(ctx, run, "act")
		}},
		saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, o *ord, p string) error {
			o.Tag = p
			return fx.Record(ctx, run, "go")
		})},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 3), def)
	st, err := saga.Start(ctx, e, def, ord{ID: "d"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, prompt, "the step to be held", func() bool { return gate.Entered() == 1 })
	_, err = e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", ID: "sig-1", Payload: json.RawMessage(`"yes"`)})
	require.NoError(t, err)
	testkit.WaitFor(t, prompt, "the wake-up to be deferred", func() bool { return e.Stats().Deferred > 0 })
	time.Sleep(100 * time.Millisecond)
	gate.Open()
	in := endedWithin(t, e, st.ID, prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	requireOnce(t, fx, st.ID, map[string]int{"act": 1, "go": 1, "done": 1})
	var o ord
	require.NoError(t, in.DecodeState(&o))
	require.Equal(t, "yes", o.Tag)
	t.Logf("stats %+v", e.Stats())
}
