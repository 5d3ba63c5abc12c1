package review2_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// Docs: "Replay makes already published messages pending again, so the relay
// publishes them once more; consumers deduplicate them by message id."
// Replaying twice before the relay ran must not publish a message twice more:
// the second replay finds nothing published.
func TestReplayTwice(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	var ids []uuid.UUID
	for _, k := range []string{"a", "b", "c"} {
		ids = append(ids, insert(t, pool, schema, msg("orders", k, "OrderPaid")))
	}
	r := newRelay(t, pool, schema, kc, relay.Config{})
	publishAll(t, r, 3)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)

	dry, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Topic: "orders"}, DryRun: true, RatePerSecond: 1000})
	require.NoError(t, err)
	require.True(t, dry.DryRun)
	require.Equal(t, ids, dry.Matched, "oldest first")
	require.Zero(t, dry.Republished)
	st, err := ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Status{Published: 3}, st, "a dry run changed the outbox")

	first, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Topic: "orders"}, RatePerSecond: 1000})
	require.NoError(t, err)
	require.Equal(t, ids, first.Matched)
	require.Equal(t, int64(3), first.Republished)
	second, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Topic: "orders"}, RatePerSecond: 1000})
	require.NoError(t, err)
	require.Empty(t, second.Matched, "a pending message was replayed again")
	require.Zero(t, second.Republished)
	st, err = ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), st.Pending)
	require.Zero(t, st.Published)

	publishAll(t, r, 3)
	got, err := kc.ReadAll(ctx, "orders")
	require.NoError(t, err)
	require.Len(t, got, 6)
	seen := map[string]int{}
	for _, m := range got {
		v, _ := header(m, "sagaflow-message-id")
		seen[v]++
	}
	for _, id := range ids {
		require.Equal(t, 2, seen[id.String()], "message %s keeps its id when replayed", id)
	}
}

// Docs: Filter "PublishedAfter time.Time // inclusive", "PublishedBefore
// time.Time // exclusive"; Key is the partition key; Max caps; dead and
// pending messages are not "already published".
func TestReplayFilterBoundsAndStates(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders", "other"))
	a := insert(t, pool, schema, msg("orders", "a", "OrderPaid"))
	b := insert(t, pool, schema, msg("orders", "b", "OrderPaid"))
	c := insert(t, pool, schema, msg("orders", "c", "OrderShipped"))
	d := insert(t, pool, schema, msg("other", "a", "OrderPaid"))
	dead := insert(t, pool, schema, msg("orders", "a", "OrderPaid"))
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 5)
	base := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for i, id := range []uuid.UUID{a, b, c, d} {
		exec(t, pool, schema, "UPDATE %s.outbox SET published_at = $2 WHERE id = $1", id, base.Add(time.Duration(i)*time.Second))
	}
	exec(t, pool, schema, "UPDATE %s.outbox SET status = 'dead', published_at = $2 WHERE id = $1", dead, base)
	pendingID := insert(t, pool, schema, outbox.Message{Topic: "orders", Key: "a", Type: "OrderPaid", Delay: time.Hour})
	// A pending row carrying an old published_at, as a replayed one might.
	exec(t, pool, schema, "UPDATE %s.outbox SET published_at = $2 WHERE id = $1", pendingID, base)

	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	replay := func(f outbox.Filter, max int) []uuid.UUID {
		t.Helper()
		res, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: f, Max: max, DryRun: true, RatePerSecond: 1000})
		require.NoError(t, err)
		return res.Matched
	}
	require.Equal(t, []uuid.UUID{a, b, c, d}, replay(outbox.Filter{}, 0), "dead or pending rows selected")
	require.Equal(t, []uuid.UUID{b}, replay(outbox.Filter{PublishedAfter: base.Add(time.Second), PublishedBefore: base.Add(2 * time.Second)}, 0))
	require.Equal(t, []uuid.UUID{a, d}, replay(outbox.Filter{Key: "a"}, 0))
	require.Equal(t, []uuid.UUID{c}, replay(outbox.Filter{Type: "OrderShipped"}, 0))
	require.Equal(t, []uuid.UUID{d}, replay(outbox.Filter{Topic: "other"}, 0))
	require.Equal(t, []uuid.UUID{a, b}, replay(outbox.Filter{}, 2), "Max keeps the oldest")
	// Filters are values, not patterns.
	require.Empty(t, replay(outbox.Filter{Key: "%"}, 0))
	require.Empty(t, replay(outbox.Filter{Key: "_"}, 0))
	require.Empty(t, replay(outbox.Filter{Type: "Order%"}, 0))
	require.Empty(t, replay(outbox.Filter{Topic: "ord%"}, 0))
	require.Empty(t, replay(outbox.Filter{PublishedAfter: base.Add(time.Hour), PublishedBefore: base}, 0), "an inverted window")

	res, err := ob.Replay(ctx, outbox.ReplayOpts{RatePerSecond: 1000})
	require.NoError(t, err)
	require.Equal(t, int64(4), res.Republished)
	st, err := ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.Dead, "replay touched the dead row")
	require.Equal(t, int64(5), st.Pending)
}

