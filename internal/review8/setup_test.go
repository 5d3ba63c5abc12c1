// Package review8_test is a black-box review, written from the
// documentation only, of three recent changes: chained remote steps
// (saga/doc.go "Kafka, remote steps, and the two modes"), bus messages run
// several to a transaction (Stats.BusBatched, inbox.Consumer.Batched), and
// the relay's overlapping claims (relay/doc.go "A cycle"). See FINDINGS.md.
package review8_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// poison are the three kinds of string PostgreSQL refuses (the 10 kB one
// in an indexed column: past the btree limit, random so it cannot be
// compressed under it).
var poison = []struct{ name, s string }{
	{"nul", "po\x00ison"},
	{"utf8", "po\xff\xfeison"},
	{"10kB", testkit.RandomLetters(10 << 10)},
}

// db is a migrated schema with an effects table and an indexed notes
// table (for poison writes).
type db struct {
	*testkit.DB
	fx *testkit.Effects
}

func newDB(t *testing.T) *db {
	t.Helper()
	d := &db{DB: testkit.NewDB(t)}
	d.fx = testkit.NewEffects(t, d.DB)
	_, err := d.Pool.Exec(context.Background(), `CREATE TABLE `+d.Table("notes")+` (note text); CREATE INDEX ON `+d.Table("notes")+` (note)`)
	require.NoError(t, err)
	return d
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
	r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, PollInterval: 50 * time.Millisecond, Logger: testkit.Discard})
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
	testkit.WaitFor(t, 20*time.Second, "the remote command of "+id.String(), func() bool {
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
	cfg := d.Config()
	cfg.Workers = 2
	cfg.RescueInterval = time.Second
	// ReplyStepLimit: on a loaded machine (CI runs the packages side by
	// side) a step run at once after a reply can take more than the 200 ms
	// default; it is then cut and its step handed to engine workers for a
	// minute, and no later reply chains it. These tests look at what runs
	// in a reply's transaction; the hand-off has its own (saga, review16).
	cfg.Kafka = &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: allSteps, SessionTimeout: 6 * time.Second,
		ReplyStepLimit: time.Minute}
	return cfg
}

func timeline(in *saga.Instance) string { return strings.Join(sagatest.Timeline(in), " | ") }
