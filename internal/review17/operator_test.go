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

// client is an engine on d that is never started: an operator's tool.
func client(t *testing.T, d *testkit.DB, defs ...saga.AnyDefinition) *saga.Engine {
	return testkit.NewEngine(t, d.Pool, config(d, 1), defs...)
}

func waitFailed(t *testing.T, e *saga.Engine, id uuid.UUID, step string, n int) {
	t.Helper()
	testkit.WaitFor(t, prompt, fmt.Sprintf("%d failures of %s", n, step), func() bool {
		return count(get(t, e, id), saga.EventStepFailed, step) >= n
	})
}

// A saga paused while its retry waits: the retry does not run when due
// (nor after), and runs promptly once resumed, by the engine or by an
// operator's tool; resumed before it was due, it runs when due, not
// before and not at the poll.
func TestPauseAroundARetry(t *testing.T) {
	const back = 600 * time.Millisecond
	for _, via := range []string{"engine", "tool"} {
		t.Run("resume after due via "+via, func(t *testing.T) {
			parallel(t)
			ctx := context.Background()
			e, op, st, fx, r := pausedWhileRetryWaits(t, via, back)
			testkit.Hold(t, back+700*time.Millisecond, "a paused saga's retry does not run", func() bool { return r.n("p/act") == 1 })
			require.Nil(t, get(t, e, st.ID).EndedAt)
			resumed := time.Now()
			require.NoError(t, op.Resume(ctx, st.ID, "go on"))
			in := endedWithin(t, e, st.ID, prompt)
			require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
			require.Less(t, r.times("p/act")[1].Sub(resumed), lateBy)
			requireOnce(t, fx, st.ID, map[string]int{"pick": 1, "act": 1, "done": 1})
			require.Equal(t, 2, r.n("p/act"))
		})
		t.Run("resume before due via "+via, func(t *testing.T) {
			parallel(t)
			ctx := context.Background()
			e, op, st, fx, r := pausedWhileRetryWaits(t, via, back)
			time.Sleep(100 * time.Millisecond)
			require.NoError(t, op.Resume(ctx, st.ID, "go on"))
			in := endedWithin(t, e, st.ID, back+prompt)
			require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
			g := r.gaps("p/act")
			require.Len(t, g, 1)
			require.GreaterOrEqual(t, g[0], back-30*time.Millisecond, "the retry ran before it was due")
			require.Less(t, g[0], back+lateBy, "the retry waited past its due time")
			requireOnce(t, fx, st.ID, map[string]int{"pick": 1, "act": 1, "done": 1})
		})
	}
}

// pausedWhileRetryWaits starts a saga whose act step fails once and is
// retried after back, on an engine with two workers, and pauses it (by the
// engine, or by an operator's tool when via is "tool") once act failed. It
// returns the engine, the operator, the saga, its effects and its runs.
func pausedWhileRetryWaits(t *testing.T, via string, back time.Duration) (e, op *saga.Engine, st saga.Started, fx *testkit.Effects, r *runs) {
	t.Helper()
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx = testkit.NewEffects(t, d)
	r = &runs{}
	def := chain("pz", fx, r, backoff(4, back), func(*ord) int { return 1 })
	e, _ = testkit.StartEngine(t, d.Pool, config(d, 2), def)
	op = e
	if via == "tool" {
		op = client(t, d, def)
	}
	st, err := saga.Start(ctx, e, def, ord{ID: "p"}, nil)
	require.NoError(t, err)
	waitFailed(t, e, st.ID, "act", 1)
	require.NoError(t, op.Pause(ctx, st.ID, "look"))
	return e, op, st, fx, r
}

