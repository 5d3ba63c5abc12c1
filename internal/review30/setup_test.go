// Package review30_test is an outside reviewer's black-box tests of
// configuration settings and user-given values at their extremes (0, 1 ns,
// 1 µs, 37 minutes, 25 and 30 days, years, time.Duration's and int's
// longest, negative values, huge batch sizes, tiny and huge rates) across
// relay, inbox, participant, idempotency, outbox and saga, written from the
// documentation only (README.md, CHANGELOG.md, docs/*.md, go doc). The
// non-test sources of those packages were not read.
//
// A test that shows a break of a documented promise is skipped with
// "FINDING F<n>: ..." unless REVIEW30_FINDINGS=1; see FINDINGS.md.
package review30_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 4) }

// childEnv names the test a child process runs for isChild.
const childEnv = "REVIEW30_CHILD"

// isChild reports whether this process is the child that runs t's body.
func isChild(t *testing.T) bool { return os.Getenv(childEnv) == t.Name() }

// inChild runs the top-level test t again in a child process (which sees
// isChild(t) true) and returns its output and error: for a body that may
// panic in a goroutine of the library, which would take every other test
// of the package with it.
func inChild(t *testing.T, limit time.Duration) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+regexp.QuoteMeta(t.Name())+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"="+t.Name())
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		return string(out), fmt.Errorf("the child still ran after %v: %w", limit, ctx.Err())
	}
	return string(out), err
}

// db is a fresh migrated schema with a pool.
func db(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	return pgtest.Migrated(t)
}

// table qualifies a table of schema.
func table(schema, name string) string {
	return pgx.Identifier{schema, name}.Sanitize()
}

// count reads one number.
func count(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// ---- logs -------------------------------------------------------------------

// logs records the records at Warn and above of a logger.
type logs struct {
	mu   sync.Mutex
	recs []string
}

func (l *logs) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelWarn }
func (l *logs) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", r.Level, r.Message)
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	l.mu.Lock()
	l.recs = append(l.recs, b.String())
	l.mu.Unlock()
	return nil
}
func (l *logs) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logs) WithGroup(string) slog.Handler      { return l }

func (l *logs) logger() *slog.Logger { return slog.New(l) }

// errors returns the records at Error level.
func (l *logs) errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, r := range l.recs {
		if strings.HasPrefix(r, "ERROR") {
			out = append(out, r)
		}
	}
	return out
}

var discard = slog.New(slog.DiscardHandler)

// ---- outbox and relay -------------------------------------------------------

// insert writes n outbox messages on topic and returns nothing; m's zero
// fields are filled.
func insert(t testing.TB, pool *pgxpool.Pool, schema string, n int, m outbox.Message) {
	t.Helper()
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	if m.Topic == "" {
		m.Topic = "review30.events"
	}
	if m.Type == "" {
		m.Type = "Evt"
	}
	ctx := context.Background()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for i := range n {
			mm := m
			if mm.Key == "" {
				mm.Key = fmt.Sprintf("k%d", i)
			}
			mm.Payload = []byte(fmt.Sprintf(`{"i":%d}`, i))
			if err := ob.InsertTx(ctx, tx, mm); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("insert outbox rows: %v", err)
	}
}

// writer is a relay Writer that records what it was given; fail, when set,
// decides the error of a call.
type writer struct {
	mu    sync.Mutex
	msgs  []kafka.Message
	calls int
	fail  func(msgs []kafka.Message) error
}

func (w *writer) WriteMessages(_ context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls++
	if w.fail != nil {
		if err := w.fail(msgs); err != nil {
			return err
		}
	}
	w.msgs = append(w.msgs, msgs...)
	return nil
}

func (w *writer) Close() error { return nil }

func (w *writer) written() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.msgs)
}

// ---- saga --------------------------------------------------------------------

type order struct {
	ID string `json:"id"`
	N  int    `json:"n,omitempty"`
}

func noop(context.Context, *saga.StepRun, *order) error { return nil }

// engineCfg is a config for schema with short polls and the given logger.
func engineCfg(schema string, l *slog.Logger) *saga.Config {
	if l == nil {
		l = discard
	}
	return &saga.Config{Schema: schema, Workers: 2, PollInterval: 50 * time.Millisecond, Logger: l}
}

// startEngine builds, registers and starts an engine; it stops when the
// test ends.
func startEngine(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e, err := saga.New(pool, cfg)
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
		if err := e.Stop(ctx); err != nil {
			t.Errorf("stop engine: %v", err)
		}
	})
	return e
}

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitEnded waits for saga id to end and returns it.
func waitEnded(t testing.TB, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	var in *saga.Instance
	waitFor(t, 30*time.Second, "saga "+id.String()+" to end", func() bool {
		var err error
		in, err = e.Get(context.Background(), id)
		if err != nil {
			t.Fatalf("get: %v", err)
		}
		return in.Status.Terminal()
	})
	return in
}

func timeline(in *saga.Instance) string {
	var b strings.Builder
	for _, ev := range in.History {
		fmt.Fprintf(&b, "  %s %s/%s attempt=%d code=%s err=%q\n", ev.Type, ev.Step, ev.Direction, ev.Attempt, ev.ErrorCode, ev.Error)
	}
	return b.String()
}
