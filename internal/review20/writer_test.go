package review20_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// inOrder checks that topic holds exactly want messages per key, values
// "<tag>/<seq>" with seq increasing by key in write order and no copy.
func inOrder(t *testing.T, kc *kafkatest.Cluster, topic, tag string, want map[string]int) {
	t.Helper()
	msgs, err := kc.ReadAll(context.Background(), topic)
	require.NoError(t, err)
	last := map[string]int{}
	got := map[string]int{}
	part := map[string]int{}
	for _, m := range msgs {
		v := string(m.Value)
		if !strings.HasPrefix(v, tag+"/") {
			continue
		}
		seq, err := strconv.Atoi(strings.TrimPrefix(v, tag+"/"))
		require.NoError(t, err, "value %q", short(v))
		k := string(m.Key)
		if p, ok := part[k]; ok {
			require.Equal(t, p, m.Partition, "key %s on two partitions", k)
		}
		part[k] = m.Partition
		if n, ok := last[k]; ok {
			require.Greater(t, seq, n, "key %s: %s/%d after %s/%d", k, tag, seq, tag, n)
		}
		last[k] = seq
		got[k]++
	}
	require.Equal(t, want, got, "messages per key of %s", tag)
}

// relay/doc.go and CHANGELOG: NewKafkaWriter's BatchTimeout is 1 µs, and
// "each WriteMessages call's messages for a partition still go in one
// produce request"; WriterOpts.BatchSize "is the most messages per
// partition in one produce request". On a topic of 4 partitions: calls of
// 200 messages over 40 keys cost at most 4 produce requests each (and at
// least 1); a call of 1,200 messages of one key at most 2; and the
// consumer side sees every key's messages once each, in write order. Then
// four goroutines share the writer, each with its own keys: every message
// once, in order per key.
func TestWriterOneProduceRequestPerPartitionPerCall(t *testing.T) {
	t.Parallel()
	const topic = "r20.writer"
	kc := kafkatest.New(t, kafkatest.SeedTopics(4, topic))
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Topic: topic, Key: []byte("warm"), Value: []byte("warm")}))
	want := map[string]int{}
	seq := 0
	var deltas []int64
	for round := range 6 {
		msgs := make([]kafka.Message, 200)
		for i := range msgs {
			k := fmt.Sprint("k", (i*7+round)%40)
			msgs[i] = kafka.Message{Topic: topic, Key: []byte(k), Value: []byte(fmt.Sprintf("seq/%d", seq))}
			want[k]++
			seq++
		}
		before := kc.ProduceRequests()
		require.NoError(t, w.WriteMessages(ctx, msgs...))
		delta := kc.ProduceRequests() - before
		deltas = append(deltas, delta)
		require.GreaterOrEqual(t, delta, int64(1))
		require.LessOrEqual(t, delta, int64(4), "round %d: 200 messages on 4 partitions took %d produce requests", round, delta)
	}
	big := make([]kafka.Message, 1200)
	for i := range big {
		big[i] = kafka.Message{Topic: topic, Key: []byte("one"), Value: []byte(fmt.Sprintf("seq/%d", seq))}
		want["one"]++
		seq++
	}
	before := kc.ProduceRequests()
	require.NoError(t, w.WriteMessages(ctx, big...))
	bigDelta := kc.ProduceRequests() - before
	require.LessOrEqual(t, bigDelta, int64(2), "1,200 messages of one key (WriterBatchSizeDefault %d)", relay.WriterBatchSizeDefault)
	t.Logf("produce requests per call of 200: %v; for 1,200 of one key: %d", deltas, bigDelta)
	inOrder(t, kc, topic, "seq", want)

	// Four goroutines share the writer (the CHANGELOG: such a writer "wants
	// a longer BatchTimeout" to merge their messages; nothing may be lost
	// or reordered without it).
	shared := map[string]int{}
	errs := make(chan error, 4)
	before = kc.ProduceRequests()
	for g := range 4 {
		for i := range 10 {
			shared[fmt.Sprintf("g%d-%d", g, i)] = 5 * 20
		}
		go func() {
			n := 0
			for range 5 {
				msgs := make([]kafka.Message, 200)
				for i := range msgs {
					msgs[i] = kafka.Message{Topic: topic, Key: []byte(fmt.Sprintf("g%d-%d", g, i%10)), Value: []byte(fmt.Sprintf("g/%d", n))}
					n++
				}
				if err := w.WriteMessages(ctx, msgs...); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range 4 {
		require.NoError(t, <-errs)
	}
	sharedDelta := kc.ProduceRequests() - before
	require.LessOrEqual(t, sharedDelta, int64(4*5*4), "20 calls on 4 partitions")
	t.Logf("4 goroutines, 20 calls of 200: %d produce requests", sharedDelta)
	inOrder(t, kc, topic, "g", shared)
}

// A relay's cycle "writes the whole batch with one synchronous
// WriteMessages call": two tenants (two schemas) on one broker, each with
// a backlog of 400 outbox rows over 50 keys (the same keys in both tenants)
// on a topic of its own with 4 partitions, written in one transaction; a
// relay each with BatchSize 400 and the default writer. One RunOnce each
// publishes all 400 in at most 4 produce requests; every key's messages
// arrive once each, in write order, with distinct message ids, and nothing
// of one tenant reaches the other's topic.
func TestRelayBacklogTwoTenantsOneRequestPerPartition(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t, kafkatest.SeedTopics(4, "r20.t0.events", "r20.t1.events"))
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	type tenant struct {
		d *testkit.DB
		r *relay.Relay
	}
	var ts []tenant
	for n := range 2 {
		d := testkit.NewDB(t)
		ob, err := outbox.New(d.Pool, d.Schema)
		require.NoError(t, err)
		require.NoError(t, pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
			for i := range 400 {
				if err := ob.InsertTx(ctx, tx, outbox.Message{Topic: fmt.Sprintf("r20.t%d.events", n), Key: fmt.Sprint("k", i%50),
					Type: "r20.event", Payload: []byte(fmt.Sprintf("t%d/%d", n, i))}); err != nil {
					return err
				}
			}
			return nil
		}))
		w := relay.NewKafkaWriter(kc.Addrs(), nil)
		t.Cleanup(func() { require.NoError(t, w.Close()) })
		r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, BatchSize: 400, PollInterval: poll, Logger: testkit.Discard})
		require.NoError(t, err)
		ts = append(ts, tenant{d, r})
	}
	want := map[string]int{}
	for i := range 50 {
		want[fmt.Sprint("k", i)] = 8
	}
	for n, tn := range ts {
		before := kc.ProduceRequests()
		published, failed, err := tn.r.RunOnce(ctx)
		require.NoError(t, err)
		delta := kc.ProduceRequests() - before
		t.Logf("tenant %d: published %d, failed %d, in %d produce requests", n, published, failed, delta)
		require.Equal(t, 400, published)
		require.Zero(t, failed)
		require.LessOrEqual(t, delta, int64(4), "tenant %d: one WriteMessages call of 400 rows on 4 partitions", n)
		require.Zero(t, tn.d.Count(t, "SELECT count(*) FROM "+tn.d.Table("outbox")+" WHERE status <> 'published'"))
	}
	for n := range 2 {
		topic := fmt.Sprintf("r20.t%d.events", n)
		inOrder(t, kc, topic, fmt.Sprintf("t%d", n), want)
		msgs, err := kc.ReadAll(ctx, topic)
		require.NoError(t, err)
		require.Len(t, msgs, 400, "%s holds another tenant's messages or copies", topic)
		ids := map[string]bool{}
		for _, m := range msgs {
			for _, h := range m.Headers {
				if h.Key == "sagaflow-message-id" {
					require.False(t, ids[string(h.Value)], "message id %s twice", h.Value)
					ids[string(h.Value)] = true
				}
			}
		}
		require.Len(t, ids, 400)
	}
}
