package review13

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// A Command that writes on run.Tx and then fails its first attempt (an
// error, or a panic) after pick: the failed attempt's write is rolled back,
// pick's is kept and pick does not run again, the retry builds the command
// again (attempt 2) and its write commits with the send: exactly one mark,
// made by attempt 2, that saw pick's effect. The timeline is complete and
// in order.
func TestTxCommandFailsOnceThenSucceeds(t *testing.T) {
	t.Parallel()
	r := newRig(t, "txretry", nil)
	ctx := context.Background()
	_, err := r.orders.Pool.Exec(ctx, "CREATE TABLE "+r.orders.Table("marks")+" (id text, attempt int, picked int)")
	require.NoError(t, err)
	var picks, builds counter
	def := saga.Define("txretry",
		saga.Step[ord]{Name: "pick", Retry: noBackoff(1),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				picks.Add(o.ID)
				return r.fx.Record(ctx, run, "pick")
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		saga.Step[ord]{Name: "pay", Timeout: wait, Retry: noBackoff(3), Remote: r.remote(
			func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
				builds.Add(o.ID)
				if _, err := run.Tx.Exec(ctx, "INSERT INTO "+r.orders.Table("marks")+" SELECT $1, $2, count(*) FROM "+
					r.fx.Table()+" WHERE saga_id = $3 AND what = 'pick'", o.ID, run.Attempt, run.SagaID); err != nil {
					return nil, err
				}
				if run.Attempt == 1 {
					if o.ID == "panics" {
						panic("vault down")
					}
					return nil, errors.New("vault unavailable")
				}
				return payCmd{ID: o.ID}, nil
			})},
		saga.Step[ord]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "ship") }},
	)
	r.start(t, nil, def)

	for _, id := range []string{"errs", "panics"} {
		st, err := saga.Start(ctx, r.engine, def, ord{ID: id}, nil)
		require.NoError(t, err)
		in := r.ended(t, st.ID)
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", id, types(in), in.LastError)
		require.Equal(t, int32(1), picks.Get(id), "%s: pick ran once", id)
		require.Equal(t, int32(2), builds.Get(id), "%s: the command was built twice", id)
		require.Equal(t, []string{"pick", "ship"}, r.fx.List(t, st.ID), id)
		require.Equal(t, []string{"pay"}, r.calls(t, st.ID), id)
		require.Equal(t, 1, r.sentTo(t, st.ID), "%s: one command sent", id)

		rows, err := r.orders.Pool.Query(ctx, "SELECT attempt, picked FROM "+r.orders.Table("marks")+" WHERE id = $1", id)
		require.NoError(t, err)
		marks, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Attempt, Picked int }])
		require.NoError(t, err)
		require.Equal(t, []struct{ Attempt, Picked int }{{2, 1}}, marks,
			"%s: only the retry's write committed, and it saw pick's effect", id)

		require.Equal(t, []string{"saga_started:pick", "step_completed:pick", "step_failed:pay", "command_sent:pay",
			"reply_received:pay", "step_completed:pay", "step_completed:ship", "saga_completed"}, types(in), id)
		var failed *saga.Event
		for i := range in.History {
			if in.History[i].Type == "step_failed" {
				failed = &in.History[i]
			}
		}
		if id == "panics" {
			require.Equal(t, saga.CodePanic, failed.ErrorCode)
		} else {
			require.Contains(t, failed.Error, "vault unavailable")
		}
	}
}
