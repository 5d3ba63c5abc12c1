package saga_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// Durations of hours and days (a RescueSlack of two hours, a step timeout of
// two days, a signal awaited for thirty days, a deadline of a year) are
// stored as such. Microseconds went to PostgreSQL as parameters that it
// typed as int4 in one place: 2^31 microseconds is under 36 minutes, and a
// RescueSlack over that failed every transition of every saga.
func TestDurationsOfDaysAreStored(t *testing.T) {
	t.Parallel()
	const (
		slack   = 2 * time.Hour
		timeout = 48 * time.Hour
		await   = 30 * 24 * time.Hour
		limit   = 365 * 24 * time.Hour
	)
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond, RescueSlack: slack, UnknownSagaGrace: 72 * time.Hour})
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	def := saga.Define("long",
		saga.Step[order]{Name: "reserve", Action: rec, Compensate: rec, Timeout: timeout},
		saga.Step[order]{Name: "approve", Wait: saga.OnSignal("approved", func(context.Context, *saga.StepRun, *order, struct{}) error {
			return nil
		}).Timeout(await)},
		saga.Step[order]{Name: "ship", Action: rec, Timeout: timeout},
	).WithDeadline(limit)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, sagatest.Event("step_completed:reserve"), &sagatest.WaitOpts{Timeout: 10 * time.Second})

	var until, deadline time.Time
	waitFor(t, 10*time.Second, func() bool {
		err := b.pool.QueryRow(ctx, "SELECT coalesce(wait_until, 'epoch'), coalesce(deadline_at, 'epoch') FROM "+b.table("saga_instances")+
			" WHERE id = $1 AND wait_kind = 'signal'", st.ID).Scan(&until, &deadline)
		return err == nil
	}, "the saga to wait for its signal")
	require.WithinDuration(t, time.Now().Add(await), until, time.Minute, "the wait's time limit")
	require.WithinDuration(t, time.Now().Add(limit), deadline, time.Minute, "the saga's deadline")

	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "approved", Payload: struct{}{}})
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "ship/forward"}, b.effects(t, st.ID))
}

// A saga put to sleep until a far future ("never": the year 9999) sleeps:
// the wait is time.Duration's longest (about 292 years), and the rescue
// deadline after it (the wait plus the step's timeout plus RescueSlack) is
// not taken past time.Duration's range, where it would turn negative, put
// the saga's deadline in the past and have the rescuer look at it on every
// pass. A saga beside it runs on.
func TestSleepUntilTheYear9999Sleeps(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
	never := time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)
	def := saga.Define("never",
		saga.Step[order]{Name: "hold", Wait: saga.SleepUntil(func(*order) time.Time { return never })},
		saga.Step[order]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return recordEffect(ctx, run, b.schema)
		}},
	)
	other := saga.Define("other", saga.Step[order]{Name: "only", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
		return recordEffect(ctx, run, b.schema)
	}})
	require.NoError(t, b.engine.Register(def))
	require.NoError(t, b.engine.Register(other))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, sagatest.Event("wait_started:hold"), &sagatest.WaitOpts{Timeout: 10 * time.Second})
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status, "history: %v", eventTypes(in))

	var deadline time.Time
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT greatest(next_check_at, due_at) FROM "+b.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&deadline))
	require.True(t, deadline.After(time.Now().AddDate(200, 0, 0)), "the rescue deadline is after the wait, not in the past: %v", deadline)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{}, res, "nothing to rescue")

	st2, err := saga.Start(ctx, b.engine, other, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st2.ID).Status)
	require.Empty(t, b.effects(t, st.ID), "the sleeper has not woken")
}

// A step whose Timeout is 30 days, or the longest duration (a step that
// never times out), runs, with its rescue deadline after it. The batch
// transaction's idle limit (idle_in_transaction_session_timeout), from the
// longest step timeout of the engine, is at most 2^31-1 ms: past that
// (24.8 days) every batch of the engine failed at its BEGIN, whichever
// saga it held, and the longest duration wrapped the sum negative.
func TestAStepWithATimeoutOfMonthsRuns(t *testing.T) {
	t.Parallel()
	for _, timeout := range []time.Duration{30 * 24 * time.Hour, math.MaxInt64} {
		t.Run(timeout.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
			entered, release := make(chan struct{}), make(chan struct{})
			def := saga.Define("patient",
				saga.Step[order]{Name: "first", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					return recordEffect(ctx, run, b.schema)
				}},
				saga.Step[order]{Name: "slow", Timeout: timeout, Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					close(entered)
					<-release
					return recordEffect(ctx, run, b.schema)
				}},
			)
			require.NoError(t, b.engine.Register(def))
			b.start(t)
			ctx := context.Background()
			st, err := saga.Start(ctx, b.engine, def, order{}, nil)
			require.NoError(t, err)
			select {
			case <-entered:
			case <-time.After(20 * time.Second):
				t.Fatal("the slow step never ran")
			}
			var deadline time.Time
			require.NoError(t, b.pool.QueryRow(ctx, "SELECT greatest(next_check_at, due_at) FROM "+b.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&deadline))
			require.True(t, deadline.After(time.Now().Add(timeout/2)), "the running step's rescue deadline is ahead: %v", deadline)
			close(release)
			in := b.waitTerminal(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
			require.Equal(t, []string{"first/forward", "slow/forward"}, b.effects(t, st.ID))
		})
	}
}

