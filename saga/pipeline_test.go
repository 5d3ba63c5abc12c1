package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// A batch sends its commands' outcomes together, after the handlers ran. These
// tests put two sagas in one batch (one worker, both commands due before it
// starts) and make the first one's outcome fail when it is sent, to show that
// it is undone alone: the second saga's step, queued behind it, still commits.

// TestRefusedOutcomeInABatchLeavesTheNextOne: saga A's step runs and writes
// its effect; while saga B's step runs, A is cancelled, so A's outcome no
// longer matches A's version. A's effect and outcome are rolled back; B's
// step commits. B either leaves the transaction alone (its outcome is sent
// with A's at the end of the batch) or uses it (A's outcome is sent before B's
// first statement). In the third variant A's step takes 150 ms, so the
// batch reads B's cancel request and pauses again before B's step (see
// batch.rereadOperators): that read must not send A's outcome ahead of B's
// step, whose handler would then wait for A's row, locked by its own batch.
func TestRefusedOutcomeInABatchLeavesTheNextOne(t *testing.T) {
	t.Parallel()
	for _, v := range []struct {
		name           string
		bUsesTx, slowA bool
	}{{"b-leaves-the-transaction-alone", false, false}, {"b-uses-the-transaction", true, false}, {"b-uses-the-transaction-after-a-slow-a", true, true}} {
		bUsesTx := v.bUsesTx
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, &saga.Config{Workers: 1})
			var aID uuid.UUID
			def := saga.Define("refused", saga.Step[order]{Name: "one",
				Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
					switch s.OrderID {
					case "a":
						if v.slowA {
							time.Sleep(150 * time.Millisecond)
						}
						return recordEffect(ctx, run, b.schema)
					case "b":
						// Another process ends A while A's outcome waits in
						// this batch's queue.
						if _, err := b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+
							" SET version = version + 1, status = 'compensated', next_check_at = NULL, ended_at = now() WHERE id = $1", aID); err != nil {
							return err
						}
						if bUsesTx {
							return recordEffect(ctx, run, b.schema)
						}
					}
					return nil
				},
			})
			require.NoError(t, b.engine.Register(def))
			ctx := context.Background()
			a, err := saga.Start(ctx, b.engine, def, order{OrderID: "a"}, nil)
			require.NoError(t, err)
			aID = a.ID
			bs, err := saga.Start(ctx, b.engine, def, order{OrderID: "b"}, nil)
			require.NoError(t, err)
			b.start(t)

			inB := b.waitTerminal(t, bs.ID)
			require.Equal(t, saga.StatusCompleted, inB.Status)
			require.Equal(t, []string{"saga_started", "step_completed:one", "saga_completed"}, eventTypes(inB))
			inA := b.waitTerminal(t, a.ID)
			require.Equal(t, saga.StatusCompensated, inA.Status)
			require.Equal(t, []string{"saga_started"}, eventTypes(inA), "A's outcome was refused")

			require.Empty(t, b.effects(t, a.ID), "A's effect went with its refused outcome")
			if bUsesTx {
				require.Equal(t, []string{"one/forward"}, b.effects(t, bs.ID))
			} else {
				require.Empty(t, b.effects(t, bs.ID))
			}
			require.Equal(t, int64(1), b.engine.Stats().StaleDiscarded)
			require.Equal(t, int64(1), b.engine.Stats().StepsSucceeded)
			inbox := "SELECT count(*) FROM " + b.table("inbox") + " WHERE key = $1"
			require.Equal(t, 0, b.count(t, inbox, a.ID.String()+"/one/forward/0"))
			require.Equal(t, 1, b.count(t, inbox, bs.ID.String()+"/one/forward/0"))
			require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
		})
	}
}

