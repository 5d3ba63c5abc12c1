// Package review34_test is an outside reviewer's black-box tests of the user
// test kit, package sagatest, attacked as its worst user would: waits with
// zero, negative and huge timeouts and polls, odd event names, the clock
// moved by zero, negative, huge durations, concurrently and while a step
// runs, the fake participant with hostile answers and forged duplicates,
// the crash matrix at its edges, and helpers called after the engine
// stopped. Written from the documentation only (README.md, CHANGELOG.md,
// docs/*.md, go doc of sagatest, saga, participant, steps); the non-test
// sources of sagatest, saga, participant and internal/testkit were not read.
//
// Its five findings (FINDINGS.md) are fixed; each finding's test now runs
// every time and asserts the fix.
package review34_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 2) }

var discard = slog.New(slog.DiscardHandler)

type order struct {
	ID  string `json:"id"`
	Pad string `json:"pad,omitempty"`
	Got string `json:"got,omitempty"`
}

func noop(context.Context, *saga.StepRun, *order) error { return nil }

// engine builds, registers and starts an engine on schema; it stops when
// the test ends.
func engine(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e := engineNotStarted(t, pool, cfg, defs...)
	if err := e.Start(context.Background()); err != nil {
		t.Fatalf("start engine: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = e.Stop(ctx)
	})
	return e
}

func engineNotStarted(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = discard
	}
	if cfg.Workers == 0 {
		cfg.Workers = 2
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	e, err := saga.New(pool, cfg)
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	if err := e.Register(defs...); err != nil {
		t.Fatalf("register: %v", err)
	}
	return e
}

// fakeTB records failures instead of failing the real test. Fatal, FailNow
// and the Skips end the calling goroutine, as testing.T's do, so helpers
// must be called through call.
type fakeTB struct {
	testing.TB // the real test: Helper, Cleanup, Name, Logf, Context...
	mu         sync.Mutex
	msgs       []string
	failed     bool
	fatal      bool
	skipped    bool
	logs       []string
}

func (f *fakeTB) Log(args ...any) {
	f.mu.Lock()
	f.logs = append(f.logs, fmt.Sprintln(args...))
	f.mu.Unlock()
}

func (f *fakeTB) Logf(format string, args ...any) {
	f.mu.Lock()
	f.logs = append(f.logs, fmt.Sprintf(format, args...))
	f.mu.Unlock()
}

// logged is everything the helper logged.
func (f *fakeTB) logged() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.logs, "\n")
}

func newFake(t *testing.T) *fakeTB { return &fakeTB{TB: t} }

func (f *fakeTB) record(fail, fatal, skip bool, msg string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.msgs = append(f.msgs, msg)
	f.failed = f.failed || fail
	f.fatal = f.fatal || fatal
	f.skipped = f.skipped || skip
}

func (f *fakeTB) Error(args ...any) { f.record(true, false, false, fmt.Sprintln(args...)) }
func (f *fakeTB) Errorf(format string, args ...any) {
	f.record(true, false, false, fmt.Sprintf(format, args...))
}
func (f *fakeTB) Fail() { f.record(true, false, false, "Fail") }
func (f *fakeTB) Fatal(args ...any) {
	f.record(true, true, false, fmt.Sprintln(args...))
	runtime.Goexit()
}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.record(true, true, false, fmt.Sprintf(format, args...))
	runtime.Goexit()
}
func (f *fakeTB) FailNow() { f.record(true, true, false, "FailNow"); runtime.Goexit() }
func (f *fakeTB) Skip(args ...any) {
	f.record(false, true, true, "SKIP "+fmt.Sprint(args...))
	runtime.Goexit()
}
func (f *fakeTB) Skipf(format string, args ...any) {
	f.record(false, true, true, "SKIP "+fmt.Sprintf(format, args...))
	runtime.Goexit()
}
func (f *fakeTB) SkipNow() { f.record(false, true, true, "SKIP"); runtime.Goexit() }
func (f *fakeTB) Failed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed
}
func (f *fakeTB) Skipped() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.skipped
}

// messages is everything the helper reported.
func (f *fakeTB) messages() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.msgs, "\n")
}

// outcome is what one call of a helper did.
type outcome struct {
	took     time.Duration
	panicked any  // non-nil: the helper panicked
	hung     bool // the helper did not return within the limit
	exited   bool // the helper ended its goroutine (Fatal/FailNow/Skip)
}

// call runs fn in its own goroutine (so that a Fatal ends only it) and
// reports how it ended; it gives up after limit.
func call(limit time.Duration, fn func()) outcome {
	done := make(chan outcome, 1)
	begun := time.Now()
	go func() {
		returned := false
		defer func() {
			o := outcome{took: time.Since(begun)}
			if r := recover(); r != nil {
				o.panicked = r
			} else if !returned {
				o.exited = true
			}
			done <- o
		}()
		fn()
		returned = true
	}()
	select {
	case o := <-done:
		return o
	case <-time.After(limit):
		return outcome{took: limit, hung: true}
	}
}

// mustFail checks that a helper call failed the fake test clearly: no
// panic, no hang, a failure recorded whose message holds each of want.
func mustFail(t *testing.T, f *fakeTB, o outcome, want ...string) {
	t.Helper()
	switch {
	case o.hung:
		t.Fatalf("the helper hung (no return within %v)", o.took)
	case o.panicked != nil:
		t.Fatalf("the helper panicked instead of failing the test: %v", o.panicked)
	case !f.Failed():
		t.Fatalf("the helper did not fail the test (returned after %v); messages: %q", o.took, f.messages())
	}
	msg := f.messages()
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("the failure message does not name %q:\n%.3000s", w, msg)
		}
	}
}

// get reads a saga.
func get(t testing.TB, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	return in
}

// waitEnded is the reviewer's own wait, independent of the kit.
func waitEnded(t testing.TB, e *saga.Engine, id uuid.UUID, d time.Duration) *saga.Instance {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		in := get(t, e, id)
		if in.Status.Terminal() {
			return in
		}
		if time.Now().After(deadline) {
			t.Fatalf("saga %s has not ended after %v: %s %v", id, d, in.Status, timeline(in))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func timeline(in *saga.Instance) string {
	var b strings.Builder
	for _, ev := range in.History {
		fmt.Fprintf(&b, "  %s %s/%s attempt=%d code=%s err=%.200q\n", ev.Type, ev.Step, ev.Direction, ev.Attempt, ev.ErrorCode, ev.Error)
	}
	return b.String()
}

// ctxT is a context bounded by d, cancelled when the test ends.
func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
