package inbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// Attacks on the inbox's wake-up after its commit: a process that dies
// between the commit and the notification leaves the handler's outbox row
// to the relay's poll, which must publish it, once.
//
// The lost wake-up is made without a fault point: the handler writes its
// row under a context of its own from outbox.WakeAfterCommit, whose wake it
// never calls. The row commits with the message's inbox key, and nobody is
// told: what a crash right after the commit leaves behind. (The fault point
// inbox.after-commit comes after the wake-up is requested, and needs a
// sagaflow_faults build and a child process: internal/chaos.)

// relayPoll is the poll of the relays here: long beside a notification's
// way, short beside the tests' deadlines.
const relayPoll = 200 * time.Millisecond

// pubWriter is a relay.Writer that counts, by message id, what it is given.
type pubWriter struct {
	mu   sync.Mutex
	byID map[string]int
}

func (w *pubWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.byID == nil {
		w.byID = map[string]int{}
	}
	for _, m := range msgs {
		for _, h := range m.Headers {
			if h.Key == store.HeaderMessageID {
				w.byID[string(h.Value)]++
			}
		}
	}
	return nil
}

func (w *pubWriter) Close() error { return nil }

func (w *pubWriter) copies(id uuid.UUID) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byID[id.String()]
}

func (w *pubWriter) total() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, c := range w.byID {
		n += c
	}
	return n
}

// startRelay runs a relay on b's schema that polls every relayPoll, and
// waits for its LISTEN connection.
func (b *bundle) startRelay(t *testing.T) *pubWriter {
	t.Helper()
	w := &pubWriter{}
	r, err := relay.New(b.pool, w, &relay.Config{Schema: b.schema, PollInterval: relayPoll,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
	})
	b.waitFor(t, "the relay's LISTEN connection", func() bool {
		for _, c := range r.Check(context.Background()).Checks {
			if c.Name == "listen" {
				return c.OK
			}
		}
		return false
	})
	return w
}

func (b *bundle) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for %s", what)
		}
	}
}

// channelHeard listens to b's schema's channel and returns a function that
// counts the notifications committed on it before each call (it commits a
// mark and reads up to it: notifications arrive in commit order).
func (b *bundle) channelHeard(t *testing.T) func() int {
	t.Helper()
	ctx := context.Background()
	st, err := store.New(b.schema)
	require.NoError(t, err)
	mark := b.schema + "_test_mark"
	conn, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	t.Cleanup(conn.Release)
	for _, ch := range []string{st.Channel(), mark} {
		_, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize())
		require.NoError(t, err)
	}
	return func() int {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		tag := uuid.NewString()
		_, err := b.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, mark, tag)
		require.NoError(t, err)
		n := 0
		for {
			got, err := conn.Conn().WaitForNotification(ctx)
			require.NoError(t, err, "the mark never came")
			if got.Channel == mark && got.Payload == tag {
				return n
			}
			if got.Channel == st.Channel() {
				n++
			}
		}
	}
}

// lostWake is a handler that writes one outbox row, whose id it keeps in
// ids, under a wake-up that is never sent.
func (b *bundle) lostWake(t *testing.T, mu *sync.Mutex, ids map[string]uuid.UUID) inbox.HandlerFunc {
	ob, err := outbox.New(b.pool, b.schema)
	require.NoError(t, err)
	return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		lost, _ := outbox.WakeAfterCommit(ctx) // the process dies before its wake
		id := uuid.Must(uuid.NewV7())
		if err := ob.InsertTx(lost, tx, outbox.Message{ID: id, Topic: "payments.replies", Key: msg.ID, Type: "charged",
			Payload: []byte(`{}`)}); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		ids[msg.ID] = id
		return nil
	}
}

// publishedOnce waits until the row id is marked published and checks that
// the relay wrote it exactly once. A published row is never claimed again,
// so the count cannot grow after the mark.
func (b *bundle) publishedOnce(t *testing.T, w *pubWriter, id uuid.UUID) {
	t.Helper()
	b.waitFor(t, "the relay's poll to publish the row", func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE id = $1 AND status = 'published'", id) == 1
	})
	require.Equal(t, 1, w.copies(id), "row %s", id)
}

// Process commits the handler's outbox row and the process dies before the
// wake-up: the relay's poll publishes the row, once, and the message
// delivered again (its offset was not committed) has no second effect.
func TestProcessRowIsPublishedOnceWhenItsWakeIsLost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := b.startRelay(t)
	heard := b.channelHeard(t)
	var mu sync.Mutex
	ids := map[string]uuid.UUID{}
	handler := b.lostWake(t, &mu, ids)
	ctx := context.Background()

	fresh, err := b.in.Process(ctx, inbox.Message{ID: "m-crash", Topic: "payments"}, handler)
	require.NoError(t, err)
	require.True(t, fresh)
	require.Zero(t, heard(), "the wake-up was not lost: the test does not make the crash it means to")
	b.publishedOnce(t, w, ids["m-crash"])

	// Redelivered after the crash: a duplicate, no second row.
	fresh, err = b.in.Process(ctx, inbox.Message{ID: "m-crash", Topic: "payments"}, handler)
	require.NoError(t, err)
	require.False(t, fresh)
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
	require.Equal(t, 1, w.total())
}

