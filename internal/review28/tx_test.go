package review28_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Every Tx action undone by the caller's rollback leaves no trace; committed,
// it takes effect, and before the commit nobody else sees it.
func TestTxActionsRolledBackLeaveNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	w := prepare(t, d, waitDef("r28rbw"), 1, isWaiting)[0]
	f := prepare(t, d, failDef("r28rbf"), 1, isFailed)[0]
	c := prepare(t, d, okDef("r28rbc"), 1, isCompleted)[0]
	e := client(t, d)
	if err := e.Pause(ctx, w, "setup"); err != nil {
		t.Fatal(err)
	}
	// a second waiting saga, unpaused, for PauseTx
	w2 := prepare(t, d, waitDef("r28rbw2"), 1, isWaiting)[0]

	before := digest(t, d)
	acts := []struct {
		name string
		do   func(tx pgx.Tx) error
	}{
		{"PauseTx", func(tx pgx.Tx) error { return e.PauseTx(ctx, tx, w2, "rb") }},
		{"UnpauseTx", func(tx pgx.Tx) error { return e.UnpauseTx(ctx, tx, w, "rb") }},
		{"ResumeTx of paused", func(tx pgx.Tx) error { return e.ResumeTx(ctx, tx, w, "rb") }},
		{"ResumeTx of failed", func(tx pgx.Tx) error { return e.ResumeTx(ctx, tx, f, "rb") }},
		{"RerunTx of failed", func(tx pgx.Tx) error { return e.RerunTx(ctx, tx, f, "open", "rb") }},
		{"RerunTx of completed", func(tx pgx.Tx) error { return e.RerunTx(ctx, tx, c, "a", "rb") }},
		{"RequestCancelTx", func(tx pgx.Tx) error { return e.RequestCancelTx(ctx, tx, w2, "rb") }},
	}
	for _, a := range acts {
		tx := begin(t, d, pgx.ReadCommitted)
		if err := a.do(tx); err != nil {
			t.Fatalf("%s: %v", a.name, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if got := digest(t, d); got != before {
			t.Fatalf("%s rolled back changed the schema:\nbefore\n%s\nafter\n%s", a.name, before, got)
		}
	}

	// Committed: each takes effect; before the commit others see nothing.
	tx := begin(t, d, pgx.ReadCommitted)
	if err := e.PauseTx(ctx, tx, w2, "commit"); err != nil {
		t.Fatal(err)
	}
	if in := get(t, e, w2); in.Paused != nil {
		t.Fatalf("PauseTx seen before its commit: %+v", in.Paused)
	}
	in, err := e.GetTx(ctx, tx, w2)
	if err != nil || in.Paused == nil || events(in, saga.EventSagaPaused) != 1 {
		t.Fatalf("GetTx does not see the transaction's own pause: %v %+v", err, in)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if in := get(t, e, w2); in.Paused == nil || in.Paused.Reason != "commit" {
		t.Fatalf("PauseTx committed, the saga is not paused: %+v", in.Paused)
	}

	tx = begin(t, d, pgx.ReadCommitted)
	if err := e.ResumeTx(ctx, tx, f, "commit"); err != nil {
		t.Fatal(err)
	}
	if in := get(t, e, f); in.Status != saga.StatusFailed {
		t.Fatalf("ResumeTx seen before commit: %s", in.Status)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if in := get(t, e, f); in.Status == saga.StatusFailed || events(in, saga.EventSagaResumed) != 1 {
		t.Fatalf("ResumeTx committed, saga %s with %d saga_resumed", in.Status, events(in, saga.EventSagaResumed))
	}
}

// A refused action returns its documented error and leaves the caller's
// transaction usable, with the caller's own writes intact.
func TestRefusedActionsLeaveTheTxUsable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	tbl := callerTable(t, d)
	w := prepare(t, d, waitDef("r28refw"), 1, isWaiting)[0]
	c := prepare(t, d, okDef("r28refc"), 1, isCompleted)[0]
	e := client(t, d)
	if _, err := e.PauseType(ctx, "r28refw", "type"); err != nil {
		t.Fatal(err)
	}
	before := digest(t, d)

	tx := begin(t, d, pgx.ReadCommitted)
	if _, err := tx.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('mine')`); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("é", 6000)
	cases := []struct {
		name string
		want error // nil: any error
		do   func() error
	}{
		{"ResumeTx of running", saga.ErrNotReplayable, func() error { return e.ResumeTx(ctx, tx, w, "x") }},
		{"ResumeTx of completed", saga.ErrNotReplayable, func() error { return e.ResumeTx(ctx, tx, c, "x") }},
		{"RerunTx of running", saga.ErrNotReplayable, func() error { return e.RerunTx(ctx, tx, w, "reserve", "x") }},
		{"RerunTx of unknown step", nil, func() error { return e.RerunTx(ctx, tx, c, "nope", "x") }},
		{"RerunTx of NUL step", nil, func() error { return e.RerunTx(ctx, tx, c, "a\x00b", "x") }},
		{"RerunTx of invalid UTF-8 step", nil, func() error { return e.RerunTx(ctx, tx, c, "a\xff", "x") }},
		{"RerunTx of 10 kB step", nil, func() error { return e.RerunTx(ctx, tx, c, long, "x") }},
		{"RerunTx of empty step", nil, func() error { return e.RerunTx(ctx, tx, c, "", "x") }},
		{"UnpauseTx held only by type", saga.ErrNotPaused, func() error { return e.UnpauseTx(ctx, tx, w, "x") }},
		{"UnpauseTx of completed", saga.ErrNotPaused, func() error { return e.UnpauseTx(ctx, tx, c, "x") }},
		{"UnpauseTx unknown", saga.ErrNotFound, func() error { return e.UnpauseTx(ctx, tx, uuid.New(), "x") }},
		{"PauseTx of completed", saga.ErrNotRunning, func() error { return e.PauseTx(ctx, tx, c, "x") }},
		{"PauseTx unknown", saga.ErrNotFound, func() error { return e.PauseTx(ctx, tx, uuid.New(), "x") }},
		{"ResumeTx unknown", saga.ErrNotFound, func() error { return e.ResumeTx(ctx, tx, uuid.New(), "x") }},
		{"RerunTx unknown", saga.ErrNotFound, func() error { return e.RerunTx(ctx, tx, uuid.New(), "a", "x") }},
		{"GetTx unknown", saga.ErrNotFound, func() error { _, err := e.GetTx(ctx, tx, uuid.New()); return err }},
		{"ResumeTx of type-held", saga.ErrNotReplayable, func() error { return e.ResumeTx(ctx, tx, w, "x") }},
	}
	for _, c := range cases {
		err := tryCall(c.do)
		if err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		if strings.HasPrefix(err.Error(), "PANIC") {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if c.want != nil && !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want an error wrapping %v", c.name, err, c.want)
		}
		if !utf8.ValidString(err.Error()) || strings.ContainsRune(err.Error(), 0) {
			t.Errorf("%s: the error text carries invalid UTF-8 or a NUL: %q", c.name, err.Error())
		}
		usable(t, tx, c.name)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit after refusals: %v", err)
	}
	if n := d.Count(t, `SELECT count(*) FROM `+tbl+` WHERE v = 'mine'`); n != 1 {
		t.Fatalf("the caller's own write is lost: %d rows", n)
	}
	// nothing of the engine's changed (the caller's table aside)
	after := digest(t, d)
	strip := func(s string) string {
		var out []string
		for _, l := range strings.Split(s, "\n") {
			if !strings.HasPrefix(l, "review28_caller=") {
				out = append(out, l)
			}
		}
		return strings.Join(out, "\n")
	}
	if strip(after) != strip(before) {
		t.Fatalf("refused actions changed the schema:\n%s\n---\n%s", before, after)
	}
}

// nil, committed and rolled back transactions, and a nil engine: errors, no
// panic, no effect.
func TestDeadTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	w := prepare(t, d, waitDef("r28dead"), 1, isWaiting)[0]
	e := client(t, d)
	before := digest(t, d)

	committed, _ := d.Pool.Begin(ctx)
	_ = committed.Commit(ctx)
	rolled, _ := d.Pool.Begin(ctx)
	_ = rolled.Rollback(ctx)
	for name, tx := range map[string]pgx.Tx{"nil": nil, "committed": committed, "rolled back": rolled} {
		for op, f := range map[string]func() error{
			"PauseTx":   func() error { return e.PauseTx(ctx, tx, w, "x") },
			"UnpauseTx": func() error { return e.UnpauseTx(ctx, tx, w, "x") },
			"ResumeTx":  func() error { return e.ResumeTx(ctx, tx, w, "x") },
			"RerunTx":   func() error { return e.RerunTx(ctx, tx, w, "reserve", "x") },
			"GetTx":     func() error { _, err := e.GetTx(ctx, tx, w); return err },
		} {
			err := tryCall(f)
			if err == nil || strings.HasPrefix(err.Error(), "PANIC") {
				t.Errorf("%s on a %s transaction: %v (want an error)", op, name, err)
			}
		}
	}
	var nilEngine *saga.Engine
	tx := begin(t, d, pgx.ReadCommitted)
	for op, f := range map[string]func() error{
		"PauseTx":   func() error { return nilEngine.PauseTx(ctx, tx, w, "x") },
		"UnpauseTx": func() error { return nilEngine.UnpauseTx(ctx, tx, w, "x") },
		"Unpause":   func() error { return nilEngine.Unpause(ctx, w, "x") },
		"ResumeTx":  func() error { return nilEngine.ResumeTx(ctx, tx, w, "x") },
		"RerunTx":   func() error { return nilEngine.RerunTx(ctx, tx, w, "reserve", "x") },
		"GetTx":     func() error { _, err := nilEngine.GetTx(ctx, tx, w); return err },
	} {
		if err := tryCall(f); !errors.Is(err, saga.ErrNilEngine) {
			t.Errorf("nil engine %s: %v, want ErrNilEngine", op, err)
		}
	}
	if got := digest(t, d); got != before {
		t.Fatalf("dead transactions changed the schema")
	}
}
