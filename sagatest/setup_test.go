package sagatest_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// bundle is a migrated schema with an engine (not started) on it.
type bundle struct {
	pool   *pgxpool.Pool
	schema string
	engine *saga.Engine
	kc     *kafkatest.Cluster // nil in the Postgres-only mode
}

// migrated returns a fresh migrated schema.
func migrated(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	return pool, schema
}

// setup makes a Postgres-only engine, or with topics a Kafka-mode engine
// on an in-process cluster seeded with them, and the relay of its schema.
func setup(t *testing.T, topics ...string) *bundle {
	t.Helper()
	pool, schema := migrated(t)
	b := &bundle{pool: pool, schema: schema}
	cfg := &saga.Config{Schema: schema, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)}
	if len(topics) > 0 {
		b.kc = kafkatest.New(t, kafkatest.SeedTopics(2, topics...))
		cfg.Kafka = &saga.KafkaConfig{Brokers: b.kc.Addrs()}
		w := relay.NewKafkaWriter(b.kc.Addrs(), nil)
		r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		require.NoError(t, r.Start(context.Background()))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			require.NoError(t, r.Stop(ctx))
			require.NoError(t, w.Close())
		})
	}
	e, err := saga.New(pool, cfg)
	require.NoError(t, err)
	b.engine = e
	return b
}

// start registers defs, starts the engine and stops it when the test ends.
func (b *bundle) start(t *testing.T, defs ...saga.AnyDefinition) {
	t.Helper()
	require.NoError(t, b.engine.Register(defs...))
	require.NoError(t, b.engine.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, b.engine.Stop(ctx))
	})
}

func (b *bundle) table(name string) string { return pgx.Identifier{b.schema, name}.Sanitize() }

func (b *bundle) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

// testLogger writes warnings and errors to the test's log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type logWriter struct{ t *testing.T }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// fakeTB records the failures of the sagatest call it is given to, which
// runs on a goroutine of its own so that Fatalf can end it. Everything
// else goes to the real test.
type fakeTB struct {
	testing.TB
	mu       sync.Mutex
	failures []string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failures = append(f.failures, fmt.Sprintf(format, args...))
}

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.Errorf(format, args...)
	runtime.Goexit()
}

// failure runs fn with a fake testing.TB and returns what it failed with,
// "" when it did not fail.
func failure(t *testing.T, fn func(tb testing.TB)) string {
	t.Helper()
	f := &fakeTB{TB: t}
	return f.run(func() { fn(f) })
}

// run runs fn on a goroutine of its own and returns the failures it
// recorded, "" for none.
func (f *fakeTB) run(fn func()) string {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	out := strings.Join(f.failures, "\n")
	f.failures = nil
	return out
}
