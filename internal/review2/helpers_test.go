// Package review2_test is an outside review of the outbox, migrations, relay
// retention and inbox consumer APIs: black-box tests against their public
// documentation, on a real PostgreSQL and an in-process Kafka (kfake). A test
// that passes documents a promise kept; a finding is a test skipped with
// "FINDING:" and the sentence of the docs it contradicts.
package review2_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// migrated returns a pool and a fresh schema that migrations.Migrate has
// migrated.
func migrated(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(t, err)
	return pool, schema
}

// freshSchemaName returns a schema name that does not exist yet, derived from
// a pgtest schema, and drops it when the test ends.
func freshSchemaName(t *testing.T, pool *pgxpool.Pool, base, suffix string) string {
	t.Helper()
	name := base + suffix
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+migrations.QuoteSchema(name)+" CASCADE")
	})
	return name
}

// insert commits m into schema's outbox and returns its id.
func insert(t *testing.T, pool *pgxpool.Pool, schema string, m outbox.Message) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	if m.ID == uuid.Nil {
		m.ID = uuid.Must(uuid.NewV7())
	}
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.InsertTx(ctx, tx, m) }))
	return m.ID
}

func msg(topic, key, typ string) outbox.Message {
	return outbox.Message{Topic: topic, Key: key, Type: typ, Payload: []byte(`{"k":"` + key + `"}`)}
}

// newRelay returns a relay on schema that publishes to kc; the writer is
// closed when the test ends, after the relay's own cleanup.
func newRelay(t *testing.T, pool *pgxpool.Pool, schema string, kc *kafkatest.Cluster, cfg relay.Config) *relay.Relay {
	t.Helper()
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	t.Cleanup(func() { _ = w.Close() })
	cfg.Schema = schema
	r, err := relay.New(pool, w, &cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
	return r
}

// publishAll runs relay cycles until nothing is pending that is due.
func publishAll(t *testing.T, r *relay.Relay, want int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	total := 0
	for total < want {
		n, failed, err := r.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, failed, "relay failed rows")
		if n == 0 {
			require.NoError(t, ctx.Err(), "published %d of %d", total, want)
			time.Sleep(20 * time.Millisecond)
		}
		total += n
	}
	require.Equal(t, want, total)
}

// count runs a count(*) query; %s in q is replaced by the quoted schema.
func count(t *testing.T, pool *pgxpool.Pool, schema, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), fmt.Sprintf(q, migrations.QuoteSchema(schema)), args...).Scan(&n))
	return n
}

// exec runs a statement; %s in q is replaced by the quoted schema.
func exec(t *testing.T, pool *pgxpool.Pool, schema, q string, args ...any) {
	t.Helper()
	_, err := pool.Exec(context.Background(), fmt.Sprintf(q, migrations.QuoteSchema(schema)), args...)
	require.NoError(t, err)
}

// groupReader joins group on topic with kafka-go's consumer-group reader,
// committing synchronously; it is closed when the test ends.
func groupReader(t *testing.T, kc *kafkatest.Cluster, group, topic string) *kafka.Reader {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers:           kc.Addrs(),
		GroupID:           group,
		Topic:             topic,
		StartOffset:       kafka.FirstOffset,
		CommitInterval:    0,
		MinBytes:          1,
		MaxBytes:          1 << 20,
		MaxWait:           50 * time.Millisecond,
		HeartbeatInterval: 500 * time.Millisecond,
		JoinGroupBackoff:  200 * time.Millisecond,
		ReadBackoffMin:    20 * time.Millisecond,
		ReadBackoffMax:    200 * time.Millisecond,
		MaxAttempts:       10,
	})
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// committedOffset returns group's committed offset of partition 0 of topic
// (-1 when none).
func committedOffset(t *testing.T, kc *kafkatest.Cluster, group, topic string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(kc.Addrs()...), Transport: tr}
	res, err := cl.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: {0}}})
	require.NoError(t, err)
	require.NoError(t, res.Error)
	parts := res.Topics[topic]
	require.Len(t, parts, 1)
	require.NoError(t, parts[0].Error)
	return parts[0].CommittedOffset
}

// recorded reports whether consumer has id in schema's inbox: Process on a
// recorded id reports false without running its handler. It records the id
// when it was not.
func recorded(t *testing.T, pool *pgxpool.Pool, schema, consumer, id string) bool {
	t.Helper()
	in, err := inbox.New(pool, &inbox.Config{Consumer: consumer, Schema: schema})
	require.NoError(t, err)
	processed, err := in.Process(context.Background(), inbox.Message{ID: id}, func(context.Context, pgx.Tx, inbox.Message) error { return nil })
	require.NoError(t, err)
	return !processed
}

// eventually polls cond every 20ms until it holds or d passes.
func eventually(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// header returns the value of the first header named key.
func header(m kafka.Message, key string) (string, int) {
	v, n := "", 0
	for _, h := range m.Headers {
		if h.Key == key {
			if n == 0 {
				v = string(h.Value)
			}
			n++
		}
	}
	return v, n
}
