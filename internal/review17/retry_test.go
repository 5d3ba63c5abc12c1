package review17

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// pick -> act (flaky) -> done, act with retry policy pol.
func chain(name string, fx *testkit.Effects, r *runs, pol *saga.RetryPolicy, fails func(o *ord) int) *saga.Definition[ord] {
	return saga.Define(name,
		saga.Step[ord]{Name: "pick", Action: rec(fx, "pick"), Compensate: rec(fx, "unpick")},
		saga.Step[ord]{Name: "act", Action: flaky(fx, r, "act", fails), Retry: pol},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
}

func requireOnce(t *testing.T, fx *testkit.Effects, id uuid.UUID, want map[string]int) {
	t.Helper()
	require.Equal(t, want, fx.Counts(t, id), "effects of %s", id)
}

// A lone saga whose step fails twice, 300 ms apart: each retry runs after
// its backoff, not before, and long before the one-minute poll.
func TestLoneRetryRunsWhenDue(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	const back = 300 * time.Millisecond
	def := chain("lone", fx, &r, backoff(5, back), func(*ord) int { return 2 })
	for _, workers := range []int{1, 4} {
		e, stop := testkit.StartEngine(t, d.Pool, config(d, workers), def)
		o := ord{ID: fmt.Sprintf("lone-%d", workers)}
		st, err := saga.Start(ctx, e, def, o, nil)
		require.NoError(t, err)
		in := endedWithin(t, e, st.ID, 2*back+prompt)
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		require.Equal(t, 2, count(in, saga.EventStepFailed, "act"), timeline(in))
		requireOnce(t, fx, st.ID, map[string]int{"pick": 1, "act": 1, "done": 1})
		require.Equal(t, 3, r.n(o.ID+"/act"))
		for _, g := range r.gaps(o.ID + "/act") {
			require.GreaterOrEqual(t, g, back-30*time.Millisecond, "a retry ran before its backoff")
			require.Less(t, g, back+prompt/2, "a retry waited for something other than its backoff")
		}
		stop()
	}
}

// Many sagas, each failing 0-3 times with backoffs of 40-160 ms, on 1 and
// on 4 workers: every saga ends completed, each effect once, the whole lot
// long before one poll.
func TestRetriesUnderContention(t *testing.T) {
	for _, workers := range []int{1, 4} {
		t.Run(fmt.Sprintf("workers=%d", workers), func(t *testing.T) {
			parallel(t)
			ctx := context.Background()
			d := testkit.NewDB(t)
			fx := testkit.NewEffects(t, d)
			var r runs
			fails := func(o *ord) int { var n int; fmt.Sscanf(o.Tag, "%d", &n); return n }
			def := saga.Define("busy",
				saga.Step[ord]{Name: "pick", Action: rec(fx, "pick"), Compensate: rec(fx, "unpick")},
				saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", fails),
					Retry: &saga.RetryPolicy{MaxAttempts: 5, Backoff: func(a int) time.Duration { return time.Duration(40*a) * time.Millisecond }}},
				saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
			)
			e, _ := testkit.StartEngine(t, d.Pool, config(d, workers), def)
			const n = 48
			ids := make([]uuid.UUID, n)
			begin := time.Now()
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprintf("c-%d", i), Tag: fmt.Sprint(i % 4)}, nil)
					ids[i] = st.ID
					errs <- err
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			for i, id := range ids {
				in := endedWithin(t, e, id, 15*time.Second-time.Since(begin))
				require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
				require.Equal(t, i%4, count(in, saga.EventStepFailed, "act"), timeline(in))
				requireOnce(t, fx, id, map[string]int{"pick": 1, "act": 1, "done": 1})
			}
			t.Logf("%d sagas on %d workers in %s; stats %+v", n, workers, time.Since(begin), e.Stats())
		})
	}
}

// A retry due in 8 s is written first, then one due in 150 ms: the
// second must not wait for the first one's timer (one timer per engine,
// set only when none is set, would miss it).
func TestShorterRetryAfterALongerOne(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	long, short := 8*time.Second, 150*time.Millisecond
	defLong := saga.Define("twolong", saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", func(*ord) int { return 1 }), Retry: backoff(3, long)})
	defShort := saga.Define("twoshort", saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", func(*ord) int { return 1 }), Retry: backoff(3, short)})
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 1), defLong, defShort)

	a, err := saga.Start(ctx, e, defLong, ord{ID: "A"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, prompt, "A's first failure", func() bool { return count(get(t, e, a.ID), saga.EventStepFailed, "act") == 1 })
	time.Sleep(50 * time.Millisecond) // A's timer is set
	b, err := saga.Start(ctx, e, defShort, ord{ID: "B"}, nil)
	require.NoError(t, err)
	in := endedWithin(t, e, b.ID, short+lateBy)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Nil(t, get(t, e, a.ID).EndedAt, "A's retry is not due yet")
	in = endedWithin(t, e, a.ID, long+prompt)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.GreaterOrEqual(t, r.gaps("A/act")[0], long-30*time.Millisecond)
	requireOnce(t, fx, a.ID, map[string]int{"act": 1})
	requireOnce(t, fx, b.ID, map[string]int{"act": 1})
}

// Retries due 200 ms, 0.7 s, 1.2 s and 2 s after their failures, written at
// about the same time: once the first timer has fired, the later ones must
// each still be woken when due.
func TestRetriesDueOneAfterAnother(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	backs := []time.Duration{200 * time.Millisecond, 700 * time.Millisecond, 1200 * time.Millisecond, 2 * time.Second}
	var defs []saga.AnyDefinition
	var typed []*saga.Definition[ord]
	for i, b := range backs {
		def := saga.Define(fmt.Sprintf("seq%d", i), saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", func(*ord) int { return 1 }), Retry: backoff(3, b)})
		defs = append(defs, def)
		typed = append(typed, def)
	}
	for _, workers := range []int{1, 2} {
		e, stop := testkit.StartEngine(t, d.Pool, config(d, workers), defs...)
		ids := make([]uuid.UUID, len(backs))
		for i, def := range typed {
			st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprintf("s%d-%d", workers, i)}, nil)
			require.NoError(t, err)
			ids[i] = st.ID
		}
		for i, id := range ids {
			in := endedWithin(t, e, id, backs[i]+prompt)
			require.Equal(t, saga.StatusCompleted, in.Status)
			g := r.gaps(fmt.Sprintf("s%d-%d/act", workers, i))
			require.Len(t, g, 1)
			require.GreaterOrEqual(t, g[0], backs[i]-30*time.Millisecond, "retry %d ran early", i)
			require.Less(t, g[0], backs[i]+lateBy, "retry %d (backoff %s) ran late", i, backs[i])
			requireOnce(t, fx, id, map[string]int{"act": 1})
		}
		stop()
	}
}

