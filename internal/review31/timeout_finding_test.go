package review31_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

// plainPool is a pool of at most n connections with pgx's defaults (no
// test tracer) on the server of the migrated schema.
func plainPool(t *testing.T, n int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = n
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestAStepTimingOutInAStatementFailsItsAttempt (F1): "An attempt that
// runs past its Timeout fails with code step_timeout and is retried like
// any other failure"; "MaxAttempts counts every attempt, the first
// included; 1 means never retry"; handlers "must honour ctx" (the package
// example passes ctx to run.Tx.Exec). A step (and a branch) whose handler
// runs a statement on run.Tx with ctx that outlasts the Timeout (300 ms
// against pg_sleep(2)), MaxAttempts 1: the saga should be compensated,
// with step_timeout, after one run of the handler.
func TestAStepTimingOutInAStatementFailsItsAttempt(t *testing.T) {
	t.Parallel()
	_, schema := db(t)
	pool := plainPool(t, 6)
	lg := &logs{}
	var stepCalls, branchCalls atomic.Int32
	slow := func(calls *atomic.Int32) func(ctx context.Context, run *saga.StepRun) error {
		return func(ctx context.Context, run *saga.StepRun) error {
			calls.Add(1)
			_, err := run.Tx.Exec(ctx, `select pg_sleep(2)`)
			return err
		}
	}
	stepDef := saga.Define("r31-slow-step",
		saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "slow", Timeout: 300 * time.Millisecond, Retry: &saga.RetryPolicy{MaxAttempts: 1},
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return slow(&stepCalls)(ctx, run) }})
	branchDef := saga.Define("r31-slow-branch",
		saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "p", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{
			{Name: "slow", Timeout: 300 * time.Millisecond, Retry: &saga.RetryPolicy{MaxAttempts: 1},
				Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
					return nil, slow(&branchCalls)(ctx, run)
				}},
		}}})
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), stepDef, branchDef)
	ctx := context.Background()
	s1, err := saga.Start(ctx, e, stepDef, order{ID: "s"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := saga.Start(ctx, e, branchDef, order{ID: "b"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(12 * time.Second)
	for time.Now().Before(deadline) && !(get(t, e, s1.ID).Status.Terminal() && get(t, e, s2.ID).Status.Terminal()) {
		time.Sleep(100 * time.Millisecond)
	}
	for _, c := range []struct {
		name  string
		in    *saga.Instance
		calls int32
	}{{"step", get(t, e, s1.ID), stepCalls.Load()}, {"branch", get(t, e, s2.ID), branchCalls.Load()}} {
		if c.in.Status != saga.StatusCompensated || c.calls != 1 {
			t.Errorf("%s: after 12 s the saga is %s and the handler ran %d times (MaxAttempts 1):\n%s", c.name, c.in.Status, c.calls, timeline(c.in))
		}
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("%d errors logged, the first: %q", len(errs), errs[0])
	}
}

// TestATinyTimeoutRunsTheHandlerOncePerAttempt (F1, the same cause at
// 1 ns to 100 µs): with a statement on run.Tx as the handler's work, each
// run of the handler is a recorded attempt, and no batch fails.
func TestATinyTimeoutRunsTheHandlerOncePerAttempt(t *testing.T) {
	t.Parallel()
	_, schema := db(t)
	pool := plainPool(t, 6)
	lg := &logs{}
	var calls atomic.Int32
	def := saga.Define("r31-tiny-stmt",
		saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "t", Timeout: 50 * time.Microsecond, Retry: &saga.RetryPolicy{MaxAttempts: 1}, Action: txStep(&calls)})
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), def)
	extra := 0
	for i := range 15 {
		calls.Store(0)
		st, err := saga.Start(context.Background(), e, def, order{ID: "t"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		in := waitEnded(t, e, st.ID, 15*time.Second)
		attempts := events(in, saga.EventStepFailed, "t") + events(in, saga.EventStepCompleted, "t")
		if int(calls.Load()) != attempts {
			extra++
			t.Logf("saga %d: ended %s, the handler ran %d times for %d recorded attempt(s) (MaxAttempts 1)", i, in.Status, calls.Load(), attempts)
		}
	}
	if extra > 0 {
		t.Errorf("%d of 15 sagas ran their step more often than they recorded attempts; errors logged: %d, e.g. %q", extra, len(lg.errors()), lg.errors()[:min(1, len(lg.errors()))])
	}
}
