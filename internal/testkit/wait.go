package testkit

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

const (
	// Poll is how often [WaitFor] and [Hold] evaluate their condition.
	Poll = 20 * time.Millisecond
	// WaitTimeout is how long [WaitEnded] and [WaitStatus] wait for a
	// saga before they fail the test.
	WaitTimeout = 40 * time.Second
)

// WaitFor evaluates cond every [Poll] until it holds, and fails the test
// if it still does not after d. what says what the test waits for, in the
// failure message ("timed out after 30s waiting for what"). cond may
// itself fail the test.
func WaitFor(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			tb.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(Poll)
	}
}

// Hold evaluates cond every [Poll] for d and fails the test the first time
// it does not hold: for an absence, which can be observed only for a
// while. what says what must keep holding, in the failure message.
func Hold(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if !cond() {
			tb.Fatalf("did not keep holding for %s: %s", d, what)
		}
		time.Sleep(Poll)
	}
}

// Recv receives from ch, and fails the test if nothing comes within d.
// what says what the value means, in the failure message.
func Recv[T any](tb testing.TB, ch <-chan T, d time.Duration, what string) T {
	tb.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		tb.Fatalf("timed out after %s waiting for %s", d, what)
	}
	var zero T
	return zero
}

// WaitEnded waits at most [WaitTimeout] for saga id to end, reading it
// through g (an engine, started or not), and returns it.
func WaitEnded(tb testing.TB, g sagatest.Getter, id uuid.UUID) *saga.Instance {
	tb.Helper()
	return sagatest.WaitEnded(tb, g, id, &sagatest.WaitOpts{Timeout: WaitTimeout})
}

// WaitStatus waits at most [WaitTimeout] for saga id to have status want,
// reading it through an engine of its own on d that is only a client, so
// that the engines under test may be stopped and replaced meanwhile.
func WaitStatus(tb testing.TB, d *DB, id uuid.UUID, want saga.Status) *saga.Instance {
	tb.Helper()
	client := NewEngine(tb, d.Pool, &saga.Config{Schema: d.Schema, Logger: Discard})
	return sagatest.Wait(tb, client, id, sagatest.Status(want), &sagatest.WaitOpts{Timeout: WaitTimeout})
}

// ActWhileHeld waits up to d until a function has entered gate, then has e
// pause ("pause") or cancel ("cancel") saga id while the function is held
// there, and opens gate: an operator acting while a step runs.
func ActWhileHeld(tb testing.TB, e *saga.Engine, id uuid.UUID, op string, gate *Gate, d time.Duration) {
	tb.Helper()
	WaitFor(tb, d, "a function to be held at the gate", func() bool { return gate.Entered() >= 1 })
	// A handler that left the gate by its context (its step's timeout
	// passed on a slow machine) is not held when the operator acts: what
	// the test asserts next would not follow from it.
	held := func(when string) {
		if gate.Left() > 0 {
			tb.Fatalf("testkit: %s saga %s: %d handler(s) left the gate by their context %s, so the step was not held: the test's step timeout is too short for this machine",
				op, id, gate.Left(), when)
		}
	}
	held("before the operator acted")
	ctx := context.Background()
	var err error
	switch op {
	case "pause":
		err = e.Pause(ctx, id, "an operator looks at it")
	case "cancel":
		err = e.Cancel(ctx, id, "an operator stops it")
	default:
		tb.Fatalf("testkit: ActWhileHeld: unknown operation %q", op)
	}
	if err != nil {
		tb.Fatalf("testkit: %s saga %s: %v", op, id, err)
	}
	if op == "pause" {
		// A pause leaves the handler alone (a cancel ends its context).
		held("before the pause committed")
	}
	gate.Open()
}
