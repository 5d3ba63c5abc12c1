package saga_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// eightSteps defines a saga of eight steps, each recording its effect in its
// transaction; step s2 blocks until release is closed, ignoring its context
// (the worst case: it completes after the request).
func eightSteps(b *bundle, name string, entered chan<- struct{}, release <-chan struct{}, honour bool) *saga.Definition[order] {
	var ss []saga.Step[order]
	for i := 1; i <= 8; i++ {
		step := fmt.Sprintf("s%d", i)
		fn := func(ctx context.Context, run *saga.StepRun, s *order) error {
			if err := recordEffect(ctx, run, b.schema); err != nil {
				return err
			}
			if step == "s2" && run.Direction == steps.Forward && run.Attempt == 1 {
				entered <- struct{}{}
				if honour {
					select {
					case <-ctx.Done():
						return ctx.Err()
					case <-release:
					}
				} else {
					<-release
				}
			}
			return nil
		}
		ss = append(ss, saga.Step[order]{Name: step, Action: fn, Compensate: fn, Retry: fastRetry, Timeout: 30 * time.Second})
	}
	return saga.Define(name, ss...)
}

// An operator's cancel (what `sagaflow cancel` calls: RequestCancel from a
// tool that knows no definition) of an 8-step saga while step 2 runs: the
// request is recorded, step 2 is told, and no step after it runs. Step 2
// here ignores its context and completes, so it is compensated too.
func TestOperatorCancelAtStep2RunsNoLaterStep(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	def := eightSteps(b, "eight", entered, release, false)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered

	tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, tool.RequestCancel(ctx, st.ID, "customer asked"))
	close(release)

	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, []string{"s1/forward", "s2/forward", "s2/compensate", "s1/compensate"}, b.effects(t, st.ID))
	require.Equal(t, []string{
		"saga_started", "step_completed:s1", "cancel_requested:s2", "step_completed:s2", "saga_cancelled:s3",
		"compensation_started:s2", "compensation_completed:s2", "compensation_completed:s1", "saga_compensated",
	}, eventTypes(in))
	require.Equal(t, saga.ErrorInfo{Code: saga.CodeCancelled, Message: "customer asked"}, *in.LastError)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_cancel_requests")), "the applied request is gone")
	require.Equal(t, int64(1), b.engine.Stats().CancelsApplied)
}

// Cancel from another engine (another process) interrupts a 30 s step that
// honours its context within a second, through the notification.
func TestCancelInterruptsARunningStepInAnotherEngine(t *testing.T) {
	t.Parallel()
	// A slow poll: only the notification can be this quick.
	b := setup(t, &saga.Config{PollInterval: time.Minute})
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	defer close(release)
	def := eightSteps(b, "interrupted", entered, release, true)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered

	other, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, other.Register(def))
	asked := time.Now()
	require.NoError(t, other.Cancel(ctx, st.ID, "stop"))
	// The request is applied (the saga leaves running) once the step is
	// interrupted; uninterrupted, that would take the step's 30 s.
	sagatest.Wait(t, b.engine, st.ID, sagatest.Cond("have the cancel applied", func(in *saga.Instance) bool {
		return in.Status != saga.StatusRunning
	}), &sagatest.WaitOpts{Timeout: 5 * time.Second})
	require.Less(t, time.Since(asked), time.Second, "the running step was interrupted")
	in := b.waitTerminalWithin(t, st.ID, 5*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status)
	// s2 was rolled back, not completed: only s1 is compensated.
	require.Equal(t, []string{"s1/forward", "s1/compensate"}, b.effects(t, st.ID), "history: %v", eventTypes(in))
	require.NotContains(t, eventTypes(in), "step_failed:s2", "an interrupted step is not charged an attempt")
}

// A request whose notification never arrived (recorded straight in the
// table here) still interrupts the running step, at the engine's next poll.
func TestCancelRequestWithoutNotificationIsFoundByPolling(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 200 * time.Millisecond})
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	defer close(release)
	def := eightSteps(b, "polled", entered, release, true)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered
	_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("saga_cancel_requests")+" (saga_id, epoch, reason) VALUES ($1, 0, 'silent')", st.ID)
	require.NoError(t, err)
	in := b.waitTerminalWithin(t, st.ID, 5*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.ErrorInfo{Code: saga.CodeCancelled, Message: "silent"}, *in.LastError)
}

// retryingAnHourAway starts, on an engine of its own, a saga whose charge
// step fails once and retries an hour later, and returns once that retry is
// written and no step of the saga runs; calls counts charge's runs.
func retryingAnHourAway(t *testing.T, name string) (*bundle, saga.Started, *atomic.Int32) {
	t.Helper()
	b := setup(t, nil)
	calls := &atomic.Int32{}
	def := threeSteps(b, name, map[string]saga.StepFunc[order]{
		"charge/forward": func(context.Context, *saga.StepRun, *order) error {
			calls.Add(1)
			return steps.RetryAfter(time.Hour, fmt.Errorf("provider busy"))
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, 10*time.Second, func() bool { return calls.Load() == 1 }, "charge to fail once")
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE id = $1 AND attempt = 1", st.ID) == 1
	}, "the retry to be scheduled")
	// The worker's commit is visible a moment before it lets go of the
	// saga's lock: wait for that, so that no step runs at the Cancel.
	require.NoError(t, b.engine.WaitUnlocked(ctx, st.ID))
	return b, st, calls
}

