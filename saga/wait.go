package saga

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// History events of steps that wait.
const (
	// EventWaitStarted: the saga waits at a step; the detail says for
	// what ("kind", "for") and for how long at most ("until_ms", absent
	// when there is no limit).
	EventWaitStarted = "wait_started"
	// EventTimerFired: a timer step's time came.
	EventTimerFired = "timer_fired"
	// EventSignalReceived: an awaited signal was delivered to the step; the
	// detail has its "signal_id" and "seq".
	EventSignalReceived = "signal_received"
	// EventChildStarted: a step started a child saga ("child_id" in the
	// detail).
	EventChildStarted = "child_started"
	// EventChildEnded: the child saga a step waited for ended; the detail
	// has its "child_id" and "status".
	EventChildEnded = "child_ended"
	// EventWaitTimedOut: a signal or child did not come within the wait's
	// timeout.
	EventWaitTimedOut = "wait_timed_out"
)

// Error codes of waits.
const (
	CodeWaitTimeout = "wait_timeout"  // an awaited signal or child saga did not come in time
	CodeChildFailed = "child_failed"  // a child saga ended compensated or failed
	CodeDeadline    = "saga_deadline" // the saga did not end within its deadline
	CodeChildStart  = "child_start"   // a child saga could not be started (not registered, bad input)
)

// Wait makes a [Step] wait, holding no worker and no connection while it
// does: for a time ([Sleep], [SleepFor], [SleepUntil]), for a signal
// ([OnSignal]) or for a child saga ([Child]). Time is the database's: a
// wait's end is stored in the saga's row, and its command is an outbox row
// due then, so waits survive restarts and end once.
//
// A signal or child wait may have a time limit ([Wait.Timeout],
// [Wait.TimeoutThen]); without one it waits until it is woken, and the
// rescuer leaves it alone.
type Wait[S any] struct {
	kind string
	// A timer's length, from the state; exactly one of sleep and until.
	sleep func(s *S) time.Duration
	until func(s *S) time.Time
	// A signal's name and handler (payload already decoded).
	signal   string
	onSignal func(ctx context.Context, run *StepRun, s *S, payload []byte) error
	// A child saga.
	child *childSpec[S]
	// The time limit of a signal or child wait: 0 for none.
	timeout time.Duration
	// What a passed time limit does: compensate (timeoutSet only), run
	// onTimeout, or go on (goOn).
	timeoutSet bool
	onTimeout  StepFunc[S]
	goOn       bool
}

type childSpec[S any] struct {
	name  string // the child definition's name
	first string // its first step
	// input builds the child's initial state, encoded; opts its start
	// options (business key, deadline).
	input func(ctx context.Context, run *StepRun, s *S) ([]byte, *StartOpts, error)
	// done applies the completed child's final state.
	done func(ctx context.Context, run *StepRun, s *S, child []byte) error
	def  AnyDefinition
}

// Sleep waits d, from when the saga reaches the step; a zero or negative d
// does not wait.
func Sleep[S any](d time.Duration) *Wait[S] {
	return &Wait[S]{kind: store.WaitTimer, sleep: func(*S) time.Duration { return d }}
}

// SleepFor waits as long as fn says, given the state when the saga reaches
// the step (a zero or negative duration does not wait).
func SleepFor[S any](fn func(s *S) time.Duration) *Wait[S] {
	return &Wait[S]{kind: store.WaitTimer, sleep: fn}
}

// SleepUntil waits until the time fn gives, from the state when the saga
// reaches the step. A time already past does not wait.
func SleepUntil[S any](fn func(s *S) time.Time) *Wait[S] {
	return &Wait[S]{kind: store.WaitTimer, until: fn}
}

// OnSignal waits for the signal called name (see [Engine.Signal]) and then
// runs handle, in the step's transaction, with the signal's payload
// decoded as JSON into P. Signals that arrive before the saga reaches the
// step are kept, and each await takes the oldest one of its name. If handle
// fails, the step fails like any step (retried, or compensated), and the
// signal stays undelivered for the next attempt; a payload that does not
// decode into P fails the step for good, with code [CodeSignalPayload].
func OnSignal[S, P any](name string, handle func(ctx context.Context, run *StepRun, s *S, payload P) error) *Wait[S] {
	w := &Wait[S]{kind: store.WaitSignal, signal: name}
	if handle != nil {
		w.onSignal = func(ctx context.Context, run *StepRun, s *S, raw []byte) error {
			var p P
			if err := json.Unmarshal(raw, &p); err != nil {
				return steps.Permanent(steps.WithCode(CodeSignalPayload,
					fmt.Errorf("signal %q: payload does not decode into %T: %w", name, p, err)))
			}
			return handle(ctx, run, s, p)
		}
	}
	return w
}

