package review11_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// startFan starts a saga of def on g and waits until it is in the group
// with branch fan.<done> completed.
func (e *env) startFan(t *testing.T, g *saga.Engine, def *saga.Definition[order], done string) uuid.UUID {
	t.Helper()
	st, err := saga.Start(context.Background(), g, def, order{ID: "o"}, nil)
	require.NoError(t, err)
	waitFor(t, "branch fan."+done+" completed", func() bool { return e.fx.Count(t, st.ID, "fan."+done) == 1 })
	return st.ID
}

// A branch that runs right now (its handler is blocked) keeps its command
// pending and locked and is left alone; only its lost sibling is sent
// again, once. Both then run once.
func TestRunningBranchIsLeftAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	def := fanDef("running", e.fx, bh, 3, "a", "b")
	entered, release := bh.block("fan.a")
	defer release()
	e.loseBranch(t, "fan.b", 0)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	st, err := saga.Start(context.Background(), g, def, order{ID: "o"}, nil)
	require.NoError(t, err)
	testkit.Recv(t, entered, wait, "branch fan.a running")
	waitFor(t, "fan.b lost", func() bool { return e.dropped(t, "%/fan.b/%") == 1 })
	require.True(t, e.age(t, st.ID, 2*slack), "the saga row is not locked while a branch's handler runs")

	res := rescue(t, g)
	require.Equal(t, 1, res.Redriven, "only the lost branch is sent again: %+v\n%s", res, e.dump(t, st.ID))
	require.Zero(t, res.FailedOver)
	require.Equal(t, 1, e.branchCommands(t, st.ID, "fan.a", "pending"), "the running branch's command stays as it is\n%s", e.dump(t, st.ID))
	require.Equal(t, 0, e.events(t, st.ID, saga.EventSagaRescued, "fan.a"))

	// A second look, still past the slack by the clock, while fan.a runs.
	waitFor(t, "the re-sent fan.b ran", func() bool { return e.fx.Count(t, st.ID, "fan.b") == 1 })
	require.True(t, e.age(t, st.ID, 2*slack))
	res = rescue(t, g)
	require.Zero(t, res.Redriven+res.FailedOver, "%+v\n%s", res, e.dump(t, st.ID))

	release()
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, st.ID).Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, st.ID))
	require.Equal(t, 1, branch(t, g, st.ID, "fan", "a", 0).Attempts, "fan.a ran once, no attempt spent by the rescuer")
	require.Equal(t, 2, branch(t, g, st.ID, "fan", "b", 0).Attempts, "the lost attempt and the one that ran")
}

// A branch whose retry is pending but not due (a long backoff) has not lost
// its command: it is not sent again, however long the saga has not moved.
func TestBranchRetryInBackoffIsNotResent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	bh.failWith("fan.b", func(attempt int) error {
		if attempt == 1 {
			return errors.New("later")
		}
		return nil
	})
	def := fanDefWith("backoff", e.fx, bh, &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return time.Hour }}, "a", "b")
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	waitFor(t, "fan.b failed once", func() bool { return e.events(t, id, saga.EventStepFailed, "fan.b") == 1 })
	require.True(t, e.age(t, id, 3*slack))
	res := rescue(t, g)
	require.Zero(t, res.Redriven+res.FailedOver, "a retry waiting for its backoff is not lost: %+v\n%s", res, e.dump(t, id))
	require.Equal(t, 1, e.branchCommands(t, id, "fan.b", "pending"), e.dump(t, id))
	require.Equal(t, 0, e.events(t, id, saga.EventSagaRescued, ""))
	require.Equal(t, 0, e.fx.Count(t, id, "fan.b"))

	// The backoff passes (clock): the retry runs, once.
	require.NoError(t, e.clk.Advance(context.Background(), time.Hour))
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
	require.Equal(t, 1, e.fx.Count(t, id, "fan.b"))
}

// steps.RetryAfter: "asks for the step to be retried no sooner than d". A
// branch that answers RetryAfter(1h) (a provider's 429) must not be retried
// at once. The plain step beside it is the control.
func TestBranchHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	bh := newBehave()
	later := func(attempt int) error {
		if attempt == 1 {
			return steps.RetryAfter(time.Hour, errors.New("429: retry after 3600 s"))
		}
		return nil
	}
	bh.failWith("fan.b", later)
	fast := &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}
	def := fanDefWith("retryafter", e.fx, bh, fast, "a", "b")
	plain := saga.Define("retryafter_plain", saga.Step[order]{Name: "only", Retry: fast,
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			if err := later(run.Attempt); err != nil {
				return err
			}
			return e.fx.Record(ctx, run, "only")
		}})
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def, plain)
	p, err := saga.Start(ctx, g, plain, order{ID: "p"}, nil)
	require.NoError(t, err)
	id := e.startFan(t, g, def, "a")
	waitFor(t, "fan.b failed once", func() bool { return e.events(t, id, saga.EventStepFailed, "fan.b") == 1 })
	waitFor(t, "only failed once", func() bool { return e.events(t, p.ID, saga.EventStepFailed, "only") == 1 })
	testkit.Hold(t, time.Second, "the plain step waits its hour (control)", func() bool { return e.fx.Count(t, p.ID, "only") == 0 })
	require.Equal(t, 0, e.fx.Count(t, id, "fan.b"),
		"FINDING: the branch was retried at once, its RetryAfter(1h) ignored (the branch's Backoff, 10 ms, was used)\n%s%v", e.dump(t, id), timeline(t, g, id))
}

