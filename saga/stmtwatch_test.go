package saga_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// A step's Timeout that ends while its statement on run.Tx runs (with the
// step's ctx, as handlers should) cancels that statement, not the batch:
// the attempt fails with step_timeout, its writes are undone with its
// savepoint, it is retried up to MaxAttempts and the saga is compensated.
// pgx closed the batch's connection when the ctx ended mid-statement: the
// attempt was never recorded, the step ran again batch after batch, for
// ever, and every saga of its batch went back with it (review31 F1). The
// engine's logger fails the test on a failed batch. A nested savepoint
// (run.Tx.Begin), a query's rows and a pgx batch are cut the same way.
func TestAStepTimingOutInAStatementIsAnAttempt(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"exec", "nested", "query", "batch"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
			var calls atomic.Int32
			sleep := func(ctx context.Context, tx pgx.Tx) error {
				q := "SELECT pg_sleep(30) /* sleeper " + b.schema + " */"
				switch how {
				case "nested":
					sp, err := tx.Begin(ctx)
					if err != nil {
						return err
					}
					if _, err := sp.Exec(ctx, q); err != nil {
						return err
					}
					return sp.Commit(ctx)
				case "query":
					rows, err := tx.Query(ctx, "SELECT g, pg_sleep(CASE WHEN g = 2 THEN 30 ELSE 0 END) FROM generate_series(1, 3) g /* sleeper "+b.schema+" */")
					if err != nil {
						return err
					}
					defer rows.Close()
					for rows.Next() {
					}
					return rows.Err()
				case "batch":
					bt := &pgx.Batch{}
					bt.Queue("SELECT 1")
					bt.Queue(q)
					return tx.SendBatch(ctx, bt).Close()
				}
				_, err := tx.Exec(ctx, q)
				return err
			}
			rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
			def := saga.Define("stmt-timeout",
				saga.Step[order]{Name: "first", Action: rec, Compensate: rec},
				saga.Step[order]{Name: "slow", Timeout: 300 * time.Millisecond,
					Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
					Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
						calls.Add(1)
						if err := rec(ctx, run, o); err != nil {
							return err
						}
						return sleep(ctx, run.Tx)
					}},
			)
			other := saga.Define("stmt-other", saga.Step[order]{Name: "only", Action: rec})
			require.NoError(t, b.engine.Register(def, other))
			b.start(t)
			ctx := context.Background()
			st, err := saga.Start(ctx, b.engine, def, order{}, nil)
			require.NoError(t, err)
			st2, err := saga.Start(ctx, b.engine, other, order{}, nil)
			require.NoError(t, err)

			in := b.waitTerminalWithin(t, st.ID, 30*time.Second)
			require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
			require.Equal(t, saga.CodeTimeout, in.LastError.Code, "%+v", in.LastError)
			require.EqualValues(t, 2, calls.Load(), "MaxAttempts 2: two attempts, each recorded")
			require.Equal(t, []string{"first/forward", "first/compensate"}, b.effects(t, st.ID), "the timed-out attempts' writes are undone")
			require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st2.ID).Status)
			require.Zero(t, b.engine.Stats().HandlersAbandoned, "the statement was cut, the handler not abandoned")
			// No statement of the test was left running on the server.
			require.Zero(t, b.count(t, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%sleeper ' || $1 || '%' AND state = 'active' AND pid <> pg_backend_pid()", b.schema))
		})
	}
}

// A cancel request while a step's statement runs cuts the statement: the
// request is applied at once, the step's writes are undone, the saga is
// compensated, and the batch's connection goes on.
func TestACancelDuringAStepsStatementCutsIt(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
	entered := make(chan struct{})
	var stmtErr atomic.Value
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	def := saga.Define("stmt-cancel",
		saga.Step[order]{Name: "first", Action: rec, Compensate: rec},
		saga.Step[order]{Name: "slow", Timeout: time.Minute, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			if err := rec(ctx, run, o); err != nil {
				return err
			}
			close(entered)
			_, err := run.Tx.Exec(ctx, "SELECT pg_sleep(60)")
			stmtErr.Store(err)
			return err
		}},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered
	require.NoError(t, b.engine.Cancel(ctx, st.ID, "operator"))
	in := b.waitTerminalWithin(t, st.ID, 20*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, saga.ErrorInfo{Code: saga.CodeCancelled, Message: "operator"}, *in.LastError)
	require.Equal(t, []string{"first/forward", "first/compensate"}, b.effects(t, st.ID))
	var pgErr *pgconn.PgError
	err, _ = stmtErr.Load().(error)
	require.True(t, errors.As(err, &pgErr), "the statement was cancelled on the server: %v", err)
	require.Equal(t, "57014", pgErr.Code)
	require.Zero(t, b.engine.Stats().HandlersAbandoned)
}

// A statement begun after the step's context ended is not sent: it fails
// with the context's error, as pgx's own would.
func TestAStatementAfterTheStepsTimeoutIsNotSent(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
	var late atomic.Value
	def := saga.Define("stmt-late",
		saga.Step[order]{Name: "late", Timeout: 100 * time.Millisecond, Retry: &saga.RetryPolicy{MaxAttempts: 1},
			Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
				<-ctx.Done()
				err := recordEffect(ctx, run, b.schema)
				late.Store(err)
				return err
			}},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	err, _ = late.Load().(error)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Empty(t, b.effects(t, st.ID))
}
