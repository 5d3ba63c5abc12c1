package relay_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

func contextWithExpiredDeadline(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithDeadline(parent, time.Now())
}

// fakeWriter is an in-memory Writer: it records the messages it accepts and
// fails the messages of failing topics, per message, as kafka.WriteErrors.
type fakeWriter struct {
	mu      sync.Mutex
	msgs    []kafka.Message
	failing map[string]error
	down    error // fails every write as a whole
	closed  bool
	writes  int
}

func (f *fakeWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return io.ErrClosedPipe
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	f.writes++
	if f.down != nil {
		return f.down
	}
	werrs := make(kafka.WriteErrors, len(msgs))
	failed := false
	for i, m := range msgs {
		if err := f.failing[m.Topic]; err != nil {
			werrs[i], failed = err, true
			continue
		}
		f.msgs = append(f.msgs, m)
	}
	if failed {
		return werrs
	}
	return nil
}

func (f *fakeWriter) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	return nil
}

func (f *fakeWriter) fail(topic string, err error) (restore func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failing == nil {
		f.failing = map[string]error{}
	}
	f.failing[topic] = err
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.failing, topic)
	}
}

func (f *fakeWriter) delivered(topic string) []kafka.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []kafka.Message
	for _, m := range f.msgs {
		if m.Topic == topic {
			out = append(out, m)
		}
	}
	return out
}

// writerSeam is a Writer with the means to check it: fail a topic's
// messages until restored, and read what was delivered to a topic.
type writerSeam struct {
	w         relay.Writer
	failTopic func(topic string) (restore func())
	delivered func(t *testing.T, topic string) []kafka.Message
}

// TestWriterSeam runs one suite against the fake writer the unit tests can
// use and against kafka-go's writer on the in-process cluster: the relay
// must not be able to tell them apart.
func TestWriterSeam(t *testing.T) {
	t.Parallel()
	t.Run("fake", func(t *testing.T) {
		t.Parallel()
		writerSuite(t, func(t *testing.T, e *env) writerSeam {
			f := &fakeWriter{}
			t.Cleanup(func() { require.NoError(t, f.Close()) })
			return writerSeam{
				w: f,
				failTopic: func(topic string) func() {
					return f.fail(topic, fmt.Errorf("fake: %w", kafka.NotEnoughReplicas))
				},
				delivered: func(t *testing.T, topic string) []kafka.Message { return f.delivered(topic) },
			}
		})
	})
	t.Run("kafka-go", func(t *testing.T) {
		t.Parallel()
		writerSuite(t, func(t *testing.T, e *env) writerSeam {
			return writerSeam{
				w:         e.writer(t),
				failTopic: func(topic string) func() { return e.kc.FailProduce(topic).Remove },
				delivered: func(t *testing.T, topic string) []kafka.Message { return e.read(t, topic) },
			}
		})
	})
}