// The re-sent command, duplicated (a re-drive is a delivery like any
// other), runs the branch once.
func TestDuplicatesOfAResentBranchCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	def := fanDef("dups", e.fx, bh, 3, "a", "b")
	e.loseBranch(t, "fan.b", 0)
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	stop()
	client := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	require.True(t, e.age(t, id, 2*slack))
	require.Equal(t, 1, rescue(t, client).Redriven)
	require.Equal(t, 1, e.branchCommands(t, id, "fan.b", "pending"))
	_, err := e.Pool.Exec(context.Background(), `INSERT INTO `+e.Table("outbox")+` (id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, status, available_at)
		SELECT gen_random_uuid(), topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, status, available_at
		FROM `+e.Table("outbox")+`, generate_series(1, 3) WHERE saga_id = $1 AND type = 'sagaflow.branch' AND status = 'pending'`, id)
	require.NoError(t, err)
	require.Equal(t, 4, e.branchCommands(t, id, "fan.b", "pending"))

	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g2, id).Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
	waitFor(t, "the duplicates consumed", func() bool { return e.branchCommands(t, id, "fan.b", "pending") == 0 })
}

// Two engines run the rescuer at once, twice each, over the same lost
// branches: each branch is sent again once, and runs once.
func TestConcurrentRescuesResendEachBranchOnce(t *testing.T) {
	t.Parallel()
	const sagas = 12
	e := newEnv(t)
	bh := newBehave()
	def := fanDef("twice", e.fx, bh, 3, "a", "b")
	e.lose(t, "%/fan.b/%", "sagaflow.branch", "delete", 0, sagas)
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	var ids []uuid.UUID
	for range sagas {
		st, err := saga.Start(context.Background(), g, def, order{ID: "o"}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for _, id := range ids {
		waitFor(t, "fan.a of every saga", func() bool { return e.fx.Count(t, id, "fan.a") == 1 })
	}
	require.Equal(t, sagas, e.dropped(t, "%/fan.b/%"))
	stop()
	for _, id := range ids {
		require.True(t, e.age(t, id, 2*slack))
	}
	c1 := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	c2 := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	var (
		mu    sync.Mutex
		total saga.RescueResult
		wg    sync.WaitGroup
		start = make(chan struct{})
	)
	for _, c := range []*saga.Engine{c1, c2, c1, c2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			res, err := c.RescueNow(context.Background())
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("rescue: %v", err)
			}
			total.Redriven += res.Redriven
			total.FailedOver += res.FailedOver
		}()
	}
	close(start)
	wg.Wait()
	require.Equal(t, sagas, total.Redriven, "each lost branch sent again once: %+v", total)
	require.Zero(t, total.FailedOver)
	for _, id := range ids {
		require.Equal(t, 1, e.branchCommands(t, id, "fan.b", "pending"), e.dump(t, id))
		require.Equal(t, 1, e.events(t, id, saga.EventSagaRescued, "fan.b"))
	}
	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	for _, id := range ids {
		require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g2, id).Status)
		require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
		require.Equal(t, 2, branch(t, g2, id, "fan", "b", 0).Attempts)
	}
}

// A command parked as dead (not deleted) is lost too: sent again, and the
// dead row stays for the operator, who can requeue it harmlessly.
func TestParkedBranchCommandIsResent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	def := fanDef("parked", e.fx, bh, 3, "a", "b")
	e.lose(t, "%/fan.b/%", "sagaflow.branch", "dead", 0, 1)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	require.Equal(t, 1, e.branchCommands(t, id, "fan.b", "dead"))
	require.True(t, e.age(t, id, 2*slack))
	require.Equal(t, 1, rescue(t, g).Redriven)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
	// The operator requeues the parked original after the fact.
	page, err := g.DeadMessages(context.Background(), nil)
	require.NoError(t, err)
	require.Len(t, page.Messages, 1)
	_, err = g.RequeueDead(context.Background(), &saga.RequeueOpts{MessageIDs: []uuid.UUID{page.Messages[0].ID}})
	require.NoError(t, err)
	waitFor(t, "the requeued command consumed", func() bool { return e.branchCommands(t, id, "fan.b", "") == 0 })
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
}

// A branch that failed once and whose retry was lost is sent again,
// counting the lost attempt.
func TestLostBranchRetryIsResent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	bh.failWith("fan.b", func(attempt int) error {
		if attempt == 1 {
			return errors.New("flaky")
		}
		return nil
	})
	def := fanDef("retry", e.fx, bh, 3, "a", "b")
	e.loseBranch(t, "fan.b", 1) // the first command goes, the retry is lost
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	waitFor(t, "the retry lost", func() bool { return e.dropped(t, "%/fan.b/%") == 1 })
	require.True(t, e.age(t, id, 2*slack))
	res := rescue(t, g)
	require.Equal(t, 1, res.Redriven, "%+v\n%s", res, e.dump(t, id))
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
	b := branch(t, g, id, "fan", "b", 0)
	require.Equal(t, 3, b.Attempts, "failed, lost, succeeded")
	require.Equal(t, "completed", b.Status)
}

