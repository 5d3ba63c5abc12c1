package inbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/store"
)

// poisons are the three kinds of string PostgreSQL refuses: a NUL byte,
// invalid UTF-8, and a value past the btree index limit (random, so that
// PostgreSQL cannot compress it under the limit).
var poisons = []struct{ name, s string }{
	{"nul", "po\x00ison"},
	{"utf8", "po\xff\xfeison"},
	{"10kB", randomText(10 << 10)},
}

func randomText(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[r.IntN(len(letters))]
	}
	return string(b)
}

// produceRaw writes records, in order, to partition 0 of their topic with a
// franz-go client, which sends their bytes as they are: kafka-go's writer
// is not used, so that no client in between checks or changes them.
func produceRaw(t *testing.T, kc *kafkatest.Cluster, recs ...*kgo.Record) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for _, r := range recs {
		r.Partition = 0
	}
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
}

func rawRecord(topic, typ, id string, key, value []byte, extra ...kgo.RecordHeader) *kgo.Record {
	r := &kgo.Record{Topic: topic, Key: key, Value: value}
	if typ != "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: store.HeaderType, Value: []byte(typ)})
	}
	if id != "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: store.HeaderMessageID, Value: []byte(id)})
	}
	r.Headers = append(r.Headers, extra...)
	return r
}

// deadLetterRow is a dead letter as stored, with its raw headers decoded.
type deadLetterRow struct {
	Reason     string
	Key, Value []byte
	RawHeaders []store.RawHeader
}

func deadLetterAt(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, table, consumer string, offset int64) *deadLetterRow {
	t.Helper()
	var d deadLetterRow
	var raw []byte
	err := q.QueryRow(context.Background(), "SELECT reason, msg_key, msg_value, raw_headers FROM "+table+
		" WHERE consumer = $1 AND kafka_offset = $2", consumer, offset).Scan(&d.Reason, &d.Key, &d.Value, &raw)
	if err == pgx.ErrNoRows {
		return nil
	}
	require.NoError(t, err)
	var hs []struct{ K, V []byte } // base64 in JSON, decoded by encoding/json
	require.NoError(t, json.Unmarshal(raw, &hs))
	for _, h := range hs {
		d.RawHeaders = append(d.RawHeaders, store.RawHeader{Key: h.K, Value: h.V})
	}
	return &d
}

