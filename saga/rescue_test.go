package saga_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// overdue moves a saga's deadline into the past, as if time had passed.
func (b *bundle) overdue(t *testing.T, id uuid.UUID) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), "UPDATE "+b.table("saga_instances")+
		" SET next_check_at = now() - interval '1 minute', due_at = NULL WHERE id = $1", id)
	require.NoError(t, err)
}

func (b *bundle) deleteCommands(t *testing.T, id uuid.UUID) {
	t.Helper()
	tag, err := b.pool.Exec(context.Background(), "DELETE FROM "+b.table("outbox")+" WHERE saga_id = $1", id)
	require.NoError(t, err)
	require.Positive(t, tag.RowsAffected())
}

func TestLostCommandIsRedriven(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "lost", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	// The command is lost in transit, and the deadline passes.
	b.deleteCommands(t, st.ID)
	b.overdue(t, st.ID)

	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Redriven: 1}, res)

	b.start(t)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"saga_started", "saga_rescued:reserve", "step_completed:reserve",
		"step_completed:charge", "step_completed:ship", "saga_completed"}, eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	// Re-driven under the same step-scoped key.
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key = $1", st.ID.String()+"/reserve/forward/0"))
	require.Equal(t, int64(1), b.engine.Stats().Rescued)
}

func TestRescueLeavesQueuedAndRunningSagasAlone(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered, release := make(chan struct{}), make(chan struct{})
	def := threeSteps(b, "queued", map[string]saga.StepFunc[order]{
		"charge/forward": func(context.Context, *saga.StepRun, *order) error {
			close(entered)
			<-release
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()

	// Workers down: the command waits in the queue. That is not a lost
	// command, and it must not cost the saga an attempt.
	queued, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.overdue(t, queued.ID)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Waiting: 1}, res)
	in, err := b.engine.Get(ctx, queued.ID)
	require.NoError(t, err)
	require.Equal(t, 0, in.Attempt)
	require.True(t, in.NextCheckAt.After(time.Now().Add(30*time.Second)), "deadline moved forward: %s", in.NextCheckAt)

	// A step running right now: the saga is alive.
	b.start(t)
	<-entered
	b.overdue(t, queued.ID)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Busy: 1}, res)
	close(release)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, queued.ID).Status)
	require.Zero(t, b.engine.Stats().Rescued)
}

func TestRescueFailsOverWhenAttemptsAreSpent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "spent", nil) // fastRetry: 3 attempts
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	b.start(t)

	// A saga stuck at "charge" with two attempts spent and its command
	// lost: the rescue is its third attempt, the last.
	stuck, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.waitTerminal(t, stuck.ID)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET status = 'running', step_name = 'charge', step_index = 1,
		direction = 'forward', attempt = 2, ended_at = NULL, next_check_at = now() - interval '1 minute', due_at = NULL, command_id = NULL WHERE id = $1`, stuck.ID)
	require.NoError(t, err)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{FailedOver: 1}, res)
	in := b.waitTerminal(t, stuck.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeRescueExhausted, in.LastError.Code)
	require.Equal(t, "charge", in.LastError.Step)
}

func TestRescueNeverOverwritesProgressMadeSinceItRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "racing", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.deleteCommands(t, st.ID)
	b.overdue(t, st.ID)

	// Between the rescuer's read and its update, the saga completes by
	// another path (one that does not take the execution lock).
	b.engine.SetBeforeRescueUpdate(func(id uuid.UUID) {
		_, err := b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET status = 'completed', version = version + 1,
			next_check_at = NULL, ended_at = now() WHERE id = $1`, id)
		require.NoError(t, err)
	})
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Superseded: 1}, res)

	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, in.Status, "the rescue did not move the saga backwards")
	require.Equal(t, int64(2), in.Version)
	require.Equal(t, []string{"saga_started"}, eventTypes(in), "no rescue was recorded")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1", st.ID), "no command was written")
}

