// Package review22 reviews, from the docs only, the polling relay's marks
// committed with synchronous_commit = off: a PostgreSQL crash within about
// half a second of the commit may undo them, and the rows must then be
// published again, never lost.
package review22

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const (
	schema      = "sagaflow"
	topicOrders = "orders" // 3 partitions
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// rig is a throwaway PostgreSQL server that a test crashes, its pool, and
// an in-process Kafka cluster.
type rig struct {
	ctx  context.Context
	srv  *pgtest.Server
	pool *pgxpool.Pool
	st   *store.Store
	kc   *kafkatest.Cluster

	mu      sync.Mutex
	written map[uuid.UUID]store.Message // every row known to be committed
	crashes int
}

// newRig starts a server of the test's own (logical: wal_level=logical).
func newRig(t *testing.T, logical bool, opts ...kafkatest.Option) *rig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	t.Cleanup(cancel)
	start := pgtest.StartServer
	if logical {
		start = pgtest.StartLogicalServer
	}
	srv, err := start(ctx)
	if err != nil {
		t.Skipf("no throwaway PostgreSQL server to crash (logical=%v): %v", logical, err)
	}
	t.Cleanup(func() { _ = srv.Stop(context.Background()) })
	cfg, err := pgxpool.ParseConfig(srv.ConnString())
	require.NoError(t, err)
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	st, err := store.New(schema)
	require.NoError(t, err)
	if len(opts) == 0 {
		opts = []kafkatest.Option{kafkatest.SeedTopics(3, topicOrders)}
	}
	kc := kafkatest.New(t, opts...)
	return &rig{ctx: ctx, srv: srv, pool: pool, st: st, kc: kc, written: map[uuid.UUID]store.Message{}}
}

func (r *rig) writer(t *testing.T) *kafka.Writer {
	t.Helper()
	w := relay.NewKafkaWriter(r.kc.Addrs(), &relay.WriterOpts{MaxAttempts: 1, MetadataTTL: 500 * time.Millisecond})
	t.Cleanup(func() { _ = w.Close() })
	return w
}

// started returns a started relay on the rig's pool (or pool), stopped at
// the end of the test, before the server.
func (r *rig) started(t *testing.T, pool *pgxpool.Pool, w relay.Writer, cfg relay.Config) *relay.Relay {
	t.Helper()
	if pool == nil {
		pool = r.pool
	}
	cfg.Schema = schema
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	rl, err := relay.New(pool, w, &cfg)
	require.NoError(t, err)
	require.NoError(t, rl.Start(r.ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rl.Stop(ctx)
	})
	return rl
}

// crash kills the server (immediate shutdown: WAL not yet written is lost)
// and starts it again, which runs crash recovery.
func (r *rig) crash(t *testing.T) {
	t.Helper()
	require.NoError(t, r.srv.Kill())
	r.mu.Lock()
	r.crashes++
	r.mu.Unlock()
	time.Sleep(30 * time.Millisecond) // let the relay see its connections die
	require.NoError(t, r.srv.Restart(r.ctx))
}

