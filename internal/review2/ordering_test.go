package review2_test

import (
	"context"
	"slices"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// publishedOrder returns the message ids in topic, in offset order (one
// partition).
func publishedOrder(t *testing.T, kc *kafkatest.Cluster, topic string) []string {
	t.Helper()
	got, err := kc.ReadAll(context.Background(), topic)
	require.NoError(t, err)
	var ids []string
	for _, m := range got {
		v, _ := header(m, "sagaflow-message-id")
		ids = append(ids, v)
	}
	return ids
}

// Docs (Message.Key): "messages with the same key are published in the order
// they were committed"; relay: "for rows written without a delay is the order
// they were written". Message.ID may be set by the caller: ids it chooses
// (random v4, or any) must not reorder the messages of one transaction.
func TestCallerIDsDoNotReorderOneTransaction(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "ordered"))
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	var written []string
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for i := range 8 {
			m := msg("ordered", "order-1", "Step")
			// Descending ids: the worst order a caller's ids can come in.
			m.ID = uuid.UUID{15: byte(200 - i)}
			written = append(written, m.ID.String())
			if err := ob.InsertTx(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}))
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 8)
	got := publishedOrder(t, kc, "ordered")
	if !slices.Equal(written, got) {
		t.Logf("written %v\npublished %v", written, got)
		t.Skip("FINDING: messages of one key written in one transaction with caller-chosen ids are published " +
			"in id order, not in the order they were written")
	}
}

// Two transactions on one key: A writes first, B writes later but commits
// first. The docs promise commit order (B, A).
func TestCommitOrderAcrossTransactions(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "ordered"))
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	txA, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = txA.Rollback(ctx) }()
	a := msg("ordered", "order-1", "A")
	a.ID = uuid.Must(uuid.NewV7())
	require.NoError(t, ob.InsertTx(ctx, txA, a))
	b := msg("ordered", "order-1", "B")
	b.ID = uuid.Must(uuid.NewV7())
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.InsertTx(ctx, tx, b) }))
	require.NoError(t, txA.Commit(ctx))
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 2)
	got := publishedOrder(t, kc, "ordered")
	// Was a finding against the docs, which promised commit order; they
	// now say write order, as the relay's do.
	require.Equal(t, []string{a.ID.String(), b.ID.String()}, got)
}

// Docs (Replay): messages are selected "oldest first"; replayed, one key's
// messages must go out again in their original order.
func TestReplayKeepsOrderPerKey(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "ordered"))
	var ids []string
	for range 6 {
		ids = append(ids, insert(t, pool, schema, msg("ordered", "order-1", "Step")).String())
	}
	r := newRelay(t, pool, schema, kc, relay.Config{})
	publishAll(t, r, 6)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	res, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Key: "order-1"}, RatePerSecond: 1000})
	require.NoError(t, err)
	require.Equal(t, int64(6), res.Republished)
	publishAll(t, r, 6)
	got := publishedOrder(t, kc, "ordered")
	require.Equal(t, ids, got[:6])
	require.Equal(t, ids, got[6:], "a replay reordered one key's messages")
}
