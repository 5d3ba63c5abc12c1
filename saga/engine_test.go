package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// threeSteps defines a saga whose steps record their effect and then run
// the behaviour the test chose for them (nil: succeed).
func threeSteps(b *bundle, name string, behave map[string]saga.StepFunc[order]) *saga.Definition[order] {
	mk := func(step string) saga.StepFunc[order] {
		return func(ctx context.Context, run *saga.StepRun, s *order) error {
			if err := recordEffect(ctx, run, b.schema); err != nil {
				return err
			}
			if f := behave[step+"/"+string(run.Direction)]; f != nil {
				if err := f(ctx, run, s); err != nil {
					return err
				}
			}
			s.Done = append(s.Done, step+"/"+string(run.Direction))
			return nil
		}
	}
	var ss []saga.Step[order]
	for _, n := range []string{"reserve", "charge", "ship"} {
		ss = append(ss, saga.Step[order]{Name: n, Action: mk(n), Compensate: mk(n), Retry: fastRetry})
	}
	return saga.Define(name, ss...)
}

func TestThreeStepSagaCompletes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "checkout", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)

	st, err := saga.Start(context.Background(), b.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	require.False(t, st.Existing)

	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{
		"saga_started", "step_completed:reserve", "step_completed:charge", "step_completed:ship", "saga_completed",
	}, eventTypes(in))
	var s order
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, order{OrderID: "o-1", Done: []string{"reserve/forward", "charge/forward", "ship/forward"}}, s)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	require.Nil(t, in.LastError)
	require.NotNil(t, in.EndedAt)
	require.Nil(t, in.NextCheckAt, "a finished saga has no deadline")
	for i := 1; i < len(in.History); i++ {
		require.False(t, in.History[i].At.Before(in.History[i-1].At), "timeline in database time order")
	}
	// Every step attempt committed its key in the inbox with its effects.
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key LIKE $1", st.ID.String()+"/%"))
	// Each command was consumed: none is left in the outbox.
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
}

