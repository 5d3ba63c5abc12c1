package review17

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// A 500 ms timer that falls due during a pause fires once, after the
// resume, promptly; a signal wait whose 300 ms limit passes compensates
// promptly; one whose limit goes on (TimeoutThen) goes on promptly.
func TestShortWaitLimitsAndATimerAcrossAPause(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	nap := saga.Define("napz",
		saga.Step[ord]{Name: "pick", Action: rec(fx, "pick")},
		saga.Step[ord]{Name: "nap", Wait: saga.Sleep[ord](500 * time.Millisecond)},
		saga.Step[ord]{Name: "done", Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			r.add(o.ID + "/done")
			return fx.Record(ctx, run, "done")
		}},
	)
	limit := saga.Define("limit",
		saga.Step[ord]{Name: "pick", Action: rec(fx, "pick"), Compensate: rec(fx, "unpick")},
		saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *ord, string) error { return nil }).Timeout(300 * time.Millisecond)},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
	then := saga.Define("then",
		saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *ord, string) error { return nil }).
			TimeoutThen(300*time.Millisecond, rec(fx, "late"))},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), nap, limit, then)

	s1, err := saga.Start(ctx, e, nap, ord{ID: "nap"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, prompt, "the nap", func() bool { return get(t, e, s1.ID).Wait != nil })
	require.NoError(t, e.Pause(ctx, s1.ID, "hold"))
	s2, err := saga.Start(ctx, e, limit, ord{ID: "limit"}, nil)
	require.NoError(t, err)
	s3, err := saga.Start(ctx, e, then, ord{ID: "then"}, nil)
	require.NoError(t, err)
	started := time.Now()

	in := endedWithin(t, e, s2.ID, 300*time.Millisecond+prompt)
	require.Equal(t, saga.StatusCompensated, in.Status, timeline(in))
	requireOnce(t, fx, s2.ID, map[string]int{"pick": 1, "unpick": 1})
	in = endedWithin(t, e, s3.ID, 300*time.Millisecond+prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	requireOnce(t, fx, s3.ID, map[string]int{"late": 1, "done": 1})
	require.Less(t, time.Since(started), 300*time.Millisecond+2*time.Second)

	testkit.Hold(t, time.Second, "the paused saga's timer does not fire", func() bool { return r.n("nap/done") == 0 })
	resumed := time.Now()
	require.NoError(t, e.Resume(ctx, s1.ID, "go"))
	in = endedWithin(t, e, s1.ID, prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	require.Less(t, r.times("nap/done")[0].Sub(resumed), lateBy)
	requireOnce(t, fx, s1.ID, map[string]int{"pick": 1, "done": 1})
}

// A saga that retries under a concurrency key of limit 1, with others
// queued behind it: each is admitted as the one before ends, and each of
// them retries too; the queue drains promptly, in start order.
func TestRetriesUnderAConcurrencyKey(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	def := chain("ck", fx, &r, backoff(4, 150*time.Millisecond), func(*ord) int { return 1 }).WithConcurrency(1)
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	var ids []uuid.UUID
	for i := range 5 {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("q", i)}, &saga.StartOpts{ConcurrencyKey: "cust"})
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	var prevEnd time.Time
	for i, id := range ids {
		in := endedWithin(t, e, id, 5*150*time.Millisecond+2*prompt)
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		requireOnce(t, fx, id, map[string]int{"pick": 1, "act": 1, "done": 1})
		first := r.times(fmt.Sprint("q", i, "/act"))[0]
		if i > 0 {
			require.True(t, first.After(prevEnd.Add(-50*time.Millisecond)), "saga %d ran before the one ahead ended", i)
		}
		prevEnd = *in.EndedAt
	}
	first, _ := e.Get(ctx, ids[0])
	last, _ := e.Get(ctx, ids[4])
	t.Logf("queue of 5 drained in %s", last.EndedAt.Sub(first.CreatedAt))
	require.Less(t, last.EndedAt.Sub(first.CreatedAt), 5*(150*time.Millisecond+time.Second))
}

// The hybrid mode: a cancel while the retry of the step after a reply
// waits (2 s backoff): compensated promptly (the remote step's refund is
// not modelled: pay has no compensation), the retry never runs.
func TestHybridCancelWhileARetryAfterAReplyWaits(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	const name = "hcx"
	h := newHybrid(t, name)
	var r runs
	const back = 2 * time.Second
	def := h.def(name, &r, back, func(*ord) int { return 1 << 20 })
	e, _ := testkit.StartEngine(t, h.orders.Pool, h.config(2), def)
	st, err := saga.Start(ctx, e, def, ord{ID: "c"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, 30*time.Second, "ship's first failure", func() bool { return count(get(t, e, st.ID), saga.EventStepFailed, "ship") == 1 })
	asked := time.Now()
	require.NoError(t, e.Cancel(ctx, st.ID, "stop"))
	in := endedWithin(t, e, st.ID, prompt)
	require.Equal(t, saga.StatusCompensated, in.Status, timeline(in))
	require.Less(t, time.Since(asked), back)
	testkit.Hold(t, back, "the retry never runs after the cancel", func() bool { return r.n("c/ship") == 1 })
	requireOnce(t, h.fx, st.ID, map[string]int{"pick": 1, "paid": 1, "unpick": 1})
}

// The hybrid mode under load: 32 sagas, the step after each reply failing
// 1-2 times (100 ms backoff), one reply partition, 2 workers.
func TestHybridRetriesAfterRepliesUnderLoad(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	const name = "hload"
	h := newHybrid(t, name)
	var r runs
	def := h.def(name, &r, 100*time.Millisecond, func(o *ord) int { var n int; fmt.Sscanf(o.ID, "l%d", &n); return 1 + n%2 })
	e, _ := testkit.StartEngine(t, h.orders.Pool, h.config(2), def)
	warm, err := saga.Start(ctx, e, def, ord{ID: "l0"}, nil)
	require.NoError(t, err)
	endedWithin(t, e, warm.ID, 30*time.Second)
	ids := []uuid.UUID{warm.ID}
	begin := time.Now()
	for i := 1; i < 32; i++ {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("l", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		in := endedWithin(t, e, id, 15*time.Second-time.Since(begin))
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		require.Equal(t, 1+i%2, count(in, saga.EventStepFailed, "ship"))
		requireOnce(t, h.fx, id, map[string]int{"pick": 1, "paid": 1, "ship": 1, "done": 1})
		require.EqualValues(t, 1, h.pays.Get(fmt.Sprint("l", i)))
	}
	t.Logf("31 sagas in %s; %+v", time.Since(begin), e.Stats())
}
