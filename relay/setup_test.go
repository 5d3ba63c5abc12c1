package relay_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// env is one test's database schema and Kafka cluster.
type env struct {
	ctx    context.Context
	pool   *pgxpool.Pool
	schema string
	st     *store.Store
	kc     *kafkatest.Cluster
}

// Topics every test cluster has.
const (
	topicOrders   = "orders"   // 3 partitions
	topicPayments = "payments" // 3 partitions
	topicBroken   = "broken"   // 1 partition, for faults
)

func setup(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	t.Cleanup(cancel)
	pool, schema := pgtest.Migrated(t)
	st, err := store.New(schema)
	require.NoError(t, err)
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, topicOrders, topicPayments), kafkatest.SeedTopics(1, topicBroken))
	return &env{ctx: ctx, pool: pool, schema: schema, st: st, kc: kc}
}

// writer returns a kafka-go writer on the test cluster that reports a
// failure after one attempt, closed when the test ends.
func (e *env) writer(t *testing.T) *kafka.Writer {
	t.Helper()
	w := relay.NewKafkaWriter(e.kc.Addrs(), &relay.WriterOpts{MaxAttempts: 1, MetadataTTL: 500 * time.Millisecond})
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	return w
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// testLogger writes a relay's warnings and errors to the test's log. The
// relay must have stopped before the test ends.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type logWriter struct{ t *testing.T }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// relay returns a relay on the test schema with cfg (Schema and Logger are
// filled in), stopped when the test ends.
func (e *env) relay(t *testing.T, w relay.Writer, cfg relay.Config) *relay.Relay {
	t.Helper()
	cfg.Schema = e.schema
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	r, err := relay.New(e.pool, w, &cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
	})
	return r
}

// insert writes a relay row for topic and key whose payload names seq.
func (e *env) insert(t *testing.T, topic, key string, seq int, mods ...func(*store.Message)) uuid.UUID {
	t.Helper()
	m := store.Message{
		ID:          uuid.Must(uuid.NewV7()),
		Topic:       topic,
		AggregateID: key,
		Type:        "test.event",
		Payload:     fmt.Appendf(nil, `{"seq":%d}`, seq),
	}
	for _, mod := range mods {
		mod(&m)
	}
	require.NoError(t, e.st.InsertMessage(e.ctx, e.pool, &m))
	return m.ID
}

type row struct {
	Status    string
	Attempts  int
	LastError string
	Published bool
	DueIn     time.Duration // available_at - now()
}

func (e *env) row(t *testing.T, id uuid.UUID) row {
	t.Helper()
	var r row
	var lastErr *string
	var due float64
	err := e.pool.QueryRow(e.ctx, `SELECT status, attempts, last_error, published_at IS NOT NULL,
			EXTRACT(EPOCH FROM available_at - now())::float8
		FROM `+pgx.Identifier{e.schema}.Sanitize()+`.outbox WHERE id = $1`, id).
		Scan(&r.Status, &r.Attempts, &lastErr, &r.Published, &due)
	require.NoError(t, err)
	if lastErr != nil {
		r.LastError = *lastErr
	}
	r.DueIn = time.Duration(due * float64(time.Second))
	return r
}

// count returns how many relay rows have status.
func (e *env) count(t *testing.T, status string) int {
	t.Helper()
	var n int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM `+pgx.Identifier{e.schema}.Sanitize()+
		`.outbox WHERE delivery = 'relay' AND status = $1`, status).Scan(&n))
	return n
}

// read returns every message stored in the given topics.
func (e *env) read(t *testing.T, topics ...string) []kafka.Message {
	t.Helper()
	var out []kafka.Message
	for _, topic := range topics {
		msgs, err := e.kc.ReadAll(e.ctx, topic)
		require.NoError(t, err)
		out = append(out, msgs...)
	}
	return out
}

// drain runs cycles until one finds nothing to do.
func drain(t *testing.T, ctx context.Context, r *relay.Relay) (published, failed int) {
	t.Helper()
	published, failed, err := drainErr(ctx, r)
	require.NoError(t, err)
	return published, failed
}

// drainErr is drain for a goroutine that is not the test's: it returns the
// first error instead of failing the test.
func drainErr(ctx context.Context, r *relay.Relay) (published, failed int, err error) {
	for range 1000 {
		p, f, err := r.RunOnce(ctx)
		if err != nil {
			return published, failed, err
		}
		if p == 0 && f == 0 {
			return published, failed, nil
		}
		published += p
		failed += f
	}
	return published, failed, errors.New("drain: the outbox never ran dry")
}

// waitFor polls cond until it holds, failing the test after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		case <-tick.C:
		}
	}
}

func header(m kafka.Message, key string) (string, bool) {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

// copies counts the messages per sagaflow-message-id.
func copies(t *testing.T, msgs []kafka.Message) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, m := range msgs {
		id, ok := header(m, store.HeaderMessageID)
		require.True(t, ok, "message without %s: %v", store.HeaderMessageID, m.Headers)
		out[id]++
	}
	return out
}