func TestRetryableFailureIsRetriedWithBackoff(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	type delivery struct {
		Delay time.Duration // how long after it was written the command became due
		Due   bool          // whether it was due when it ran, by the database's clock
	}
	var calls atomic.Int32
	var seen []delivery
	def := threeSteps(b, "retrying", map[string]saga.StepFunc[order]{
		"charge/forward": func(ctx context.Context, run *saga.StepRun, s *order) error {
			// The command that delivered this attempt is still in the
			// outbox, claimed by this very transaction.
			rows, err := run.Tx.Query(ctx, `SELECT available_at - created_at, available_at <= now()
				FROM `+b.table("outbox")+` WHERE step_key = $1`, run.IdempotencyKey())
			if err != nil {
				return err
			}
			ds, err := pgx.CollectRows(rows, pgx.RowToStructByPos[delivery])
			if err != nil {
				return err
			}
			seen = append(seen, ds...)
			if calls.Add(1) <= 2 {
				return fmt.Errorf("provider unavailable (attempt %d)", run.Attempt)
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)

	st, err := saga.Start(context.Background(), b.engine, def, order{OrderID: "o-2"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{
		"saga_started", "step_completed:reserve", "step_failed:charge", "step_failed:charge",
		"step_completed:charge", "step_completed:ship", "saga_completed",
	}, eventTypes(in))
	f1, f2, ok := in.History[2], in.History[3], in.History[4]
	require.Equal(t, 1, f1.Attempt)
	require.Equal(t, 2, f2.Attempt)
	require.Equal(t, 3, ok.Attempt)
	require.Equal(t, saga.CodeError, f1.ErrorCode)
	require.Contains(t, f1.Error, "provider unavailable (attempt 1)")
	require.JSONEq(t, `50`, jsonField(t, f1.Detail, "retry_in_ms"))
	// The backoff was honoured in database time: the first attempt came at
	// once, each retry's command was due 50ms after it was written, and no
	// attempt ran before its command was due.
	require.Len(t, seen, 3)
	require.Less(t, seen[0].Delay, time.Millisecond)
	for _, d := range seen {
		require.True(t, d.Due)
	}
	for _, d := range seen[1:] {
		require.GreaterOrEqual(t, d.Delay, 50*time.Millisecond)
		require.Less(t, d.Delay, 51*time.Millisecond)
	}
	// The failed attempts' writes were rolled back: one effect per step.
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

func TestPermanentFailureCompensatesInReverse(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "declined", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(steps.WithCode("no_carrier", errors.New("no carrier serves this address")))
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)

	st, err := saga.Start(context.Background(), b.engine, def, order{OrderID: "o-3"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, []string{
		"saga_started", "step_completed:reserve", "step_completed:charge", "step_failed:ship",
		"compensation_started:charge", "compensation_completed:charge", "compensation_completed:reserve",
		"saga_compensated",
	}, eventTypes(in))
	require.Equal(t, 1, in.History[3].Attempt, "a permanent error is not retried")
	require.Equal(t, "no_carrier", in.History[3].ErrorCode)
	// Compensations ran in reverse, once each; the failed step's write was undone.
	require.Equal(t, []string{"reserve/forward", "charge/forward", "charge/compensate", "reserve/compensate"}, b.effects(t, st.ID))
	require.NotNil(t, in.LastError)
	require.Equal(t, saga.ErrorInfo{Code: "no_carrier", Message: in.LastError.Message, Step: "ship"}, *in.LastError)
	require.Contains(t, in.LastError.Message, "no carrier serves this address")
}

func TestCompensationThatGivesUpParksTheSaga(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "stuck-refund", map[string]saga.StepFunc[order]{
		"charge/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("card declined"))
		},
		"reserve/compensate": func(context.Context, *saga.StepRun, *order) error {
			return errors.New("warehouse API down")
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)

	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-4"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, []string{
		"saga_started", "step_completed:reserve", "step_failed:charge", "compensation_started:reserve",
		"step_failed:reserve", "step_failed:reserve", "step_failed:reserve", "saga_failed:reserve",
	}, eventTypes(in))
	require.Equal(t, saga.ErrorInfo{Code: saga.CodeError, Message: "warehouse API down", Step: "reserve"}, *in.LastError)
	require.Equal(t, steps.Compensate, in.Direction)

	// Visible to operators through List.
	res, err := b.engine.List(ctx, &saga.ListOpts{Statuses: []saga.Status{saga.StatusFailed}})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 1)
	require.Equal(t, st.ID, res.Sagas[0].ID)
	require.Equal(t, "warehouse API down", res.Sagas[0].LastError.Message)
}

func TestDuplicateCommandHasOneEffect(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "dup", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()

	// Start before the engine runs, then deliver every command twice more
	// (a relay retry, a rebalance): copies with new message ids.
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-5"}, nil)
	require.NoError(t, err)
	dupSQL := "INSERT INTO " + b.table("outbox") + ` (id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key)
		SELECT gen_random_uuid(), topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key
		FROM ` + b.table("outbox") + " WHERE id = $1"
	var original uuid.UUID
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT id FROM "+b.table("outbox")+" WHERE saga_id = $1", st.ID).Scan(&original))
	for range 2 {
		_, err = b.pool.Exec(ctx, dupSQL, original)
		require.NoError(t, err)
	}
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1", st.ID))

	b.start(t)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	// Duplicates are consumed, not left behind and not parked: a copy
	// claimed while the original held the saga was deferred, and is
	// discarded after the saga ended.
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("outbox")) == 0
	}, "duplicates to be consumed")
	require.GreaterOrEqual(t, b.engine.Stats().StaleDiscarded, int64(2))
}

func TestInboxKeySkipsAnAlreadyCommittedStep(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "inboxed", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-6"}, nil)
	require.NoError(t, err)
	// The first step's key is already in the inbox: its effects committed
	// before (for example by an operator's manual fix). It must not run again.
	key := steps.Key{SagaID: st.ID, Step: "reserve", Direction: steps.Forward, Epoch: 0}.String()
	_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("inbox")+" (consumer, key) VALUES ('sagaflow.engine', $1)", key)
	require.NoError(t, err)

	b.start(t)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"charge/forward", "ship/forward"}, b.effects(t, st.ID))
	require.Equal(t, "step_deduplicated", in.History[1].Type)
	require.Equal(t, int64(1), b.engine.Stats().Deduplicated)
}

