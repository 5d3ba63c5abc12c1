package review29_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

// db is a fresh migrated schema.
func db(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	return pool, schema
}

// engine starts an engine on schema with defs; it stops when the test ends.
func engine(t *testing.T, pool *pgxpool.Pool, schema string, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e, err := saga.New(pool, &saga.Config{Schema: schema, Workers: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	if err := e.Register(defs...); err != nil {
		t.Fatalf("register: %v", err)
	}
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

// fakeTB records failures instead of failing the real test. Fatal calls
// end the calling goroutine, as testing.T's do, so helpers must be called
// through run.
type fakeTB struct {
	*testing.T // everything not below: Helper, Cleanup, Name, Context...
	mu         sync.Mutex
	errors     []string
	fatal      bool
}

func newFake(t *testing.T) *fakeTB { return &fakeTB{T: t} }

func (f *fakeTB) record(fatal bool, msg string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errors = append(f.errors, msg)
	f.fatal = f.fatal || fatal
}

func (f *fakeTB) Error(args ...any)                 { f.record(false, fmt.Sprintln(args...)) }
func (f *fakeTB) Errorf(format string, args ...any) { f.record(false, fmt.Sprintf(format, args...)) }
func (f *fakeTB) Fail()                             { f.record(false, "Fail") }
func (f *fakeTB) Fatal(args ...any)                 { f.record(true, fmt.Sprintln(args...)); runtime.Goexit() }
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.record(true, fmt.Sprintf(format, args...))
	runtime.Goexit()
}
func (f *fakeTB) FailNow()         { f.record(true, "FailNow"); runtime.Goexit() }
func (f *fakeTB) Skip(args ...any) { f.record(true, "SKIP "+fmt.Sprint(args...)); runtime.Goexit() }
func (f *fakeTB) Skipf(format string, args ...any) {
	f.record(true, "SKIP "+fmt.Sprintf(format, args...))
	runtime.Goexit()
}
func (f *fakeTB) SkipNow() { f.record(true, "SKIP"); runtime.Goexit() }
func (f *fakeTB) Failed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.errors) > 0
}

// messages is everything the helper reported.
func (f *fakeTB) messages() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.errors, "\n")
}

// run calls fn in its own goroutine (so that a Fatal ends only it) and
// returns how long it took and what fn panicked with (nil for none).
func run(t *testing.T, f *fakeTB, fn func()) (time.Duration, any) {
	t.Helper()
	done := make(chan any, 1)
	begun := time.Now()
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- fmt.Sprint("panic: ", r)
				return
			}
			done <- nil // returned, or ended by a Fatal (runtime.Goexit)
		}()
		fn()
	}()
	select {
	case p := <-done:
		return time.Since(begun), p
	case <-time.After(60 * time.Second):
		t.Fatalf("the helper did not return within 60 s")
		return 0, nil
	}
}
