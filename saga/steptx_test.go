package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// TestTimedOutStepThatUsesItsTxFailsAlone: a step overruns its timeout (but
// not HandlerGrace) and then uses its transaction with its own, expired,
// context — to log the failure, say — and returns the error. The statement
// fails on its own, the step fails with step_timeout, is retried, then
// compensated, and the other saga in the batch commits. (The transaction a
// step sees sends the batch's queued writes before the step's statement; it
// sent them with the step's expired context once, which lost the whole
// batch, every time.)
func TestTimedOutStepThatUsesItsTxFailsAlone(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	b := setup(t, &saga.Config{Workers: 1})
	def := saga.Define("slowtx", saga.Step[order]{Name: "one", Timeout: 200 * time.Millisecond,
		Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 50 * time.Millisecond }},
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if s.OrderID == "slow" {
				time.Sleep(300 * time.Millisecond) // overruns Timeout, well within HandlerGrace
				_, err := run.Tx.Exec(ctx, "SELECT 1")
				return err
			}
			return recordEffect(ctx, run, b.schema)
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	fast, err := saga.Start(ctx, b.engine, def, order{OrderID: "fast"}, nil)
	require.NoError(t, err)
	slow, err := saga.Start(ctx, b.engine, def, order{OrderID: "slow"}, nil)
	require.NoError(t, err)
	b.start(t)

	// Both end within 15 s: a healthy saga is not held hostage by the batch
	// it shares.
	deadline := time.Now().Add(15 * time.Second)
	f := sagatest.WaitEnded(t, b.engine, fast.ID, &sagatest.WaitOpts{Timeout: time.Until(deadline)})
	s := sagatest.WaitEnded(t, b.engine, slow.ID, &sagatest.WaitOpts{Timeout: max(time.Until(deadline), time.Millisecond)})
	require.Equal(t, saga.StatusCompleted, f.Status)
	require.Equal(t, saga.StatusCompensated, s.Status)
	require.Equal(t, saga.CodeTimeout, s.History[1].ErrorCode)
}

// TestKafkaTimedOutStepThatUsesItsTxDoesNotStallThePartition: the same step
// in Kafka mode, where a lost batch would run the message again forever and
// its partition (one here) would never reach the next saga's command. The
// step fails with step_timeout, is retried, and compensates; the other saga
// completes.
func TestKafkaTimedOutStepThatUsesItsTxDoesNotStallThePartition(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	k := setupKafka(t, 1, "kslowtx")
	def := saga.Define("kslowtx", saga.Step[order]{Name: "one", Timeout: 200 * time.Millisecond,
		Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 50 * time.Millisecond }},
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if s.OrderID == "slow" {
				time.Sleep(300 * time.Millisecond)
				_, err := run.Tx.Exec(ctx, "SELECT 1")
				return err
			}
			return recordEffect(ctx, run, k.schema)
		},
	})
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()
	slow, err := saga.Start(ctx, k.engine, def, order{OrderID: "slow"}, nil)
	require.NoError(t, err)
	fast, err := saga.Start(ctx, k.engine, def, order{OrderID: "fast"}, nil)
	require.NoError(t, err)
	k.start(t)

	deadline := time.Now().Add(20 * time.Second)
	f := sagatest.WaitEnded(t, k.engine, fast.ID, &sagatest.WaitOpts{Timeout: time.Until(deadline)})
	s := sagatest.WaitEnded(t, k.engine, slow.ID, &sagatest.WaitOpts{Timeout: max(time.Until(deadline), time.Millisecond)})
	require.Equal(t, saga.StatusCompleted, f.Status)
	require.Equal(t, saga.StatusCompensated, s.Status)
}

// TestStepFailingWithADatabaseError: the commonest failure — a step's
// statement fails (the transaction is aborted) and the step returns that
// error. The engine rolls back to the step's savepoint and records the
// failure. The rollback goes on its own: in one pipeline with the failure's
// writes, pgx would first prepare their statements, which PostgreSQL refuses
// in an aborted transaction, and the batch was lost on every retry.
func TestStepFailingWithADatabaseError(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	b := setup(t, &saga.Config{Workers: 1})
	def := saga.Define("dberr", saga.Step[order]{Name: "one",
		Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 50 * time.Millisecond }},
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if s.OrderID == "bad" {
				_, err := run.Tx.Exec(ctx, "SELECT 1/0")
				return err
			}
			return recordEffect(ctx, run, b.schema)
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	good, err := saga.Start(ctx, b.engine, def, order{OrderID: "good"}, nil)
	require.NoError(t, err)
	bad, err := saga.Start(ctx, b.engine, def, order{OrderID: "bad"}, nil)
	require.NoError(t, err)
	b.start(t)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, good.ID).Status)
	in := b.waitTerminal(t, bad.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "%v", eventTypes(in))
}