func writerSuite(t *testing.T, newSeam func(*testing.T, *env) writerSeam) {
	t.Run("WriteMessages", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		s := newSeam(t, e)
		msgs := []kafka.Message{
			{Topic: topicOrders, Key: []byte("a"), Value: []byte("1"), Headers: []kafka.Header{{Key: "h", Value: []byte("x")}}},
			{Topic: topicPayments, Key: []byte("b"), Value: []byte("2")},
			{Topic: topicBroken, Key: []byte("c"), Value: []byte("3")},
		}
		require.NoError(t, s.w.WriteMessages(e.ctx, msgs[:2]...))
		got := s.delivered(t, topicOrders)
		require.Len(t, got, 1)
		require.Equal(t, []byte("a"), got[0].Key)
		require.Equal(t, []byte("1"), got[0].Value)
		require.Equal(t, []kafka.Header{{Key: "h", Value: []byte("x")}}, got[0].Headers)

		// A failing topic: kafka.WriteErrors with one entry per message,
		// nil for those that were written.
		restore := s.failTopic(topicBroken)
		err := s.w.WriteMessages(e.ctx, msgs...)
		var werrs kafka.WriteErrors
		require.ErrorAs(t, err, &werrs)
		require.Len(t, werrs, 3)
		require.NoError(t, werrs[0])
		require.NoError(t, werrs[1])
		require.ErrorIs(t, werrs[2], kafka.NotEnoughReplicas)
		require.Empty(t, s.delivered(t, topicBroken))
		require.Len(t, s.delivered(t, topicOrders), 2)
		restore()
		require.NoError(t, s.w.WriteMessages(e.ctx, msgs[2]))
		require.Len(t, s.delivered(t, topicBroken), 1)
	})

	t.Run("relay", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		s := newSeam(t, e)
		r := e.relay(t, s.w, relay.Config{Backoff: func(int) time.Duration { return 0 }})
		var ids []uuid.UUID
		for i, topic := range []string{topicOrders, topicBroken, topicPayments, topicBroken} {
			ids = append(ids, e.insert(t, topic, fmt.Sprintf("k%d", i), i,
				func(m *store.Message) { m.Headers = map[string]string{"traceparent": "00-abc"} }))
		}
		restore := s.failTopic(topicBroken)
		p, f, err := r.RunOnce(e.ctx)
		require.NoError(t, err)
		require.Equal(t, 2, p)
		require.Equal(t, 2, f)
		require.Equal(t, store.OutboxPublished, e.row(t, ids[0]).Status)
		require.Equal(t, store.OutboxPublished, e.row(t, ids[2]).Status)
		for _, id := range []uuid.UUID{ids[1], ids[3]} {
			got := e.row(t, id)
			require.Equal(t, store.OutboxPending, got.Status)
			require.Zero(t, got.Attempts, "a partition without enough replicas is an outage: no attempt spent")
			require.Contains(t, got.LastError, "relay: publish to broken: ")
		}
		restore()
		p, f, err = r.RunOnce(e.ctx)
		require.NoError(t, err)
		require.Equal(t, 2, p)
		require.Zero(t, f)
		got := s.delivered(t, topicBroken)
		require.Len(t, got, 2)
		for i, m := range got {
			id, _ := header(m, store.HeaderMessageID)
			require.Equal(t, ids[1+2*i].String(), id, "retried in order")
			tp, _ := header(m, "traceparent")
			require.Equal(t, "00-abc", tp)
		}
	})
}

// TestWholeBatchFailure uses the fake writer for what kafka-go cannot be
// made to do on demand: fail a write as a whole.
func TestWholeBatchFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	f := &fakeWriter{down: errors.New("fake: cluster on fire")}
	r := e.relay(t, f, relay.Config{MaxAttempts: 2, Backoff: func(int) time.Duration { return 0 }})
	var ids []uuid.UUID
	for i := range 3 {
		ids = append(ids, e.insert(t, topicOrders, "k", i))
	}
	p, n, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Zero(t, p)
	require.Equal(t, 3, n)
	for _, id := range ids {
		got := e.row(t, id)
		require.Equal(t, store.OutboxPending, got.Status)
		require.Equal(t, "relay: publish batch of 3 to orders: fake: cluster on fire", got.LastError)
	}
	_, _, err = r.RunOnce(e.ctx)
	require.NoError(t, err)
	for _, id := range ids {
		got := e.row(t, id)
		require.Equal(t, store.OutboxDead, got.Status)
		require.Equal(t, relay.CodeAttemptsExhausted+": gave up after 2 attempts: relay: publish batch of 3 to orders: fake: cluster on fire",
			got.LastError)
	}
	require.Equal(t, 2, f.writes, "one write per batch")
	require.True(t, slices.ContainsFunc(ids, func(id uuid.UUID) bool { return e.row(t, id).Attempts == 2 }))
}

