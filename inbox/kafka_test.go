package inbox_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
)

// The consume-loop tests of consumer_test.go again, through kafka-go's
// consumer-group Reader and the real Kafka protocol (an in-process kfake
// cluster): the group's offsets are the broker's, and redelivery is what a
// rebalance does.

func TestKafkaConsumerDeadLettersPoisonAndKeepsThePartitionMoving(t *testing.T) {
	t.Parallel()
	b := setup(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
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
	cfg := &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler}, MaxMessageBytes: 200}
	produce(t, kc,
		kafkaMessage("charge.requested", "m-1", []byte(`{"order_id":"o-1","amount":5}`)),
		kafkaMessage("charge.requested", "m-2", []byte(`{not json`)),                                   // undecodable
		kafkaMessage("refund.requested", "m-3", []byte(`{}`)),                                          // unknown type
		kafkaMessage("charge.requested", "m-4", []byte(`{"order_id":"`+strings.Repeat("x", 300)+`"}`)), // oversized
		kafkaMessage("", "", []byte(`{}`)),                                                             // no type, no id
		kafkaMessage("charge.requested", "m-5", []byte(`{"order_id":"o-5","amount":7}`)),
	)

	r := newGroupReader(t, kc, false)
	c, err := b.in.NewConsumer(r, cfg)
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return len(r.committedOffsets()) == 6 })
	require.NoError(t, r.Close()) // leaves the group

	require.Equal(t, []string{"o-1", "o-5"}, order, "the valid messages behind the poison were processed, in order")
	require.Equal(t, []int64{0, 1, 2, 3, 4, 5}, r.fetchedOffsets())
	require.Equal(t, []int64{0, 1, 2, 3, 4, 5}, r.committedOffsets(), "every offset committed, in order")
	require.Equal(t, int64(6), committedOffset(t, kc), "the group's offset on the broker is past all six")
	rows, err := b.pool.Query(context.Background(), "SELECT coalesce(message_id, ''), reason, msg_value, kafka_offset FROM "+b.table("dead_letters")+" ORDER BY id")
	require.NoError(t, err)
	type dead struct {
		ID, Reason string
		Value      []byte
		Offset     int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[dead])
	require.NoError(t, err)
	require.Len(t, got, 4)
	require.Equal(t, "m-2", got[0].ID)
	require.Contains(t, got[0].Reason, "refused by its handler: permanent: decode charge.requested message m-2")
	require.Equal(t, []byte(`{not json`), got[0].Value, "the original bytes, as the broker returned them")
	require.Equal(t, "m-3", got[1].ID)
	require.Equal(t, `unknown message type "refund.requested" (handled: charge.requested)`, got[1].Reason)
	require.Equal(t, "m-4", got[2].ID)
	require.Contains(t, got[2].Reason, "oversized: 315 bytes, more than MaxMessageBytes (200)")
	require.Equal(t, "payments/0/4", got[3].ID, "a message without an id header is identified by its position")
	require.Equal(t, "no sagaflow-type header, and no Default handler", got[3].Reason)
	for i, d := range got {
		require.Equal(t, []int64{1, 2, 3, 4}[i], d.Offset, "dead letter %d keeps the offset", i)
	}

	// A fresh member of the group starts where the group's offset is:
	// its first message is the one produced next, nothing before it.
	produce(t, kc, kafkaMessage("charge.requested", "m-6", []byte(`{"order_id":"o-6","amount":9}`)))
	fresh := newGroupReader(t, kc, false)
	c, err = b.in.NewConsumer(fresh, cfg)
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return len(fresh.committedOffsets()) == 1 })
	require.NoError(t, fresh.Close())
	require.Equal(t, []int64{6}, fresh.fetchedOffsets(), "nothing redelivered")
	require.Equal(t, []string{"o-1", "o-5", "o-6"}, order)
	require.Equal(t, int64(7), committedOffset(t, kc))
	require.Equal(t, 4, b.count(t, "SELECT count(*) FROM "+b.table("dead_letters")))
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("charges")))
}

