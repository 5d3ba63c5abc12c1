package review29_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type rich struct {
	ID     string  `json:"id"`
	Hidden string  `json:"-"`
	F      float64 `json:"f"`
	Text   string  `json:"text,omitempty"`
}

// RunStep: writes of a successful step are visible in Run.Tx and never
// committed; a failed step's writes are undone; the state goes through JSON.
func TestRunStepWritesAndState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := db(t)
	table := pgx.Identifier{schema, "ledger"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+table+" (id text)"); err != nil {
		t.Fatal(err)
	}
	write := func(fail bool) saga.Step[rich] {
		return saga.Step[rich]{Name: "debit", Action: func(ctx context.Context, run *saga.StepRun, s *rich) error {
			if _, err := run.Tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", s.ID); err != nil {
				return err
			}
			s.Hidden, s.Text = "kept only in memory", "done"
			if fail {
				return errors.New("boom")
			}
			return nil
		}}
	}
	t.Run("inner", func(t *testing.T) {
		ok := sagatest.RunStep(t, pool, write(false), rich{ID: "a"}, nil)
		if ok.Err != nil || ok.State.Text != "done" || ok.State.Hidden != "" {
			t.Fatalf("success: err %v, state %+v (Hidden must be lost in JSON)", ok.Err, ok.State)
		}
		if ok.Run == nil || ok.Run.Attempt != 1 || ok.Run.SagaName != "sagatest" || ok.Run.Direction != steps.Forward || ok.Run.SagaID == uuid.Nil {
			t.Fatalf("run %+v", ok.Run)
		}
		var n int
		if err := ok.Run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil || n != 1 {
			t.Fatalf("the step's write is not in its transaction: %d %v", n, err)
		}
		bad := sagatest.RunStep(t, pool, write(true), rich{ID: "b"}, nil)
		if bad.Err == nil || bad.State.Text != "" {
			t.Fatalf("failure: err %v, state %+v (a failed step's state must be the one given)", bad.Err, bad.State)
		}
		if err := bad.Run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil || n != 0 {
			t.Fatalf("a failed step's write is still there: %d %v", n, err)
		}
	})
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Fatalf("RunStep committed %d rows (%v)", n, err)
	}

	t.Run("with the caller's tx", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ('mine')"); err != nil {
			t.Fatal(err)
		}
		res := sagatest.RunStep(t, tx, write(true), rich{ID: "c"}, nil)
		if res.Err == nil {
			t.Fatal("no error")
		}
		var ids []string
		rows, _ := tx.Query(ctx, "SELECT id FROM "+table)
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || strings.Join(ids, ",") != "mine" {
			t.Fatalf("the caller's transaction holds %v (%v), want only its own row", ids, err)
		}
	})
}

// A state JSON cannot encode is an error, not a pass.
func TestRunStepUnencodableState(t *testing.T) {
	t.Parallel()
	pool, _ := db(t)
	step := saga.Step[rich]{Name: "nan", Action: func(_ context.Context, _ *saga.StepRun, s *rich) error {
		s.F = math.NaN()
		return nil
	}}
	res := sagatest.RunStep(t, pool, step, rich{ID: "a"}, nil)
	if res.Err == nil {
		t.Fatalf("a NaN in the state passed: %+v", res.State)
	}
	t.Logf("NaN: %v", res.Err)
}

// The context ends at the step's Timeout, and has a deadline by default.
func TestRunStepTimeout(t *testing.T) {
	t.Parallel()
	pool, _ := db(t)
	var hadDeadline bool
	dflt := saga.Step[rich]{Name: "d", Action: func(ctx context.Context, _ *saga.StepRun, _ *rich) error {
		_, hadDeadline = ctx.Deadline()
		return nil
	}}
	if res := sagatest.RunStep(t, pool, dflt, rich{}, nil); res.Err != nil || !hadDeadline {
		t.Fatalf("default: err %v, deadline %t", res.Err, hadDeadline)
	}
	slow := saga.Step[rich]{Name: "slow", Timeout: 200 * time.Millisecond,
		Action: func(ctx context.Context, _ *saga.StepRun, _ *rich) error {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(30 * time.Second):
				return nil
			}
		}}
	begun := time.Now()
	res := sagatest.RunStep(t, pool, slow, rich{}, nil)
	if res.Err == nil || time.Since(begun) > 20*time.Second {
		t.Fatalf("slow step: err %v after %s", res.Err, time.Since(begun))
	}
}