func TestNewKafkaWriter(t *testing.T) {
	t.Parallel()
	w := relay.NewKafkaWriter([]string{"127.0.0.1:9092"}, nil)
	require.Equal(t, kafka.RequireAll, w.RequiredAcks)
	require.IsType(t, &kafka.Hash{}, w.Balancer)
	require.False(t, w.Async)
	require.False(t, w.AllowAutoTopicCreation)
	require.Equal(t, relay.WriterBatchTimeoutDefault, w.BatchTimeout)
	require.Equal(t, relay.WriterBatchSizeDefault, w.BatchSize)
	require.Equal(t, int64(relay.WriterBatchBytesDefault), w.BatchBytes)
	require.Equal(t, relay.WriterMaxAttemptsDefault, w.MaxAttempts)
	require.NoError(t, w.Close())

	w = relay.NewKafkaWriter([]string{"127.0.0.1:9092"}, &relay.WriterOpts{
		Balancer: kafka.Murmur2Balancer{}, AllowAutoTopicCreation: true, BatchTimeout: time.Millisecond, MaxAttempts: 7,
	})
	require.IsType(t, kafka.Murmur2Balancer{}, w.Balancer)
	require.True(t, w.AllowAutoTopicCreation)
	require.Equal(t, time.Millisecond, w.BatchTimeout)
	require.Equal(t, 7, w.MaxAttempts)
	require.NoError(t, w.Close())

	require.PanicsWithValue(t, "relay: NewKafkaWriter: no brokers", func() { relay.NewKafkaWriter(nil, nil) })
}

func TestRelayCreatesTopicsWhenAllowed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	kc := kafkatest.New(t, kafkatest.AllowAutoTopicCreation(), kafkatest.DefaultNumPartitions(2))
	w := relay.NewKafkaWriter(kc.Addrs(), &relay.WriterOpts{AllowAutoTopicCreation: true, MaxAttempts: 1})
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	r := e.relay(t, w, relay.Config{})
	id := e.insert(t, "created-on-demand", "k", 1)
	p, f, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, p, "last error: %s", e.row(t, id).LastError)
	require.Zero(t, f)
	msgs, err := kc.ReadAll(e.ctx, "created-on-demand")
	require.NoError(t, err)
	require.Len(t, msgs, 1)
}

// TestTheInboxReadsWhatTheRelayWrote: a message the relay published, read
// from the broker, identifies itself to the inbox by the outbox row's id and
// type — the contract consumers deduplicate on.
func TestTheInboxReadsWhatTheRelayWrote(t *testing.T) {
	t.Parallel()
	e := setup(t)
	id := e.insert(t, topicOrders, "order-7", 1, func(m *store.Message) { m.Type = "order.created" })
	r := e.relay(t, e.writer(t), relay.Config{})
	published, _ := drain(t, e.ctx, r)
	require.Equal(t, 1, published)
	msgs := e.read(t, topicOrders)
	require.Len(t, msgs, 1)
	msg := inbox.FromKafka(msgs[0])
	require.Equal(t, id.String(), msg.ID)
	require.Equal(t, "order.created", msg.Type)
	require.Equal(t, []byte("order-7"), msg.Key)
	require.JSONEq(t, `{"seq":1}`, string(msg.Value))
}

// TestTheDefaultWriterSendsOneRequestPerPartitionAndWrite: the default
// writer waits (almost) nothing to fill a batch, and still sends each
// WriteMessages call as one produce request per partition, so the relay's
// batches stay whole on the wire.
func TestTheDefaultWriterSendsOneRequestPerPartitionAndWrite(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const topic = "whole-batches"
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, topic))
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	write := func(keys ...string) {
		t.Helper()
		var msgs []kafka.Message
		for i := range 200 {
			msgs = append(msgs, kafka.Message{Topic: topic, Key: []byte(keys[i%len(keys)]), Value: []byte(fmt.Sprint(i))})
		}
		require.NoError(t, w.WriteMessages(ctx, msgs...))
	}
	write("warm-up") // metadata and connections
	partitions := map[int]bool{}
	keys := []string{}
	for i := 0; len(partitions) < 2; i++ {
		k := fmt.Sprint("key-", i)
		keys = append(keys, k)
		partitions[(&kafka.Hash{}).Balance(kafka.Message{Key: []byte(k)}, 0, 1)] = true
	}
	for range 20 {
		before := kc.ProduceRequests()
		write("one-key")
		require.Equal(t, int64(1), kc.ProduceRequests()-before, "200 messages of one key")
		before = kc.ProduceRequests()
		write(keys...)
		require.Equal(t, int64(2), kc.ProduceRequests()-before, "200 messages over both partitions")
	}
}
