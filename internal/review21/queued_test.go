package review21

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
)

// inbox.ConsumerConfig.Queued, now asked once per batch: "It is asked once
// per batch, after its first message: the batch then tops up with at most
// that many, and with none when it reports none". A backlog of 43 messages
// on one partition, BatchSize 8, and a Queued that reports the reader's
// queue, nothing, a negative count, or far more than there is. Every
// message is handled once, no transaction holds more than 8 messages (nor,
// with nothing reported, more than 1), Queued is asked at most once per
// transaction, and a count far above what there is does not keep the
// messages there are from being handled. With nothing reported, it is
// asked once for every message (each its own batch).
func TestConsumerQueuedAskedOncePerBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		queued func(*kafka.Reader) int
	}{
		{"reader", func(r *kafka.Reader) int { return int(r.Stats().QueueLength) }},
		{"none", func(*kafka.Reader) int { return 0 }},
		{"negative", func(*kafka.Reader) int { return -7 }},
		{"huge", func(*kafka.Reader) int { return 1 << 30 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const topic, n, size = "r21.queued", 43, 8
			kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic))
			d := testkit.NewDB(t)
			tbl := d.Table("handled")
			_, err := d.Pool.Exec(context.Background(), "CREATE TABLE "+tbl+" (id text, txid text)")
			require.NoError(t, err)
			var msgs []kafka.Message
			for i := range n {
				msgs = append(msgs, kafka.Message{Topic: topic, Key: []byte("k"), Value: []byte(`{}`), Headers: []kafka.Header{
					{Key: "sagaflow-type", Value: []byte("r21.thing")}, {Key: "sagaflow-message-id", Value: []byte(fmt.Sprintf("m-%d", i))}}})
			}
			w := kafka.NewWriter(kafka.WriterConfig{Brokers: kc.Addrs(), BatchSize: n, BatchTimeout: 5 * time.Millisecond, RequiredAcks: int(kafka.RequireAll)})
			wctx, cancel := context.WithTimeout(context.Background(), within)
			defer cancel()
			require.NoError(t, w.WriteMessages(wctx, msgs...))
			require.NoError(t, w.Close())

			r := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: "r21-queued", Topic: topic,
				StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond,
				HeartbeatInterval: 500 * time.Millisecond, JoinGroupBackoff: 200 * time.Millisecond})
			in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "r21", Schema: d.Schema, Logger: testkit.Discard})
			require.NoError(t, err)
			var asked atomic.Int32
			handler := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
				_, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ($1, pg_current_xact_id()::text)", msg.ID)
				return err
			}
			c, err := in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"r21.thing": handler},
				BatchSize: size, Queued: func() int { asked.Add(1); return tc.queued(r) }})
			require.NoError(t, err)
			require.NoError(t, c.Start(context.Background()))
			stopped := false
			stop := func() {
				if stopped {
					return
				}
				stopped = true
				ctx, cancel := context.WithTimeout(context.Background(), within)
				defer cancel()
				require.NoError(t, c.Stop(ctx))
				require.NoError(t, r.Close())
			}
			t.Cleanup(stop)
			testkit.WaitFor(t, within, "every message handled", func() bool {
				return d.Count(t, "SELECT count(*) FROM "+tbl) >= n
			})
			stop()
			require.Equal(t, n, d.Count(t, "SELECT count(*) FROM "+tbl), "each message once")
			require.Equal(t, n, d.Count(t, "SELECT count(DISTINCT id) FROM "+tbl))
			txs := d.Count(t, "SELECT count(DISTINCT txid) FROM "+tbl)
			biggest := d.Count(t, "SELECT max(c) FROM (SELECT count(*) AS c FROM "+tbl+" GROUP BY txid) x")
			t.Logf("%s: %d transactions, the biggest of %d messages; Queued asked %d times; batched %d", tc.name, txs, biggest, asked.Load(), c.Batched())
			require.LessOrEqual(t, biggest, size, "a transaction held more than BatchSize messages")
			require.LessOrEqual(t, int(asked.Load()), txs, "Queued asked more than once per batch")
			if tc.name == "none" {
				require.Equal(t, 1, biggest, "nothing reported ready, yet a batch topped up")
				require.Equal(t, n, int(asked.Load()), "asked once per batch, after its first message")
			}
			// A negative count is not documented; it is dealt with as no
			// Queued at all (the batch waits for more and tops up): see
			// FINDINGS.md, observation O1.
		})
	}
}
