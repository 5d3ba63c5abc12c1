package review29_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// transfer writes one ledger row per step, with run.Tx, or with the pool
// for the step named leaky (the negative control the doc describes).
func transfer(pool *pgxpool.Pool, schema string, leaky string) *saga.Definition[order] {
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	write := func(step string) saga.StepFunc[order] {
		return func(ctx context.Context, run *saga.StepRun, o *order) error {
			q := "INSERT INTO " + ledger + " (saga_id, step) VALUES ($1, $2)"
			if step == leaky {
				_, err := pool.Exec(ctx, q, run.SagaID, step)
				return err
			}
			_, err := run.Tx.Exec(ctx, q, run.SagaID, step)
			return err
		}
	}
	return saga.Define("r29_transfer",
		saga.Step[order]{Name: "debit", Action: write("debit")},
		saga.Step[order]{Name: "credit", Action: write("credit")},
	)
}

func ledger(t *testing.T, pool *pgxpool.Pool, schema string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+pgx.Identifier{schema, "ledger"}.Sanitize()+
		" (saga_id uuid, step text)"); err != nil {
		t.Fatal(err)
	}
}

func crashOpts(pool *pgxpool.Pool, schema string, d *saga.Definition[order]) *sagatest.CrashOpts {
	l := pgx.Identifier{schema, "ledger"}.Sanitize()
	return &sagatest.CrashOpts{
		Config: &saga.Config{Schema: schema, Workers: 2},
		Sagas:  4,
		Start: func(ctx context.Context, e *saga.Engine, b sagatest.Round, i int) (uuid.UUID, error) {
			st, err := saga.Start(ctx, e, d, order{ID: fmt.Sprintf("%s-%d", b, i)}, nil)
			return st.ID, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			var debit, credit int
			err := pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE step = 'debit'), count(*) FILTER (WHERE step = 'credit') FROM "+
				l+" WHERE saga_id = $1", in.ID).Scan(&debit, &credit)
			return map[sagatest.Effect]int{{Step: "debit"}: debit, {Step: "credit"}: credit}, err
		},
		Timeout: 30 * time.Second,
	}
}

// Positive control: a saga that writes with run.Tx passes every boundary.
func TestCrashMatrixPassesACorrectSaga(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ledger(t, pool, schema)
	d := transfer(pool, schema, "")
	opts := crashOpts(pool, schema, d)
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler, sagatest.AfterCommit}
	// Two crossings each, named: the defaults' late crossing depends on how
	// many batches the round without a crash made, and so would the count
	// of rounds below. A round starts its 4 sagas whether or not it reaches
	// its crossing.
	opts.Crossings = []int{1, 2}
	sagatest.CrashMatrix(t, pool, d, opts)
	// Every saga the matrix started ended, with each effect exactly once.
	var sagas, rows int
	if err := pool.QueryRow(context.Background(), "SELECT (SELECT count(*) FROM "+pgx.Identifier{schema, "saga_instances"}.Sanitize()+
		" WHERE status = 'completed'), (SELECT count(*) FROM "+pgx.Identifier{schema, "ledger"}.Sanitize()+")").Scan(&sagas, &rows); err != nil {
		t.Fatal(err)
	}
	// 4 sagas in each of 5 rounds: the round without a crash, and two per
	// boundary.
	if sagas != 20 || rows != 40 {
		t.Fatalf("%d sagas completed with %d ledger rows, want 20 and 40", sagas, rows)
	}
}

// Negative control: a write with the pool shows up as doubled.
func TestCrashMatrixCatchesAWriteOutsideTheTx(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ledger(t, pool, schema)
	d := transfer(pool, schema, "debit")
	opts := crashOpts(pool, schema, d)
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler}
	expectFail(t, 60*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) },
		"step debit", string(sagatest.AfterHandler))
}

// An Effects that says a completed step wrote nothing: lost.
func TestCrashMatrixCatchesALostEffect(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ledger(t, pool, schema)
	d := transfer(pool, schema, "")
	opts := crashOpts(pool, schema, d)
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterCommit}
	count := opts.Effects
	opts.Effects = func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
		m, err := count(ctx, in)
		m[sagatest.Effect{Step: "credit"}] = 0
		m[sagatest.Effect{Step: "credit", Compensation: true}] = 1 // never compensated
		return m, err
	}
	expectFail(t, 60*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) },
		"step credit", "compensation of credit")
}

