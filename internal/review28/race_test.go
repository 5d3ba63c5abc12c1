package review28_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Eight operators unpause one paused saga at once, half with Unpause, half
// with UnpauseTx in transactions they commit: exactly one lifts the pause.
func TestConcurrentUnpauseOneWins(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	ids := prepare(t, d, waitDef("r28cu"), 3, isWaiting)
	e := client(t, d)
	for round, id := range ids {
		if err := e.Pause(ctx, id, "p"); err != nil {
			t.Fatal(err)
		}
		errs := together(8, func(i int) error {
			if (i+round)%2 == 0 {
				return e.Unpause(ctx, id, "u")
			}
			tx, err := d.Pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if err := e.UnpauseTx(ctx, tx, id, "utx"); err != nil {
				return err
			}
			return tx.Commit(ctx)
		})
		wins := 0
		for _, err := range errs {
			switch {
			case err == nil:
				wins++
			case errors.Is(err, saga.ErrNotPaused):
			default:
				t.Errorf("unexpected error: %v", err)
			}
		}
		in := get(t, e, id)
		if wins != 1 || events(in, saga.EventSagaUnpaused) != 1 || in.Paused != nil {
			t.Fatalf("round %d: %d unpauses succeeded, %d saga_unpaused entries, paused %+v; errors %v",
				round, wins, events(in, saga.EventSagaUnpaused), in.Paused, errs)
		}
	}
}

// Eight operators resume one failed saga at once, each in its own
// transaction with ResumeTx: exactly one resume.
func TestConcurrentResumeTxOneWins(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	id := prepare(t, d, failDef("r28cr"), 1, isFailed)[0]
	e := client(t, d)
	errs := together(8, func(i int) error {
		if i%3 == 0 {
			return e.Resume(ctx, id, "plain")
		}
		tx, err := d.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if err := e.ResumeTx(ctx, tx, id, "tx"); err != nil {
			return err
		}
		return tx.Commit(ctx)
	})
	wins := 0
	for _, err := range errs {
		switch {
		case err == nil:
			wins++
		case errors.Is(err, saga.ErrNotReplayable):
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	in := get(t, e, id)
	if wins != 1 || events(in, saga.EventSagaResumed) != 1 {
		t.Fatalf("%d resumes succeeded, %d saga_resumed: %v", wins, events(in, saga.EventSagaResumed), errs)
	}
	// a concurrent Unpause of the (failed, unpaused) saga never replays it
	id2 := prepare(t, d, failDef("r28cr2"), 1, isFailed)[0]
	errs = together(6, func(int) error { return e.Unpause(ctx, id2, "u") })
	for _, err := range errs {
		if !errors.Is(err, saga.ErrNotPaused) {
			t.Fatalf("Unpause of a failed saga: %v, want ErrNotPaused", err)
		}
	}
	if in := get(t, e, id2); in.Status != saga.StatusFailed || events(in, saga.EventSagaResumed) != 0 {
		t.Fatalf("Unpause replayed a failed saga: %s", in.Status)
	}
}

// ResumeTx holds the saga's row until its commit: a second operator waits,
// and, once the first commits, is refused; a cancelled context frees the
// waiter with an error and no effect.
func TestResumeTxHoldsTheRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	id := prepare(t, d, failDef("r28hold"), 1, isFailed)[0]
	e := client(t, d)
	tx1 := begin(t, d, pgx.ReadCommitted)
	if err := e.ResumeTx(ctx, tx1, id, "first"); err != nil {
		t.Fatal(err)
	}
	// a waiter whose context ends while it waits
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	tx2 := begin(t, d, pgx.ReadCommitted)
	err := e.ResumeTx(cctx, tx2, id, "cancelled")
	cancel()
	if err == nil {
		t.Fatalf("a second ResumeTx did not wait for the first's row and succeeded")
	}
	if !errors.Is(err, context.DeadlineExceeded) && !strings.Contains(err.Error(), "cancel") {
		t.Logf("second ResumeTx with an ended context: %v", err)
	}
	_ = tx2.Rollback(ctx)
	// a patient waiter is refused once the first commits
	done := make(chan error, 1)
	go func() {
		tx3, err := d.Pool.Begin(ctx)
		if err != nil {
			done <- err
			return
		}
		defer tx3.Rollback(ctx)
		if err := e.ResumeTx(ctx, tx3, id, "third"); err != nil {
			done <- err
			return
		}
		done <- tx3.Commit(ctx)
	}()
	testkit.Hold(t, 200*time.Millisecond, "the third waits", func() bool { return len(done) == 0 })
	if err := tx1.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	err = testkit.Recv(t, done, 30*time.Second, "third ResumeTx")
	if !errors.Is(err, saga.ErrNotReplayable) {
		t.Fatalf("third ResumeTx after the first committed: %v, want ErrNotReplayable", err)
	}
	in := get(t, e, id)
	if events(in, saga.EventSagaResumed) != 1 {
		t.Fatalf("%d saga_resumed", events(in, saga.EventSagaResumed))
	}
	// the pool is not poisoned
	if err := e.Pause(ctx, id, "after"); err != nil {
		t.Fatalf("pause after: %v", err)
	}
}

// A context cancelled before the call: an error, no effect, and for the Tx
// forms nothing but the transaction is lost.
func TestCancelledContext(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	w := prepare(t, d, waitDef("r28ctx"), 1, isWaiting)[0]
	f := prepare(t, d, failDef("r28ctxf"), 1, isFailed)[0]
	e := client(t, d)
	if err := e.Pause(context.Background(), w, "p"); err != nil {
		t.Fatal(err)
	}
	before := digest(t, d)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for op, f := range map[string]func(tx pgx.Tx) error{
		"Unpause":   func(pgx.Tx) error { return e.Unpause(ctx, w, "x") },
		"UnpauseTx": func(tx pgx.Tx) error { return e.UnpauseTx(ctx, tx, w, "x") },
		"ResumeTx":  func(tx pgx.Tx) error { return e.ResumeTx(ctx, tx, f, "x") },
		"RerunTx":   func(tx pgx.Tx) error { return e.RerunTx(ctx, tx, f, "open", "x") },
		"PauseTx":   func(tx pgx.Tx) error { return e.PauseTx(ctx, tx, f, "x") },
	} {
		tx := begin(t, d, pgx.ReadCommitted)
		if err := tryCall(func() error { return f(tx) }); err == nil || strings.HasPrefix(err.Error(), "PANIC") {
			t.Errorf("%s with a cancelled context: %v", op, err)
		}
		_ = tx.Commit(context.Background()) // whatever survived, commit it
	}
	if got := digest(t, d); got != before {
		t.Fatalf("calls with a cancelled context changed the schema")
	}
}
