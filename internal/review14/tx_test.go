package review14

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// The step chained after a signal uses run.Tx heavily: hundreds of
// statements, a savepoint of its own (run.Tx.Begin) with an error inside,
// rolled back or not, an error it ignores. Its writes commit with the
// wait's end or are rolled back alone; the handler's write is there once.
func TestChainedStepUsesItsTransaction(t *testing.T) {
	t.Parallel()
	type want struct {
		rows     map[string]int // rows of the step's own table, by what
		failed   int            // step_failed:act entries
		failCode string         // their code, when set
	}
	for _, c := range []struct {
		name string
		// body runs on act's attempt n; it returns act's result.
		body func(ctx context.Context, tx txer, id uuid.UUID, n int) error
		want want
	}{
		{"heavy", func(ctx context.Context, tx txer, id uuid.UUID, _ int) error {
			for range 300 {
				if err := tx.ins(ctx, id, "heavy"); err != nil {
					return err
				}
			}
			nested, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := nested.Exec(ctx, "INSERT INTO "+tx.table+" VALUES ($1, 'nested')", id); err != nil {
				return err
			}
			if _, err := nested.Exec(ctx, "SELECT 1/0"); err == nil {
				return errors.New("1/0 did not fail")
			}
			if err := nested.Rollback(ctx); err != nil {
				return err
			}
			return tx.ins(ctx, id, "after")
		}, want{map[string]int{"heavy": 300, "after": 1}, 0, ""}},
		{"released-then-fails", func(ctx context.Context, tx txer, id uuid.UUID, n int) error {
			nested, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := nested.Exec(ctx, "INSERT INTO "+tx.table+" VALUES ($1, 'nested')", id); err != nil {
				return err
			}
			if err := nested.Commit(ctx); err != nil {
				return err
			}
			if n == 1 {
				return errors.New("fails after its savepoint was released")
			}
			return nil
		}, want{map[string]int{"nested": 1}, 1, ""}},
		{"nested-left-aborted", func(ctx context.Context, tx txer, id uuid.UUID, n int) error {
			nested, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if n == 1 {
				_, _ = nested.Exec(ctx, "SELECT 1/0") // and neither rolled back nor reported
				return errReturnNil
			}
			if err := tx.ins(ctx, id, "ok"); err != nil {
				return err
			}
			return nested.Commit(ctx)
		}, want{map[string]int{"ok": 1}, 1, saga.CodeTxAborted}},
		{"error-ignored", func(ctx context.Context, tx txer, id uuid.UUID, n int) error {
			if err := tx.ins(ctx, id, "before"); err != nil {
				return err
			}
			if n == 1 {
				_, _ = tx.Exec(ctx, "SELECT 1/0") // ignored: the transaction is aborted
				return errReturnNil
			}
			return nil
		}, want{map[string]int{"before": 1}, 1, saga.CodeTxAborted}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			table := r.db.Table("mine")
			_, err := r.db.Pool.Exec(context.Background(), "CREATE TABLE "+table+" (saga_id uuid, what text)")
			require.NoError(t, err)
			var acts tally
			def := chainDef(r, "tx"+c.name, chainOpts{actRetry: noBackoff(3),
				act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
					if err := c.body(ctx, txer{run.Tx, table}, run.SagaID, acts.add(o.ID)); errors.Is(err, errReturnNil) {
						return nil // success, with the transaction left aborted
					} else if err != nil {
						return err
					}
					return r.fx.Record(ctx, run, "act")
				}})
			r.start(t, nil, def)
			id := r.startAt(t, def, "o-1", "await")
			r.signal(t, id, "go", "sig-1", "p")
			in := r.ended(t, id)
			require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
			require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
			got := map[string]int{}
			for what := range c.want.rows {
				got[what] = r.db.Count(t, "SELECT count(*) FROM "+table+" WHERE saga_id = $1 AND what = $2", id, what)
			}
			require.Equal(t, c.want.rows, got)
			require.Equal(t, 0, r.db.Count(t, "SELECT count(*) FROM "+table+" WHERE what = 'nested'")-c.want.rows["nested"])
			require.Equal(t, c.want.failed, count(in, "step_failed:act"), describe(in))
			if c.want.failCode != "" {
				for _, e := range in.History {
					if e.Type == saga.EventStepFailed {
						require.Equal(t, c.want.failCode, e.ErrorCode, describe(in))
					}
				}
			}
			if c.want.failed == 0 {
				require.Equal(t, 1, r.txids(t, id, "onsig", "act"))
			}
			require.Equal(t, 1, count(in, "signal_received:await"))
			requireDelivered(t, r, id, "await")
		})
	}
}

// errReturnNil makes act return success at once, writing nothing more.
var errReturnNil = errors.New("return nil")

// txIface is the step's transaction.
type txIface = pgx.Tx

// txer is run.Tx with the step's own table.
type txer struct {
	txIface
	table string
}

func (x txer) ins(ctx context.Context, id uuid.UUID, what string) error {
	_, err := x.Exec(ctx, "INSERT INTO "+x.table+" VALUES ($1, $2)", id, what)
	return err
}

// A chained step that does what StepRun.Tx says not to: it commits or
// rolls back run.Tx on its first attempt, and returns success. The docs
// promise nothing for this misuse; what must hold all the same is that
// the wait's end is neither lost nor doubled: the handler's write is there
// exactly as often as the timeline says await completed (once), the
// signal is delivered once, and act's write as often as act completed.
func TestChainedStepEndsItsTransaction(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"rollback", "commit"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			var acts tally
			def := chainDef(r, "misuse"+how, chainOpts{actRetry: noBackoff(3),
				act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
					if acts.add(o.ID) == 1 {
						if err := r.fx.Record(ctx, run, "act-try"); err != nil {
							return err
						}
						if how == "rollback" {
							return run.Tx.Rollback(ctx)
						}
						return run.Tx.Commit(ctx)
					}
					return r.fx.Record(ctx, run, "act")
				}})
			r.start(t, nil, def)
			id := r.startAt(t, def, "o-1", "await")
			r.signal(t, id, "go", "sig-1", "p")
			in := r.ended(t, id)
			t.Logf("%s: %s; effects %v", how, in.Status, r.fx.List(t, id))
			require.Equal(t, 1, count(in, "step_completed:await"), describe(in))
			require.Equal(t, 1, r.fx.Count(t, id, "onsig"), describe(in))
			require.Equal(t, 1, count(in, "signal_received:await"), describe(in))
			requireDelivered(t, r, id, "await")
			require.Equal(t, count(in, "step_completed:act"), r.fx.Count(t, id, "act")+r.fx.Count(t, id, "act-try"), describe(in))
			require.Equal(t, 1, r.db.Count(t, "SELECT count(*) FROM "+r.fx.Table()+" WHERE saga_id = $1 AND what = 'prep'", id))
			// What it does: the attempt fails (the misuse is named), its
			// write is gone, and the retry completes.
			require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
			require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
			require.Equal(t, 1, count(in, "step_failed:act"), describe(in))
		})
	}
}