func TestTwoRescuersNeverDoubleDrive(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{RescueBatch: 7})
	def := threeSteps(b, "double", nil)
	require.NoError(t, b.engine.Register(def))
	other, err := saga.New(b.pool, &saga.Config{Schema: b.schema, RescueBatch: 7, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, other.Register(def))
	ctx := context.Background()
	const n = 40
	for range n {
		st, err := saga.Start(ctx, b.engine, def, order{}, nil)
		require.NoError(t, err)
		b.deleteCommands(t, st.ID)
		b.overdue(t, st.ID)
	}
	var wg sync.WaitGroup
	results := make([]saga.RescueResult, 2)
	for i, e := range []*saga.Engine{b.engine, other} {
		wg.Go(func() {
			res, err := e.RescueNow(ctx)
			require.NoError(t, err)
			results[i] = res
		})
	}
	wg.Wait()
	require.Equal(t, n, results[0].Redriven+results[1].Redriven, "%+v", results)
	// Each saga re-driven exactly once: one rescue entry, one command.
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM (SELECT saga_id FROM "+b.table("saga_history")+
		" WHERE event = 'saga_rescued' GROUP BY saga_id HAVING count(*) <> 1) x"))
	require.Equal(t, n, b.count(t, "SELECT count(DISTINCT saga_id) FROM "+b.table("saga_history")+" WHERE event = 'saga_rescued'"))
	require.Equal(t, n, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE status = 'pending'"))
}

// TestBusySagasDoNotStarveTheRescuer: with more overdue sagas running a step
// than the rescuer takes per pass, it must neither spin on them nor miss the
// saga behind them whose command was lost.
func TestBusySagasDoNotStarveTheRescuer(t *testing.T) {
	t.Parallel()
	// BatchSize 1: each blocked saga is taken by its own worker.
	b := setup(t, &saga.Config{RescueBatch: 2, BatchSize: 1})
	blocked := threeStepsBlocked(t, b)
	defer blocked.release()
	lost := threeSteps(b, "lost-behind", nil)
	require.NoError(t, b.engine.Register(lost))
	ctx := context.Background()
	var busy []uuid.UUID
	for range 2 {
		st, err := saga.Start(ctx, b.engine, blocked.def, order{}, nil)
		require.NoError(t, err)
		busy = append(busy, st.ID)
	}
	b.start(t)
	<-blocked.entered
	<-blocked.entered
	st, err := saga.Start(ctx, b.engine, lost, order{}, nil)
	require.NoError(t, err)
	b.waitTerminal(t, st.ID)
	// Now: two sagas mid-step and a third stuck with its command lost, all
	// overdue, the busy ones first in deadline order.
	for _, id := range busy {
		b.overdue(t, id)
	}
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET status = 'running', step_name = 'charge', step_index = 1,
		attempt = 0, ended_at = NULL, next_check_at = now() - interval '1 second', due_at = NULL, command_id = NULL WHERE id = $1`, st.ID)
	require.NoError(t, err)

	started := time.Now()
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Less(t, time.Since(started), 5*time.Second, "the rescuer returned instead of spinning")
	require.Equal(t, 2, res.Busy)
	require.Equal(t, 1, res.Redriven, "the saga behind the busy ones was reached: %+v", res)
	blocked.release()
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
}

// deadlineColumns reads a saga's next_check_at (the rescuer's indexed lower
// bound) and due_at (its deadline when later), as microseconds since the
// epoch (0 for NULL).
func (b *bundle) deadlineColumns(t *testing.T, id uuid.UUID) (check, due int64) {
	t.Helper()
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT
			coalesce((EXTRACT(EPOCH FROM next_check_at) * 1e6)::int8, 0), coalesce((EXTRACT(EPOCH FROM due_at) * 1e6)::int8, 0)
		FROM `+b.table("saga_instances")+` WHERE id = $1`, id).Scan(&check, &due))
	return check, due
}