// TestAbortedOutcomeInABatchLeavesTheNextOne: saga A's step leaves the
// transaction aborted and returns no error; saga B's step, in the same batch,
// succeeds. A's outcome cannot be written: its step is undone and recorded as
// failed (tx_aborted), and retried; B's step commits with the batch.
//
// In the "slow" variant A's step takes 150 ms after leaving the transaction
// aborted, so the batch reads B's cancel request and pauses again (see
// batch.rereadOperators) in a transaction that A left aborted.
func TestAbortedOutcomeInABatchLeavesTheNextOne(t *testing.T) {
	t.Parallel()
	for _, slow := range []bool{false, true} {
		t.Run(map[bool]string{false: "quick", true: "slow"}[slow], func(t *testing.T) {
			t.Parallel()
			abortedOutcomeLeavesTheNextOne(t, slow)
		})
	}
}

func abortedOutcomeLeavesTheNextOne(t *testing.T, slow bool) {
	b := setup(t, &saga.Config{Workers: 1})
	def := saga.Define("aborted", saga.Step[order]{Name: "one", Retry: fastRetry,
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if s.OrderID == "a" && run.Attempt == 1 {
				if err := recordEffect(ctx, run, b.schema); err != nil {
					return err
				}
				_, _ = run.Tx.Exec(ctx, "SELECT 1/0") // the error is swallowed
				if slow {
					time.Sleep(150 * time.Millisecond)
				}
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	a, err := saga.Start(ctx, b.engine, def, order{OrderID: "a"}, nil)
	require.NoError(t, err)
	bs, err := saga.Start(ctx, b.engine, def, order{OrderID: "b"}, nil)
	require.NoError(t, err)
	b.start(t)

	inB := b.waitTerminal(t, bs.ID)
	require.Equal(t, saga.StatusCompleted, inB.Status)
	require.Equal(t, []string{"saga_started", "step_completed:one", "saga_completed"}, eventTypes(inB))
	inA := b.waitTerminal(t, a.ID)
	require.Equal(t, saga.StatusCompleted, inA.Status)
	require.Equal(t, []string{"saga_started", "step_failed:one", "step_completed:one", "saga_completed"}, eventTypes(inA))
	require.Equal(t, saga.CodeTxAborted, inA.History[1].ErrorCode)
	require.Empty(t, b.effects(t, a.ID), "the aborted attempt's effect was rolled back")
	require.Equal(t, int64(1), b.engine.Stats().AttemptsFailed)
	require.Equal(t, int64(1), b.engine.Stats().Retries)
}

// Issue #11, point 8: a step whose first statement has to wait for the
// writes of an earlier step in its batch, which wait on a row lock held
// elsewhere, is not charged for that wait: it is not abandoned, it is not
// failed, and no attempt is spent.
func TestStepIsNotChargedForEarlierWritesWaitingOnALock(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 1, BatchSize: 2, HandlerGrace: 300 * time.Millisecond})
	def := saga.Define("honest", saga.Step[order]{Name: "one", Timeout: 500 * time.Millisecond,
		Retry: &saga.RetryPolicy{MaxAttempts: 1},
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if s.OrderID == "b" {
				// The batch's queued outcome of saga a is sent first.
				_, err := run.Tx.Exec(ctx, "SELECT 1")
				return err
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	a, err := saga.Start(ctx, b.engine, def, order{OrderID: "a"}, nil)
	require.NoError(t, err)
	bs, err := saga.Start(ctx, b.engine, def, order{OrderID: "b"}, nil)
	require.NoError(t, err)

	// Someone else holds saga a's row for longer than b's timeout and grace
	// together.
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, "SELECT 1 FROM "+b.table("saga_instances")+" WHERE id = $1 FOR UPDATE", a.ID)
	require.NoError(t, err)
	b.start(t)
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%UPDATE %saga_instances%'") > 0
	}, "the batch's write to wait on the lock")
	time.Sleep(1500 * time.Millisecond) // hold it well past b's timeout + grace: the point of the test
	require.NoError(t, holder.Rollback(ctx))

	for _, id := range []uuid.UUID{a.ID, bs.ID} {
		in := b.waitTerminal(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, "saga %s", id)
		require.Equal(t, []string{"saga_started", "step_completed:one", "saga_completed"}, eventTypes(in))
		require.Equal(t, 1, in.History[1].Attempt)
	}
	require.Zero(t, b.engine.Stats().HandlersAbandoned)
	require.Zero(t, b.engine.Stats().AttemptsFailed)
}