// An operator acts while a step with a timeout of months runs: a cancel
// interrupts it at once (its context is cancelled) and the saga is
// compensated; a pause lets it finish and holds the next step until the
// saga is resumed, after which the rescue deadline is again the step's
// timeout ahead and the saga completes. The unpause's deadline is one of
// the sums that stop at the longest duration.
func TestOperatorActsDuringAStepWithATimeoutOfMonths(t *testing.T) {
	t.Parallel()
	for _, timeout := range []time.Duration{30 * 24 * time.Hour, math.MaxInt64} {
		t.Run("cancel/"+timeout.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
			entered := make(chan struct{})
			def := saga.Define("patient",
				saga.Step[order]{Name: "first", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					return recordEffect(ctx, run, b.schema)
				}, Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					return recordEffect(ctx, run, b.schema)
				}},
				saga.Step[order]{Name: "slow", Timeout: timeout, Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					close(entered)
					<-ctx.Done() // runs until interrupted
					return ctx.Err()
				}},
			)
			require.NoError(t, b.engine.Register(def))
			b.start(t)
			ctx := context.Background()
			st, err := saga.Start(ctx, b.engine, def, order{}, nil)
			require.NoError(t, err)
			select {
			case <-entered:
			case <-time.After(20 * time.Second):
				t.Fatal("the slow step never ran")
			}
			require.NoError(t, b.engine.Cancel(ctx, st.ID, "operator"))
			in := b.waitTerminalWithin(t, st.ID, 20*time.Second)
			require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
			require.Equal(t, saga.ErrorInfo{Code: saga.CodeCancelled, Message: "operator"}, *in.LastError)
			require.Equal(t, []string{"first/forward", "first/compensate"}, b.effects(t, st.ID))
		})
		t.Run("pause/"+timeout.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
			entered, release := make(chan struct{}), make(chan struct{})
			entered2, release2 := make(chan struct{}), make(chan struct{})
			rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
			def := saga.Define("patient",
				saga.Step[order]{Name: "slow", Timeout: timeout, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
					close(entered)
					<-release
					return rec(ctx, run, o)
				}},
				saga.Step[order]{Name: "next", Timeout: timeout, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
					close(entered2)
					<-release2
					return rec(ctx, run, o)
				}},
			)
			require.NoError(t, b.engine.Register(def))
			b.start(t)
			ctx := context.Background()
			st, err := saga.Start(ctx, b.engine, def, order{}, nil)
			require.NoError(t, err)
			select {
			case <-entered:
			case <-time.After(20 * time.Second):
				t.Fatal("the slow step never ran")
			}
			require.NoError(t, b.engine.Pause(ctx, st.ID, "incident"))
			close(release)
			waitFor(t, 10*time.Second, func() bool { return b.heldCommands(t, st.ID) == 1 }, "next's command to be held")
			stays(t, 300*time.Millisecond, func() bool { return len(b.effects(t, st.ID)) == 1 }, "no step may start while paused")

			require.NoError(t, b.engine.Resume(ctx, st.ID, "incident over"))
			select {
			case <-entered2:
			case <-time.After(20 * time.Second):
				t.Fatal("the next step never ran after the resume")
			}
			var deadline time.Time
			require.NoError(t, b.pool.QueryRow(ctx, "SELECT greatest(next_check_at, due_at) FROM "+b.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&deadline))
			require.True(t, deadline.After(time.Now().Add(timeout/2)), "the resumed step's rescue deadline is ahead: %v", deadline)
			close(release2)
			in := b.waitTerminalWithin(t, st.ID, 20*time.Second)
			require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
			require.True(t, hasEvent(in, saga.EventSagaUnpaused))
			require.Equal(t, []string{"slow/forward", "next/forward"}, b.effects(t, st.ID))
		})
	}
}
