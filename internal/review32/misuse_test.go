package review32_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

// misuses are handlers that catch the cut statement's error and go on
// using run.Tx after their Timeout, each ending with return nil. Each
// writes an effect tagged "late" after the timeout, and runs
// nextval(r32_probe) (a sequence: not undone by a rollback) after the
// timeout, to see whether a statement begun after ctx ended was sent.
func misuses(r *rig) map[string]func(ctx context.Context, run *saga.StepRun) error {
	late := func(ctx context.Context, run *saga.StepRun) {
		r.sawErr(run, r.effect(ctx, run, "late"))
		_, err := run.Tx.Exec(ctx, r.q(`SELECT nextval('S.r32_probe')`))
		r.sawErr(run, err)
	}
	return map[string]func(ctx context.Context, run *saga.StepRun) error{
		// ignores the error and returns nil at once
		"ignore": func(ctx context.Context, run *saga.StepRun) error {
			_, _ = run.Tx.Exec(ctx, `SELECT pg_sleep(5)`)
			return nil
		},
		// catches it and writes on with ctx
		"continue-ctx": func(ctx context.Context, run *saga.StepRun) error {
			_, _ = run.Tx.Exec(ctx, `SELECT pg_sleep(5)`)
			late(ctx, run)
			return nil
		},
		// catches it and writes on with a context of its own
		"continue-background": func(ctx context.Context, run *saga.StepRun) error {
			_, _ = run.Tx.Exec(ctx, `SELECT pg_sleep(5)`)
			late(context.Background(), run)
			return nil
		},
		// catches it, begins a savepoint of its own, writes, commits it
		"own-savepoint-after": func(ctx context.Context, run *saga.StepRun) error {
			_, _ = run.Tx.Exec(ctx, `SELECT pg_sleep(5)`)
			bg := context.Background()
			sp, err := run.Tx.Begin(bg)
			if err != nil {
				r.sawErr(run, err)
				return nil
			}
			_, err = sp.Exec(bg, r.q(`SELECT nextval('S.r32_probe')`))
			r.sawErr(run, err)
			r.sawErr(run, r.effect(bg, &saga.StepRun{Tx: sp, SagaID: run.SagaID, Step: run.Step, Direction: run.Direction, Attempt: run.Attempt}, "late"))
			r.sawErr(run, sp.Commit(bg))
			return nil
		},
		// sleeps in a savepoint of its own, rolls it back (which would
		// clear the aborted state), then writes on
		"own-savepoint-around": func(ctx context.Context, run *saga.StepRun) error {
			sp, err := run.Tx.Begin(ctx)
			if err != nil {
				return err
			}
			_, _ = sp.Exec(ctx, `SELECT pg_sleep(5)`)
			r.sawErr(run, sp.Rollback(context.Background()))
			late(context.Background(), run)
			return nil
		},
		// the same with ctx for the rollback and the writes
		"own-savepoint-around-ctx": func(ctx context.Context, run *saga.StepRun) error {
			sp, err := run.Tx.Begin(ctx)
			if err != nil {
				return err
			}
			_, _ = sp.Exec(ctx, `SELECT pg_sleep(5)`)
			r.sawErr(run, sp.Rollback(ctx))
			late(ctx, run)
			return nil
		},
		// never touches the statement's error path: waits for ctx in Go,
		// then writes with a context of its own
		"after-done-background": func(ctx context.Context, run *saga.StepRun) error {
			<-ctx.Done()
			late(context.Background(), run)
			return nil
		},
	}
}

// runMisuses starts one saga per kind of misuses (a step with Timeout
// 300 ms, MaxAttempts 1, that writes an effect and then misbehaves) and
// calls check with each ended saga.
func runMisuses(t *testing.T, kinds []string, check func(t *testing.T, r *rig, kind string, id uuid.UUID, in *saga.Instance)) {
	r := newRig(t)
	ctx := context.Background()
	hs := misuses(r)
	var defs []saga.AnyDefinition
	dm := map[string]*saga.Definition[order]{}
	for _, kind := range kinds {
		h := hs[kind]
		def := saga.Define("r32-misuse-"+kind,
			saga.Step[order]{Name: "first", Action: noop, Compensate: noop},
			saga.Step[order]{Name: "slow", Timeout: 300 * time.Millisecond, Retry: &saga.RetryPolicy{MaxAttempts: 1},
				Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					r.ran(run)
					if err := r.effect(ctx, run, "early"); err != nil {
						return err
					}
					return h(ctx, run)
				}})
		defs = append(defs, def)
		dm[kind] = def
	}
	e := r.engine(t, saga.Config{Workers: 2, BatchSize: 3}, defs...)
	ids := map[string]uuid.UUID{}
	for _, kind := range kinds {
		st, err := saga.Start(ctx, e, dm[kind], order{ID: kind}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids[kind] = st.ID
	}
	for _, kind := range kinds {
		id := ids[kind]
		t.Run(kind, func(t *testing.T) {
			in := waitEnded(t, e, id, 20*time.Second)
			t.Logf("errors the handler saw: %v", r.errsOf(id, "slow"))
			check(t, r, kind, id, in)
		})
	}
	r.noErrors(t)
}