// The same through a Consumer that deals with a message at a time (the
// reader seam): the first consumer commits each message, loses its wake-up
// and dies before committing the offsets; the next consumer is given the
// messages again. Each handler's row is published once, by the poll.
func TestConsumerRowsArePublishedOnceWhenTheirWakesAreLost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := b.startRelay(t)
	heard := b.channelHeard(t)
	var mu sync.Mutex
	ids := map[string]uuid.UUID{}
	handlers := map[string]inbox.HandlerFunc{"charge.requested": b.lostWake(t, &mu, ids)}
	payload, _ := json.Marshal(chargeRequested{OrderID: "o-1", Amount: 3})
	msgIDs := []string{"m-1", "m-2", "m-3", "m-4", "m-5"}

	first := &memReader{dropCommits: true}
	for _, id := range msgIDs {
		first.add("charge.requested", id, payload)
	}
	c, err := b.in.NewConsumer(first, &inbox.ConsumerConfig{Handlers: handlers})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return b.count(t, "SELECT count(*) FROM "+b.table("inbox")) == len(msgIDs) })
	require.Zero(t, heard(), "the wake-ups were not lost: the test does not make the crash it means to")

	second := &memReader{msgs: first.msgs}
	c, err = b.in.NewConsumer(second, &inbox.ConsumerConfig{Handlers: handlers})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { second.mu.Lock(); defer second.mu.Unlock(); return len(second.committed) == len(msgIDs) })

	mu.Lock()
	require.Len(t, ids, len(msgIDs))
	rows := make([]uuid.UUID, 0, len(ids))
	for _, id := range ids {
		rows = append(rows, id)
	}
	mu.Unlock()
	for _, id := range rows {
		b.publishedOnce(t, w, id)
	}
	require.Equal(t, len(msgIDs), b.count(t, "SELECT count(*) FROM "+b.table("outbox")), "a redelivered message wrote a second row")
	require.Equal(t, len(msgIDs), w.total())
}

// The same through a Consumer's batches (kafka-go's reader on an
// in-process broker, BatchSize 16): several messages commit in one
// transaction, whose wake-ups are lost. The messages are given again, as
// after a crash before the offsets' commit: every one is a duplicate. Each
// row is published once, by the poll.
func TestConsumerBatchRowsArePublishedOnceWhenTheirWakesAreLost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := b.startRelay(t)
	heard := b.channelHeard(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	var mu sync.Mutex
	ids := map[string]uuid.UUID{}
	handlers := map[string]inbox.HandlerFunc{"charge.requested": b.lostWake(t, &mu, ids)}
	const n = 30
	var msgs []kafka.Message
	for i := range n {
		msgs = append(msgs, kafkaMessage("charge.requested", fmt.Sprintf("m-%d", i), []byte(`{"order_id":"o","amount":1}`)))
	}
	produce(t, kc, msgs...)

	r := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: kafkaGroup, Topic: kafkaTopic,
		StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond,
		HeartbeatInterval: 500 * time.Millisecond, JoinGroupBackoff: 200 * time.Millisecond})
	t.Cleanup(func() { _ = r.Close() })
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: handlers, BatchSize: 16})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { return b.count(t, "SELECT count(*) FROM "+b.table("inbox")) == n })
	require.Positive(t, c.Batched(), "no batch: the test does not reach the batch's wake-up")
	require.Zero(t, heard(), "the wake-ups were not lost: the test does not make the crash it means to")

	// Given again, as after a crash before the offsets' commit.
	second := &memReader{}
	for i, m := range msgs {
		m.Topic, m.Offset = kafkaTopic, int64(i)
		second.msgs = append(second.msgs, m)
	}
	c, err = b.in.NewConsumer(second, &inbox.ConsumerConfig{Handlers: handlers})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { second.mu.Lock(); defer second.mu.Unlock(); return len(second.committed) == n })

	mu.Lock()
	require.Len(t, ids, n)
	rows := make([]uuid.UUID, 0, len(ids))
	for _, id := range ids {
		rows = append(rows, id)
	}
	mu.Unlock()
	for _, id := range rows {
		b.publishedOnce(t, w, id)
	}
	require.Equal(t, n, b.count(t, "SELECT count(*) FROM "+b.table("outbox")), "a message read again wrote a second row")
	require.Equal(t, n, w.total())
}