func TestKafkaConsumerThatLeftWithoutCommittingIsDeduplicated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	var calls atomic.Int32
	cfg := &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": b.charge(&calls)}}
	payload, err := json.Marshal(chargeRequested{OrderID: "o-1", Amount: 3})
	require.NoError(t, err)
	produce(t, kc,
		kafkaMessage("charge.requested", "m-1", payload),
		kafkaMessage("charge.requested", "", payload), // from another producer: identified by its position
		kafkaMessage("charge.requested", "m-3", payload),
	)

	// The first member processes the three messages, but its commits never
	// reach the broker; then it leaves the group.
	first := newGroupReader(t, kc, true)
	c, err := b.in.NewConsumer(first, cfg)
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return len(first.droppedOffsets()) == 3 })
	require.NoError(t, first.Close())
	require.Equal(t, []int64{0, 1, 2}, first.fetchedOffsets())
	require.Equal(t, int32(3), calls.Load())
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("inbox")))
	require.Equal(t, int64(-1), committedOffset(t, kc), "the group has no committed offset")

	// The next member of the group gets the partition, and every message
	// again from the start.
	second := newGroupReader(t, kc, false)
	c, err = b.in.NewConsumer(second, cfg)
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return len(second.committedOffsets()) == 3 })
	require.NoError(t, second.Close())
	require.Equal(t, []int64{0, 1, 2}, second.fetchedOffsets(), "the three messages were redelivered")
	require.Equal(t, int32(3), calls.Load(), "redelivered messages had no second effect")
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("charges")), "one effect per distinct message")
	require.Equal(t, 3, b.count(t, "SELECT count(DISTINCT message_id) FROM "+b.table("charges")))
	require.Equal(t, int64(3), committedOffset(t, kc), "the second member committed past all three")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("dead_letters")))
}

// A backlog read with kafka-go's own reader, with a BatchSize, is dealt with
// several messages to a transaction: each message's effect happens once (a copy of a message
// in the same batch is skipped), a poison message sends its batch the
// one-at-a-time way, where it is dead-lettered and the rest processed, and
// the group's offset ends past every message.
func TestKafkaConsumerDealsWithABacklogInBatches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	handler := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		req, err := inbox.DecodeJSON[chargeRequested](msg)
		if err != nil {
			return err // permanent: the message cannot be decoded
		}
		_, err = tx.Exec(ctx, "INSERT INTO "+b.table("charges")+" VALUES ($1, $2)", msg.ID, req.Amount)
		return err
	}
	var msgs []kafka.Message
	for i := range 40 {
		msgs = append(msgs, kafkaMessage("charge.requested", fmt.Sprintf("m-%d", i), []byte(`{"order_id":"o","amount":1}`)))
		if i == 5 {
			msgs = append(msgs, kafkaMessage("charge.requested", "m-5", []byte(`{"order_id":"o","amount":1}`))) // a copy
		}
		if i == 20 {
			msgs = append(msgs, kafkaMessage("charge.requested", "m-poison", []byte(`{not json`)))
		}
	}
	produce(t, kc, msgs...)

	r := batchReader(t, kc)
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler}, BatchSize: 16})
	require.NoError(t, err)
	runConsumer(t, c, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("charges")) == 40 &&
			b.count(t, "SELECT count(*) FROM "+b.table("dead_letters")) == 1 && committedOffsetSoFar(kc) == int64(len(msgs))
	})
	require.NoError(t, r.Close())

	require.Equal(t, 40, b.count(t, "SELECT count(*) FROM "+b.table("charges")), "each message once, the copy skipped")
	require.Equal(t, 40, b.count(t, "SELECT count(DISTINCT message_id) FROM "+b.table("charges")))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("dead_letters")+" WHERE message_id = 'm-poison'"))
	require.Positive(t, c.Batched(), "some messages were dealt with several to a transaction")
	t.Logf("batched %d of %d messages", c.Batched(), len(msgs))
}

