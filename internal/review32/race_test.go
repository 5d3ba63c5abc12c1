package review32_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

// TestStatementsEndingAroundTheirTimeout: every run of a handler is a
// recorded attempt, effects in run.Tx exist exactly once per completed
// saga, and no batch fails, when statements end around their Timeout.
// 48 sagas whose step runs pg_sleep of 1-20 ms (as an Exec, in a savepoint
// of its own, or as a query's rows) with a Timeout of 1-20 ms, MaxAttempts
// 3, beside 16 "victim" sagas whose step runs a 3 ms statement with a
// minute's Timeout and MaxAttempts 1 (a cancel meant for a neighbour in the
// batch must not cut it). Two engines on the schema, BatchSize 6, Workers 1
// and 2.
func TestStatementsEndingAroundTheirTimeout(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	ctx := context.Background()
	const n = 48
	var defs []saga.AnyDefinition
	var racers []*saga.Definition[order]
	for i := range n {
		timeout := time.Duration(1+i%20) * time.Millisecond
		sleep := float64(1+(i*7)%20) / 1000
		how := i % 3
		def := saga.Define(fmt.Sprintf("r32-race-%d", i),
			saga.Step[order]{Name: "s", Timeout: timeout, Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: fixed(time.Millisecond)},
				Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					r.ran(run)
					if err := r.effect(ctx, run, ""); err != nil {
						return err
					}
					switch how {
					case 1:
						sp, err := run.Tx.Begin(ctx)
						if err != nil {
							return err
						}
						if _, err := sp.Exec(ctx, `SELECT pg_sleep($1)`, sleep); err != nil {
							return err
						}
						return sp.Commit(ctx)
					case 2:
						rows, err := run.Tx.Query(ctx, `SELECT g, pg_sleep($1) FROM generate_series(1, 2) g`, sleep/2)
						if err != nil {
							return err
						}
						defer rows.Close()
						for rows.Next() {
						}
						return rows.Err()
					}
					_, err := run.Tx.Exec(ctx, `SELECT pg_sleep($1)`, sleep)
					return err
				}})
		defs = append(defs, def)
		racers = append(racers, def)
	}
	victim := saga.Define("r32-victim", saga.Step[order]{Name: "v", Timeout: time.Minute, Retry: &saga.RetryPolicy{MaxAttempts: 1},
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			r.ran(run)
			if err := r.effect(ctx, run, ""); err != nil {
				return err
			}
			_, err := run.Tx.Exec(ctx, `SELECT pg_sleep(0.003)`)
			r.sawErr(run, err)
			return err
		}})
	defs = append(defs, victim)
	e1 := r.engineNotStarted(t, saga.Config{Workers: 1, BatchSize: 6}, defs...)
	e2 := r.engineNotStarted(t, saga.Config{Workers: 2, BatchSize: 6}, defs...)
	var ids, victims []uuid.UUID
	for i, def := range racers {
		st, err := saga.Start(ctx, e1, def, order{ID: fmt.Sprint(i)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, st.ID)
		if i%3 == 0 {
			st, err := saga.Start(ctx, e1, victim, order{}, nil)
			if err != nil {
				t.Fatal(err)
			}
			victims = append(victims, st.ID)
		}
	}
	r.startEngine(t, e1)
	r.startEngine(t, e2)
	var completed, compensated atomic.Int32
	for _, id := range ids {
		in := waitEnded(t, e1, id, 30*time.Second)
		runs, recorded := r.runsOf(id, "s"), attempts(in, "s")
		if runs != recorded {
			t.Errorf("saga %s (%s): the handler ran %d times for %d recorded attempts\n%s", in.Name, in.Status, runs, recorded, timeline(in))
		}
		fx := r.effects(t, id, "s/forward", "")
		switch in.Status {
		case saga.StatusCompleted:
			completed.Add(1)
			if fx != 1 {
				t.Errorf("saga %s completed with %d effects of its step", in.Name, fx)
			}
		case saga.StatusCompensated:
			compensated.Add(1)
			if fx != 0 {
				t.Errorf("saga %s compensated with %d effects of its step", in.Name, fx)
			}
		default:
			t.Errorf("saga %s ended %s\n%s", in.Name, in.Status, timeline(in))
		}
	}
	for _, id := range victims {
		in := waitEnded(t, e1, id, 30*time.Second)
		if in.Status != saga.StatusCompleted || r.runsOf(id, "v") != 1 || r.effects(t, id, "v/forward", "") != 1 {
			t.Errorf("a victim saga beside the racers: %s after %d runs, %d effects, errors %v\n%s", in.Status, r.runsOf(id, "v"), r.effects(t, id, "v/forward", ""), r.errsOf(id, "v"), timeline(in))
		}
	}
	t.Logf("%d completed, %d compensated; abandoned %d+%d", completed.Load(), compensated.Load(), e1.Stats().HandlersAbandoned, e2.Stats().HandlersAbandoned)
	r.noErrors(t)
}