// One worker: A's retry comes due while the worker runs B's 800 ms step.
// After B, the worker must still run A's retry at once: the wake-up that
// found no idle worker must not be lost.
func TestRetryDueWhileTheOnlyWorkerIsBusy(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	defA := saga.Define("busya", saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", func(*ord) int { return 1 }), Retry: backoff(3, 200*time.Millisecond)})
	var bDone time.Time
	var mu sync.Mutex
	defB := saga.Define("busyb", saga.Step[ord]{Name: "slow", Timeout: 5 * time.Second,
		Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			select {
			case <-time.After(800 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
			mu.Lock()
			bDone = time.Now()
			mu.Unlock()
			return fx.Record(ctx, run, "slow")
		}})
	cfg := config(d, 1)
	cfg.BatchSize = 1
	e, _ := testkit.StartEngine(t, d.Pool, cfg, defA, defB)
	a, err := saga.Start(ctx, e, defA, ord{ID: "A"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, prompt, "A's first run", func() bool { return r.n("A/act") == 1 })
	b, err := saga.Start(ctx, e, defB, ord{ID: "B"}, nil)
	require.NoError(t, err)
	inB := endedWithin(t, e, b.ID, prompt)
	require.Equal(t, saga.StatusCompleted, inB.Status)
	inA := endedWithin(t, e, a.ID, prompt)
	require.Equal(t, saga.StatusCompleted, inA.Status)
	ts := r.times("A/act")
	require.Len(t, ts, 2)
	mu.Lock()
	lag := ts[1].Sub(bDone)
	mu.Unlock()
	t.Logf("A's retry ran %s after B's step returned", lag)
	require.Less(t, lag, lateBy)
	requireOnce(t, fx, a.ID, map[string]int{"act": 1})
	requireOnce(t, fx, b.ID, map[string]int{"slow": 1})
}

// A step that fails six times in a row, 60 ms apart, then succeeds; one
// that never succeeds (compensated at once after its last attempt); one
// that pauses when exhausted and runs again promptly on Resume.
func TestManyFailuresInARow(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	ok := chain("six", fx, &r, backoff(7, 60*time.Millisecond), func(*ord) int { return 6 })
	never := chain("never", fx, &r, backoff(4, 60*time.Millisecond), func(*ord) int { return 1 << 20 })
	held := saga.Define("held",
		saga.Step[ord]{Name: "pick", Action: rec(fx, "pick"), Compensate: rec(fx, "unpick")},
		saga.Step[ord]{Name: "act", Action: flaky(fx, &r, "act", func(*ord) int { return 3 }), Retry: backoff(3, 60*time.Millisecond), PauseWhenExhausted: true},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), ok, never, held)

	s1, err := saga.Start(ctx, e, ok, ord{ID: "six"}, nil)
	require.NoError(t, err)
	s2, err := saga.Start(ctx, e, never, ord{ID: "never"}, nil)
	require.NoError(t, err)
	s3, err := saga.Start(ctx, e, held, ord{ID: "held"}, nil)
	require.NoError(t, err)

	in := endedWithin(t, e, s1.ID, 6*60*time.Millisecond+prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	require.Equal(t, 6, count(in, saga.EventStepFailed, "act"))
	requireOnce(t, fx, s1.ID, map[string]int{"pick": 1, "act": 1, "done": 1})

	in = endedWithin(t, e, s2.ID, 3*60*time.Millisecond+prompt)
	require.Equal(t, saga.StatusCompensated, in.Status, timeline(in))
	require.Equal(t, 4, r.n("never/act"))
	requireOnce(t, fx, s2.ID, map[string]int{"pick": 1, "unpick": 1})

	testkit.WaitFor(t, prompt, "held to pause when exhausted", func() bool { return get(t, e, s3.ID).Paused != nil })
	require.Equal(t, 3, r.n("held/act"))
	testkit.Hold(t, 300*time.Millisecond, "a paused saga runs nothing", func() bool { return r.n("held/act") == 3 })
	resumed := time.Now()
	require.NoError(t, e.Resume(ctx, s3.ID, "fixed"))
	in = endedWithin(t, e, s3.ID, prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	require.Equal(t, 4, r.n("held/act"))
	require.Less(t, r.times("held/act")[3].Sub(resumed), 2*time.Second)
	requireOnce(t, fx, s3.ID, map[string]int{"pick": 1, "act": 1, "done": 1})
}
