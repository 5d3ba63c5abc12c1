package review34_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// sleeper is a saga that sleeps d, then completes.
func sleeper(name string, d time.Duration) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "nap", Wait: saga.Sleep[order](d)},
		saga.Step[order]{Name: "after", Action: noop})
}

// startWaiting starts a saga of def and waits until its wait has started.
func startWaiting(t *testing.T, e *saga.Engine, def *saga.Definition[order]) uuid.UUID {
	t.Helper()
	st, err := saga.Start(ctxT(t, 10*time.Second), e, def, order{ID: uuid.NewString()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sagatest.Wait(t, e, st.ID, sagatest.Event("wait_started:nap"), &sagatest.WaitOpts{Timeout: 15 * time.Second})
	return st.ID
}

// waitUntil is the end of the saga's wait, in database time.
func waitUntil(t *testing.T, e *saga.Engine, id uuid.UUID) time.Time {
	t.Helper()
	in := get(t, e, id)
	if in.Wait == nil || in.Wait.Until == nil {
		t.Fatalf("saga %s has no wait end: %s %+v\n%s", id, in.Status, in.Wait, timeline(in))
	}
	return *in.Wait.Until
}

// TestAdvanceRefusesNonPositive: "d must be positive (an error
// otherwise)"; nothing moves.
func TestAdvanceRefusesNonPositive(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	def := sleeper("nap8", 8*time.Hour)
	e := engine(t, pool, &saga.Config{Schema: schema}, def)
	id := startWaiting(t, e, def)
	before := waitUntil(t, e, id)
	c := sagatest.NewClock(pool, schema, e)
	for _, d := range []time.Duration{0, -1, -time.Hour, math.MinInt64} {
		err := c.Advance(ctxT(t, 10*time.Second), d)
		if err == nil {
			t.Errorf("Advance(%v) = nil, want an error", d)
		} else if !strings.Contains(err.Error(), "positive") {
			t.Errorf("Advance(%v) = %v: does not say d must be positive", d, err)
		}
	}
	if after := waitUntil(t, e, id); !after.Equal(before) {
		t.Fatalf("refused advances moved the wait's end from %v to %v", before, after)
	}
}

// TestAdvanceByHugeDurations: the longest duration is positive; Advance
// must take it (or refuse it with an error), never leave the schema in a
// state where the saga does not end.
func TestAdvanceByHugeDurations(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	def := sleeper("nap48", 48*time.Hour)
	e := engine(t, pool, &saga.Config{Schema: schema}, def)
	id := startWaiting(t, e, def)
	c := sagatest.NewClock(pool, schema, e)
	for i, d := range []time.Duration{1, time.Microsecond, math.MaxInt64, math.MaxInt64, math.MaxInt64} {
		if err := c.Advance(ctxT(t, 20*time.Second), d); err != nil {
			t.Logf("Advance #%d (%v) = %v", i, d, err)
			if d < time.Hour {
				t.Fatalf("Advance(%v) failed: %v", d, err)
			}
		}
	}
	in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: 15 * time.Second})
	if in.Status != saga.StatusCompleted {
		t.Fatalf("after advancing past a 48 h sleep: %s\n%s", in.Status, sagatest.Describe(in))
	}
	sagatest.RequireTimeline(t, in, "saga_started", "wait_started:nap", "timer_fired:nap", "step_completed:nap", "step_completed:after", "saga_completed")
	// A new saga on the schema still runs and sleeps as long as it says.
	id2 := startWaiting(t, e, def)
	u := waitUntil(t, e, id2)
	var now time.Time
	if err := pool.QueryRow(context.Background(), "SELECT now()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	if got := u.Sub(now); got < 47*time.Hour || got > 49*time.Hour {
		t.Fatalf("a new 48 h sleep ends in %v", got)
	}
}

// TestConcurrentAdvancesAddUp: eight Advance(1h) at once move an 8 h sleep
// by exactly 8 h: none fails, none is lost.
func TestConcurrentAdvancesAddUp(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	def := sleeper("nap9", 9*time.Hour)
	e := engine(t, pool, &saga.Config{Schema: schema}, def)
	id := startWaiting(t, e, def)
	before := waitUntil(t, e, id)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each goroutine its own clock, as parallel helpers would have.
			errs <- sagatest.NewClock(pool, schema, e).Advance(ctxT(t, 30*time.Second), time.Hour)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("a concurrent Advance failed: %v", err)
		}
	}
	after := waitUntil(t, e, id)
	if moved := before.Sub(after); moved != 8*time.Hour {
		t.Fatalf("eight concurrent Advance(1h) moved the wait's end by %v", moved)
	}
	if in := get(t, e, id); in.Status != saga.StatusRunning {
		t.Fatalf("a 9 h sleep ended after 8 h: %s", in.Status)
	}
	if err := sagatest.NewClock(pool, schema, e).Advance(ctxT(t, 10*time.Second), time.Hour); err != nil {
		t.Fatal(err)
	}
	if in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: 15 * time.Second}); in.Status != saga.StatusCompleted {
		t.Fatalf("%s", sagatest.Describe(in))
	}
}

