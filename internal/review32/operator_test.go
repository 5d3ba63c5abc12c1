package review32_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

// TestACancelOfABatchNeighbourDoesNotCutTheRunningStep: Cancel "when a step
// runs, the engine running it ... cancels the step's context"; the other
// steps of a batch go on. Two sagas claimed in one batch (Workers 1,
// BatchSize 4), each with a step running pg_sleep(0.8) on run.Tx: when the
// first enters its statement, the other saga is cancelled. The running step
// must complete (its statement not cut) and its saga complete; the other
// saga ends compensated; no error logged.
func TestACancelOfABatchNeighbourDoesNotCutTheRunningStep(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	ctx := context.Background()
	var once sync.Once
	first := make(chan uuid.UUID, 1)
	var e *saga.Engine
	def := saga.Define("r32-neighbour",
		saga.Step[order]{Name: "s", Timeout: time.Minute, Compensate: noop, Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			r.ran(run)
			if err := r.effect(ctx, run, ""); err != nil {
				return err
			}
			once.Do(func() { first <- run.SagaID })
			_, err := run.Tx.Exec(ctx, `SELECT pg_sleep(0.8)`)
			r.sawErr(run, err)
			return err
		}},
		saga.Step[order]{Name: "t", Action: noop})
	e = r.engineNotStarted(t, saga.Config{Workers: 1, BatchSize: 4}, def)
	a, err := saga.Start(ctx, e, def, order{ID: "a"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := saga.Start(ctx, e, def, order{ID: "b"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.startEngine(t, e)
	running := <-first
	other := a.ID
	if running == a.ID {
		other = b.ID
	}
	time.Sleep(100 * time.Millisecond) // the statement is on the server
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := e.Cancel(cctx, other, "operator"); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	in := waitEnded(t, e, running, 15*time.Second)
	if in.Status != saga.StatusCompleted || r.runsOf(running, "s") != 1 {
		t.Errorf("the running saga: %s after %d runs, its statement's errors %v\n%s", in.Status, r.runsOf(running, "s"), r.errsOf(running, "s"), timeline(in))
	}
	for _, err := range r.errsOf(running, "s") {
		if err != nil {
			t.Errorf("the running step's statement failed: %v", err)
		}
	}
	if r.effects(t, running, "s/forward", "") != 1 {
		t.Errorf("the running saga has %d effects of its step; want 1", r.effects(t, running, "s/forward", ""))
	}
	oin := waitEnded(t, e, other, 15*time.Second)
	if oin.Status != saga.StatusCompensated {
		t.Errorf("the cancelled saga: %s\n%s", oin.Status, timeline(oin))
	}
	r.noErrors(t)
}

// TestAPauseDuringAStatementLetsTheStepFinish: "A step that runs when the
// pause commits finishes and records its outcome; the command it writes
// next waits." A pause while the step's statement (pg_sleep(0.6)) runs must
// not cut it; Unpause lets the saga complete, with the step's effect once.
func TestAPauseDuringAStatementLetsTheStepFinish(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	ctx := context.Background()
	entered := make(chan struct{})
	var once sync.Once
	def := saga.Define("r32-pause",
		saga.Step[order]{Name: "s", Timeout: time.Minute, Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			r.ran(run)
			if err := r.effect(ctx, run, ""); err != nil {
				return err
			}
			once.Do(func() { close(entered) })
			_, err := run.Tx.Exec(ctx, `SELECT pg_sleep(0.6)`)
			r.sawErr(run, err)
			return err
		}},
		saga.Step[order]{Name: "t", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return r.effect(ctx, run, "") }})
	e := r.engine(t, saga.Config{Workers: 1}, def)
	st, err := saga.Start(ctx, e, def, order{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-entered
	time.Sleep(100 * time.Millisecond)
	if err := e.Pause(ctx, st.ID, "operator"); err != nil {
		t.Fatalf("pause: %v", err)
	}
	waitFor(t, 10*time.Second, "the step's outcome", func() bool { return events(get(t, e, st.ID), saga.EventStepCompleted, "s") == 1 })
	time.Sleep(200 * time.Millisecond)
	in := get(t, e, st.ID)
	if in.Paused == nil || in.Status != saga.StatusRunning || r.effects(t, st.ID, "t/forward", "") != 0 {
		t.Errorf("after the step: paused %v, status %s, next step's effects %d\n%s", in.Paused, in.Status, r.effects(t, st.ID, "t/forward", ""), timeline(in))
	}
	if err := e.Unpause(ctx, st.ID, "go"); err != nil {
		t.Fatalf("unpause: %v", err)
	}
	in = waitEnded(t, e, st.ID, 10*time.Second)
	if in.Status != saga.StatusCompleted || r.runsOf(st.ID, "s") != 1 || r.effects(t, st.ID, "s/forward", "") != 1 || r.effects(t, st.ID, "t/forward", "") != 1 {
		t.Errorf("status %s, %d runs, effects %d/%d, statement errors %v\n%s", in.Status, r.runsOf(st.ID, "s"),
			r.effects(t, st.ID, "s/forward", ""), r.effects(t, st.ID, "t/forward", ""), r.errsOf(st.ID, "s"), timeline(in))
	}
	r.noErrors(t)
}

// TestAStatementThatOutlivesItsCutIsATimeout (F1): a statement that is not
// cancelled quickly (a PL/pgSQL block that catches query_canceled and
// sleeps on for 0.7 s, then succeeds), and a statement run with
// context.Background() (pg_sleep(0.7), not derived from the step's ctx),
// each with Timeout 200 ms, MaxAttempts 1, HandlerGrace 5 s: "An attempt
// that runs past its Timeout fails with code step_timeout"; the step's
// writes are undone; no handler is abandoned, no error logged.
func TestAStatementThatOutlivesItsCutIsATimeout(t *testing.T) {
	t.Parallel()
	finding(t, "F1", "a statement that outlives the step's Timeout and succeeds completes the step, its writes committed")
	r := newRig(t)
	ctx := context.Background()
	stmts := map[string]func(ctx context.Context, run *saga.StepRun) error{
		"catches-cancel": func(ctx context.Context, run *saga.StepRun) error {
			_, err := run.Tx.Exec(ctx, `DO $$ BEGIN BEGIN PERFORM pg_sleep(5); EXCEPTION WHEN query_canceled THEN PERFORM pg_sleep(0.7); END; END $$`)
			return err
		},
		"background": func(_ context.Context, run *saga.StepRun) error {
			_, err := run.Tx.Exec(context.Background(), `SELECT pg_sleep(0.7)`)
			return err
		},
	}
	var defs []saga.AnyDefinition
	dm := map[string]*saga.Definition[order]{}
	for kind, stmt := range stmts {
		def := saga.Define("r32-outlive-"+kind,
			saga.Step[order]{Name: "first", Action: noop, Compensate: noop},
			saga.Step[order]{Name: "slow", Timeout: 200 * time.Millisecond, Retry: &saga.RetryPolicy{MaxAttempts: 1},
				Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					r.ran(run)
					if err := r.effect(ctx, run, ""); err != nil {
						return err
					}
					err := stmt(ctx, run)
					r.sawErr(run, err)
					return err
				}})
		defs = append(defs, def)
		dm[kind] = def
	}
	e := r.engine(t, saga.Config{Workers: 2, HandlerGrace: 5 * time.Second}, defs...)
	for kind, def := range dm {
		st, err := saga.Start(ctx, e, def, order{ID: kind}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Run(kind, func(t *testing.T) {
			in := waitEnded(t, e, st.ID, 15*time.Second)
			t.Logf("the statement's error: %v", r.errsOf(st.ID, "slow"))
			if in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeTimeout {
				t.Errorf("status %s, last error %+v; want compensated with step_timeout\n%s", in.Status, in.LastError, timeline(in))
			}
			if r.runsOf(st.ID, "slow") != 1 || attempts(in, "slow") != 1 || r.effects(t, st.ID, "slow/forward", "") != 0 {
				t.Errorf("%d runs, %d attempts, %d effects; want 1, 1, 0\n%s", r.runsOf(st.ID, "slow"), attempts(in, "slow"), r.effects(t, st.ID, "slow/forward", ""), timeline(in))
			}
		})
	}
	if n := e.Stats().HandlersAbandoned; n != 0 {
		t.Errorf("%d handlers abandoned", n)
	}
	r.noErrors(t)
}