// CodeSignalPayload is the code of a step whose awaited signal's payload did
// not decode into the handler's type.
const CodeSignalPayload = "signal_payload"

// Child starts a saga of definition def in the step's transaction, with the
// initial state input returns, and waits for it to end. The child must be
// registered with the same engine. Starting it is idempotent by the step's
// key: its id is derived from the key, so a retried or duplicated step
// finds the child it started.
//
//   - The child completed: done runs in the step's transaction with the
//     child's final state, and the saga goes on.
//   - The child ended compensated or failed: the step fails for good (code
//     [CodeChildFailed]) and the saga compensates the steps before it.
//   - The saga is cancelled (or passes its deadline, or the wait's
//     timeout) while it waits: the child is cancelled too.
//
// The step's own Compensate, if any, runs when a later step fails; it is
// the place to undo what the completed child did. A child whose
// StartOpts.BusinessKey belongs to another saga is not started: the step
// fails for good with code [CodeChildStart].
func Child[S, C any](def *Definition[C], input func(ctx context.Context, run *StepRun, s *S) (C, *StartOpts, error),
	done func(ctx context.Context, run *StepRun, s *S, child C) error) *Wait[S] {
	w := &Wait[S]{kind: store.WaitChild}
	if def == nil || input == nil {
		return w // refused by compile
	}
	cs := &childSpec[S]{name: def.name, def: def}
	if len(def.steps) > 0 {
		cs.first = def.steps[0].Name
	}
	cs.input = func(ctx context.Context, run *StepRun, s *S) ([]byte, *StartOpts, error) {
		c, opts, err := input(ctx, run, s)
		if err != nil {
			return nil, nil, err
		}
		raw, err := json.Marshal(&c)
		if err != nil {
			return nil, nil, steps.Permanent(fmt.Errorf("encode the state of child saga %q: %w", def.name, err))
		}
		return raw, opts, nil
	}
	cs.done = func(ctx context.Context, run *StepRun, s *S, raw []byte) error {
		if done == nil {
			return nil
		}
		var c C
		if err := json.Unmarshal(raw, &c); err != nil {
			return steps.Permanent(steps.WithCode(CodeStateDecode, fmt.Errorf("child saga %q: final state does not decode: %w", def.name, err)))
		}
		return done(ctx, run, s, c)
	}
	w.child = cs
	return w
}

// Timeout limits a signal or child wait to d: when nothing came by then,
// the step fails for good (code [CodeWaitTimeout]) and the saga
// compensates the steps before it. A child still running is cancelled.
func (w *Wait[S]) Timeout(d time.Duration) *Wait[S] {
	w.timeout, w.timeoutSet, w.onTimeout, w.goOn = d, true, nil, false
	return w
}

// TimeoutThen limits a signal or child wait to d: when nothing came by
// then, fn runs in the step's transaction as the step's action (its error
// is treated as any step's), or, with fn nil, the saga simply goes on to
// the next step. A child still running is cancelled.
func (w *Wait[S]) TimeoutThen(d time.Duration, fn StepFunc[S]) *Wait[S] {
	w.timeout, w.timeoutSet, w.onTimeout, w.goOn = d, true, fn, fn == nil
	return w
}

// compiledWait is a step's wait as the executor uses it.
type compiledWait struct {
	kind       string
	signal     string
	childName  string
	childFirst string
	childDef   AnyDefinition
	timeout    time.Duration // 0: none
	goOn       bool
	hasOnTO    bool
	// delay returns how long a timer waits, given the state and the
	// database's clock.
	delay func(state []byte, now time.Time) (time.Duration, error)
	// onSignal applies a signal's payload; childInput builds a child's
	// state; childDone applies its final state; onTimeout runs the
	// timeout's handler.
	onSignal   func(ctx context.Context, r *StepRun, state, payload []byte) ([]byte, error)
	childInput func(ctx context.Context, r *StepRun, state []byte) ([]byte, *StartOpts, error)
	childDone  func(ctx context.Context, r *StepRun, state, child []byte) ([]byte, error)
	onTimeout  func(ctx context.Context, r *StepRun, state []byte) ([]byte, error)
}