// Compensate direction and a remote step's command.
func TestRunStepCompensateAndRemote(t *testing.T) {
	t.Parallel()
	pool, _ := db(t)
	var forward, backward int
	step := saga.Step[rich]{Name: "reserve",
		Action:     func(context.Context, *saga.StepRun, *rich) error { forward++; return nil },
		Compensate: func(context.Context, *saga.StepRun, *rich) error { backward++; return nil },
	}
	id := uuid.New()
	res := sagatest.RunStep(t, pool, step, rich{}, &sagatest.StepOpts{Direction: steps.Compensate, SagaID: id, Attempt: 3, Epoch: 2})
	if res.Err != nil || forward != 0 || backward != 1 {
		t.Fatalf("compensate: err %v, forward %d, backward %d", res.Err, forward, backward)
	}
	if res.Run.Direction != steps.Compensate || res.Run.SagaID != id || res.Run.Attempt != 3 || res.Run.Epoch != 2 ||
		!strings.HasPrefix(res.Run.Key.String(), id.String()+"/reserve/") {
		t.Fatalf("run %+v key %s", res.Run, res.Run.Key)
	}
	remote := saga.Step[rich]{Name: "pay", Remote: &saga.Remote[rich]{
		Topic: "payments", Type: "payments.charge",
		Command: func(_ context.Context, _ *saga.StepRun, s *rich) (any, error) {
			return map[string]string{"order": s.ID}, nil
		},
	}}
	res = sagatest.RunStep(t, pool, remote, rich{ID: "o-\u00e9"}, nil)
	if res.Err != nil || string(res.Command) != `{"order":"o-é"}` {
		t.Fatalf("remote: err %v, command %s", res.Err, res.Command)
	}
}

// "as the engine would": a state the engine cannot store (a NUL in a
// string, which jsonb refuses) parks the saga in the engine; RunStep must
// not report that step as a plain success.
func TestRunStepNULInStateAsTheEngineWould(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := db(t)
	nul := saga.Step[rich]{Name: "nul", Action: func(_ context.Context, _ *saga.StepRun, s *rich) error {
		s.Text = "a\x00b"
		return nil
	}}
	d := saga.Define("r29_nul", nul)
	e := engine(t, pool, schema, d)
	st, err := saga.Start(ctx, e, d, rich{ID: "o-1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := sagatest.WaitEnded(t, e, st.ID, nil)
	t.Logf("engine: %s", sagatest.Describe(in))
	if in.Status == saga.StatusCompleted {
		t.Fatalf("the engine completed a saga with a NUL in its state")
	}
	res := sagatest.RunStep(t, pool, nul, rich{ID: "o-1"}, nil)
	t.Logf("RunStep: err %v, state %q", res.Err, res.State.Text)
	if res.Err == nil {
		t.Fatalf("RunStep passed a step that the engine ends %s (%v)", in.Status, in.LastError)
	}
}

// The engine bounds a state at Config.MaxStateBytes (1 MiB by default) after
// each step; RunStep "as the engine would" should not pass a 2 MiB state.
func TestRunStepOversizedStateAsTheEngineWould(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := db(t)
	grow := saga.Step[rich]{Name: "grow", Action: func(_ context.Context, _ *saga.StepRun, s *rich) error {
		s.Text = strings.Repeat("x", 2<<20)
		return nil
	}}
	d := saga.Define("r29_grow", grow)
	e := engine(t, pool, schema, d)
	st, err := saga.Start(ctx, e, d, rich{ID: "o-1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := sagatest.WaitEnded(t, e, st.ID, nil)
	if in.Status == saga.StatusCompleted {
		t.Fatalf("the engine completed a saga with a 2 MiB state")
	}
	res := sagatest.RunStep(t, pool, grow, rich{ID: "o-1"}, nil)
	t.Logf("engine: %v; RunStep: err %v", in.LastError, res.Err)
	if res.Err == nil {
		t.Fatalf("RunStep passed a step that the engine ends %s (%v)", in.Status, in.LastError)
	}
}