// TestKafkaConsumerPoisonBytesNeverStopThePartition sends every kind of
// string PostgreSQL refuses in every field a consumer reads (message id,
// key, header name and value, type, value), each followed by a valid
// message on the same partition, with a raw producer. The valid messages
// are all processed, in order, within seconds; a message whose handler
// wrote the poison to PostgreSQL is dead-lettered at its first failure with
// its raw bytes; an unsafe message id is only an id, and deduplicates.
func TestKafkaConsumerPoisonBytesNeverStopThePartition(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	// A naive handler writes what it received to indexed text columns, as
	// a service might; PostgreSQL refuses the poison.
	_, err := b.pool.Exec(ctx, "CREATE TABLE "+b.table("received")+" (field text, value text); CREATE INDEX ON "+
		b.table("received")+" (field); CREATE INDEX ON "+b.table("received")+" (value)")
	require.NoError(t, err)
	var mu sync.Mutex
	var valid []string
	naiveCalls := map[int64]int{}
	cfg := &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{
		"valid": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			mu.Lock()
			defer mu.Unlock()
			valid = append(valid, string(msg.Value))
			return nil
		},
		"naive": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			mu.Lock()
			naiveCalls[msg.Offset]++
			mu.Unlock()
			ins := "INSERT INTO " + b.table("received") + " VALUES ($1, $2)"
			for _, h := range msg.RawHeaders {
				if _, err := tx.Exec(ctx, ins, string(h.Key), string(h.Value)); err != nil {
					return fmt.Errorf("record header: %w", err)
				}
			}
			if _, err := tx.Exec(ctx, ins, "key", string(msg.Key)); err != nil {
				return fmt.Errorf("record key: %w", err)
			}
			_, err := tx.Exec(ctx, ins, "value", string(msg.Value))
			return err
		},
	}}

	type poisonCase struct {
		name string
		rec  *kgo.Record
		dead bool // else processed
	}
	var cases []poisonCase
	for _, p := range poisons {
		cases = append(cases,
			poisonCase{"message id " + p.name, rawRecord(kafkaTopic, "valid", p.s, nil, []byte("id-"+p.name)), false},
			poisonCase{"header name " + p.name, rawRecord(kafkaTopic, "naive", "", []byte("k"), []byte("v"),
				kgo.RecordHeader{Key: p.s, Value: []byte("v")}), true},
			poisonCase{"header value " + p.name, rawRecord(kafkaTopic, "naive", "", []byte("k"), []byte("v"),
				kgo.RecordHeader{Key: "x-trace", Value: []byte(p.s)}), true},
			poisonCase{"key " + p.name, rawRecord(kafkaTopic, "naive", "", []byte(p.s), []byte("v")), true},
			poisonCase{"value " + p.name, rawRecord(kafkaTopic, "naive", "", []byte("k"), []byte(p.s)), true},
			poisonCase{"type " + p.name, rawRecord(kafkaTopic, p.s, "", []byte("k"), []byte("v")), true},
		)
	}
	cases = append(cases, poisonCase{"repeated message id header", rawRecord(kafkaTopic, "valid", "m-a", nil, []byte("twice"),
		kgo.RecordHeader{Key: store.HeaderMessageID, Value: []byte("m-b")}), true})
	// The same unsafe id again: a duplicate, skipped.
	cases = append(cases, poisonCase{"message id nul again", rawRecord(kafkaTopic, "valid", poisons[0].s, nil, []byte("id-nul-again")), false})

	var recs []*kgo.Record
	var want []string
	for i, c := range cases {
		v := fmt.Sprintf("after %d", i)
		want = append(want, v)
		recs = append(recs, c.rec, rawRecord(kafkaTopic, "valid", fmt.Sprintf("m-%d", i), nil, []byte(v)))
	}
	produceRaw(t, kc, recs...)

	r := newGroupReader(t, kc, false)
	c, err := b.in.NewConsumer(r, cfg)
	require.NoError(t, err)
	start := time.Now()
	runConsumer(t, c, func() bool { return len(r.committedOffsets()) == len(recs) })
	require.Less(t, time.Since(start), 15*time.Second)
	require.NoError(t, r.Close())

	var gotValid []string
	for _, v := range valid {
		if strings.HasPrefix(v, "after ") {
			gotValid = append(gotValid, v)
		}
	}
	require.Equal(t, want, gotValid, "every valid message behind a poison was processed, in order")
	for i, c := range cases {
		offset := int64(2 * i)
		d := deadLetterAt(t, b.pool, b.table("dead_letters"), "payments", offset)
		if !c.dead {
			require.Nil(t, d, "%s: processed, not dead-lettered", c.name)
			continue
		}
		require.NotNil(t, d, "%s: dead-lettered", c.name)
		require.Equal(t, c.rec.Key, d.Key, "%s: the raw key", c.name)
		require.Equal(t, c.rec.Value, d.Value, "%s: the raw value", c.name)
		require.Len(t, d.RawHeaders, len(c.rec.Headers), "%s", c.name)
		for j, h := range c.rec.Headers {
			require.Equal(t, []byte(h.Key), d.RawHeaders[j].Key, "%s: raw header %d's name", c.name, j)
			require.Equal(t, h.Value, d.RawHeaders[j].Value, "%s: raw header %d's value", c.name, j)
		}
		if n, ran := naiveCalls[offset]; ran {
			require.Equal(t, 1, n, "%s: a content error is not retried", c.name)
			require.Contains(t, d.Reason, "PostgreSQL refused the message's content", c.name)
		}
	}
	// The unsafe ids: each processed once, the repeated one skipped.
	require.Equal(t, 1, strings.Count(strings.Join(valid, "|"), "id-nul"), "the duplicate of an unsafe id was skipped")
	require.Contains(t, valid, "id-utf8")
	require.Contains(t, valid, "id-10kB")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("received")), "no poison was written")
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key LIKE 'sha256:%'"),
		"the unsafe ids are recorded by their hash")
}
