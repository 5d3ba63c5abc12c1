package sagatest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// transfer is the state of the ledger saga: hold, debit, credit; credit
// fails for good when Refuse is set, and the saga compensates.
type transfer struct {
	Refuse bool `json:"refuse"`
}

// ledger writes one row into the schema's effects table per step and per
// compensation it runs. With outside set, it writes with the pool rather
// than with run.Tx: a row is committed whether or not its step is.
func ledger(b *bundle, outside bool) *saga.Definition[transfer] {
	effects := b.table("effects")
	write := func(step string, comp bool) saga.StepFunc[transfer] {
		return func(ctx context.Context, run *saga.StepRun, _ *transfer) error {
			q := "INSERT INTO " + effects + " (saga_id, step, compensation) VALUES ($1, $2, $3)"
			if outside {
				_, err := b.pool.Exec(ctx, q, run.SagaID, step, comp)
				return err
			}
			_, err := run.Tx.Exec(ctx, q, run.SagaID, step, comp)
			return err
		}
	}
	return saga.Define("ledger",
		saga.Step[transfer]{Name: "hold", Action: write("hold", false), Compensate: write("hold", true)},
		saga.Step[transfer]{Name: "debit", Action: write("debit", false), Compensate: write("debit", true)},
		saga.Step[transfer]{Name: "credit", Action: func(ctx context.Context, run *saga.StepRun, s *transfer) error {
			if s.Refuse {
				return steps.Permanent(steps.WithCode("refused", errors.New("the payee refused the transfer")))
			}
			return write("credit", false)(ctx, run, s)
		}},
	)
}

// ledgerOpts starts sagas on the ledger (every third one refused) and counts
// their rows in the effects table.
func ledgerOpts(t *testing.T, b *bundle, def *saga.Definition[transfer], boundaries ...sagatest.Boundary) *sagatest.CrashOpts {
	_, err := b.pool.Exec(context.Background(), "CREATE TABLE "+b.table("effects")+" (saga_id uuid NOT NULL, step text NOT NULL, compensation boolean NOT NULL)")
	require.NoError(t, err)
	return &sagatest.CrashOpts{
		Config:     &saga.Config{Schema: b.schema, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)},
		Boundaries: boundaries,
		Start: func(ctx context.Context, e *saga.Engine, _ sagatest.Round, i int) (uuid.UUID, error) {
			st, err := saga.Start(ctx, e, def, transfer{Refuse: i%3 == 2}, nil)
			return st.ID, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			got := map[sagatest.Effect]int{}
			for _, e := range []sagatest.Effect{{Step: "hold"}, {Step: "debit"}, {Step: "credit"},
				{Step: "hold", Compensation: true}, {Step: "debit", Compensation: true}} {
				got[e] = 0
			}
			rows, err := b.pool.Query(ctx, "SELECT step, compensation, count(*) FROM "+b.table("effects")+" WHERE saga_id = $1 GROUP BY 1, 2", in.ID)
			if err != nil {
				return nil, err
			}
			var e sagatest.Effect
			var n int
			_, err = pgx.ForEachRow(rows, []any{&e.Step, &e.Compensation, &n}, func() error {
				got[e] = n
				return nil
			})
			return got, err
		},
	}
}

func TestCrashMatrixPassesASagaThatWritesThroughItsStepTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := ledger(b, false)
	sagatest.CrashMatrix(t, b.pool, def, ledgerOpts(t, b, def))
}

// The negative control: steps that write with the pool, outside their
// transactions, leave their rows behind when the engine crashes before the
// steps commit, and write them again when the steps run again.
func TestCrashMatrixCatchesEffectsWrittenOutsideTheStepTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := ledger(b, true)
	opts := ledgerOpts(t, b, def)
	msg := failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, b.pool, def, opts) })
	require.Regexp(t, `boundary engine.after-handler, crossing \d+: 0 stuck, 0 lost, [1-9]\d* doubled, 0 ended otherwise than without a crash:\n`+
		`saga \d \([0-9a-f-]+\): (step|compensation of) [a-z]+: its effects are there twice, but it completed once \(doubled\)`, msg)
	require.NotContains(t, msg, "round without a crash")
}

func TestCrashMatrixRefusesMissingOptions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := ledger(b, false)
	msg := failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, b.pool, def, &sagatest.CrashOpts{}) })
	require.Equal(t, "sagatest: crash matrix: CrashOpts.Effects, CrashOpts.Start: required, and nil", msg)
	msg = failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, nil, def, nil) })
	require.Equal(t, "sagatest: crash matrix: CrashOpts.Effects, CrashOpts.Start, opts, pool: required, and nil", msg)
	opts := ledgerOpts(t, b, def, "engine.before-lunch")
	msg = failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, b.pool, def, opts) })
	require.Equal(t, fmt.Sprintf("sagatest: crash matrix: CrashOpts.Boundaries: unknown boundary %q", "engine.before-lunch"), msg)
	opts.Boundaries, opts.Crossings = nil, []int{3, 0}
	msg = failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, b.pool, def, opts) })
	require.Equal(t, "sagatest: crash matrix: CrashOpts.Crossings: 0: a crossing is counted from 1", msg)
}

func TestRoundNames(t *testing.T) {
	require.Equal(t, "no-crash", sagatest.Round{}.String())
	require.Equal(t, "engine.after-handler.12", sagatest.Round{Boundary: sagatest.AfterHandler, Crossing: 12}.String())
}

// EveryCrossing crashes each step of one saga that writes outside its
// step transaction: three rounds at after-handler (hold, debit, credit),
// each of which doubles the effect of the step it crashed.
func TestCrashMatrixEveryCrossingCrashesEachStep(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := ledger(b, true)
	opts := ledgerOpts(t, b, def, sagatest.AfterHandler)
	opts.Sagas, opts.EveryCrossing = 1, true
	msg := failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, b.pool, def, opts) })
	for i, step := range []string{"hold", "debit", "credit"} {
		require.Regexp(t, fmt.Sprintf(`boundary engine.after-handler, crossing %d: 0 stuck, 0 lost, 1 doubled, 0 ended otherwise than without a crash:\n`+
			`saga 0 \([0-9a-f-]+\): step %s: its effects are there twice`, i+1, step), msg)
	}
}

// A Postgres-only saga never crosses AfterHold: there is nothing to crash,
// and nothing fails.
func TestCrashMatrixPassesOverABoundaryTheSagaNeverCrosses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := ledger(b, true)
	opts := ledgerOpts(t, b, def, sagatest.AfterHold)
	require.Empty(t, failure(t, func(tb testing.TB) { sagatest.CrashMatrix(tb, b.pool, def, opts) }))
}