// insert writes rows with store.InsertMessage, one transaction each, while
// the server is up (the caller never crashes it concurrently).
func (r *rig) insert(t *testing.T, ms ...store.Message) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, 0, len(ms))
	for _, m := range ms {
		if m.ID == uuid.Nil {
			m.ID = uuid.Must(uuid.NewV7())
		}
		var err error
		for range 100 { // the pool may still hold connections the crash broke
			if err = r.st.InsertMessage(r.ctx, r.pool, &m); err == nil {
				break
			}
			if exists(r.ctx, r.pool, m.ID) {
				err = nil
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		require.NoError(t, err)
		r.mu.Lock()
		r.written[m.ID] = m
		r.mu.Unlock()
		ids = append(ids, m.ID)
	}
	return ids
}

func exists(ctx context.Context, pool *pgxpool.Pool, id uuid.UUID) bool {
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM sagaflow.outbox WHERE id = $1`, id).Scan(&n); err != nil {
		return false
	}
	return n == 1
}

// msg is a relay row on topic with key and a payload naming seq.
func msg(topic, key string, seq int) store.Message {
	return store.Message{ID: uuid.Must(uuid.NewV7()), Topic: topic, AggregateID: key, Type: "test.event",
		Payload: fmt.Appendf(nil, `{"key":%q,"seq":%d}`, key, seq)}
}

// counts returns the number of relay rows per status, retrying while the
// server recovers.
func (r *rig) counts(t *testing.T) map[string]int {
	t.Helper()
	for range 200 {
		rows, err := r.pool.Query(r.ctx, `SELECT status, count(*) FROM sagaflow.outbox WHERE delivery = 'relay' GROUP BY status`)
		if err == nil {
			out := map[string]int{}
			for rows.Next() {
				var s string
				var n int
				if err = rows.Scan(&s, &n); err != nil {
					break
				}
				out[s] = n
			}
			rows.Close()
			if err == nil && rows.Err() == nil {
				return out
			}
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatal("counts: the server never answered")
	return nil
}

// waitSettled waits until no relay row is pending.
func (r *rig) waitSettled(t *testing.T, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		c := r.counts(t)
		if c["pending"] == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v, %d rows still pending (%v): the relay stopped publishing after the crashes", timeout, c["pending"], c)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// healthAfterCrashes is rl.Health once it answers. Health reads again on
// another connection when a crash broke the pooled one (pgerr.RetryRead),
// but right after a crash the server itself may still be recovering.
func (r *rig) healthAfterCrashes(t *testing.T, rl *relay.Relay) relay.Health {
	t.Helper()
	var h relay.Health
	var err error
	for range 20 {
		if h, err = rl.Health(r.ctx); err == nil {
			return h
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.NoError(t, err, "Health after the crashes")
	return h
}

func header(m kafka.Message, key string) (string, bool) {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

// onTopic reads topic, checks that every message carries the
// sagaflow-message-id of a row this rig wrote and that every copy of a row
// carries the same key, value and type, and returns the messages by id
// sorted by partition and offset.
func (r *rig) onTopic(t *testing.T, topic string) (byID map[uuid.UUID][]kafka.Message, all []kafka.Message) {
	t.Helper()
	msgs, err := r.kc.ReadAll(r.ctx, topic)
	require.NoError(t, err)
	sort.SliceStable(msgs, func(i, j int) bool {
		if msgs[i].Partition != msgs[j].Partition {
			return msgs[i].Partition < msgs[j].Partition
		}
		return msgs[i].Offset < msgs[j].Offset
	})
	byID = map[uuid.UUID][]kafka.Message{}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		s, ok := header(m, store.HeaderMessageID)
		require.True(t, ok, "a message without %s: %v", store.HeaderMessageID, m.Headers)
		id, err := uuid.Parse(s)
		require.NoError(t, err)
		w, ok := r.written[id]
		require.True(t, ok, "message %s on %s is no row the test wrote", id, topic)
		require.Equal(t, w.AggregateID, string(m.Key), "key of a copy of %s", id)
		require.True(t, bytes.Equal(w.Payload, m.Value), "value of a copy of %s: %q, want %q", id, m.Value, w.Payload)
		typ, _ := header(m, "sagaflow-type")
		require.Equal(t, w.Type, typ, "sagaflow-type of a copy of %s", id)
		for k, v := range w.Headers {
			got, ok := header(m, k)
			require.True(t, ok, "header %q of %s missing from a copy", k, id)
			require.Equal(t, v, got, "header %q of a copy of %s", k, id)
		}
		byID[id] = append(byID[id], m)
	}
	return byID, msgs
}

// requireAllDelivered asserts that every row written to topic (but those in
// except) is marked published and is on the topic at least once; it returns
// how many ids were on the topic more than once.
func (r *rig) requireAllDelivered(t *testing.T, topic string, except map[uuid.UUID]bool) (dupIDs int) {
	t.Helper()
	byID, _ := r.onTopic(t, topic)
	r.mu.Lock()
	var want []uuid.UUID
	for id, m := range r.written {
		if m.Topic == topic && !except[id] {
			want = append(want, id)
		}
	}
	r.mu.Unlock()
	var lost []string
	for _, id := range want {
		if len(byID[id]) == 0 {
			lost = append(lost, id.String())
		}
	}
	require.Empty(t, lost, "%d of %d rows written to %s never reached it", len(lost), len(want), topic)
	var notPublished int
	ids := make([]uuid.UUID, len(want))
	copy(ids, want)
	require.NoError(t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM sagaflow.outbox WHERE id = ANY($1) AND status <> 'published'`, ids).Scan(&notPublished))
	require.Zero(t, notPublished, "rows on the topic but not marked published")
	for _, c := range byID {
		if len(c) > 1 {
			dupIDs++
		}
	}
	return dupIDs
}

// seqOf reads the "seq" of a payload made by msg.
func seqOf(t *testing.T, v []byte) int {
	t.Helper()
	i := strings.Index(string(v), `"seq":`)
	require.GreaterOrEqual(t, i, 0, "payload %q", v)
	var n int
	_, err := fmt.Sscanf(string(v[i+len(`"seq":`):]), "%d", &n)
	require.NoError(t, err)
	return n
}
