package inbox_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
)

// Start runs the consumer in the background; Stop lets it finish and
// returns, and a second Start resumes where the committed offsets are.
func TestConsumerStartsAndStops(t *testing.T) {
	t.Parallel()
	b := setup(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	var calls atomic.Int32
	cfg := &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge.requested": b.charge(&calls)}}
	payload, err := json.Marshal(chargeRequested{OrderID: "o-1", Amount: 3})
	require.NoError(t, err)
	produce(t, kc, kafkaMessage("charge.requested", "m-1", payload), kafkaMessage("charge.requested", "m-2", payload))

	r := newGroupReader(t, kc, false)
	c, err := b.in.NewConsumer(r, cfg)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, c.Start(ctx))
	require.NoError(t, c.Start(ctx), "a second Start does nothing")
	require.Eventually(t, func() bool { return len(r.committedOffsets()) == 2 }, 20*time.Second, 5*time.Millisecond)
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, c.Stop(stopCtx))
	require.NoError(t, c.Stop(stopCtx), "Stop on a stopped consumer")
	require.Equal(t, int32(2), calls.Load())

	produce(t, kc, kafkaMessage("charge.requested", "m-3", payload))
	require.NoError(t, c.Start(ctx))
	require.Eventually(t, func() bool { return len(r.committedOffsets()) == 3 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, c.Stop(stopCtx))
	require.Equal(t, []int64{0, 1, 2}, r.fetchedOffsets(), "the restarted consumer went on after the committed offsets")
	require.Equal(t, int32(3), calls.Load())
}

// A running consumer deletes its own keys older than Retention, and only
// its own: another consumer's keys in the same schema stay.
func TestConsumerDeletesItsOwnOldKeys(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, "INSERT INTO "+b.table("inbox")+` (consumer, key, processed_at) VALUES
		('payments', 'old', now() - interval '3 hours'), ('payments', 'new', now()),
		('shipping', 'old', now() - interval '3 hours')`)
	require.NoError(t, err)

	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	var calls atomic.Int32
	c, err := b.in.NewConsumer(newGroupReader(t, kc, false), &inbox.ConsumerConfig{
		Handlers:  map[string]inbox.HandlerFunc{"charge.requested": b.charge(&calls)},
		Retention: 2 * time.Hour, RetentionInterval: 20 * time.Millisecond,
	})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE consumer = 'payments'") == 1
	}, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, c.Stop(ctx))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE consumer = 'payments' AND key = 'new'"))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE consumer = 'shipping'"), "another consumer's key stays")

	_, err = b.in.DeleteProcessed(ctx, 0, 10)
	require.ErrorIs(t, err, inbox.ErrInvalidConfig)
	_, err = b.in.NewConsumer(newGroupReader(t, kc, false), &inbox.ConsumerConfig{Default: b.charge(&calls), RetentionInterval: -time.Second})
	require.ErrorIs(t, err, inbox.ErrInvalidConfig)
}