// TestAdvanceWhileAStepRuns: "Advance waits for the transactions of running
// steps ... as long as ctx allows": with a short ctx it returns the
// context's error in time and moves nothing; with a longer one it returns
// once the step has committed.
func TestAdvanceWhileAStepRuns(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	entered := make(chan struct{}, 4)
	def := saga.Define("busy",
		saga.Step[order]{Name: "nap", Wait: saga.Sleep[order](10 * time.Hour)},
		saga.Step[order]{Name: "hog", Timeout: 30 * time.Second, Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			entered <- struct{}{}
			select {
			case <-time.After(3 * time.Second):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}})
	e := engine(t, pool, &saga.Config{Schema: schema}, def)
	c := sagatest.NewClock(pool, schema, e)
	// A second saga sleeps, to see whether a failed Advance moved anything.
	id := startWaiting(t, e, def)
	other := startWaiting(t, e, def)
	if err := c.Advance(ctxT(t, 10*time.Second), 10*time.Hour); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered:
	case <-time.After(15 * time.Second):
		t.Fatal("the hog step did not start")
	}
	_ = id
	_ = other
	// Now both hogs run (or one runs, one waits). Advance with 300 ms.
	third := startWaiting(t, e, def)
	before := waitUntil(t, e, third)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	begun := time.Now()
	err := c.Advance(ctx, time.Hour)
	took := time.Since(begun)
	t.Logf("Advance with 300 ms while a step runs: %v after %v", err, took)
	if took > 2*time.Second {
		t.Errorf("Advance with a 300 ms context took %v", took)
	}
	if err == nil {
		// It may have got through if no step held a row then; then it moved.
		if after := waitUntil(t, e, third); before.Sub(after) != time.Hour {
			t.Fatalf("Advance returned nil and moved the wait by %v", before.Sub(after))
		}
		return
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Advance's error does not wrap the context's: %v", err)
	}
	if after := waitUntil(t, e, third); !after.Equal(before) {
		t.Fatalf("a failed Advance moved the wait's end by %v (not one transaction)", before.Sub(after))
	}
	// With time enough, it waits for the step and moves.
	if err := c.Advance(ctxT(t, 20*time.Second), time.Hour); err != nil {
		t.Fatalf("Advance with 20 s: %v", err)
	}
	if after := waitUntil(t, e, third); before.Sub(after) != time.Hour {
		t.Fatalf("moved by %v, want 1h", before.Sub(after))
	}
}

// TestClockMisuse: a clock of a nil pool, of a typed nil engine, or after
// its engine stopped returns an error (or works); it never panics.
func TestClockMisuse(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	def := sleeper("nap2", 2*time.Hour)
	e := engine(t, pool, &saga.Config{Schema: schema}, def)
	id := startWaiting(t, e, def)
	for name, c := range map[string]*sagatest.Clock{
		"nil pool":         sagatest.NewClock(nil, schema, e),
		"typed nil engine": sagatest.NewClock(pool, schema, (*saga.Engine)(nil)),
		"nil engines":      sagatest.NewClock(pool, schema, nil, nil),
		"closed pool":      sagatest.NewClock(closedPool(t), schema),
	} {
		t.Run(name, func(t *testing.T) {
			var err error
			o := call(15*time.Second, func() { err = c.Advance(ctxT(t, 10*time.Second), time.Minute) })
			if o.panicked != nil {
				t.Fatalf("Advance panicked: %v", o.panicked)
			}
			if o.hung {
				t.Fatalf("Advance hung")
			}
			t.Logf("Advance: %v", err)
			if strings.Contains(name, "nil pool") || strings.Contains(name, "closed") {
				if err == nil {
					t.Fatalf("Advance on a %s returned nil", name)
				}
			}
		})
	}
	// After the engine stopped, Advance still moves the rows (RescueNow on a
	// stopped engine may fail, but must say so), and a new engine finishes.
	if err := e.Stop(ctxT(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	err := sagatest.NewClock(pool, schema, e).Advance(ctxT(t, 10*time.Second), 3*time.Hour)
	t.Logf("Advance after Stop: %v", err)
	e2 := engine(t, pool, &saga.Config{Schema: schema}, def)
	in := sagatest.WaitEnded(t, e2, id, &sagatest.WaitOpts{Timeout: 15 * time.Second})
	if in.Status != saga.StatusCompleted {
		t.Fatalf("%s", sagatest.Describe(in))
	}
}

func closedPool(t *testing.T) *pgxpool.Pool {
	p, err := pgxpool.New(context.Background(), pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	return p
}