// TestAHandlerThatGoesOnAfterItsStatementWasCutFails: "the step's writes
// are undone with its savepoint and the attempt is recorded"; "a statement
// begun after ctx ended is not sent". Handlers that catch (or ignore) the
// cut statement's error and go on with run.Tx (a statement with ctx or
// context.Background(), a savepoint of their own, rolling back their own
// savepoint with ctx), then return nil: each run must be one recorded
// failed attempt (MaxAttempts 1), the saga compensated, no write of the step
// committed, no error logged. The failure's code is left to
// TestAHandlerThatSwallowsTheCutIsRecordedAsATimeout (F2).
func TestAHandlerThatGoesOnAfterItsStatementWasCutFails(t *testing.T) {
	t.Parallel()
	runMisuses(t, []string{"ignore", "continue-ctx", "continue-background", "own-savepoint-after", "own-savepoint-around-ctx"},
		func(t *testing.T, r *rig, kind string, id uuid.UUID, in *saga.Instance) {
			if in.Status != saga.StatusCompensated || in.LastError == nil || (in.LastError.Code != saga.CodeTimeout && in.LastError.Code != "tx_aborted") {
				t.Errorf("status %s, last error %+v; want compensated after a failed attempt\n%s", in.Status, in.LastError, timeline(in))
			}
			if n := r.runsOf(id, "slow"); n != 1 || attempts(in, "slow") != 1 || events(in, saga.EventStepFailed, "slow") != 1 {
				t.Errorf("the handler ran %d times for %d recorded attempts; want one failed attempt\n%s", n, attempts(in, "slow"), timeline(in))
			}
			if n := r.effects(t, id, "slow/forward", ""); n != 0 {
				t.Errorf("%d writes of the timed-out attempt committed", n)
			}
		})
}

// TestAHandlerThatSwallowsTheCutIsRecordedAsATimeout (F2): "An attempt that
// runs past its Timeout fails with code step_timeout" (package doc; also
// Step.Timeout). A handler whose statement was cut at its Timeout and that
// returns nil (ignoring the 57014) is recorded with code tx_aborted and the
// message "commit step: saga: write outcome of saga …: … 25P02", not
// step_timeout.
func TestAHandlerThatSwallowsTheCutIsRecordedAsATimeout(t *testing.T) {
	t.Parallel()
	runMisuses(t, []string{"ignore", "continue-ctx"},
		func(t *testing.T, r *rig, kind string, id uuid.UUID, in *saga.Instance) {
			if in.LastError == nil || in.LastError.Code != saga.CodeTimeout {
				t.Errorf("last error %+v; want code step_timeout\n%s", in.LastError, timeline(in))
			}
		})
}

// TestAHandlerThatWritesOnAfterItsTimeoutDoesNotComplete (F1): "An attempt
// that runs past its Timeout fails with code step_timeout" and "a statement
// begun after ctx ended is not sent". A handler that, once its Timeout has
// passed, writes on run.Tx with context.Background() (after rolling back a
// savepoint of its own with context.Background(), or after waiting for ctx
// in Go) and returns nil: its step completes, the writes made after the
// timeout commit, and the saga completes.
func TestAHandlerThatWritesOnAfterItsTimeoutDoesNotComplete(t *testing.T) {
	t.Parallel()
	finding(t, "F1", "a handler that writes with context.Background() after its Timeout and returns nil completes, its late writes committed")
	runMisuses(t, []string{"own-savepoint-around", "after-done-background"},
		func(t *testing.T, r *rig, kind string, id uuid.UUID, in *saga.Instance) {
			if in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeTimeout {
				t.Errorf("status %s, last error %+v; want compensated with step_timeout\n%s", in.Status, in.LastError, timeline(in))
			}
			if n := r.effects(t, id, "slow/forward", "late"); n != 0 {
				t.Errorf("%d writes made after the timeout committed", n)
			}
		})
}

// TestAStatementAfterTheTimeoutWithItsOwnContextIsNotSent (F1): "a statement
// begun after ctx ended is not sent" (CHANGELOG: "A statement begun after
// the step's context ended is not sent"). A handler that, after its
// Timeout, runs nextval on run.Tx with context.Background(): the sequence
// (not transactional) shows whether the statement reached the server.
func TestAStatementAfterTheTimeoutWithItsOwnContextIsNotSent(t *testing.T) {
	t.Parallel()
	finding(t, "F1", "a statement on run.Tx with context.Background() begun after the step's Timeout is sent")
	r := newRig(t)
	ctx := context.Background()
	var stmtErr error
	done := make(chan struct{})
	def := saga.Define("r32-late-bg",
		saga.Step[order]{Name: "late", Timeout: 100 * time.Millisecond, Retry: &saga.RetryPolicy{MaxAttempts: 1},
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				defer close(done)
				<-ctx.Done()
				_, stmtErr = run.Tx.Exec(context.Background(), r.q(`SELECT nextval('S.r32_probe')`))
				return nil
			}})
	e := r.engine(t, saga.Config{}, def)
	st, err := saga.Start(ctx, e, def, order{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := waitEnded(t, e, st.ID, 15*time.Second)
	<-done
	if in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeTimeout {
		t.Errorf("status %s, last error %+v; want compensated with step_timeout\n%s", in.Status, in.LastError, timeline(in))
	}
	if n := r.probes(t); n != 0 || stmtErr == nil {
		t.Errorf("the statement begun after the step's timeout with context.Background() reached the server (%d nextval, error %v)", n, stmtErr)
	}
	r.noErrors(t)
}
