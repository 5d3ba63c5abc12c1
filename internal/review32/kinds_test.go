package review32_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/saga"
)

// slowKinds are the ways a step's statement on run.Tx can outlast its
// Timeout: each sleeps 5 s on the server unless it is cut.
func slowKinds(r *rig) map[string]func(ctx context.Context, tx pgx.Tx) error {
	const sleepRow2 = `SELECT g FROM generate_series(1, 3) g, LATERAL (SELECT pg_sleep(CASE WHEN g = 2 THEN 5 ELSE 0 END)) s`
	return map[string]func(ctx context.Context, tx pgx.Tx) error{
		"exec": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT pg_sleep(5)`)
			return err
		},
		"query-next": func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, sleepRow2)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
			}
			return rows.Err()
		},
		"collect-rows": func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, sleepRow2)
			if err != nil {
				return err
			}
			_, err = pgx.CollectRows(rows, pgx.RowTo[int32])
			return err
		},
		"for-each-row": func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, sleepRow2)
			if err != nil {
				return err
			}
			var g int32
			_, err = pgx.ForEachRow(rows, []any{&g}, func() error { return nil })
			return err
		},
		"query-row-scan": func(ctx context.Context, tx pgx.Tx) error {
			var s string
			return tx.QueryRow(ctx, `SELECT pg_sleep(5)::text`).Scan(&s)
		},
		"send-batch": func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`)
			b.Queue(`SELECT pg_sleep(5)`)
			b.Queue(`SELECT 2`)
			b.Queue(r.q(`INSERT INTO S.r32_slow (x) SELECT 1 WHERE false`))
			br := tx.SendBatch(ctx, b)
			var first error
			for range 4 {
				if _, err := br.Exec(); err != nil && first == nil {
					first = err
				}
			}
			if err := br.Close(); err != nil && first == nil {
				first = err
			}
			return first
		},
		"copy-from": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.CopyFrom(ctx, pgx.Identifier{r.schema, "r32_slow"}, []string{"x"}, pgx.CopyFromRows([][]any{{1}, {2}}))
			return err
		},
		"nested-exec": func(ctx context.Context, tx pgx.Tx) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, `SELECT pg_sleep(5)`); err != nil {
				_ = sp.Rollback(ctx)
				return err
			}
			return sp.Commit(ctx)
		},
		"nested-twice-commit": func(ctx context.Context, tx pgx.Tx) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			sp2, err := sp.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp2.Exec(ctx, r.q(`INSERT INTO S.r32_slow (x) VALUES (1)`)); err != nil {
				return err
			}
			if err := sp2.Commit(ctx); err != nil {
				return err
			}
			return sp.Commit(ctx)
		},
		"prepare-exec": func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Prepare(ctx, "r32_sleep", `SELECT pg_sleep($1)`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "r32_sleep", 5.0)
			return err
		},
		"lock-wait": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, r.q(`UPDATE S.r32_lk SET v = v + 1 WHERE id = 1`))
			return err
		},
	}
}

// TestEachStatementKindIsCutAtTheTimeout: "A statement the handler runs on
// run.Tx with ctx when ctx ends (its Timeout, a cancel request) is cancelled
// on the server (SQLSTATE 57014): the step's writes are undone with its
// savepoint and the attempt is recorded, while the batch's connection and
// the other steps of its batch go on". The CHANGELOG names Exec, Query and
// its rows, QueryRow, SendBatch, CopyFrom, Prepare and a savepoint the step
// begins. Each kind: a step with Timeout 300 ms, MaxAttempts 2, whose
// statement would sleep 5 s; a lock wait on a row the test holds. Every
// saga must compensate with step_timeout after two recorded runs, its
// timed-out writes undone, the statement's error 57014, no handler
// abandoned and no error logged; a plain saga started beside them completes.
func TestEachStatementKindIsCutAtTheTimeout(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	ctx := context.Background()
	// Hold the row the lock-wait kind updates until the test ends.
	holder, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, r.q(`SELECT * FROM S.r32_lk WHERE id = 1 FOR UPDATE`)); err != nil {
		t.Fatal(err)
	}
	// nested-twice-commit needs a slow insert: it uses r32_slow's trigger.
	kinds := slowKinds(r)
	var defs []saga.AnyDefinition
	names := map[string]*saga.Definition[order]{}
	for kind, stmt := range kinds {
		def := saga.Define("r32-kind-"+kind,
			saga.Step[order]{Name: "first", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				return r.effect(ctx, run, "")
			}, Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				return r.effect(ctx, run, "")
			}},
			saga.Step[order]{Name: "slow", Timeout: 300 * time.Millisecond,
				Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: fixed(10 * time.Millisecond)},
				Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					r.ran(run)
					if err := r.effect(ctx, run, ""); err != nil {
						return err
					}
					err := stmt(ctx, run.Tx)
					r.sawErr(run, err)
					return err
				}})
		defs = append(defs, def)
		names[kind] = def
	}
	plain := saga.Define("r32-plain", saga.Step[order]{Name: "only", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
		return r.effect(ctx, run, "")
	}})
	defs = append(defs, plain)
	e := r.engine(t, saga.Config{Workers: 3, BatchSize: 4}, defs...)
	ids := map[string]uuid.UUID{}
	for kind, def := range names {
		st, err := saga.Start(ctx, e, def, order{ID: kind}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids[kind] = st.ID
	}
	var plainIDs []uuid.UUID
	for range 6 {
		st, err := saga.Start(ctx, e, plain, order{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		plainIDs = append(plainIDs, st.ID)
	}
	for kind, id := range ids {
		t.Run(kind, func(t *testing.T) {
			in := waitEnded(t, e, id, 25*time.Second)
			if in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeTimeout {
				t.Errorf("status %s, last error %+v; want compensated with step_timeout\n%s", in.Status, in.LastError, timeline(in))
			}
			if n := r.runsOf(id, "slow"); n != 2 || attempts(in, "slow") != 2 {
				t.Errorf("the handler ran %d times, %d attempts recorded; want 2 and 2 (MaxAttempts 2)\n%s", n, attempts(in, "slow"), timeline(in))
			}
			if n := r.effects(t, id, "slow/forward", ""); n != 0 {
				t.Errorf("%d writes of the timed-out attempts committed", n)
			}
			if r.effects(t, id, "first/forward", "") != 1 || r.effects(t, id, "first/compensate", "") != 1 {
				t.Errorf("first step's effects: %d forward, %d compensate; want 1 and 1", r.effects(t, id, "first/forward", ""), r.effects(t, id, "first/compensate", ""))
			}
			for i, err := range r.errsOf(id, "slow") {
				if !is57014(err) && !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("run %d: the statement's error is %v; want SQLSTATE 57014 (or the context's error)", i+1, err)
				}
			}
		})
	}
	for _, id := range plainIDs {
		if in := waitEnded(t, e, id, 10*time.Second); in.Status != saga.StatusCompleted || r.effects(t, id, "only/forward", "") != 1 {
			t.Errorf("a plain saga beside them: %s with %d effects\n%s", in.Status, r.effects(t, id, "only/forward", ""), timeline(in))
		}
	}
	if n := e.Stats().HandlersAbandoned; n != 0 {
		t.Errorf("%d handlers abandoned; the statements should have been cut", n)
	}
	r.noErrors(t)
}