// A cancel of a saga waiting on a retry's backoff (no step running) is
// applied at once, in Cancel's transaction; a second cancel is refused.
func TestCancelBetweenStepsAppliesAtOnce(t *testing.T) {
	t.Parallel()
	b, st, _ := retryingAnHourAway(t, "backoff")
	ctx := context.Background()
	require.NoError(t, b.engine.Cancel(ctx, st.ID, "too slow"))
	// Applied in Cancel's own transaction: when Cancel returns, the cancel
	// is in the timeline and the saga no longer runs forward (a worker may
	// already have run the quick compensation after it).
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.True(t, hasEvent(in, saga.EventSagaCancelled), "applied in Cancel's own transaction: %v", eventTypes(in))
	require.Contains(t, []saga.Status{saga.StatusCompensating, saga.StatusCompensated}, in.Status)
	require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, st.ID).Status)
	require.ErrorIs(t, b.engine.Cancel(ctx, st.ID, "again"), saga.ErrNotRunning)
	require.ErrorIs(t, b.engine.Cancel(ctx, uuid.New(), "nobody"), saga.ErrNotFound)
}

// Cancel reads the saga and tries its execution lock in one statement,
// whose snapshot comes before the lock: a step that commits between them
// leaves the row read stale though the lock is won. The hook makes that
// happen (the saga's version moves on from another connection, as the
// step's commit would): the cancel reads again and applies at once; when
// the saga moves on at every read, the cancel command applies it. Either
// way Cancel succeeds and the saga compensates; it used to fail with "the
// saga changed while its execution lock was held".
func TestCancelWhoseReadAStepOutdates(t *testing.T) {
	t.Parallel()
	for _, moves := range []int{1, 3} {
		t.Run(fmt.Sprint(moves, " moves"), func(t *testing.T) {
			t.Parallel()
			b, st, calls := retryingAnHourAway(t, "outdated")
			ctx := context.Background()
			var reads atomic.Int32
			b.engine.SetCancelRead(func(id uuid.UUID) {
				if int(reads.Add(1)) > moves {
					return
				}
				_, err := b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET version = version + 1 WHERE id = $1", id)
				require.NoError(t, err)
			})
			require.NoError(t, b.engine.Cancel(ctx, st.ID, "too slow"))
			require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, st.ID).Status)
			in, err := b.engine.Get(ctx, st.ID)
			require.NoError(t, err)
			require.True(t, hasEvent(in, saga.EventSagaCancelled), "%v", eventTypes(in))
			require.EqualValues(t, 1, calls.Load(), "the retry an hour away never ran")
			if moves == 1 {
				require.EqualValues(t, 2, reads.Load(), "read again once")
			} else {
				require.EqualValues(t, 3, reads.Load(), "three reads, then the cancel command")
			}
		})
	}
}

// A request left for a saga that ended before any engine applied it is
// refused and recorded, not silently dropped.
func TestCancelRequestForAnEndedSagaIsRecordedAsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "late", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	// The saga is made to look compensating, as if it failed meanwhile,
	// and the request is left pending.
	tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, tool.RequestCancel(ctx, st.ID, "too late"))
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET status = 'compensating', direction = 'compensate' WHERE id = $1", st.ID)
	require.NoError(t, err)
	b.start(t)
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_cancel_requests")) == 0
	}, "the request to be dealt with")
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Contains(t, eventTypes(in), "cancel_refused")
	for _, ev := range in.History {
		if ev.Type == saga.EventCancelRefused {
			require.Equal(t, saga.CodeCancelRefused, ev.ErrorCode)
			require.Contains(t, string(ev.Detail), "compensating already")
		}
	}
}

// A saga claimed in a batch whose turn has not come yet (its command waits
// behind a slow step of another saga in the same batch) and cancelled
// meanwhile never starts its step: the engine hears of the request for
// every saga its workers hold, not only the one whose step runs.
func TestCancelOfASagaQueuedInARunningBatch(t *testing.T) {
	t.Parallel()
	for _, viaTool := range []bool{false, true} {
		t.Run(map[bool]string{false: "Cancel", true: "RequestCancel"}[viaTool], func(t *testing.T) {
			t.Parallel()
			b, x, started := behindASlowStep(t, &saga.Config{Workers: 1, BatchSize: 16}, 2*time.Second)
			ctx := context.Background()
			if viaTool {
				tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
				require.NoError(t, err)
				require.NoError(t, tool.RequestCancel(ctx, x.ID, "operator"))
			} else {
				require.NoError(t, b.engine.Cancel(ctx, x.ID, "operator"))
			}
			in := b.waitTerminal(t, x.ID)
			require.Equal(t, saga.StatusCompensated, in.Status)
			require.Empty(t, b.effects(t, x.ID))
			require.Zero(t, started.Load(), "the queued saga's step never started")
			require.Equal(t, []string{"saga_started", "cancel_requested:reserve", "saga_cancelled:reserve", "saga_compensated"}, eventTypes(in))
		})
	}
}

