package review29_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// waiting waits until the saga's timer is stored.
func waiting(t *testing.T, e *saga.Engine, id uuid.UUID) time.Time {
	t.Helper()
	in := sagatest.Wait(t, e, id, sagatest.Cond("store its timer", func(in *saga.Instance) bool {
		return in.Wait != nil && in.Wait.Until != nil
	}), nil)
	return *in.Wait.Until
}

// A 48-hour sleep: an hour of Advance moves its end an hour nearer and ends
// nothing; 47 more end it. A second schema's saga is not touched.
func TestClockDrivesSleepAndStaysInItsSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := db(t)
	d := napper("r29_nap")
	e := engine(t, pool, schema, d)
	pool2, schema2 := db(t)
	e2 := engine(t, pool2, schema2, d)

	id := start(t, e, d, "o-1")
	other := start(t, e2, d, "o-1")
	until := waiting(t, e, id)
	until2 := waiting(t, e2, other)

	clock := sagatest.NewClock(pool, schema, e)
	if err := clock.Advance(ctx, time.Hour); err != nil {
		t.Fatalf("advance 1h: %v", err)
	}
	in, err := e.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if in.Status != saga.StatusRunning || in.Step != "nap" || in.Wait == nil || in.Wait.Until == nil {
		t.Fatalf("after 1h of 48h: %s", sagatest.Describe(in))
	}
	if moved := until.Sub(*in.Wait.Until); moved < 59*time.Minute || moved > 61*time.Minute {
		t.Fatalf("the timer moved by %s, want 1h", moved)
	}
	if err := clock.Advance(ctx, 47*time.Hour); err != nil {
		t.Fatalf("advance 47h: %v", err)
	}
	begun := time.Now()
	in = sagatest.WaitEnded(t, e, id, nil)
	if in.Status != saga.StatusCompleted {
		t.Fatalf("after 48h: %s", sagatest.Describe(in))
	}
	t.Logf("ended %s after the advance", time.Since(begun))

	in2, err := e2.Get(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if in2.Status != saga.StatusRunning || in2.Wait == nil || in2.Wait.Until == nil || !in2.Wait.Until.Equal(until2) {
		t.Fatalf("the other schema's saga moved: %s", sagatest.Describe(in2))
	}
}

// A retry due in two hours (steps.RetryAfter) and a signal's time limit of
// a day pass with Advance.
func TestClockDrivesRetryAfterAndSignalTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := db(t)
	var calls atomic.Int32
	retried := saga.Define("r29_retry",
		saga.Step[order]{Name: "charge", Action: func(context.Context, *saga.StepRun, *order) error {
			if calls.Add(1) == 1 {
				return steps.RetryAfter(2*time.Hour, errors.New("try later"))
			}
			return nil
		}},
	)
	awaiting := saga.Define("r29_await",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "approval", Wait: saga.OnSignal("approved",
			func(context.Context, *saga.StepRun, *order, struct{}) error { return nil }).Timeout(24 * time.Hour)},
	)
	e := engine(t, pool, schema, retried, awaiting)
	r := start(t, e, retried, "o-1")
	a := start(t, e, awaiting, "o-2")
	sagatest.Wait(t, e, r, sagatest.Event("step_failed:charge"), nil)
	waiting(t, e, a)

	// Not yet: a minute is not two hours.
	if err := sagatest.NewClock(pool, schema, e).Advance(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	expectFail(t, 20*time.Second, func(tb testing.TB) {
		sagatest.WaitEnded(tb, e, r, &sagatest.WaitOpts{Timeout: 500 * time.Millisecond})
	}, "step_failed:charge")

	if err := sagatest.NewClock(pool, schema, e).Advance(ctx, 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	in := sagatest.WaitEnded(t, e, r, nil)
	sagatest.RequireTimeline(t, in, "saga_started", "step_failed:charge", "step_completed:charge", "saga_completed")
	in = sagatest.WaitEnded(t, e, a, nil)
	if in.Status != saga.StatusCompensated {
		t.Fatalf("the signal's time limit did not pass: %s", sagatest.Describe(in))
	}
	sagatest.Wait(t, e, a, sagatest.Event("wait_timed_out:approval"), nil)
}

// A clock of a schema that does not exist, or whose name is hostile, must
// not report success: a test would then believe time had passed.
func TestClockOfAWrongSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := db(t)
	for name, s := range map[string]string{
		"missing":         schema + "_nope",
		"injection":       schema + `"; DROP SCHEMA "` + schema + `" CASCADE; --`,
		"short injection": `a"; DROP SCHEMA x; --`,
		"nul":             schema + "\x00",
		"bad utf-8":       schema + "\xff",
		"empty":           "",
	} {
		t.Run(name, func(t *testing.T) {
			err := sagatest.NewClock(pool, s).Advance(ctx, time.Hour)
			if err == nil {
				t.Errorf("Advance on schema %q reported success", s)
			}
			t.Logf("%v", err)
		})
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the schema is gone (%d, %v)", n, err)
	}
}

// Advance with a cancelled context fails and moves nothing; a negative
// duration is not documented and must at least not move time forward
// silently into the past of a timer.
func TestClockAdvanceEdges(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := napper("r29_nap")
	e := engine(t, pool, schema, d)
	id := start(t, e, d, "o-1")
	until := waiting(t, e, id)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := sagatest.NewClock(pool, schema, e).Advance(cancelled, 48*time.Hour); err == nil {
		t.Fatal("Advance with a cancelled context succeeded")
	}
	in, err := e.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if in.Wait == nil || in.Wait.Until == nil || !in.Wait.Until.Equal(until) {
		t.Fatalf("a failed Advance moved the timer: %s", sagatest.Describe(in))
	}
	err = sagatest.NewClock(pool, schema, e).Advance(context.Background(), -time.Hour)
	in, gerr := e.Get(context.Background(), id)
	if gerr != nil {
		t.Fatal(gerr)
	}
	t.Logf("Advance(-1h): err=%v, timer moved by %s", err, in.Wait.Until.Sub(until))
	if err == nil && in.Wait.Until.Before(until) {
		t.Fatal("Advance(-1h) made time pass forward")
	}
}