// A pause of the saga type while retries wait, lifted after they were
// due: none runs during the pause, all run promptly after ResumeType.
func TestPauseTypeAroundRetries(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	def := chain("pt", fx, &r, backoff(4, 300*time.Millisecond), func(*ord) int { return 1 })
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	var ids []uuid.UUID
	for i := range 6 {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("t", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for _, id := range ids {
		waitFailed(t, e, id, "act", 1)
	}
	_, err := e.PauseType(ctx, "pt", "deploy")
	require.NoError(t, err)
	total := func() int {
		n := 0
		for i := range 6 {
			n += r.n(fmt.Sprint("t", i, "/act"))
		}
		return n
	}
	// On a slow machine a retry can come due (300 ms) before the last
	// first failure is seen and the pause asked for: count from the pause.
	atPause := total()
	testkit.Hold(t, time.Second, "no retry runs while the type is paused", func() bool { return total() == atPause })
	_, err = e.ResumeType(ctx, "pt")
	require.NoError(t, err)
	for _, id := range ids {
		in := endedWithin(t, e, id, prompt)
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		requireOnce(t, fx, id, map[string]int{"pick": 1, "act": 1, "done": 1})
	}
	require.Equal(t, 12, total())
}

// A cancel (by the engine, or RequestCancel by a tool) while a 2 s retry
// waits: the saga compensates promptly, and the retry never runs, not
// even once its backoff has passed.
func TestCancelWhileARetryWaits(t *testing.T) {
	for _, via := range []string{"cancel", "request"} {
		t.Run(via, func(t *testing.T) {
			parallel(t)
			ctx := context.Background()
			d := testkit.NewDB(t)
			fx := testkit.NewEffects(t, d)
			var r runs
			const back = 2 * time.Second
			def := chain("cw", fx, &r, backoff(5, back), func(*ord) int { return 1 << 20 })
			e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
			st, err := saga.Start(ctx, e, def, ord{ID: "c"}, nil)
			require.NoError(t, err)
			waitFailed(t, e, st.ID, "act", 1)
			asked := time.Now()
			if via == "cancel" {
				require.NoError(t, e.Cancel(ctx, st.ID, "stop"))
			} else {
				require.NoError(t, client(t, d).RequestCancel(ctx, st.ID, "stop"))
			}
			in := endedWithin(t, e, st.ID, prompt)
			require.Equal(t, saga.StatusCompensated, in.Status, timeline(in))
			require.Less(t, time.Since(asked), back, "the cancel waited for the retry")
			testkit.Hold(t, back, "the retry never runs after the cancel", func() bool { return r.n("c/act") == 1 })
			requireOnce(t, fx, st.ID, map[string]int{"pick": 1, "unpick": 1})
		})
	}
}

// A cancel right at the moment a 100 ms retry comes due, over many sagas:
// each either retries once more or not, and ends compensated promptly,
// its compensation once.
func TestCancelRacesADueRetry(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	def := chain("cr", fx, &r, backoff(50, 100*time.Millisecond), func(*ord) int { return 1 << 20 })
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	op := client(t, d, def)
	var ids []uuid.UUID
	for i := range 12 {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("r", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		waitFailed(t, e, id, "act", 1)
		time.Sleep(time.Duration(i%4) * 30 * time.Millisecond)
		require.NoError(t, op.Cancel(ctx, id, "stop"))
	}
	for _, id := range ids {
		in := endedWithin(t, e, id, prompt)
		require.Equal(t, saga.StatusCompensated, in.Status, timeline(in))
		requireOnce(t, fx, id, map[string]int{"pick": 1, "unpick": 1})
	}
}

// A retry written by an engine that is stopped before it is due, and then
// started again (or replaced by another): the new engine must find it due
// without the poll.
func TestRetryAcrossARestart(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	const back = 1500 * time.Millisecond
	def := chain("rs", fx, &r, backoff(4, back), func(*ord) int { return 1 })
	e1, stop1 := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	st, err := saga.Start(ctx, e1, def, ord{ID: "x"}, nil)
	require.NoError(t, err)
	waitFailed(t, e1, st.ID, "act", 1)
	stop1()
	e2, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	in := endedWithin(t, e2, st.ID, back+prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	require.Less(t, r.gaps("x/act")[0], back+lateBy)
	requireOnce(t, fx, st.ID, map[string]int{"pick": 1, "act": 1, "done": 1})
}

// Two engines, two workers each, on one schema, starting sagas on both:
// every retry runs promptly whichever engine wrote it, effects once.
func TestTwoEnginesOneSchema(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	var r runs
	def := chain("two", fx, &r, backoff(5, 80*time.Millisecond), func(o *ord) int { var n int; fmt.Sscanf(o.Tag, "%d", &n); return n })
	a, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	b, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	begin := time.Now()
	var ids []uuid.UUID
	for i := range 30 {
		e := a
		if i%2 == 1 {
			e = b
		}
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("e", i), Tag: fmt.Sprint(1 + i%3)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		in := endedWithin(t, a, id, 12*time.Second-time.Since(begin))
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		require.Equal(t, 1+i%3, count(in, saga.EventStepFailed, "act"))
		requireOnce(t, fx, id, map[string]int{"pick": 1, "act": 1, "done": 1})
	}
	t.Logf("30 sagas on two engines in %s; A %+v B %+v", time.Since(begin), a.Stats(), b.Stats())
}