// A step that pushes the deadline later writes it to due_at and leaves the
// indexed next_check_at alone (so the row can be updated in place). When
// that lower bound passes first, the rescuer only moves it up to the
// deadline; it rescues the saga once the deadline itself has passed.
func TestRescuerWaitsForTheDeadlineNotItsLowerBound(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "bound", map[string]saga.StepFunc[order]{
		"charge/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.RetryAfter(time.Hour, errors.New("the bank asks us to come back later"))
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	check0, due0 := b.deadlineColumns(t, st.ID)
	require.Positive(t, check0)
	require.Greater(t, due0, check0, "a new saga's deadline is later than its first check")

	b.start(t)
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE id = $1 AND step_name = 'charge' AND attempt = 1", st.ID) == 1
	}, "charge's first attempt to fail")
	check1, due1 := b.deadlineColumns(t, st.ID)
	require.Equal(t, check0, check1, "reserve's and charge's transitions moved the indexed lower bound")
	require.Greater(t, due1, due0+int64(50*time.Minute/time.Microsecond), "the retry an hour away moved the deadline")

	// charge's retry is lost, and the lower bound passes: the deadline has
	// not, so the rescuer only moves the check to it.
	b.deleteCommands(t, st.ID)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET next_check_at = now() - interval '1 second' WHERE id = $1", st.ID)
	require.NoError(t, err)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Rechecked: 1}, res)
	check2, due2 := b.deadlineColumns(t, st.ID)
	require.Equal(t, due1, check2, "the check moved to the deadline")
	require.Equal(t, due1, due2)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{}, res, "a second look finds nothing to do")

	// Then the deadline passes: the lost retry is re-driven.
	b.overdue(t, st.ID)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Redriven: 1}, res)
}

// A saga that waits for a signal without a time limit has no deadline. When
// the signal's wake-up is lost (deleted here; parked as dead during a
// rolling deploy), the rescuer wakes it again once the signal has waited
// RescueSlack, at most once per RescueSlack, and leaves a saga whose
// signal has not come alone (found by review10, F1).
//
// The slack passes by sagatest.Clock: a slack of 300 ms of real time had
// passed, on a loaded machine, between the signal and the first look.
func TestRescuerWakesAWaitWhoseWakeUpWasLost(t *testing.T) {
	t.Parallel()
	const slack = time.Hour
	b := setup(t, &saga.Config{RescueSlack: slack})
	def := saga.Define("lostwake",
		saga.Step[order]{Name: "wait", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
		saga.Step[order]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return recordEffect(ctx, run, b.schema)
		}},
	)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	lost, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	quiet, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.start(t)
	waiting := func(id uuid.UUID) bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE id = $1 AND wait_kind = 'signal'", id) == 1 &&
			b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND status = 'pending'", id) == 0
	}
	waitFor(t, 10*time.Second, func() bool { return waiting(lost.ID) && waiting(quiet.ID) }, "both sagas to wait")

	// The signal's wake-up is lost before an engine takes it.
	require.NoError(t, b.engine.Stop(ctx))
	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: lost.ID, Name: "go", Payload: struct{}{}})
	require.NoError(t, err)
	b.deleteCommands(t, lost.ID)

	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Woken, "the signal has not waited RescueSlack yet")
	// No engine given: the clock's own rescue pass would take the wake-up.
	require.NoError(t, sagatest.NewClock(b.pool, b.schema).Advance(ctx, slack+time.Minute))
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Woken: 1}, res)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Woken, "woken at most once per RescueSlack")
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND status = 'pending'", lost.ID))

	b.start(t)
	in := b.waitTerminal(t, lost.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"after/forward"}, b.effects(t, lost.ID))
	require.True(t, waiting(quiet.ID), "the saga whose signal has not come still waits, and was not woken")
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_history")+" WHERE saga_id = $1 AND event = 'saga_rescued'", quiet.ID))
}
