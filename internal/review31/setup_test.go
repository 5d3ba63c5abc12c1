// Package review31_test is an outside reviewer's black-box tests of
// user-given values at their extremes where review30 did not go: waits
// (Sleep, SleepFor, SleepUntil, a signal wait's Timeout) at 0, negative,
// 1 ns, the zero time, far pasts and futures; parallel branches' timeouts,
// retries and counts; step timeouts of 1 ns and 1 µs; many workers on a
// small pool; MaxStateBytes at its edges; and broker-side settings (Kafka
// over kfake, relay.WriterOpts, NATS, RabbitMQ, webhooks). Written from the
// documentation only (README.md, CHANGELOG.md, docs/*.md, go doc); the
// non-test sources of the public packages were not read.
//
// A test that shows a break of a documented promise is skipped with
// "FINDING F<n>: ..." unless REVIEW31_FINDINGS=1; see FINDINGS.md.
package review31_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 2) }

// db is a fresh migrated schema with a pool.
func db(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	return pgtest.Migrated(t)
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

// all returns every record.
func (l *logs) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.recs...)
}

var discard = slog.New(slog.DiscardHandler)

// ---- saga --------------------------------------------------------------------

type order struct {
	ID  string `json:"id"`
	N   int    `json:"n,omitempty"`
	Pad string `json:"pad,omitempty"`
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

// waitEnded waits up to d for saga id to end and returns it.
func waitEnded(t testing.TB, e *saga.Engine, id uuid.UUID, d time.Duration) *saga.Instance {
	t.Helper()
	var in *saga.Instance
	waitFor(t, d, "saga "+id.String()+" to end", func() bool {
		var err error
		in, err = e.Get(context.Background(), id)
		if err != nil {
			t.Fatalf("get: %v", err)
		}
		return in.Status.Terminal()
	})
	return in
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

// events counts the history entries of type typ (and step, when not "").
func events(in *saga.Instance, typ, step string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Type == typ && (step == "" || ev.Step == step) {
			n++
		}
	}
	return n
}

func timeline(in *saga.Instance) string {
	var b strings.Builder
	for _, ev := range in.History {
		fmt.Fprintf(&b, "  %s %s/%s attempt=%d code=%s err=%q\n", ev.Type, ev.Step, ev.Direction, ev.Attempt, ev.ErrorCode, ev.Error)
	}
	return b.String()
}

// insert writes n outbox relay messages on topic.
func insert(t testing.TB, pool *pgxpool.Pool, schema string, n int, topic string) {
	t.Helper()
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for i := range n {
			if err := ob.InsertTx(ctx, tx, outbox.Message{Topic: topic, Type: "Evt", Key: fmt.Sprintf("k%d", i), Payload: []byte(fmt.Sprintf(`{"i":%d}`, i))}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("insert outbox rows: %v", err)
	}
}