// compileWait checks w and makes it untyped; encode turns the state back
// into JSON.
func compileWait[S any](sagaName, step string, w *Wait[S], encode func(*S) ([]byte, error)) (*compiledWait, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: saga %q step %q: "+format, append([]any{ErrInvalidDefinition, sagaName, step}, args...)...)
	}
	decode := func(raw []byte) (*S, error) {
		var s S
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, &stateDecodeError{err: err}
		}
		return &s, nil
	}
	// with runs fn on the decoded state and encodes it again.
	with := func(raw []byte, fn func(s *S) error) ([]byte, error) {
		s, err := decode(raw)
		if err != nil {
			return nil, err
		}
		if err := fn(s); err != nil {
			return nil, err
		}
		return encode(s)
	}
	cw := &compiledWait{kind: w.kind, timeout: w.timeout, goOn: w.goOn, hasOnTO: w.onTimeout != nil}
	if w.timeoutSet && w.timeout <= 0 {
		return nil, bad("a wait's timeout must be positive, not %s", w.timeout)
	}
	switch w.kind {
	case store.WaitTimer:
		if w.timeoutSet {
			return nil, bad("a timer has no timeout of its own: it is one")
		}
		if w.sleep == nil && w.until == nil {
			return nil, bad("SleepFor and SleepUntil need a function")
		}
		cw.delay = func(raw []byte, now time.Time) (time.Duration, error) {
			s, err := decode(raw)
			if err != nil {
				return 0, err
			}
			if w.sleep != nil {
				return w.sleep(s), nil
			}
			return w.until(s).Sub(now), nil
		}
	case store.WaitSignal:
		if !validSignalName(w.signal) {
			return nil, bad("signal name %q must be 1-200 bytes of printable text", w.signal)
		}
		if w.onSignal == nil {
			return nil, bad("OnSignal needs a handler")
		}
		cw.signal = w.signal
		cw.onSignal = func(ctx context.Context, r *StepRun, raw, payload []byte) ([]byte, error) {
			return with(raw, func(s *S) error { return w.onSignal(ctx, r, s, payload) })
		}
	case store.WaitChild:
		if w.child == nil {
			return nil, bad("Child needs a definition and an input function")
		}
		if w.child.first == "" {
			return nil, bad("child saga %q has no steps", w.child.name)
		}
		c := w.child
		cw.childName, cw.childFirst, cw.childDef = c.name, c.first, c.def
		cw.childInput = func(ctx context.Context, r *StepRun, raw []byte) ([]byte, *StartOpts, error) {
			s, err := decode(raw)
			if err != nil {
				return nil, nil, err
			}
			return c.input(ctx, r, s)
		}
		cw.childDone = func(ctx context.Context, r *StepRun, raw, child []byte) ([]byte, error) {
			return with(raw, func(s *S) error { return c.done(ctx, r, s, child) })
		}
	default:
		return nil, bad("the wait was not made by Sleep, SleepFor, SleepUntil, OnSignal or Child")
	}
	if fn := w.onTimeout; fn != nil {
		cw.onTimeout = func(ctx context.Context, r *StepRun, raw []byte) ([]byte, error) {
			return with(raw, func(s *S) error { return fn(ctx, r, s) })
		}
	}
	return cw, nil
}

// childID is the id of the child saga that the step with key starts:
// derived from the key, so that every attempt and duplicate of the step
// names the same child.
func childID(key steps.Key) uuid.UUID {
	return uuid.NewSHA1(childNamespace, []byte(key.String()))
}

// childNamespace is the UUIDv5 namespace of child saga ids.
var childNamespace = uuid.MustParse("5c0f3a55-9a43-4d53-8c1e-2a7d7e0f1c01")

// waitDetail is the detail of an [EventWaitStarted] entry.
func waitDetail(kind, waitFor string, delay time.Duration) []byte {
	m := map[string]any{"kind": kind}
	if waitFor != "" {
		m["for"] = waitFor
	}
	if delay >= 0 {
		m["until_ms"] = delay.Milliseconds()
	}
	out, _ := json.Marshal(m)
	return out
}
