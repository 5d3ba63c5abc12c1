package testkit

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/saga"
)

const (
	// PollInterval is the engine PollInterval of [DB.Config]: short, so
	// tests do not wait on it.
	PollInterval = 50 * time.Millisecond
	// StopTimeout is how long the engine that [Start] started has to stop
	// when the test ends.
	StopTimeout = 30 * time.Second
)

// Discard is a logger that writes nowhere. Its handler still formats
// every record, so that a race on a logged value shows under -race.
var Discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// Config returns the engine configuration tests start from: d's schema,
// [PollInterval], and a [Discard] logger; the rest is saga's defaults.
// Each call returns a new Config, for the caller to change.
func (d *DB) Config() *saga.Config {
	return &saga.Config{Schema: d.Schema, PollInterval: PollInterval, Logger: Discard}
}

// PatientConfig is [DB.Config] for an engine of workers workers that is
// moved only by its wake-ups and look ahead: it polls once a minute, its
// rescuer runs hourly, and HandlerGrace is 500 ms. Anything left to the
// poll shows as a saga that does not move within seconds.
func (d *DB) PatientConfig(workers int) *saga.Config {
	c := d.Config()
	c.PollInterval = time.Minute
	c.RescueInterval = time.Hour
	c.Workers = workers
	c.HandlerGrace = 500 * time.Millisecond
	return c
}

// ConstantBackoff is a retry policy of n attempts, d apart.
func ConstantBackoff(n int, d time.Duration) *saga.RetryPolicy {
	return &saga.RetryPolicy{MaxAttempts: n, Backoff: func(int) time.Duration { return d }}
}

// NewEngine returns an engine on pool with cfg and defs registered. It is
// not started: as it is, it is a client that starts, reads and steers
// sagas.
func NewEngine(tb testing.TB, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	tb.Helper()
	e, err := saga.New(pool, cfg)
	if err != nil {
		tb.Fatalf("testkit: new engine: %v", err)
	}
	if len(defs) > 0 {
		if err := e.Register(defs...); err != nil {
			tb.Fatalf("testkit: register: %v", err)
		}
	}
	return e
}

// Start starts e and returns a function that stops it, waiting at most
// [StopTimeout] and failing the test if Stop returns an error. The
// function does its work once, however often it is called; Start also
// registers it as a cleanup, so an engine a test does not stop is stopped
// when the test ends.
func Start(tb testing.TB, e *saga.Engine) (stop func()) {
	tb.Helper()
	if err := e.Start(context.Background()); err != nil {
		tb.Fatalf("testkit: start engine: %v", err)
	}
	var once sync.Once
	stop = func() {
		tb.Helper()
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), StopTimeout)
			defer cancel()
			if err := e.Stop(ctx); err != nil {
				tb.Fatalf("testkit: stop engine: %v", err)
			}
		})
	}
	tb.Cleanup(stop)
	return stop
}

// StartEngine is [NewEngine] and then [Start].
func StartEngine(tb testing.TB, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) (*saga.Engine, func()) {
	tb.Helper()
	e := NewEngine(tb, pool, cfg, defs...)
	return e, Start(tb, e)
}