// A saga claimed in a batch whose turn has not come yet, and cancelled or
// paused meanwhile by a request whose notification never reaches the engine
// (written straight into the tables: a loaded machine delivered one more
// than 300 ms late in a CI run, and the step's handler was called after
// Cancel had returned), never starts its step: a batch whose read of a saga
// is older than operatorReadAge reads its cancel request and pauses again
// before it runs the saga's command.
func TestCancelOrPauseUnheardOfByARunningBatch(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"cancel", "pause"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			// PollInterval a minute: the engine's poll for cancel requests of the
			// sagas it holds (the fallback for lost notifications) does not
			// come within the test.
			b, x, started := behindASlowStep(t, &saga.Config{Workers: 1, BatchSize: 16, PollInterval: time.Minute}, 400*time.Millisecond)
			ctx := context.Background()
			var err error
			if op == "cancel" {
				_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("saga_cancel_requests")+" (saga_id, epoch, reason) VALUES ($1, 0, 'unheard')", x.ID)
			} else {
				_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("saga_pauses")+" (kind, saga_id, saga_name, code, reason) VALUES ('saga', $1, 'queued', 'operator', 'unheard')", x.ID)
			}
			require.NoError(t, err)
			if op == "cancel" {
				in := b.waitTerminal(t, x.ID)
				require.Equal(t, saga.StatusCompensated, in.Status)
				require.Empty(t, b.effects(t, x.ID))
				require.Zero(t, started.Load(), "the queued saga's step never started")
				return
			}
			// Paused: the step is held, not run, until the pause is lifted.
			time.Sleep(time.Second)
			require.Zero(t, started.Load(), "the paused saga's step did not start")
			require.NoError(t, b.engine.Resume(ctx, x.ID, "go on"))
			in := b.waitTerminal(t, x.ID)
			require.Equal(t, saga.StatusCompleted, in.Status)
			require.Equal(t, int32(1), started.Load())
		})
	}
}

// behindASlowStep starts, on an engine of cfg (one worker, one batch), a
// saga whose step takes slowFor (or until its context ends) and then one of
// type "queued" whose step counts its calls in started, and returns once
// the slow step runs: both commands are in one batch, the queued one behind.
func behindASlowStep(t *testing.T, cfg *saga.Config, slowFor time.Duration) (*bundle, saga.Started, *atomic.Int32) {
	t.Helper()
	b := setup(t, cfg)
	slowRunning := make(chan struct{}, 1)
	slow := saga.Define("slow", saga.Step[order]{Name: "s1", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
		slowRunning <- struct{}{}
		select {
		case <-ctx.Done():
		case <-time.After(slowFor):
		}
		return nil
	}})
	started := new(atomic.Int32)
	queued := saga.Define("queued", saga.Step[order]{Name: "reserve", Compensate: noop,
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			started.Add(1)
			return recordEffect(ctx, run, b.schema)
		}})
	require.NoError(t, b.engine.Register(slow, queued))
	ctx := context.Background()
	_, err := saga.Start(ctx, b.engine, slow, order{}, nil)
	require.NoError(t, err)
	x, err := saga.Start(ctx, b.engine, queued, order{}, nil)
	require.NoError(t, err)
	b.start(t) // one batch claims both; the slow step runs first
	<-slowRunning
	return b, x, started
}

// A cancel request left over while a saga compensates (recorded in the
// instant before a step failed for good) never interrupts a compensation
// and never skips one: it is refused, and every completed step is
// compensated.
func TestCancelRequestNeverInterruptsACompensation(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 50 * time.Millisecond})
	compensating := make(chan struct{}, 1)
	release := make(chan struct{})
	def := threeSteps(b, "undoing", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("no carrier"))
		},
		"charge/compensate": func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			compensating <- struct{}{}
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-compensating
	_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("saga_cancel_requests")+" (saga_id, epoch, reason) VALUES ($1, 0, 'late')", st.ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "SELECT pg_notify($1, $2)", b.schema+"_sagaflow", "sagaflow.cancel:"+st.ID.String())
	require.NoError(t, err)
	// Several polls pass while the compensation runs; it must not be cut.
	time.Sleep(300 * time.Millisecond)
	close(release)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "charge/compensate", "reserve/compensate"}, b.effects(t, st.ID))
	require.NotContains(t, eventTypes(in), "saga_cancelled:charge")
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_cancel_requests")) == 0
	}, "the late request to be refused")
}
