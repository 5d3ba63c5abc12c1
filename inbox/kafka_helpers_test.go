package inbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/store"
)

// The helpers of the kfake tests: a kafka-go consumer-group reader on an
// in-process cluster, watched through the seam a Consumer reads through.

const (
	kafkaTopic = "payments"
	kafkaGroup = "payments-service"
)

// groupReader is a kafka.Reader in a consumer group that records what the
// Consumer fetched and committed. With dropCommits, commits never reach the
// broker: a consumer that dies, or leaves its group, before committing.
type groupReader struct {
	*kafka.Reader
	dropCommits bool

	mu        sync.Mutex
	fetched   []int64 // offsets, in the order fetched
	committed []int64 // offsets whose commit the broker acknowledged
	dropped   []int64 // offsets whose commit was dropped
}

// newGroupReader joins kafkaGroup on kc's kafkaTopic with kafka-go's
// consumer-group reader, committing synchronously as the Consumer asks
// (CommitInterval 0). It is closed, leaving the group, when the test ends
// if the test has not closed it before.
func newGroupReader(t *testing.T, kc *kafkatest.Cluster, dropCommits bool) *groupReader {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers:           kc.Addrs(),
		GroupID:           kafkaGroup,
		Topic:             kafkaTopic,
		StartOffset:       kafka.FirstOffset, // for a group without a committed offset
		CommitInterval:    0,                 // CommitMessages commits before it returns
		MinBytes:          1,
		MaxBytes:          1 << 20,
		MaxWait:           50 * time.Millisecond,
		HeartbeatInterval: 500 * time.Millisecond,
		JoinGroupBackoff:  200 * time.Millisecond,
		ReadBackoffMin:    20 * time.Millisecond,
		ReadBackoffMax:    200 * time.Millisecond,
		MaxAttempts:       10,
	})
	gr := &groupReader{Reader: r, dropCommits: dropCommits}
	t.Cleanup(func() { _ = r.Close() }) // Close is idempotent
	return gr
}

func (r *groupReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	m, err := r.Reader.FetchMessage(ctx)
	if err == nil {
		r.mu.Lock()
		r.fetched = append(r.fetched, m.Offset)
		r.mu.Unlock()
	}
	return m, err
}

func (r *groupReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	if r.dropCommits {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, m := range msgs {
			r.dropped = append(r.dropped, m.Offset)
		}
		return nil
	}
	if err := r.Reader.CommitMessages(ctx, msgs...); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		r.committed = append(r.committed, m.Offset)
	}
	return nil
}

func (r *groupReader) fetchedOffsets() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int64(nil), r.fetched...)
}

func (r *groupReader) committedOffsets() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int64(nil), r.committed...)
}

func (r *groupReader) droppedOffsets() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int64(nil), r.dropped...)
}

// kafkaMessage is a message to kafkaTopic with the headers the relay sets
// ("" leaves a header out).
func kafkaMessage(typ, id string, value []byte) kafka.Message {
	m := kafka.Message{Topic: kafkaTopic, Key: []byte("order-1"), Value: value}
	if typ != "" {
		m.Headers = append(m.Headers, kafka.Header{Key: store.HeaderType, Value: []byte(typ)})
	}
	if id != "" {
		m.Headers = append(m.Headers, kafka.Header{Key: store.HeaderMessageID, Value: []byte(id)})
	}
	return m
}

// produce writes msgs, in order, with a kafka-go writer. One partition
// keeps them in that order.
func produce(t *testing.T, kc *kafkatest.Cluster, msgs ...kafka.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	w := kafka.NewWriter(kafka.WriterConfig{
		Brokers:      kc.Addrs(),
		BatchTimeout: 5 * time.Millisecond,
		BatchSize:    len(msgs),
		RequiredAcks: int(kafka.RequireAll),
	})
	err := w.WriteMessages(ctx, msgs...)
	require.NoError(t, w.Close())
	require.NoError(t, err)
}

// committedOffset returns kafkaGroup's committed offset of partition 0, as
// the broker has it (-1: none), with an OffsetFetch request.
func committedOffset(t *testing.T, kc *kafkatest.Cluster) int64 {
	t.Helper()
	off, err := fetchCommittedOffset(kc)
	require.NoError(t, err)
	return off
}

// fetchCommittedOffset asks the broker for kafkaGroup's committed offset of
// partition 0 (the broker answers "group not found" until the first commit).
func fetchCommittedOffset(kc *kafkatest.Cluster) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections() // kafka.DefaultTransport would keep its connections, and goleak would see them
	client := &kafka.Client{Addr: kafka.TCP(kc.Addrs()...), Transport: tr}
	res, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: kafkaGroup, Topics: map[string][]int{kafkaTopic: {0}}})
	if err != nil {
		return 0, err
	}
	if res.Error != nil {
		return 0, res.Error
	}
	parts := res.Topics[kafkaTopic]
	if len(parts) != 1 {
		return 0, fmt.Errorf("%d partitions in the answer, want 1", len(parts))
	}
	if parts[0].Error != nil {
		return 0, parts[0].Error
	}
	return parts[0].CommittedOffset, nil
}

// batchReader reads the test topic from its start in the test group, with
// no wait for more bytes, so that a backlog is held ready in batches.
func batchReader(t *testing.T, kc *kafkatest.Cluster) *kafka.Reader {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: kafkaGroup, Topic: kafkaTopic,
		StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond,
		HeartbeatInterval: 500 * time.Millisecond, JoinGroupBackoff: 200 * time.Millisecond})
	t.Cleanup(func() { _ = r.Close() })
	return r
}
