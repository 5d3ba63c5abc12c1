package review2_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// Docs (relay.Config.Retention): "a running relay deletes older ones every
// RetentionInterval ... Pending and dead rows are never deleted." Another
// schema's rows are not the relay's.
func TestRelayRetentionDeletesOnlyOldPublished(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	poolB, schemaB := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	oldPub := insert(t, pool, schema, msg("orders", "a", "T"))
	newPub := insert(t, pool, schema, msg("orders", "b", "T"))
	oldDead := insert(t, pool, schema, msg("orders", "c", "T"))
	otherOld := insert(t, poolB, schemaB, msg("orders", "z", "T"))
	r := newRelay(t, pool, schema, kc, relay.Config{Retention: time.Hour, RetentionInterval: 50 * time.Millisecond, PollInterval: time.Minute})
	publishAll(t, r, 3)
	publishAll(t, newRelay(t, poolB, schemaB, kc, relay.Config{}), 1)
	exec(t, pool, schema, "UPDATE %s.outbox SET published_at = now() - interval '2 hours', created_at = now() - interval '3 hours' WHERE id = $1", oldPub)
	exec(t, pool, schema, "UPDATE %s.outbox SET status = 'dead', published_at = now() - interval '2 hours', created_at = now() - interval '3 hours' WHERE id = $1", oldDead)
	exec(t, poolB, schemaB, "UPDATE %s.outbox SET published_at = now() - interval '2 hours', created_at = now() - interval '3 hours' WHERE id = $1", otherOld)
	delayed := msg("orders", "d", "T")
	delayed.Delay = 24 * time.Hour
	oldPending := insert(t, pool, schema, delayed)
	exec(t, pool, schema, "UPDATE %s.outbox SET created_at = now() - interval '3 hours', published_at = now() - interval '2 hours' WHERE id = $1", oldPending)

	require.NoError(t, r.Start(ctx))
	eventually(t, 10*time.Second, func() bool {
		return count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE id = $1", oldPub) == 0
	}, "the relay did not delete a row published 2h ago with Retention 1h")
	time.Sleep(200 * time.Millisecond) // a few more retention rounds
	require.NoError(t, r.Stop(ctx))
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE id = $1", newPub), "recent published row deleted")
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE id = $1", oldDead), "dead row deleted")
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE id = $1", oldPending), "pending row deleted")
	require.Equal(t, 1, count(t, poolB, schemaB, "SELECT count(*) FROM %s.outbox WHERE id = $1", otherOld), "another schema's row deleted")
}

// Docs: "negative keeps them".
func TestRelayNegativeRetentionKeeps(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	id := insert(t, pool, schema, msg("orders", "a", "T"))
	r := newRelay(t, pool, schema, kc, relay.Config{Retention: -1, RetentionInterval: 20 * time.Millisecond})
	publishAll(t, r, 1)
	exec(t, pool, schema, "UPDATE %s.outbox SET published_at = now() - interval '400 days' WHERE id = $1", id)
	require.NoError(t, r.Start(ctx))
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, r.Stop(ctx))
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE id = $1", id))
}

// Docs (DeletePublished): "at most batch rows per statement, and returns how
// many it deleted. Pending and dead messages are never deleted." A message
// replayed (pending again) after its publication must not be deleted.
func TestDeletePublishedBatchesAndSparesReplayed(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	for _, k := range []string{"a", "b", "c", "d", "e", "f"} {
		insert(t, pool, schema, msg("orders", k, "T"))
	}
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 6)
	exec(t, pool, schema, "UPDATE %s.outbox SET published_at = now() - interval '2 hours'")
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	res, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Key: "f"}, RatePerSecond: 1000})
	require.NoError(t, err)
	require.Equal(t, int64(1), res.Republished)

	n, err := ob.DeletePublished(ctx, time.Hour, 2)
	require.NoError(t, err)
	t.Logf("DeletePublished(batch 2) of 5 old rows returned %d", n)
	left := count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE status = 'published'")
	require.Equal(t, int64(5-left), n, "the count returned is not what was deleted")
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE status = 'pending' AND aggregateid = 'f'"), "the replayed row was deleted")
	for left > 0 {
		n, err = ob.DeletePublished(ctx, time.Hour, 2)
		require.NoError(t, err)
		require.NotZero(t, n)
		left = count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE status = 'published'")
	}
	_, err = ob.DeletePublished(ctx, time.Hour, 0)
	require.Error(t, err, "batch 0")
}

// Docs (ConsumerConfig.Retention): "a running consumer deletes older ones
// every RetentionInterval"; DeleteProcessed deletes "this consumer's inbox
// keys". Other consumers' keys, recent keys and another schema's keys stay.
func TestConsumerRetentionDeletesOnlyItsOwnOldKeys(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	poolB, schemaB := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "payments"))
	for _, k := range []struct{ consumer, id string }{{"pay", "old"}, {"pay", "new"}, {"ship", "old"}, {"pay-2", "old"}} {
		require.False(t, recorded(t, pool, schema, k.consumer, k.id))
	}
	require.False(t, recorded(t, poolB, schemaB, "pay", "old"))
	exec(t, pool, schema, "UPDATE %s.inbox SET processed_at = now() - interval '2 hours' WHERE key = 'old'")
	exec(t, poolB, schemaB, "UPDATE %s.inbox SET processed_at = now() - interval '2 hours'")

	in, err := inbox.New(pool, &inbox.Config{Consumer: "pay", Schema: schema})
	require.NoError(t, err)
	c, err := in.NewConsumer(groupReader(t, kc, "pay", "payments"), &inbox.ConsumerConfig{
		Default:           func(context.Context, pgx.Tx, inbox.Message) error { return nil },
		Retention:         time.Hour,
		RetentionInterval: 50 * time.Millisecond,
	})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	eventually(t, 10*time.Second, func() bool {
		return count(t, pool, schema, "SELECT count(*) FROM %s.inbox WHERE consumer = 'pay' AND key = 'old'") == 0
	}, "the consumer did not delete its key processed 2h ago with Retention 1h")
	time.Sleep(200 * time.Millisecond)
	require.NoError(t, c.Stop(ctx))
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.inbox WHERE consumer = 'pay' AND key = 'new'"), "recent key deleted")
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.inbox WHERE consumer = 'ship'"), "another consumer's key deleted")
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.inbox WHERE consumer = 'pay-2'"), "a consumer whose name starts alike lost its key")
	require.Equal(t, 1, count(t, poolB, schemaB, "SELECT count(*) FROM %s.inbox"), "another schema's key deleted")

	// The same through DeleteProcessed, for the other consumer.
	ship, err := inbox.New(pool, &inbox.Config{Consumer: "ship", Schema: schema})
	require.NoError(t, err)
	n, err := ship.DeleteProcessed(ctx, time.Hour, 10)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.inbox WHERE consumer = 'pay-2'"))
}

// Docs: "negative keeps them".
func TestConsumerNegativeRetentionKeeps(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "payments"))
	require.False(t, recorded(t, pool, schema, "pay", "old"))
	exec(t, pool, schema, "UPDATE %s.inbox SET processed_at = now() - interval '400 days'")
	in, err := inbox.New(pool, &inbox.Config{Consumer: "pay", Schema: schema})
	require.NoError(t, err)
	c, err := in.NewConsumer(groupReader(t, kc, "pay", "payments"), &inbox.ConsumerConfig{
		Default:           func(context.Context, pgx.Tx, inbox.Message) error { return nil },
		Retention:         -1,
		RetentionInterval: 20 * time.Millisecond,
	})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, c.Stop(ctx))
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.inbox"))
}
