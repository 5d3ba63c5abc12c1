package review16

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// ship, run at once after pay's reply, writes "ship#1" through run.Tx and
// then waits (honouring ctx) for 5 s; when its ctx ends (the limit) it
// writes "late#1" through run.Tx with a fresh context and returns success
// anyway, as the worst user would. Doc: given up past the limit, "its
// context cancelled, its transaction's connection closed (its writes
// undone), and nothing of it recorded, not even as an attempt; the reply is
// applied again on its own, with the step's command, and an engine worker
// runs the step, with its Timeout and its attempts counted as usual".
// So: ship#1 and late#1 never persist, ship#2 exactly once, "paid" once,
// no step_failed, ship's completion is attempt 1, StepsHandedOff 1.
func TestSlowShipWritesBeforeTheCutAndNothingPersists(t *testing.T) {
	t.Parallel()
	r := newRig(t, "cutwrites", "", nil)
	cut := make(chan time.Duration, 1)
	r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
		if n == 1 {
			began := time.Now()
			if err := r.fx.Record(ctx, run, "ship#1"); err != nil {
				return err
			}
			cancelled := waitCtx(ctx, 5*time.Second)
			if cancelled {
				cut <- time.Since(began)
			} else {
				cut <- -1
			}
			_ = r.fx.Record(context.Background(), run, "late#1") // the connection should be gone
			return nil
		}
		return r.fx.Record(ctx, run, "ship#2")
	}
	def := r.def(defOpts{})
	r.start(t, nil, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
	require.NoError(t, err)
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
	took := <-cut
	require.Greater(t, took, time.Duration(0), "the first run's ctx was cancelled at the limit, not left to run 5 s")
	require.Less(t, took, 4*time.Second, "cut at the limit (200 ms), generous bound")
	require.Equal(t, []string{"pick", "paid", "ship#2", "done"}, r.fx.List(t, st.ID), "the given-up run's writes (early and late) undone: %v", timeline(in))
	require.Equal(t, int32(2), r.shipRuns.Get("o"))
	require.Zero(t, count(in, "step_failed", "ship"), "nothing of the given-up run recorded: %v", timeline(in))
	require.Equal(t, 1, count(in, "step_completed", "ship"), "%v", timeline(in))
	require.Equal(t, 1, count(in, "step_completed", "pay"), "%v", timeline(in))
	for _, e := range in.History {
		if e.Type == "step_completed" && e.Step == "ship" && e.Attempt != 0 {
			require.Equal(t, 1, e.Attempt, "the worker's run is attempt 1: %v", timeline(in))
		}
	}
	require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
	st2 := r.engine.Stats()
	require.Equal(t, int64(1), st2.StepsHandedOff)
	require.Zero(t, st2.HandlersAbandoned)
	require.Zero(t, st2.AttemptsFailed)
}

// ship ignores its ctx always (sleeps 1.5 s; Timeout 300 ms, HandlerGrace
// 200 ms), MaxAttempts 3, after pay's reply, default limit. Doc: on the
// reply worker it is given up at the limit, not recorded, not an attempt;
// on the engine workers its attempts count "as usual", and (0c4ef86) each
// abandoned attempt is recorded before a worker of the engine runs the
// step again. So ship runs 4 times (1 cut + 3 attempts), the worker runs
// see run.Attempt 1, 2, 3, each finds the previous attempts already in the
// history, the history has exactly attempts [1 2 3] handler_overran, and
// the saga compensates: pay refunded, pick undone, "paid" once, no "ship".
func TestDeafShipAfterReplyIsCutThenCountsMaxAttempts(t *testing.T) {
	t.Parallel()
	r := newRig(t, "deafship", "", nil)
	type seen struct {
		attempt int
		before  int
		err     error
	}
	var mu sync.Mutex
	var runs []seen
	rd := readerPool(t, r.orders)
	r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
		b, err := historyCount(context.Background(), rd, run.SagaID, "step_failed", "ship")
		mu.Lock()
		runs = append(runs, seen{run.Attempt, b, err})
		mu.Unlock()
		r.sleep(1500 * time.Millisecond)
		return nil
	}
	def := r.def(defOpts{shipRetry: 3, shipTimeout: 300 * time.Millisecond})
	r.start(t, func(cfg *saga.Config) { cfg.HandlerGrace = 200 * time.Millisecond; cfg.Workers = 4 }, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
	require.NoError(t, err)
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
	require.Equal(t, "ship", in.LastError.Step, "%+v", in.LastError)
	require.Equal(t, []int{1, 2, 3}, failedAttempts(in, "ship"), "%v", timeline(in))
	for _, e := range in.History {
		if e.Type == "step_failed" && e.Step == "ship" {
			require.Equal(t, saga.CodeAbandonedRunOn, e.ErrorCode, "%v", timeline(in))
		}
	}
	require.Equal(t, int32(4), r.shipRuns.Get("o"), "one cut run on the reply worker + MaxAttempts 3: %v", timeline(in))
	mu.Lock()
	got := append([]seen(nil), runs...)
	mu.Unlock()
	for _, s := range got {
		require.NoError(t, s.err)
	}
	// The first run is the one on the reply worker (its attempt number is
	// whatever it is); the worker's runs are attempts 1..3, each after the
	// previous one's record.
	require.Len(t, got, 4)
	for i, s := range got[1:] {
		require.Equal(t, i+1, s.attempt, "worker run %d: %+v", i+1, got)
		require.Equal(t, i, s.before, "worker run %d found the earlier abandoned attempts recorded: %+v", i+1, got)
	}
	require.Equal(t, int64(1), r.engine.Stats().StepsHandedOff)
	require.Equal(t, int64(3), r.engine.Stats().HandlersAbandoned)
	require.Eventually(t, func() bool { return len(r.calls(t, st.ID)) == 2 }, wait, 20*time.Millisecond, "pay refunded")
	require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID))
	require.Equal(t, []string{"pick", "paid", "unpick"}, r.fx.List(t, st.ID), "%v", timeline(in))
}
