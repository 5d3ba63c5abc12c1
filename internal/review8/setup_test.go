// Package review8_test is a black-box review, written from the
// documentation only, of three recent changes: chained remote steps
// (saga/doc.go "Kafka, remote steps, and the two modes"), bus messages run
// several to a transaction (Stats.BusBatched, inbox.Consumer.Batched), and
// the relay's overlapping claims (relay/doc.go "A cycle"). See FINDINGS.md.
package review8_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// poison are the three kinds of string PostgreSQL refuses (the 10 kB one
// in an indexed column: past the btree limit, random so it cannot be
// compressed under it).
var poison = []struct{ name, s string }{
	{"nul", "po\x00ison"},
	{"utf8", "po\xff\xfeison"},
	{"10kB", randomLetters(10 << 10)},
}

func randomLetters(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	b := make([]byte, n)
	x := uint64(88172645463325252)
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = letters[x%uint64(len(letters))]
	}
	return string(b)
}

// db is a migrated schema with an effects table (no unique key: a doubled
// effect is a second row) and an indexed notes table (for poison writes).
type db struct {
	pool   *pgxpool.Pool
	schema string
}

func newDB(t *testing.T) *db {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	d := &db{pool: pool, schema: schema}
	_, err = pool.Exec(ctx, `CREATE TABLE `+d.table("effects")+
		` (seq bigint GENERATED ALWAYS AS IDENTITY, saga_id uuid, what text NOT NULL, txid bigint DEFAULT txid_current())`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE `+d.table("notes")+` (note text); CREATE INDEX ON `+d.table("notes")+` (note)`)
	require.NoError(t, err)
	return d
}

func (d *db) table(name string) string { return pgx.Identifier{d.schema, name}.Sanitize() }

func (d *db) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, d.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

// effect records what for saga id in tx.
func (d *db) effect(ctx context.Context, tx pgx.Tx, id uuid.UUID, what string) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+d.table("effects")+` (saga_id, what) VALUES ($1, $2)`, id, what)
	return err
}

// effects lists saga id's effects in commit order.
func (d *db) effects(t *testing.T, id uuid.UUID) []string {
	t.Helper()
	rows, err := d.pool.Query(context.Background(), `SELECT what FROM `+d.table("effects")+` WHERE saga_id = $1 ORDER BY seq`, id)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ---- Kafka side ----

// bus is a kfake cluster with a relay on the schema, a raw producer (a
// participant in another language: the bytes go as given) and a reader of
// whole topics.
type bus struct {
	*db
	kc *kafkatest.Cluster
	cl *kgo.Client
}

func newBus(t *testing.T, d *db, partitions int32, topics ...string) *bus {
	t.Helper()
	kc := kafkatest.New(t, kafkatest.SeedTopics(partitions, topics...))
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(d.pool, w, &relay.Config{Schema: d.schema, PollInterval: 50 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
		require.NoError(t, w.Close())
	})
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return &bus{db: d, kc: kc, cl: cl}
}

func (b *bus) produce(t *testing.T, recs ...*kgo.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.cl.ProduceSync(ctx, recs...).FirstErr())
}

// commandKey waits for saga id's command on topic and returns its step key.
func (b *bus) commandKey(t *testing.T, topic string, id uuid.UUID) string {
	t.Helper()
	var key string
	eventually(t, 20*time.Second, "the remote command of "+id.String(), func() bool {
		msgs, err := b.kc.ReadAll(context.Background(), topic)
		require.NoError(t, err)
		for _, m := range msgs {
			if string(m.Key) != id.String() {
				continue
			}
			for _, h := range m.Headers {
				if h.Key == wire.HeaderStepKey {
					key = string(h.Value)
				}
			}
		}
		return key != ""
	})
	return key
}

// reply is a reply record as docs/protocol.md "Replies" describes it.
func reply(topic string, id uuid.UUID, key string, value string) *kgo.Record {
	return &kgo.Record{Topic: topic, Partition: 0, Key: []byte(id.String()), Value: []byte(value),
		Headers: []kgo.RecordHeader{
			{Key: wire.HeaderMessageID, Value: []byte(uuid.NewString())},
			{Key: wire.HeaderType, Value: []byte(steps.ReplyType)},
			{Key: wire.HeaderSagaID, Value: []byte(id.String())},
			{Key: wire.HeaderStepKey, Value: []byte(key)},
		}}
}

func setHeader(r *kgo.Record, name, value string) {
	for i := range r.Headers {
		if r.Headers[i].Key == name {
			r.Headers[i].Value = []byte(value)
			return
		}
	}
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: name, Value: []byte(value)})
}

// ---- engines ----

func engineConfig(d *db, kc *kafkatest.Cluster, allSteps bool) *saga.Config {
	return &saga.Config{
		Schema:         d.schema,
		Workers:        2,
		PollInterval:   50 * time.Millisecond,
		RescueInterval: time.Second,
		Logger:         quiet,
		Kafka:          &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: allSteps, SessionTimeout: 6 * time.Second},
	}
}

// startEngine makes and starts an engine; stop stops it (idempotent, also
// at cleanup).
func startEngine(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) (*saga.Engine, func()) {
	t.Helper()
	e, err := saga.New(pool, cfg)
	require.NoError(t, err)
	require.NoError(t, e.Register(defs...))
	require.NoError(t, e.Start(context.Background()))
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(ctx))
	}
	t.Cleanup(stop)
	return e, stop
}

func waitEnded(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: 40 * time.Second})
}

func timeline(in *saga.Instance) string { return strings.Join(sagatest.Timeline(in), " | ") }

var _ = fmt.Sprintf
