package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/store"
)

// memReader is an in-memory partition: the seam a Consumer reads through,
// faked to control redelivery precisely. The same behaviour is checked
// against kafka-go on a real (in-process) broker in the kfake tests.
type memReader struct {
	mu          sync.Mutex
	msgs        []kafka.Message
	next        int
	committed   []int64
	dropCommits bool
}

func (r *memReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	for {
		r.mu.Lock()
		if r.next < len(r.msgs) {
			m := r.msgs[r.next]
			r.next++
			r.mu.Unlock()
			return m, nil
		}
		r.mu.Unlock()
		select {
		case <-ctx.Done():
			return kafka.Message{}, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (r *memReader) CommitMessages(_ context.Context, msgs ...kafka.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dropCommits {
		return errors.New("left the group")
	}
	for _, m := range msgs {
		r.committed = append(r.committed, m.Offset)
	}
	return nil
}

func (r *memReader) add(typ, id string, value []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := kafka.Message{Topic: "payments", Partition: 0, Offset: int64(len(r.msgs)), Key: []byte("order-1"), Value: value}
	if typ != "" {
		m.Headers = append(m.Headers, kafka.Header{Key: store.HeaderType, Value: []byte(typ)})
	}
	if id != "" {
		m.Headers = append(m.Headers, kafka.Header{Key: store.HeaderMessageID, Value: []byte(id)})
	}
	r.msgs = append(r.msgs, m)
}

type chargeRequested struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

// runConsumer runs c until cond holds, then stops it.
func runConsumer(t *testing.T, c *inbox.Consumer, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatal("timed out waiting for the consumer")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	require.NoError(t, <-done)
}

func TestConsumerDeadLettersPoisonAndKeepsThePartitionMoving(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var order []string
	var mu sync.Mutex
	handler := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		req, err := inbox.DecodeJSON[chargeRequested](msg)
		if err != nil {
			return err
		}
		mu.Lock()
		order = append(order, req.OrderID)
		mu.Unlock()
		_, err = tx.Exec(ctx, "INSERT INTO "+b.table("charges")+" VALUES ($1, $2)", msg.ID, req.Amount)
		return err
	}
	r := &memReader{}
	r.add("charge.requested", "m-1", []byte(`{"order_id":"o-1","amount":5}`))
	r.add("charge.requested", "m-2", []byte(`{not json`))                                   // undecodable
	r.add("refund.requested", "m-3", []byte(`{}`))                                          // unknown type
	r.add("charge.requested", "m-4", []byte(`{"order_id":"`+strings.Repeat("x", 300)+`"}`)) // oversized
	r.add("", "", []byte(`{}`))                                                             // no type, no id
	r.add("charge.requested", "m-5", []byte(`{"order_id":"o-5","amount":7}`))
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{
		Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler}, MaxMessageBytes: 200,
	})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { r.mu.Lock(); defer r.mu.Unlock(); return len(r.committed) == 6 })

	require.Equal(t, []string{"o-1", "o-5"}, order, "the valid messages behind the poison were processed, in order")
	require.Equal(t, []int64{0, 1, 2, 3, 4, 5}, r.committed, "every offset committed, in order")
	rows, err := b.pool.Query(context.Background(), "SELECT coalesce(message_id, ''), reason, msg_value FROM "+b.table("dead_letters")+" ORDER BY id")
	require.NoError(t, err)
	type dead struct {
		ID, Reason string
		Value      []byte
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[dead])
	require.NoError(t, err)
	require.Len(t, got, 4)
	require.Equal(t, "m-2", got[0].ID)
	require.Contains(t, got[0].Reason, "refused by its handler: permanent: decode charge.requested message m-2")
	require.Equal(t, []byte(`{not json`), got[0].Value, "the original bytes")
	require.Equal(t, `unknown message type "refund.requested" (handled: charge.requested)`, got[1].Reason)
	require.Contains(t, got[2].Reason, "oversized: 315 bytes, more than MaxMessageBytes (200)")
	require.Equal(t, "payments/0/4", got[3].ID, "a message without an id header is identified by its position")
	require.Equal(t, "no sagaflow-type header, and no Default handler", got[3].Reason)
}

func TestConsumerRetriesTransientErrorsInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var fails atomic.Int32
	var seen []string
	var mu sync.Mutex
	r := &memReader{}
	r.add("t", "m-1", []byte(`1`))
	r.add("t", "m-2", []byte(`2`))
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{
		RetryInitial: time.Millisecond, RetryMax: 5 * time.Millisecond,
		Handlers: map[string]inbox.HandlerFunc{"t": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			mu.Lock()
			seen = append(seen, msg.ID)
			mu.Unlock()
			if msg.ID == "m-1" && fails.Add(1) <= 3 {
				return errors.New("database hiccup")
			}
			return nil
		}},
	})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { r.mu.Lock(); defer r.mu.Unlock(); return len(r.committed) == 2 })
	require.Equal(t, []string{"m-1", "m-1", "m-1", "m-1", "m-2"}, seen, "m-2 waited for m-1")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("dead_letters")), "transient errors are not poison")
}

func TestConsumerThatLeftWithoutCommittingIsDeduplicated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var calls atomic.Int32
	handler := b.charge(&calls)
	payload, _ := json.Marshal(chargeRequested{OrderID: "o-1", Amount: 3})
	// The first consumer processes three messages but its commits never
	// reach the broker (it left the group).
	first := &memReader{dropCommits: true}
	for _, id := range []string{"m-1", "m-2", "m-3"} {
		first.add("charge.requested", id, payload)
	}
	c, err := b.in.NewConsumer(first, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler}})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return b.count(t, "SELECT count(*) FROM "+b.table("inbox")) == 3 })

	// The partition is redelivered from the start to the next consumer.
	second := &memReader{msgs: first.msgs}
	c, err = b.in.NewConsumer(second, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler}})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { second.mu.Lock(); defer second.mu.Unlock(); return len(second.committed) == 3 })
	require.Equal(t, int32(3), calls.Load(), "redelivered messages had no second effect")
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("charges")))
}

func TestConsumerGivesUpOnAMessageThatKeepsFailing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := &memReader{}
	r.add("t", "m-1", []byte(`1`))
	r.add("t", "m-2", []byte(`2`))
	var calls atomic.Int32
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{
		RetryInitial: time.Millisecond, RetryMax: time.Millisecond, MaxAttempts: 4,
		Handlers: map[string]inbox.HandlerFunc{"t": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			if msg.ID == "m-1" {
				calls.Add(1)
				return errors.New("a bug that never goes away")
			}
			return nil
		}},
	})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { r.mu.Lock(); defer r.mu.Unlock(); return len(r.committed) == 2 })
	require.Equal(t, int32(4), calls.Load())
	var reason string
	require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT reason FROM "+b.table("dead_letters")+" WHERE message_id = 'm-1'").Scan(&reason))
	require.Equal(t, "gave up after 4 attempts: a bug that never goes away", reason)
}
