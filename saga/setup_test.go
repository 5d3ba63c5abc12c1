package saga_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// bundle is what most tests need: a migrated schema, an engine on it, and an
// effects table that step handlers write to in their own transaction.
type bundle struct {
	pool   *pgxpool.Pool
	schema string
	engine *saga.Engine
}

// setup migrates a fresh schema and creates an engine (not started) on it.
func setup(t *testing.T, cfg *saga.Config) *bundle {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.Migrated(t)
	// effects is the handlers' own table: no unique key, so a doubled effect
	// shows up as a second row instead of an error.
	_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s.effects (
		seq bigint GENERATED ALWAYS AS IDENTITY, saga_id uuid, step text, direction text, key text)`,
		pgx.Identifier{schema}.Sanitize()))
	require.NoError(t, err)
	c := saga.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.Schema = schema
	if c.PollInterval == 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = testLogger(t)
	}
	e, err := saga.New(pool, &c)
	require.NoError(t, err)
	return &bundle{pool: pool, schema: schema, engine: e}
}

// start starts the engine and stops it when the test ends.
func (b *bundle) start(t *testing.T) {
	t.Helper()
	require.NoError(t, b.engine.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, b.engine.Stop(ctx))
	})
}

func (b *bundle) table(name string) string {
	return pgx.Identifier{b.schema}.Sanitize() + "." + name
}

// recordEffect writes the step's effect row inside the step's transaction.
func recordEffect(ctx context.Context, run *saga.StepRun, schema string) error {
	_, err := run.Tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{schema}.Sanitize()+
		".effects (saga_id, step, direction, key) VALUES ($1, $2, $3, $4)",
		run.SagaID, run.Step, string(run.Direction), run.IdempotencyKey())
	return err
}

// effects returns "step/direction" of a saga's effect rows in commit order.
func (b *bundle) effects(t *testing.T, id uuid.UUID) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(),
		"SELECT step || '/' || direction FROM "+b.table("effects")+" WHERE saga_id = $1 ORDER BY seq", id)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

func (b *bundle) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

// waitTerminal polls until the saga has ended and returns it.
func (b *bundle) waitTerminal(t *testing.T, id uuid.UUID) *saga.Instance {
	t.Helper()
	return b.waitTerminalWithin(t, id, 30*time.Second)
}

// waitTerminalWithin waits at most timeout for saga id to end.
func (b *bundle) waitTerminalWithin(t *testing.T, id uuid.UUID, timeout time.Duration) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, b.engine, id, &sagatest.WaitOpts{Timeout: timeout})
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, cond func() bool, what string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for "+what, append([]any{timeout}, args...)...)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// eventTypes lists the timeline's event types, with the step where there is one.
func eventTypes(in *saga.Instance) []string { return sagatest.Timeline(in) }

type testWriter struct {
	mu     sync.Mutex
	t      *testing.T
	on     bool
	errors int
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if strings.Contains(string(p), "level=ERROR") {
		w.errors++
	}
	if w.on {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

var errorsAllowed sync.Map // *testing.T -> true

// allowErrorLogs lets the test's engines log errors (the test provokes them).
func allowErrorLogs(t *testing.T) { errorsAllowed.Store(t, true) }

// testLogger logs warnings and errors through t.Log while the test runs, and
// fails the test if an engine logged an error it did not expect: a batch
// that failed and was retried can hide a bug behind a passing test.
func testLogger(t *testing.T) *slog.Logger {
	w := &testWriter{t: t, on: true}
	t.Cleanup(func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.on = false
		if _, ok := errorsAllowed.Load(t); !ok && w.errors > 0 {
			t.Errorf("the engine logged %d unexpected errors (see the log above)", w.errors)
		}
	})
	var out io.Writer = w
	return slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// order is the state of the test sagas.
type order struct {
	OrderID string   `json:"order_id"`
	Done    []string `json:"done"`
}

// fastRetry retries quickly so tests do not wait.
var fastRetry = &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 50 * time.Millisecond }}

// dummyPool is a pool that never connects, for tests that need none.
func dummyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func discardLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelError}))
}