// Docs: "Max caps how many messages are published again. Defaults to
// ReplayMaxDefault; at most ReplayMaxLimit." and "RatePerSecond limits
// messages per second."
func TestReplayLimitsAndRate(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		insert(t, pool, schema, msg("orders", k, "T"))
	}
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 5)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)

	for _, opts := range []outbox.ReplayOpts{
		{Max: outbox.ReplayMaxLimit + 1, DryRun: true},
		{Max: -1, DryRun: true},
		{RatePerSecond: -1, DryRun: true},
	} {
		_, err := ob.Replay(ctx, opts)
		require.Error(t, err, "Replay(Max %d, Rate %v) is refused, not clamped", opts.Max, opts.RatePerSecond)
	}

	start := time.Now()
	res, err := ob.Replay(ctx, outbox.ReplayOpts{RatePerSecond: 5})
	require.NoError(t, err)
	require.Equal(t, int64(5), res.Republished)
	require.GreaterOrEqual(t, time.Since(start), 500*time.Millisecond, "5 messages at 5/s went out at once")
}

// A second tenant: two schemas on one database. Status, Replay, relays and
// DeletePublished of one see nothing of the other.
func TestSecondTenantIsolation(t *testing.T) {
	t.Parallel()
	poolA, schemaA := migrated(t)
	poolB, schemaB := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	shared := uuid.Must(uuid.NewV7())
	a1 := msg("orders", "a", "T")
	a1.ID = shared
	insert(t, poolA, schemaA, a1)
	insert(t, poolA, schemaA, msg("orders", "a", "T"))
	b1 := msg("orders", "b", "T")
	b1.ID = shared // the same id in another schema is another message
	insert(t, poolB, schemaB, b1)

	relayA := newRelay(t, poolA, schemaA, kc, relay.Config{})
	publishAll(t, relayA, 2)
	obA, err := outbox.New(poolA, schemaA)
	require.NoError(t, err)
	obB, err := outbox.New(poolB, schemaB)
	require.NoError(t, err)
	stA, err := obA.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Status{Published: 2}, stA)
	stB, err := obB.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), stB.Pending)
	require.Zero(t, stB.Published)

	res, err := obB.Replay(ctx, outbox.ReplayOpts{RatePerSecond: 1000})
	require.NoError(t, err)
	require.Empty(t, res.Matched, "schema B replayed schema A's messages")
	_, err = obB.DeletePublished(ctx, 0, 100)
	require.Error(t, err, "olderThan 0 is refused (the docs do not say so)")
	n, err := obB.DeletePublished(ctx, time.Millisecond, 100)
	require.NoError(t, err)
	require.Zero(t, n)

	publishAll(t, newRelay(t, poolB, schemaB, kc, relay.Config{}), 1)
	exec(t, poolA, schemaA, "UPDATE %s.outbox SET published_at = now() - interval '2 hours'")
	exec(t, poolB, schemaB, "UPDATE %s.outbox SET published_at = now() - interval '2 hours'")
	n, err = obB.DeletePublished(ctx, time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	stA, err = obA.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), stA.Published, "schema B's retention deleted schema A's rows")
	h, err := relayA.Health(ctx)
	require.NoError(t, err)
	require.Zero(t, h.Pending)

	// A dead letter in schema A counts in A only.
	in, err := inbox.New(poolA, &inbox.Config{Consumer: "pay", Schema: schemaA})
	require.NoError(t, err)
	stored, err := in.DeadLetter(ctx, inbox.Message{ID: "poison", Topic: "orders", Value: []byte{0xff}}, "test")
	require.NoError(t, err)
	require.True(t, stored)
	stA, err = obA.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), stA.DeadLetters)
	stB, err = obB.Status(ctx)
	require.NoError(t, err)
	require.Zero(t, stB.DeadLetters, "schema A's dead letter counted in schema B")
}