func TestCrashBeforeCommitRunsTheStepAgainWithTheSameKey(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	b := setup(t, &saga.Config{BatchSize: 1})
	var mu sync.Mutex
	var keys []string
	def := threeSteps(b, "crashy", map[string]saga.StepFunc[order]{
		"charge/forward": func(_ context.Context, run *saga.StepRun, _ *order) error {
			mu.Lock()
			keys = append(keys, run.IdempotencyKey())
			mu.Unlock()
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	var crashed atomic.Bool
	b.engine.SetBeforeCommit(func(ctx context.Context, tx pgx.Tx) error {
		mu.Lock()
		n := len(keys)
		mu.Unlock()
		if n == 1 && crashed.CompareAndSwap(false, true) {
			// The handler ran and wrote its effect in tx; the worker dies
			// now: its connection goes away with the transaction.
			_ = tx.Conn().PgConn().Conn().Close()
			return errors.New("simulated crash before commit")
		}
		return nil
	})
	b.start(t)

	st, err := saga.Start(context.Background(), b.engine, def, order{OrderID: "o-7"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.True(t, crashed.Load())
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, keys, 2, "the step ran again after the crash")
	require.Equal(t, keys[0], keys[1], "with the same step-scoped key")
	require.Equal(t, st.ID.String()+"/charge/forward/0", keys[0])
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

func TestStaleWorkerCannotCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered := make(chan struct{})
	release := make(chan struct{})
	var first atomic.Bool
	first.Store(true)
	def := threeSteps(b, "fenced", map[string]saga.StepFunc[order]{
		"charge/forward": func(ctx context.Context, run *saga.StepRun, s *order) error {
			// threeSteps has recorded the effect in the step's transaction.
			if first.CompareAndSwap(true, false) {
				close(entered)
				<-release
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-8"}, nil)
	require.NoError(t, err)

	<-entered
	// While the worker runs "charge", another worker takes the saga over
	// (as the rescuer would after a lost lease): the version moves on.
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET version = version + 1, next_check_at = now(), due_at = NULL WHERE id = $1", st.ID)
	require.NoError(t, err)
	close(release)
	// The stale worker's commit is refused.
	waitFor(t, 10*time.Second, func() bool { return b.engine.Stats().StaleDiscarded >= 1 }, "the stale commit to be refused")
	require.Equal(t, []string{"reserve/forward"}, b.effects(t, st.ID), "the stale worker's effect went with its refused commit")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key = $1", st.ID.String()+"/charge/forward/0"))
	// The saga, re-driven, runs charge once more under the same key. The
	// stale worker's transaction may still hold the saga's lock for a
	// moment after the refusal is counted; a rescuer that finds it locked
	// takes it for a running step and moves its deadline a RescueSlack on.
	// Let that deadline pass, as time would, until a rescue re-drives it.
	waitFor(t, 10*time.Second, func() bool {
		_, err := b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET next_check_at = now(), due_at = NULL WHERE id = $1", st.ID)
		require.NoError(t, err)
		res, err := b.engine.RescueNow(ctx)
		require.NoError(t, err)
		return res.Redriven == 1
	}, "the saga to be re-driven")
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key = $1", st.ID.String()+"/charge/forward/0"))
}

func TestStaleWorkerCannotCommitAfterCancel(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered := make(chan struct{})
	def := threeSteps(b, "fenced-cancel", map[string]saga.StepFunc[order]{
		"charge/forward": func(ctx context.Context, run *saga.StepRun, s *order) error {
			if run.Attempt == 1 && run.Direction == steps.Forward {
				close(entered)
				<-ctx.Done() // honours its context
				return ctx.Err()
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-8"}, nil)
	require.NoError(t, err)

	<-entered
	require.NoError(t, b.engine.Cancel(ctx, st.ID, "customer changed their mind"))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	// The interrupted charge's effect (written in its transaction) is gone,
	// and no step_completed for charge was recorded.
	require.Equal(t, []string{"reserve/forward", "reserve/compensate"}, b.effects(t, st.ID))
	require.Equal(t, []string{
		"saga_started", "step_completed:reserve", "cancel_requested:charge", "saga_cancelled:charge", "compensation_started:reserve",
		"compensation_completed:reserve", "saga_compensated",
	}, eventTypes(in))
	require.Equal(t, saga.ErrorInfo{Code: saga.CodeCancelled, Message: "customer changed their mind"}, *in.LastError)
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key = $1", st.ID.String()+"/charge/forward/0"))

	// Cancelling again is refused with a clear error.
	err = b.engine.Cancel(ctx, st.ID, "again")
	require.ErrorIs(t, err, saga.ErrNotRunning)
	require.ErrorContains(t, err, "status is compensated")
	require.ErrorIs(t, b.engine.Cancel(ctx, uuid.New(), "x"), saga.ErrNotFound)
}

func TestStepTimeoutRetriesThenCompensates(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	slow := func(ctx context.Context, run *saga.StepRun, s *order) error {
		<-ctx.Done() // a well-behaved handler gives up when its context does
		return ctx.Err()
	}
	def := saga.Define("timeouts",
		saga.Step[order]{Name: "reserve", Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			return recordEffect(ctx, run, b.schema)
		}, Compensate: func(ctx context.Context, run *saga.StepRun, s *order) error {
			return recordEffect(ctx, run, b.schema)
		}},
		saga.Step[order]{Name: "charge", Action: slow, Timeout: 100 * time.Millisecond,
			Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeTimeout, in.LastError.Code)
	require.Equal(t, "charge", in.LastError.Step)
	require.Contains(t, in.LastError.Message, "timed out after 100ms")
	require.Equal(t, []string{"reserve/forward", "reserve/compensate"}, b.effects(t, st.ID))
}

func TestPanicIsRecoveredWithItsStack(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "panicky", map[string]saga.StepFunc[order]{
		"charge/forward": func(_ context.Context, run *saga.StepRun, _ *order) error {
			if run.Attempt == 1 {
				var m map[string]int
				//lint:ignore SA5000 the runtime panic is what this test provokes
				m["boom"]++
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "the retry after the panic succeeded")
	failed := in.History[2]
	require.Equal(t, saga.EventStepFailed, failed.Type)
	require.Equal(t, saga.CodePanic, failed.ErrorCode)
	require.Contains(t, failed.Error, "assignment to entry in nil map")
	require.Contains(t, jsonField(t, failed.Detail, "stack"), "engine_test.go")
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

// A handler that ignores its context past its Timeout and HandlerGrace is
// abandoned: its connection is closed, the attempt recorded as failed
// (handler_overran) and retried. Until the attempt is recorded, the
// engine's other workers leave the saga's command alone, though the closed
// transaction no longer holds it: the timeline shows the abandoned attempt
// before the retry, and the handler ran twice. slow delays the record (a
// test hook), which gives the other workers every chance to take the
// command first.
func TestHandlerIgnoringItsContextIsAbandoned(t *testing.T) {
	t.Parallel()
	for _, slow := range []bool{false, true} {
		t.Run(fmt.Sprint("slow record ", slow), func(t *testing.T) {
			t.Parallel()
			handlerIgnoringItsContext(t, slow)
		})
	}
}

func handlerIgnoringItsContext(t *testing.T, slow bool) {
	allowErrorLogs(t)
	b := setup(t, &saga.Config{HandlerGrace: 200 * time.Millisecond, BatchSize: 1})
	if slow {
		b.engine.SetBeforeRecordAbandoned(func(uuid.UUID) { time.Sleep(time.Second) })
	}
	var calls atomic.Int32
	abandonedWrite := make(chan error, 1)
	def := saga.Define("stubborn", saga.Step[order]{
		Name: "hang", Timeout: 100 * time.Millisecond, Retry: fastRetry,
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if calls.Add(1) == 1 {
				time.Sleep(time.Second) // ignores ctx on purpose
				// Its transaction is gone by now: this write must fail.
				abandonedWrite <- recordEffect(context.Background(), run, b.schema)
				return nil
			}
			return recordEffect(ctx, run, b.schema)
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, int64(1), b.engine.Stats().HandlersAbandoned)
	require.Equal(t, []string{"hang/forward"}, b.effects(t, st.ID))
	require.Equal(t, int32(2), calls.Load(), "the abandoned call and the retry")
	require.Equal(t, []string{"saga_started", "step_failed:hang", "step_completed:hang", "saga_completed"}, eventTypes(in))
	failed := in.History[1]
	require.Equal(t, saga.CodeAbandonedRunOn, failed.ErrorCode)
	require.Equal(t, 1, failed.Attempt)
	require.Contains(t, failed.Error, "ignored its context")
	require.Equal(t, 2, in.History[2].Attempt, "the retry is attempt 2")
	require.Error(t, <-abandonedWrite, "the abandoned handler's transaction must be unusable")
}

func TestStartTxJoinsTheCallersTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "atomic-start", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, "CREATE TABLE "+b.table("orders")+" (id text PRIMARY KEY)")
	require.NoError(t, err)

	// Rolled back: neither the order nor the saga nor its command exist.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "INSERT INTO "+b.table("orders")+" VALUES ('o-9')")
	require.NoError(t, err)
	st, err := saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "o-9"}, &saga.StartOpts{BusinessKey: "o-9"})
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("orders")))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("saga_history")))
	_, err = b.engine.Get(ctx, st.ID)
	require.ErrorIs(t, err, saga.ErrNotFound)

	// Committed: both exist; a second start with the key returns the first.
	err = pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+b.table("orders")+" VALUES ('o-9')"); err != nil {
			return err
		}
		st, err = saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "o-9"}, &saga.StartOpts{BusinessKey: "o-9"})
		return err
	})
	require.NoError(t, err)
	require.False(t, st.Existing)
	again, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-9"}, &saga.StartOpts{BusinessKey: "o-9"})
	require.NoError(t, err)
	require.True(t, again.Existing)
	require.Equal(t, st.ID, again.ID)
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))

	// The same key on another saga type is a different saga.
	other := threeSteps(b, "other", nil)
	require.NoError(t, b.engine.Register(other))
	st2, err := saga.Start(ctx, b.engine, other, order{}, &saga.StartOpts{BusinessKey: "o-9"})
	require.NoError(t, err)
	require.False(t, st2.Existing)

	// Concurrent starts with one key: exactly one saga.
	var wg sync.WaitGroup
	ids := make([]uuid.UUID, 8)
	for i := range ids {
		wg.Go(func() {
			r, err := saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{BusinessKey: "race"})
			require.NoError(t, err)
			ids[i] = r.ID
		})
	}
	wg.Wait()
	for _, id := range ids {
		require.Equal(t, ids[0], id)
	}
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE business_key = 'race'"))
}

func TestStartRejectsUnregisteredAndOversizedState(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{MaxStateBytes: 1024})
	def := threeSteps(b, "sized", nil)
	ctx := context.Background()
	_, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.ErrorIs(t, err, saga.ErrNotRegistered)
	require.ErrorContains(t, err, `"sized"`)

	require.NoError(t, b.engine.Register(def))
	big := order{OrderID: string(make([]byte, 2000))}
	_, err = saga.Start(ctx, b.engine, def, big, nil)
	require.ErrorIs(t, err, saga.ErrPayloadTooLarge)
	require.ErrorContains(t, err, "MaxStateBytes (1024)")
	_, err = saga.Start(ctx, b.engine, def, order{OrderID: "nul\x00byte"}, nil)
	require.ErrorContains(t, err, "NUL")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
}

func jsonField(t *testing.T, raw []byte, field string) string {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(raw, &m))
	v, ok := m[field]
	require.True(t, ok, "field %q in %s", field, raw)
	if s, ok := v.(string); ok {
		return s
	}
	out, err := json.Marshal(v)
	require.NoError(t, err)
	return string(out)
}
