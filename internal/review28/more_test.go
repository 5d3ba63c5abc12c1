package review28_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// An engine on schema A never reads or touches schema B's sagas, whatever
// transaction it is handed.
func TestTwoTenants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b := testkit.NewDB(t), testkit.NewDB(t)
	aw := prepare(t, a, waitDef("r28ten"), 1, isWaiting)[0]
	bw := prepare(t, b, waitDef("r28ten"), 1, isWaiting)[0]
	bf := prepare(t, b, failDef("r28tenf"), 1, isFailed)[0]
	eb := client(t, b)
	if err := eb.Pause(ctx, bw, "b's pause"); err != nil {
		t.Fatal(err)
	}
	ea := client(t, a)
	before := digest(t, b)
	for _, pool := range []*testkit.DB{a, b} {
		tx := begin(t, pool, pgx.ReadCommitted)
		for op, f := range map[string]func() error{
			"UnpauseTx": func() error { return ea.UnpauseTx(ctx, tx, bw, "a") },
			"PauseTx":   func() error { return ea.PauseTx(ctx, tx, bf, "a") },
			"ResumeTx":  func() error { return ea.ResumeTx(ctx, tx, bf, "a") },
			"RerunTx":   func() error { return ea.RerunTx(ctx, tx, bf, "open", "a") },
			"GetTx":     func() error { _, err := ea.GetTx(ctx, tx, bw); return err },
			"Unpause":   func() error { return ea.Unpause(ctx, bw, "a") },
		} {
			if err := f(); !errors.Is(err, saga.ErrNotFound) {
				t.Errorf("engine of A, %s on B's saga (tx of %s): %v, want ErrNotFound", op, pool.Schema, err)
			}
			usable(t, tx, op)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// A's own saga of the same type name: pausing and unpausing it leaves B alone
	tx := begin(t, a, pgx.ReadCommitted)
	if err := ea.PauseTx(ctx, tx, aw, "a"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ea.Unpause(ctx, aw, "a"); err != nil {
		t.Fatal(err)
	}
	if got := digest(t, b); got != before {
		t.Fatalf("the engine of schema A changed schema B")
	}
}

// Hostile reasons: stored as PostgreSQL text (NUL as \0, invalid UTF-8 as
// U+FFFD, at most 2000 bytes) by every Tx action, the transaction usable.
func TestHostileReasons(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	w := prepare(t, d, waitDef("r28host"), 1, isWaiting)[0]
	f := prepare(t, d, failDef("r28hostf"), 1, isFailed)[0]
	c := prepare(t, d, okDef("r28hostc"), 1, isCompleted)[0]
	e := client(t, d)
	reasons := []string{"nul\x00here", "bad\xff\xfeutf8", strings.Repeat("x\x00\xff", 4000), strings.Repeat("é", 6000), "\u202e\x1b[2J"}
	for i, r := range reasons {
		tx := begin(t, d, pgx.ReadCommitted)
		if err := e.PauseTx(ctx, tx, w, r); err != nil {
			t.Fatalf("PauseTx reason %d: %v", i, err)
		}
		in, err := e.GetTx(ctx, tx, w)
		if err != nil {
			t.Fatalf("GetTx: %v", err)
		}
		got := in.Paused.Reason
		if !utf8.ValidString(got) || strings.ContainsRune(got, 0) || len(got) > 2000 {
			t.Fatalf("reason %d stored as %d bytes, valid UTF-8 %v, NUL %v", i, len(got), utf8.ValidString(got), strings.ContainsRune(got, 0))
		}
		if i == 0 && got != `nul\0here` {
			t.Fatalf("a NUL should become \\0: %q", got)
		}
		if err := e.UnpauseTx(ctx, tx, w, r); err != nil {
			t.Fatalf("UnpauseTx reason %d: %v", i, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	tx := begin(t, d, pgx.ReadCommitted)
	if err := e.RerunTx(ctx, tx, c, "b", reasons[2]); err != nil {
		t.Fatalf("RerunTx hostile reason: %v", err)
	}
	if err := e.ResumeTx(ctx, tx, f, reasons[2]); err != nil {
		t.Fatalf("ResumeTx hostile reason: %v", err)
	}
	usable(t, tx, "hostile reasons")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uuid.UUID{w, f, c} {
		in := get(t, e, id)
		for _, ev := range in.History {
			if len(ev.Detail) > 8000 || !utf8.Valid(ev.Detail) {
				t.Fatalf("history %s of %s: detail of %d bytes", ev.Type, id, len(ev.Detail))
			}
		}
	}
	if n := events(get(t, e, w), saga.EventSagaUnpaused); n != len(reasons) {
		t.Fatalf("%d saga_unpaused, want %d", n, len(reasons))
	}
}

// GetTx agrees with itself in a REPEATABLE READ or SERIALIZABLE transaction
// while another operator pauses the saga.
func TestGetTxSnapshot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	ids := prepare(t, d, waitDef("r28snap"), 2, isWaiting)
	e := client(t, d)
	for i, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		id := ids[i]
		tx := begin(t, d, iso)
		first, err := e.GetTx(ctx, tx, id)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Pause(ctx, id, "meanwhile"); err != nil {
			t.Fatal(err)
		}
		again, err := e.GetTx(ctx, tx, id)
		if err != nil {
			t.Fatal(err)
		}
		if again.Paused != nil || again.Version != first.Version || len(again.History) != len(first.History) {
			t.Fatalf("%s: GetTx's reads disagree within the snapshot: paused %+v, version %d/%d, history %d/%d",
				iso, again.Paused, first.Version, again.Version, len(first.History), len(again.History))
		}
		_ = tx.Rollback(ctx)
		if in := get(t, e, id); in.Paused == nil {
			t.Fatal("the pause is lost")
		}
	}
}

// The actions in a REPEATABLE READ or SERIALIZABLE transaction whose snapshot
// predates another operator's change: the docs say "should be READ
// COMMITTED"; whatever they do, an action that returns nil must have its
// effect once the transaction commits.
func TestTxActionsUnderStaleSnapshot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	ids := prepare(t, d, waitDef("r28stale"), 4, isWaiting)
	e := client(t, d)
	for i, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		// PauseTx on a saga paused in the snapshot, unpaused since
		id := ids[2*i]
		if err := e.Pause(ctx, id, "old"); err != nil {
			t.Fatal(err)
		}
		tx := begin(t, d, iso)
		usable(t, tx, "begin") // takes the snapshot
		if err := e.Unpause(ctx, id, "meanwhile"); err != nil {
			t.Fatal(err)
		}
		perr := e.PauseTx(ctx, tx, id, "stale")
		if perr != nil {
			usable(t, tx, "a refused PauseTx")
		}
		cerr := tx.Commit(ctx)
		in := get(t, e, id)
		t.Logf("%s PauseTx: %v; commit: %v; paused after: %v", iso, perr, cerr, in.Paused != nil)
		if perr == nil && cerr == nil && in.Paused == nil {
			t.Errorf("%s: PauseTx returned nil and the transaction committed, but the saga is not paused", iso)
		}
		// UnpauseTx on a saga not paused in the snapshot, paused since
		id = ids[2*i+1]
		tx = begin(t, d, iso)
		usable(t, tx, "begin")
		if err := e.Pause(ctx, id, "meanwhile"); err != nil {
			t.Fatal(err)
		}
		uerr := e.UnpauseTx(ctx, tx, id, "stale")
		if uerr != nil {
			usable(t, tx, "a refused UnpauseTx")
		}
		cerr = tx.Commit(ctx)
		in = get(t, e, id)
		t.Logf("%s UnpauseTx: %v; commit: %v; paused after: %v", iso, uerr, cerr, in.Paused != nil)
		if uerr == nil && cerr == nil && in.Paused != nil {
			t.Errorf("%s: UnpauseTx returned nil and committed, but the saga is still paused", iso)
		}
	}
}

// gateDef: "hold" waits at the gate, then "next" records that it ran.
func gateDef(name string, gate *testkit.Gate, nextRuns *atomic.Int32) *saga.Definition[st] {
	return saga.Define(name,
		saga.Step[st]{Name: "hold", Action: func(ctx context.Context, _ *saga.StepRun, _ *st) error { return gate.Pass(ctx) }},
		saga.Step[st]{Name: "next", Action: func(context.Context, *saga.StepRun, *st) error { nextRuns.Add(1); return nil }},
	)
}

// An operator pauses with PauseTx while a step runs: the step finishes, the
// next waits for UnpauseTx. ResumeTx and RerunTx of the running saga are
// refused.
func TestPauseTxWhileAStepRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	var next atomic.Int32
	def := gateDef("r28mid", gate, &next)
	e, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
	s, err := saga.Start(ctx, e, def, st{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 30*time.Second, "the step runs", func() bool { return gate.Entered() > 0 })
	tx := begin(t, d, pgx.ReadCommitted)
	if err := e.ResumeTx(ctx, tx, s.ID, "x"); !errors.Is(err, saga.ErrNotReplayable) {
		t.Fatalf("ResumeTx of a running saga: %v", err)
	}
	if err := e.RerunTx(ctx, tx, s.ID, "hold", "x"); !errors.Is(err, saga.ErrNotReplayable) {
		t.Fatalf("RerunTx of a running saga: %v", err)
	}
	if err := e.PauseTx(ctx, tx, s.ID, "mid-step"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	gate.Open()
	testkit.WaitFor(t, 30*time.Second, "hold completes", func() bool {
		return testkit.Events(get(t, e, s.ID), saga.EventStepCompleted, "hold") == 1
	})
	testkit.Hold(t, time.Second, "next does not run while paused", func() bool { return next.Load() == 0 })
	tx = begin(t, d, pgx.ReadCommitted)
	if err := e.UnpauseTx(ctx, tx, s.ID, "go"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	in := testkit.WaitEnded(t, e, s.ID)
	if in.Status != saga.StatusCompleted || next.Load() != 1 {
		t.Fatalf("after UnpauseTx: %s, next ran %d times", in.Status, next.Load())
	}
}

// A saga paused while its compensation runs, whose compensation then gives up:
// it ends failed. Two operators' Unpause must not replay it.
func TestUnpauseNeverReplaysAFailedSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	def := saga.Define("r28fwp",
		saga.Step[st]{Name: "reserve",
			Action: func(context.Context, *saga.StepRun, *st) error { return nil },
			Compensate: func(ctx context.Context, _ *saga.StepRun, _ *st) error {
				if err := gate.Pass(ctx); err != nil {
					return err
				}
				return steps.Permanent(errors.New("release refused"))
			}},
		saga.Step[st]{Name: "charge", Action: func(context.Context, *saga.StepRun, *st) error {
			return steps.Permanent(errors.New("declined"))
		}},
	)
	e, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
	s, err := saga.Start(ctx, e, def, st{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 30*time.Second, "the compensation runs", func() bool { return gate.Entered() > 0 })
	if err := e.Pause(ctx, s.ID, "while compensating"); err != nil {
		t.Fatal(err)
	}
	gate.Open()
	in := testkit.WaitEnded(t, e, s.ID)
	if in.Status != saga.StatusFailed {
		t.Fatalf("ended %s, want failed: %v", in.Status, testkit.Timeline(in))
	}
	errs := together(4, func(i int) error {
		if i%2 == 0 {
			return e.Unpause(ctx, s.ID, "op")
		}
		tx, err := d.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if err := e.UnpauseTx(ctx, tx, s.ID, "optx"); err != nil {
			return err
		}
		return tx.Commit(ctx)
	})
	for _, err := range errs {
		if !errors.Is(err, saga.ErrNotPaused) {
			t.Errorf("Unpause of a failed saga: %v, want ErrNotPaused", err)
		}
	}
	testkit.Hold(t, 500*time.Millisecond, "the saga stays failed", func() bool {
		in := get(t, e, s.ID)
		return in.Status == saga.StatusFailed && events(in, saga.EventSagaResumed) == 0
	})
	// the CLI's unpause of it exits 1 and does not replay it either
	r := cli(t, d, "unpause", s.ID.String())
	if r.code != 1 {
		t.Fatalf("sagaflow unpause of a failed saga: %s", r)
	}
	if in := get(t, e, s.ID); in.Status != saga.StatusFailed || events(in, saga.EventSagaResumed) != 0 {
		t.Fatalf("the CLI's unpause replayed a failed saga")
	}
}
