package review3_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// orderID is saga i's order in the round of boundary b; every odd one fails
// at its second step and is compensated.
func orderID(b sagatest.Round, i int) string {
	id := fmt.Sprintf("%s-%d", b, i)
	if i%2 == 1 {
		id += "-x"
	}
	return id
}

type order struct {
	ID string `json:"id"`
}

// migrated returns a pool and a fresh schema that migrations.Migrate has
// migrated.
func migrated(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(t, err)
	return pool, schema
}

// effectSaga is a two-step saga whose second step fails for good when the
// order's id ends in "-x", so that the first is compensated. Each handler
// inserts one row into effects: through run.Tx when inTx, else straight
// through pool, outside the step's transaction.
func effectSaga(pool *pgxpool.Pool, table string, inTx bool) *saga.Definition[order] {
	write := func(what string) saga.StepFunc[order] {
		return func(ctx context.Context, run *saga.StepRun, o *order) error {
			q := "INSERT INTO " + table + " (saga_id, what) VALUES ($1, $2)"
			var err error
			if inTx {
				_, err = run.Tx.Exec(ctx, q, run.SagaID, what)
			} else {
				_, err = pool.Exec(ctx, q, run.SagaID, what)
			}
			return err
		}
	}
	return saga.Define("cm",
		saga.Step[order]{Name: "reserve", Action: write("reserve"), Compensate: write("release")},
		saga.Step[order]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			if strings.HasSuffix(o.ID, "-x") {
				return steps.Permanent(errors.New("cannot ship " + o.ID))
			}
			return write("ship")(ctx, run, o)
		}},
	)
}

func crashOpts(pool *pgxpool.Pool, schema, table string, def *saga.Definition[order]) *sagatest.CrashOpts {
	return &sagatest.CrashOpts{
		Config:  &saga.Config{Schema: schema, PollInterval: 20 * time.Millisecond},
		Sagas:   4,
		Timeout: 20 * time.Second,
		Start: func(ctx context.Context, e *saga.Engine, b sagatest.Round, i int) (uuid.UUID, error) {
			st, err := saga.Start(ctx, e, def, order{ID: orderID(b, i)}, nil)
			return st.ID, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			out := map[sagatest.Effect]int{}
			for what, eff := range map[string]sagatest.Effect{
				"reserve": {Step: "reserve"},
				"release": {Step: "reserve", Compensation: true},
				"ship":    {Step: "ship"},
			} {
				var n int
				if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE saga_id = $1 AND what = $2", in.ID, what).Scan(&n); err != nil {
					return nil, err
				}
				out[eff] = n
			}
			return out, nil
		},
	}
}

func effectsTable(t *testing.T, pool *pgxpool.Pool, schema string) string {
	table := migrations.QuoteSchema(schema) + ".review3_effects"
	_, err := pool.Exec(context.Background(), "CREATE TABLE "+table+" (saga_id uuid NOT NULL, what text NOT NULL)")
	require.NoError(t, err)
	return table
}

// A saga that writes only through run.Tx passes the matrix.
func TestCrashMatrixPassesCorrectSaga(t *testing.T) {
	pool, schema := migrated(t)
	table := effectsTable(t, pool, schema)
	def := effectSaga(pool, table, true)
	sagatest.CrashMatrix(t, pool, def, crashOpts(pool, schema, table, def))
}

// recorder is a testing.TB that records failures instead of failing the test.
type recorder struct {
	testing.TB
	mu     sync.Mutex
	failed bool
	msgs   []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = true
	r.msgs = append(r.msgs, fmt.Sprintf(format, args...))
}
func (r *recorder) Error(args ...any) { r.Errorf("%s", fmt.Sprint(args...)) }
func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}
func (r *recorder) Fatal(args ...any) { r.Fatalf("%s", fmt.Sprint(args...)) }
func (r *recorder) Fail()             { r.Errorf("Fail called") }
func (r *recorder) FailNow()          { r.Fatalf("FailNow called") }
func (r *recorder) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}

// A saga that writes outside run.Tx doubles its effect when the engine dies
// after the handler and before the commit: the matrix must fail, naming the
// boundary and the effect.
func TestCrashMatrixFailsSagaWritingOutsideTx(t *testing.T) {
	pool, schema := migrated(t)
	table := effectsTable(t, pool, schema)
	def := effectSaga(pool, table, false)
	rec := &recorder{TB: t}
	opts := crashOpts(pool, schema, table, def)
	opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler}
	// The first handler to return is a reserve, which always writes. The
	// other crossings (the defaults) may be the ship of an order that fails
	// without writing, depending on the order the workers ran the handlers
	// in: a slow CI run crashed there, and nothing was doubled.
	opts.Crossings = []int{1}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sagatest.CrashMatrix(rec, pool, def, opts)
	}()
	<-done
	require.True(t, rec.Failed(), "CrashMatrix passed a saga that writes outside run.Tx")
	all := strings.Join(rec.msgs, "\n")
	t.Logf("CrashMatrix said:\n%s", all)
	require.Contains(t, all, string(sagatest.AfterHandler), "the failure names the boundary")
	require.True(t, strings.Contains(all, "step reserve") || strings.Contains(all, "step ship") || strings.Contains(all, "compensation of reserve"),
		"the failure names the effect as Effect.String does")
}
