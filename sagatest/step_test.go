package sagatest_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type reservation struct {
	SKU      string `json:"sku"`
	Reserved bool   `json:"reserved"`
	Note     string `json:"-"` // not stored: lost between steps
}

// stockStep reserves a SKU in the stock table through run.Tx; a SKU that
// is "gone" writes first and then fails for good.
func stockStep(table string) saga.Step[reservation] {
	return saga.Step[reservation]{
		Name: "reserve",
		Action: func(ctx context.Context, run *saga.StepRun, r *reservation) error {
			if _, err := run.Tx.Exec(ctx, "INSERT INTO "+table+" (sku, step_key) VALUES ($1, $2)", r.SKU, run.IdempotencyKey()); err != nil {
				return err
			}
			if r.SKU == "gone" {
				return steps.Permanent(steps.WithCode("out_of_stock", errors.New("no stock left")))
			}
			r.Reserved, r.Note = true, "set by the step"
			return nil
		},
		Compensate: func(ctx context.Context, run *saga.StepRun, r *reservation) error {
			_, err := run.Tx.Exec(ctx, "DELETE FROM "+table+" WHERE sku = $1", r.SKU)
			r.Reserved = false
			return err
		},
	}
}

func TestRunStepRunsTheActionInATestTransaction(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	table := pgx.Identifier{schema, "stock"}.Sanitize()
	_, err := pool.Exec(ctx, "CREATE TABLE "+table+" (sku text, step_key text)")
	require.NoError(t, err)
	step := stockStep(table)
	count := func(q pgx.Row) int {
		var n int
		require.NoError(t, q.Scan(&n))
		return n
	}

	t.Run("success", func(t *testing.T) {
		res := sagatest.RunStep(t, pool, step, reservation{SKU: "a"}, &sagatest.StepOpts{SagaName: "checkout", Epoch: 2})
		require.NoError(t, res.Err)
		require.Equal(t, reservation{SKU: "a", Reserved: true}, res.State, "the state after its JSON round trip")
		require.Equal(t, 1, count(res.Run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE step_key = $1",
			res.Run.SagaID.String()+"/reserve/forward/2")), "the step wrote in the test transaction")
		require.Equal(t, 0, count(pool.QueryRow(ctx, "SELECT count(*) FROM "+table)), "and nothing is committed")
		require.Equal(t, steps.Key{SagaID: res.Run.SagaID, Step: "reserve", Direction: steps.Forward, Epoch: 2}, res.Run.Key)
		require.Equal(t, 1, res.Run.Attempt)
		require.Equal(t, "checkout", res.Run.SagaName)
	})
	require.Equal(t, 0, count(pool.QueryRow(ctx, "SELECT count(*) FROM "+table)), "rolled back when the test ended")

	t.Run("a failed step leaves no writes and no state change", func(t *testing.T) {
		res := sagatest.RunStep(t, pool, step, reservation{SKU: "gone"}, nil)
		require.True(t, steps.IsPermanent(res.Err))
		require.Equal(t, "out_of_stock", steps.Code(res.Err))
		require.Equal(t, reservation{SKU: "gone"}, res.State)
		require.Equal(t, 0, count(res.Run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+table)), "its insert was rolled back")
	})

	t.Run("a step that breaks its transaction is rolled back and the transaction stays usable", func(t *testing.T) {
		broken := saga.Step[reservation]{Name: "broken", Action: func(ctx context.Context, run *saga.StepRun, _ *reservation) error {
			_, err := run.Tx.Exec(ctx, "SELECT * FROM no_such_table")
			return err
		}}
		res := sagatest.RunStep(t, pool, broken, reservation{}, nil)
		require.ErrorContains(t, res.Err, "no_such_table")
		require.Equal(t, 0, count(res.Run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+table)))
	})

	t.Run("compensation, in the caller's transaction", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { require.NoError(t, tx.Rollback(ctx)) }()
		_, err = tx.Exec(ctx, "INSERT INTO "+table+" (sku) VALUES ('b')")
		require.NoError(t, err)
		res := sagatest.RunStep(t, tx, step, reservation{SKU: "b", Reserved: true}, &sagatest.StepOpts{Direction: steps.Compensate})
		require.NoError(t, res.Err)
		require.False(t, res.State.Reserved)
		require.Equal(t, steps.Compensate, res.Run.Direction)
		require.Equal(t, 0, count(tx.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE sku = 'b'")), "deleted in the caller's transaction")
	})

	t.Run("a remote step builds its command", func(t *testing.T) {
		remote := saga.Step[reservation]{Name: "hold", Remote: &saga.Remote[reservation]{
			Topic: "inventory.commands", Type: "inventory.hold", CompensateType: "inventory.release",
			Command: func(_ context.Context, run *saga.StepRun, r *reservation) (any, error) {
				return map[string]string{"sku": r.SKU, "key": run.IdempotencyKey()}, nil
			},
		}}
		res := sagatest.RunStep(t, pool, remote, reservation{SKU: "c"}, nil)
		require.NoError(t, res.Err)
		require.JSONEq(t, `{"sku": "c", "key": "`+res.Run.Key.String()+`"}`, string(res.Command))
		res = sagatest.RunStep(t, pool, remote, reservation{SKU: "c"}, &sagatest.StepOpts{Direction: steps.Compensate})
		require.NoError(t, res.Err)
		var cmd map[string]string
		require.NoError(t, json.Unmarshal(res.Command, &cmd))
		require.Equal(t, res.Run.SagaID.String()+"/hold/compensate/0", cmd["key"], "Command serves the compensation too")
	})

	t.Run("a step without what the direction needs fails the test", func(t *testing.T) {
		msg := failure(t, func(tb testing.TB) {
			sagatest.RunStep(tb, pool, saga.Step[reservation]{Name: "fwd", Action: step.Action}, reservation{},
				&sagatest.StepOpts{Direction: steps.Compensate})
		})
		require.Contains(t, msg, `sagatest: run step "fwd": it has no Compensate`)
	})
}
