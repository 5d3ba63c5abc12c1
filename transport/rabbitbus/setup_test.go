package rabbitbus_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
	"github.com/sagaflow/sagaflow/transport/transporttest"
)

func TestMain(m *testing.M) { transporttest.Main(m) }

// localBroker is where the tests look for RabbitMQ when RABBITMQ_URL is not
// set.
const localBroker = "amqp://guest:guest@127.0.0.1:5672/"

// brokerURL finds the broker once: RABBITMQ_URL, else the local server.
var brokerURL = sync.OnceValues(func() (string, error) {
	url := os.Getenv("RABBITMQ_URL")
	explicit := url != ""
	if !explicit {
		url = localBroker
	}
	conn, err := rabbitbus.Dial(url)()
	if err != nil {
		if explicit {
			return "", fmt.Errorf("RABBITMQ_URL=%s does not answer: %w", url, err)
		}
		return "", fmt.Errorf("skip: no RabbitMQ at %s and RABBITMQ_URL is not set (Debian: apt-get install rabbitmq-server; "+
			"or point RABBITMQ_URL at a RabbitMQ 3.10 or later): %w", url, err)
	}
	_ = conn.Close()
	return url, nil
})

// broker returns the broker's URL; the test is skipped when no broker was
// named and none runs locally, and fails when the named one does not
// answer.
func broker(t testing.TB) string {
	t.Helper()
	url, err := brokerURL()
	if err != nil {
		if msg := err.Error(); len(msg) > 6 && msg[:6] == "skip: " {
			t.Skip(msg[6:])
		}
		t.Fatal(err)
	}
	return url
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// env is one test's broker names and database schema.
type env struct {
	ctx    context.Context
	url    string
	dial   rabbitbus.DialFunc
	topo   rabbitbus.Topology
	id     string // unique per test: in every name the test makes
	admin  *amqp.Connection
	pool   *pgxpool.Pool
	schema string
	st     *store.Store

	mu     sync.Mutex
	queues []string
}

// setup gives a test its own exchange (with partitions partitions), its own
// group and topic names, and a migrated schema. Every queue the test
// declares through it and the exchange are deleted when it ends.
func setup(t *testing.T, partitions int) *env {
	t.Helper()
	url := broker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	id := randomID()
	admin, err := rabbitbus.Dial(url)()
	require.NoError(t, err)
	e := &env{ctx: ctx, url: url, dial: rabbitbus.Dial(url), id: id, admin: admin,
		topo: rabbitbus.Topology{Exchange: "sf-test-" + id, Partitions: partitions}}
	t.Cleanup(func() {
		ch, err := admin.Channel()
		if err == nil {
			e.mu.Lock()
			for _, q := range e.queues {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					t.Logf("delete queue %s: %v", q, err)
					ch, _ = admin.Channel()
				}
			}
			e.mu.Unlock()
			if ch != nil {
				_ = ch.ExchangeDelete(e.topo.Exchange, false, false)
			}
		}
		_ = admin.Close()
	})
	e.pool, e.schema = pgtest.Migrated(t)
	e.st, err = store.New(e.schema)
	require.NoError(t, err)
	return e
}

func randomID() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// name is a group or topic name unique to the test.
func (e *env) name(s string) string { return "sf-" + e.id + "-" + s }

// track makes the test delete group's queues for topics when it ends.
func (e *env) track(group string, topics ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, t := range topics {
		for p := range e.topo.Partitions {
			e.queues = append(e.queues, rabbitbus.QueueName(group, t, p))
		}
	}
}

// setupGroups declares groups' queues for topics.
func (e *env) setupGroups(t *testing.T, topics []string, groups ...string) {
	t.Helper()
	for _, g := range groups {
		e.track(g, topics...)
	}
	require.NoError(t, rabbitbus.Setup(e.ctx, e.admin, topics, &rabbitbus.SetupOpts{Topology: e.topo, Groups: groups}))
}

func (e *env) writer(t *testing.T) *rabbitbus.Writer {
	t.Helper()
	w, err := rabbitbus.NewWriter(e.dial, &rabbitbus.WriterOpts{Topology: e.topo})
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func (e *env) reader(t *testing.T, group string, topics []string, opts *rabbitbus.ReaderOpts) *rabbitbus.Reader {
	t.Helper()
	e.track(group, topics...)
	var o rabbitbus.ReaderOpts
	if opts != nil {
		o = *opts
	}
	o.Topology = e.topo
	r, err := rabbitbus.NewReader(e.dial, group, topics, &o)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func (e *env) table(name string) string { return pgx.Identifier{e.schema, name}.Sanitize() }

func (e *env) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, e.pool.QueryRow(e.ctx, q, args...).Scan(&n))
	return n
}

// waitFor polls cond until it holds, failing the test after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
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

// fetch fetches one message within timeout.
func fetch(t *testing.T, r *rabbitbus.Reader, timeout time.Duration) kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	m, err := r.FetchMessage(ctx)
	require.NoError(t, err)
	return m
}
