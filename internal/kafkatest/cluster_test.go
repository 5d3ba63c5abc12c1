package kafkatest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// newWriter returns a kafka-go writer on c that gives up after one attempt,
// closed when the test ends.
func newWriter(t *testing.T, c *kafkatest.Cluster) *kafka.Writer {
	t.Helper()
	w := kafka.NewWriter(kafka.WriterConfig{
		Brokers:      c.Addrs(),
		Balancer:     &kafka.Hash{},
		BatchTimeout: 5 * time.Millisecond,
		MaxAttempts:  1,
		RequiredAcks: int(kafka.RequireAll),
	})
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func messages(topic string, n int) []kafka.Message {
	var out []kafka.Message
	for i := range n {
		out = append(out, kafka.Message{
			Topic:   topic,
			Key:     fmt.Appendf(nil, "k%d", i%3),
			Value:   fmt.Appendf(nil, "v%d", i),
			Headers: []kafka.Header{{Key: "h", Value: fmt.Appendf(nil, "%d", i)}},
		})
	}
	return out
}

func TestWriteAndReadAll(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := kafkatest.New(t, kafkatest.SeedTopics(3, "a", "b"))
	if len(c.Addrs()) != 1 {
		t.Fatalf("Addrs = %v, want one broker", c.Addrs())
	}
	w := newWriter(t, c)
	if err := w.WriteMessages(ctx, messages("a", 9)...); err != nil {
		t.Fatal(err)
	}
	if empty, err := c.ReadAll(ctx, "b"); err != nil || len(empty) != 0 {
		t.Fatalf("ReadAll of an empty topic = %d messages, %v", len(empty), err)
	}
	if _, err := c.ReadAll(ctx, "no-such-topic"); err == nil {
		t.Error("ReadAll of a missing topic succeeded")
	}
	got, err := c.ReadAll(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 9 {
		t.Fatalf("read %d messages, want 9", len(got))
	}
	seen := map[string]bool{}
	partOf := map[string]int{}
	for _, m := range got {
		seen[string(m.Value)] = true
		if p, ok := partOf[string(m.Key)]; ok && p != m.Partition {
			t.Errorf("key %s in partitions %d and %d", m.Key, p, m.Partition)
		}
		partOf[string(m.Key)] = m.Partition
		if len(m.Headers) != 1 || m.Headers[0].Key != "h" {
			t.Errorf("message %s: headers %v", m.Value, m.Headers)
		}
		if m.Topic != "a" {
			t.Errorf("message %s: topic %q", m.Value, m.Topic)
		}
	}
	if len(seen) != 9 {
		t.Errorf("distinct values %d, want 9", len(seen))
	}
	if c.ProduceRequests() == 0 {
		t.Error("ProduceRequests = 0 after a write")
	}
}

func TestFailProduce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := kafkatest.New(t, kafkatest.SeedTopics(1, "a", "b"))
	w := newWriter(t, c)

	f := c.FailProduce("a")
	msgs := append(messages("a", 2), messages("b", 2)...)
	err := w.WriteMessages(ctx, msgs...)
	var werr kafka.WriteErrors
	if !errors.As(err, &werr) {
		t.Fatalf("WriteMessages = %v, want kafka.WriteErrors", err)
	}
	for i, e := range werr {
		if wantFail := msgs[i].Topic == "a"; (e != nil) != wantFail {
			t.Errorf("message %d on %s: error %v", i, msgs[i].Topic, e)
		}
		if e != nil && !errors.Is(e, kafka.NotEnoughReplicas) {
			t.Errorf("message %d: error %v, want NOT_ENOUGH_REPLICAS", i, e)
		}
	}
	if f.Hits() == 0 {
		t.Error("fault has no hits")
	}
	f.Remove()
	f.Remove()
	if err := w.WriteMessages(ctx, messages("a", 2)...); err != nil {
		t.Fatalf("after Remove: %v", err)
	}
	got, err := c.ReadAll(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Errorf("topic a has %d records, want 2 (the failed ones are not stored)", len(got))
	}

	n := c.FailProduceN("", 1)
	if err := w.WriteMessages(ctx, messages("b", 1)...); err == nil {
		t.Error("first write after FailProduceN(1) succeeded")
	}
	if err := n.Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteMessages(ctx, messages("b", 1)...); err != nil {
		t.Errorf("second write after FailProduceN(1): %v", err)
	}
}

func TestUnreachable(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := kafkatest.New(t, kafkatest.SeedTopics(1, "a"))

	w := newWriter(t, c)
	if err := w.WriteMessages(ctx, messages("a", 1)...); err != nil {
		t.Fatal(err)
	}
	f := c.Unreachable()
	if err := w.WriteMessages(ctx, messages("a", 1)...); err == nil {
		t.Fatal("write to an unreachable cluster succeeded")
	}
	if err := f.Wait(ctx, 1); err != nil {
		t.Fatalf("no request was refused: %v", err)
	}
	f.Remove()
	f.Remove()
	// A new client connects at once.
	w2 := newWriter(t, c)
	if err := w2.WriteMessages(ctx, messages("a", 1)...); err != nil {
		t.Fatalf("after Remove: %v", err)
	}
	// The first writer's pooled connections were closed under it: a write
	// may fail once on a dead connection before the writer reconnects.
	var err error
	for range 3 {
		if err = w.WriteMessages(ctx, messages("a", 1)...); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("first writer after Remove: %v", err)
	}
}

func TestCloseTwice(t *testing.T) {
	t.Parallel()
	c, err := kafkatest.Start(kafkatest.NumBrokers(2), kafkatest.AllowAutoTopicCreation(), kafkatest.DefaultNumPartitions(2))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Addrs()) != 2 {
		t.Errorf("Addrs = %v, want two brokers", c.Addrs())
	}
	if err := c.CreateTopic("x", 4); err != nil {
		t.Error(err)
	}
	c.Close()
	c.Close()
}