// F3, fixed: with the defaults (8 sagas), a pool write in the second step
// passed, since the one round per boundary crashed its middle crossing,
// among the first steps. The defaults now add a round three quarters of
// the way through the crossings, among the later steps, and catch it.
func TestCrashMatrixDefaultsCatchALeakInTheSecondStep(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ledger(t, pool, schema)
	d := transfer(pool, schema, "credit")
	opts := crashOpts(pool, schema, d)
	opts.Sagas = sagatest.CrashSagasDefault
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler}
	expectFail(t, 90*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) },
		"step credit", string(sagatest.AfterHandler))
}

// The package doc: "an effect written outside run.Tx (with the pool, say)
// shows up as doubled". With one saga, crossing 2 of after-handler is its
// credit step, and the leak is caught.
func TestCrashMatrixCatchesALeakInTheSecondStepAtItsCrossing(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ledger(t, pool, schema)
	d := transfer(pool, schema, "credit")
	opts := crashOpts(pool, schema, d)
	opts.Sagas, opts.Crossings = 1, []int{2}
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler}
	expectFail(t, 60*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) },
		"step credit", string(sagatest.AfterHandler))
}

// picky refuses to run its charge step twice in one process: it is not
// crash-safe at charge, and ends compensated when charge is re-run.
func picky() *saga.Definition[order] {
	var mu sync.Mutex
	seen := map[uuid.UUID]bool{}
	return saga.Define("r29_picky",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Action: func(_ context.Context, run *saga.StepRun, _ *order) error {
			mu.Lock()
			defer mu.Unlock()
			if seen[run.SagaID] {
				return steps.Permanent(errors.New("ran twice"))
			}
			seen[run.SagaID] = true
			return nil
		}},
	)
}

func noEffects(context.Context, *saga.Instance) (map[sagatest.Effect]int, error) { return nil, nil }

// A saga that ends otherwise after a crash must fail the matrix: "each saga
// ends as it does without a crash". Crossing 2 of one saga is its charge.
func TestCrashMatrixCatchesADifferentEnd(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := picky()
	opts := crashOpts(pool, schema, d)
	opts.Sagas, opts.Crossings = 1, []int{2}
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler}
	opts.Effects = noEffects
	expectFail(t, 60*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) },
		"compensated", "completed")
}

// Misuse: no options, no Start, a Start that fails, an Effects that fails.
func TestCrashMatrixMisuse(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ledger(t, pool, schema)
	d := transfer(pool, schema, "")
	t.Run("nil opts", func(t *testing.T) {
		expectFail(t, 10*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, nil) }, "Start")
	})
	t.Run("no Effects", func(t *testing.T) {
		opts := crashOpts(pool, schema, d)
		opts.Effects = nil
		expectFail(t, 10*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) }, "Effects")
	})
	t.Run("failing Start", func(t *testing.T) {
		opts := crashOpts(pool, schema, d)
		opts.Start = func(context.Context, *saga.Engine, sagatest.Round, int) (uuid.UUID, error) {
			return uuid.Nil, errors.New("no start today")
		}
		expectFail(t, 30*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) }, "no start today")
	})
	t.Run("failing Effects", func(t *testing.T) {
		opts := crashOpts(pool, schema, d)
		opts.Boundaries = []sagatest.Boundary{sagatest.AfterCommit}
		opts.Effects = func(context.Context, *saga.Instance) (map[sagatest.Effect]int, error) {
			return nil, errors.New("cannot count")
		}
		expectFail(t, 60*time.Second, func(tb testing.TB) { sagatest.CrashMatrix(tb, pool, d, opts) }, "cannot count")
	})
	t.Run("unknown boundary", func(t *testing.T) {
		opts := crashOpts(pool, schema, d)
		opts.Boundaries = []sagatest.Boundary{"engine.after-lunch"}
		f := newFake(t)
		_, p := run(t, f, func() { sagatest.CrashMatrix(f, pool, d, opts) })
		t.Logf("unknown boundary: panic=%v msg=%q", p, f.messages())
		if p == nil && !f.Failed() {
			t.Fatal("a matrix with an unknown boundary passed without crashing anything")
		}
	})
}