// ConsumerConfig.Queued decides whether a batch tops up: a backlog read
// with a Queued that reports the real reader's queue is batched, one that
// always reports nothing ready is dealt with a message to a transaction.
func TestKafkaConsumerBatchesWhatQueuedReportsReady(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		queued  func(*kafka.Reader) func() int
		batched bool
	}{
		{"the reader's queue", func(r *kafka.Reader) func() int { return func() int { return int(r.Stats().QueueLength) } }, true},
		{"nothing ready", func(*kafka.Reader) func() int { return func() int { return 0 } }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
			handler := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
				_, err := tx.Exec(ctx, "INSERT INTO "+b.table("charges")+" VALUES ($1, 1)", msg.ID)
				return err
			}
			var msgs []kafka.Message
			for i := range 40 {
				msgs = append(msgs, kafkaMessage("charge.requested", fmt.Sprintf("m-%d", i), []byte(`{}`)))
			}
			produce(t, kc, msgs...)
			r := batchReader(t, kc)
			c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler},
				BatchSize: 16, Queued: tc.queued(r)})
			require.NoError(t, err)
			runConsumer(t, c, func() bool { return b.count(t, "SELECT count(*) FROM "+b.table("charges")) == 40 })
			require.NoError(t, r.Close())
			require.Equal(t, 40, b.count(t, "SELECT count(DISTINCT message_id) FROM "+b.table("charges")))
			if tc.batched {
				require.Positive(t, c.Batched(), "the backlog went several to a transaction")
			} else {
				require.Zero(t, c.Batched(), "nothing was ready, so nothing was batched")
			}
		})
	}
}

// committedOffsetSoFar is committedOffset, or -1 while the broker knows no
// offset of the group.
func committedOffsetSoFar(kc *kafkatest.Cluster) int64 {
	off, err := fetchCommittedOffset(kc)
	if err != nil {
		return -1
	}
	return off
}

// A batch records the ids of all its messages in one statement. Ids that
// PostgreSQL would refuse as they are (a NUL byte, invalid UTF-8, 10 kB)
// are recorded in their stored form, so a copy in the same batch, a copy in
// a later batch, and a copy run one at a time (after a poison message sent
// its batch that way) are each skipped: one effect per distinct id. Two ids
// that differ only past what a shortened form would keep stay distinct.
func TestKafkaConsumerBatchRecordsHostileIDsOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	var calls atomic.Int32
	handler := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		if _, err := inbox.DecodeJSON[chargeRequested](msg); err != nil {
			return err // permanent: the message cannot be decoded
		}
		calls.Add(1)
		_, err := tx.Exec(ctx, "INSERT INTO "+b.table("charges")+" VALUES ($1, 1)", fmt.Sprintf("%x", sha256.Sum256([]byte(msg.ID))))
		return err
	}
	long := strings.Repeat("k", 10<<10)
	ids := []string{"plain", "nul\x00byte", "bad\xff\xfeutf8", long + "a", long + "b", "sha256:looks-hashed"}
	payload := []byte(`{"order_id":"o","amount":1}`)
	var msgs []kafka.Message
	// Already recorded before the consumer starts: skipped in its batch.
	_, err := b.in.Process(context.Background(), inbox.Message{ID: "plain"}, func(context.Context, pgx.Tx, inbox.Message) error { return nil })
	require.NoError(t, err)
	for _, id := range ids {
		msgs = append(msgs, kafkaMessage("charge.requested", id, payload), kafkaMessage("charge.requested", id, payload))
	}
	msgs = append(msgs, kafkaMessage("charge.requested", "poison", []byte(`{not json`)))
	for _, id := range ids {
		msgs = append(msgs, kafkaMessage("charge.requested", id, payload))
	}
	produce(t, kc, msgs...)

	r := batchReader(t, kc)
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": handler}, BatchSize: 8})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return committedOffsetSoFar(kc) == int64(len(msgs)) })
	require.NoError(t, r.Close())

	// calls counts handler runs, those of batches rolled back too.
	require.GreaterOrEqual(t, calls.Load(), int32(len(ids)-1))
	require.Equal(t, len(ids)-1, b.count(t, "SELECT count(*) FROM "+b.table("charges")), "one effect per distinct id, none for the id recorded before")
	require.Equal(t, len(ids)-1, b.count(t, "SELECT count(DISTINCT message_id) FROM "+b.table("charges")))
	require.Equal(t, len(ids), b.count(t, "SELECT count(*) FROM "+b.table("inbox")), "each id recorded once, the poison's not at all")
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("dead_letters")+" WHERE message_id = 'poison'"))
	t.Logf("batched %d of %d messages", c.Batched(), len(msgs))
}