// A lost retry with the branch's attempts spent fails the group: the
// completed branch and the step before are compensated once, the lost
// branch never runs, and the branch says why.
func TestLostBranchRetryExhausted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	bh.failWith("fan.b", func(int) error { return errors.New("flaky") })
	def := fanDef("exhaust", e.fx, bh, 2, "a", "b")
	e.loseBranch(t, "fan.b", 1)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	waitFor(t, "the retry lost", func() bool { return e.dropped(t, "%/fan.b/%") == 1 })
	require.True(t, e.age(t, id, 2*slack))
	res := rescue(t, g)
	require.Equal(t, 1, res.FailedOver, "%+v\n%s", res, e.dump(t, id))
	require.Zero(t, res.Redriven)
	in := testkit.WaitEnded(t, g, id)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "undo:fan.a": 1, "undo:pre": 1}, e.fx.Counts(t, id))
	b := branch(t, g, id, "fan", "b", 0)
	require.Equal(t, "failed", b.Status)
	require.NotNil(t, b.LastError)
	require.Equal(t, saga.CodeRescueExhausted, b.LastError.Code)
	require.Equal(t, 2, b.Attempts)

	// Nothing more to do, however often it looks.
	require.NoError(t, e.clk.Advance(context.Background(), 2*slack))
	res = rescue(t, g)
	require.Zero(t, res.Redriven+res.FailedOver+res.Woken)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "undo:fan.a": 1, "undo:pre": 1}, e.fx.Counts(t, id))
}

// The group fails (a lost branch with no attempt left) while a sibling is
// mid-attempt: the sibling is not interrupted, finds the group gone, and
// its effects roll back; it is not compensated, since it never completed.
func TestExhaustedWhileSiblingRuns(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	bh := newBehave()
	def := fanDef("midway", e.fx, bh, 1, "a", "b")
	entered, release := bh.block("fan.a")
	defer release()
	e.loseBranch(t, "fan.b", 0)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	st, err := saga.Start(context.Background(), g, def, order{ID: "o"}, nil)
	require.NoError(t, err)
	testkit.Recv(t, entered, wait, "fan.a running")
	require.True(t, e.age(t, st.ID, 2*slack))
	res := rescue(t, g)
	require.Equal(t, 1, res.FailedOver, "%+v\n%s", res, e.dump(t, st.ID))
	release()
	require.Equal(t, saga.StatusCompensated, testkit.WaitEnded(t, g, st.ID).Status)
	waitFor(t, "fan.a's command consumed", func() bool { return e.branchCommands(t, st.ID, "fan.a", "pending") == 0 })
	require.Equal(t, map[string]int{"pre": 1, "undo:pre": 1}, e.fx.Counts(t, st.ID), "fan.a rolled back, so not compensated\n%s", e.dump(t, st.ID))
	require.Equal(t, "cancelled", branch(t, g, st.ID, "fan", "a", 0).Status)
}

// sagatest.Clock is how a user makes time pass in a test: "every time
// sagaflow stored in the schema moves d into the past ... so the rescuer
// finds lost commands". Advancing it past RescueSlack, with the engine
// given, must rescue a lost branch as it rescues every other lost command.
func TestClockAdvanceRescuesALostBranch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	def := fanDef("clock", e.fx, newBehave(), 3, "a", "b")
	e.loseBranch(t, "fan.b", 0)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	require.NoError(t, sagatest.NewClock(e.Pool, e.Schema, g).Advance(ctx, 3*slack))
	in := sagatest.WaitEnded(t, g, id, &sagatest.WaitOpts{Timeout: 5 * time.Second})
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
}

// A re-sent command lost again is sent again after another RescueSlack,
// not before ("a saga is looked at at most once per RescueSlack"), each
// loss counting an attempt; the third attempt runs.
func TestBranchLostTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	def := fanDef("twice_lost", e.fx, newBehave(), 3, "a", "b")
	e.lose(t, "%/fan.b/%", "sagaflow.branch", "delete", 0, 2)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	require.True(t, e.age(t, id, 2*slack))
	require.Equal(t, 1, rescue(t, g).Redriven)
	require.Equal(t, 2, e.dropped(t, "%/fan.b/%"), "the re-sent command was lost too")
	res := rescue(t, g)
	require.Zero(t, res.Redriven+res.FailedOver, "looked at again before RescueSlack: %+v", res)
	require.True(t, e.age(t, id, 2*slack))
	require.Equal(t, 1, rescue(t, g).Redriven)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g, id).Status)
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
	require.Equal(t, 3, branch(t, g, id, "fan", "b", 0).Attempts)
	require.Equal(t, 2, e.events(t, id, saga.EventSagaRescued, "fan.b"))
}
