package pgtest

import (
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ForExample is [NewSchema] for Example functions, which have no
// testing.TB: it panics where NewSchema would fail a test, and returns a
// function that runs the cleanups (close the pool, drop the schema).
func ForExample() (*pgxpool.Pool, string, func()) {
	tb := &exampleTB{}
	pool, schema := NewSchema(tb)
	return pool, schema, func() {
		for _, f := range slices.Backward(tb.cleanups) {
			f()
		}
		if tb.failed != "" {
			panic(tb.failed)
		}
	}
}

// exampleTB is the part of testing.TB that NewSchema uses. The embedded
// interface is nil: any other method panics.
type exampleTB struct {
	testing.TB
	cleanups []func()
	failed   string
}

func (t *exampleTB) Helper()                           {}
func (t *exampleTB) Cleanup(f func())                  { t.cleanups = append(t.cleanups, f) }
func (t *exampleTB) Logf(string, ...any)               {}
func (t *exampleTB) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }
func (t *exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (t *exampleTB) Errorf(format string, args ...any) { t.failed = fmt.Sprintf(format, args...) }
