package store_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// relaySetup migrates a fresh schema and returns its pool and statements.
func relaySetup(t *testing.T) (context.Context, *pgxpool.Pool, *store.Store, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	pool, st, schema := newStore(t)
	return ctx, pool, st, schema
}

func insertRelay(t *testing.T, ctx context.Context, pool *pgxpool.Pool, st *store.Store, m store.Message) uuid.UUID {
	t.Helper()
	if m.ID == uuid.Nil {
		m.ID = uuid.Must(uuid.NewV7())
	}
	if m.Topic == "" {
		m.Topic = "orders"
	}
	if m.Type == "" {
		m.Type = "order.created"
	}
	if m.Payload == nil {
		m.Payload = []byte("{}")
	}
	require.NoError(t, st.InsertMessage(ctx, pool, &m))
	return m.ID
}

type outboxRow struct {
	Status      string
	Attempts    int
	LastError   *string
	Published   bool
	DueInSecond float64 // available_at - now()
}

func readOutbox(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema string, id uuid.UUID) outboxRow {
	t.Helper()
	var r outboxRow
	err := pool.QueryRow(ctx, `SELECT status, attempts, last_error, published_at IS NOT NULL,
			EXTRACT(EPOCH FROM available_at - now())::float8
		FROM `+pgx.Identifier{schema}.Sanitize()+`.outbox WHERE id = $1`, id).
		Scan(&r.Status, &r.Attempts, &r.LastError, &r.Published, &r.DueInSecond)
	require.NoError(t, err)
	return r
}

func claimIDs(t *testing.T, ctx context.Context, tx pgx.Tx, st *store.Store, limit int) []uuid.UUID {
	t.Helper()
	ms, err := st.ClaimRelayBatch(ctx, tx, limit)
	require.NoError(t, err)
	var ids []uuid.UUID
	for _, m := range ms {
		ids = append(ids, m.ID)
	}
	return ids
}

func TestClaimRelayBatchTakesDueRelayRowsInAvailableOrder(t *testing.T) {
	t.Parallel()
	ctx, pool, st, _ := relaySetup(t)

	// Ids that sort the other way round from their insertion: the claim
	// must follow available_at, not id.
	var ids []uuid.UUID
	for i := range 3 {
		id := uuid.UUID{15: byte(9 - i)}
		insertRelay(t, ctx, pool, st, store.Message{ID: id, AggregateID: "a", Payload: []byte{byte(i)},
			Headers: map[string]string{"traceparent": "00-x"}})
		ids = append(ids, id)
	}
	insertRelay(t, ctx, pool, st, store.Message{AggregateID: "later", Delay: time.Hour})
	insertRelay(t, ctx, pool, st, store.Message{AggregateID: "direct", Delivery: store.DeliveryDirect})

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	ms, err := st.ClaimRelayBatch(ctx, tx, 10)
	require.NoError(t, err)
	require.Len(t, ms, 3, "neither the delayed row nor the direct one is claimed")
	for i, m := range ms {
		require.Equal(t, ids[i], m.ID)
		require.Equal(t, "orders", m.Topic)
		require.Equal(t, "a", m.AggregateID)
		require.Equal(t, "order.created", m.Type)
		require.Equal(t, []byte{byte(i)}, m.Payload)
		require.JSONEq(t, `{"traceparent": "00-x"}`, string(m.Headers))
		require.Zero(t, m.Attempts)
		require.Nil(t, m.SagaID)
		require.False(t, m.CreatedAt.IsZero())
	}

	limited := claimIDs(t, ctx, tx, st, 2)
	require.Equal(t, ids[:2], limited, "a claim in the same transaction sees its own locks as its own")
}

func TestClaimRelayBatchSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx, pool, st, _ := relaySetup(t)
	for range 6 {
		insertRelay(t, ctx, pool, st, store.Message{AggregateID: "k"})
	}
	tx1, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx1.Rollback(ctx)
	tx2, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx2.Rollback(ctx)

	first := claimIDs(t, ctx, tx1, st, 4)
	second := claimIDs(t, ctx, tx2, st, 4)
	require.Len(t, first, 4)
	require.Len(t, second, 2, "the other transaction gets only the rows nobody holds")
	for _, id := range second {
		require.NotContains(t, first, id)
	}

	// Once the first claimer marks its rows published and commits, they are
	// gone for everyone.
	require.NoError(t, st.MarkPublished(ctx, tx1, first))
	require.NoError(t, tx1.Commit(ctx))
	tx3, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx3.Rollback(ctx)
	require.Empty(t, claimIDs(t, ctx, tx3, st, 10))
}

func TestMarkPublishedAndFailed(t *testing.T) {
	t.Parallel()
	ctx, pool, st, schema := relaySetup(t)
	pub := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "a"})
	retry := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "b"})
	dead := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "c"})

	require.NoError(t, st.MarkFailed(ctx, pool, []store.RelayFailure{{ID: pub, Err: "broker down", Delay: 0}}))
	r := readOutbox(t, ctx, pool, schema, pub)
	require.Equal(t, store.OutboxPending, r.Status)
	require.Equal(t, 1, r.Attempts)
	require.Equal(t, "broker down", *r.LastError)

	require.NoError(t, st.MarkPublished(ctx, pool, []uuid.UUID{pub}))
	r = readOutbox(t, ctx, pool, schema, pub)
	require.Equal(t, store.OutboxPublished, r.Status)
	require.Equal(t, 2, r.Attempts)
	require.Nil(t, r.LastError)
	require.True(t, r.Published)

	require.NoError(t, st.MarkFailed(ctx, pool, []store.RelayFailure{
		{ID: retry, Err: "not enough replicas", Delay: time.Minute},
		{ID: dead, Err: "payload too large", Dead: true},
		{ID: pub, Err: "ignored: no longer pending", Dead: true},
	}))
	r = readOutbox(t, ctx, pool, schema, retry)
	require.Equal(t, store.OutboxPending, r.Status)
	require.Equal(t, 1, r.Attempts)
	require.Equal(t, "not enough replicas", *r.LastError)
	require.InDelta(t, 60, r.DueInSecond, 5, "available_at pushed back by the delay")
	r = readOutbox(t, ctx, pool, schema, dead)
	require.Equal(t, store.OutboxDead, r.Status)
	require.Equal(t, "payload too large", *r.LastError)
	r = readOutbox(t, ctx, pool, schema, pub)
	require.Equal(t, store.OutboxPublished, r.Status, "a published row is never marked again")
	require.Nil(t, r.LastError)

	// A failure during a broker outage pushes the row back without
	// spending an attempt.
	require.NoError(t, st.MarkFailed(ctx, pool, []store.RelayFailure{
		{ID: retry, Err: "broker unreachable", Delay: 2 * time.Minute, Outage: true},
	}))
	r = readOutbox(t, ctx, pool, schema, retry)
	require.Equal(t, store.OutboxPending, r.Status)
	require.Equal(t, 1, r.Attempts, "an outage spends no attempt")
	require.Equal(t, "broker unreachable", *r.LastError)
	require.InDelta(t, 120, r.DueInSecond, 5)
	require.NoError(t, st.MarkFailed(ctx, pool, []store.RelayFailure{
		{ID: retry, Err: "not enough replicas", Delay: time.Minute},
	}))

	d, ok, err := st.NextRelayDue(ctx, pool, 0)
	require.NoError(t, err)
	require.True(t, ok)
	require.InDelta(t, time.Minute.Seconds(), d.Seconds(), 5)

	require.NoError(t, st.MarkPublished(ctx, pool, nil))
	require.NoError(t, st.MarkFailed(ctx, pool, nil))
}

func TestRelayOutboxStatusCountsRelayRowsOnly(t *testing.T) {
	t.Parallel()
	ctx, pool, st, _ := relaySetup(t)

	status, err := st.RelayOutboxStatus(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, store.OutboxStatus{}, status)
	_, ok, err := st.NextRelayDue(ctx, pool, 0)
	require.NoError(t, err)
	require.False(t, ok)

	insertRelay(t, ctx, pool, st, store.Message{AggregateID: "a"})
	insertRelay(t, ctx, pool, st, store.Message{AggregateID: "b", Delay: time.Hour})
	dead := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "c"})
	require.NoError(t, st.MarkFailed(ctx, pool, []store.RelayFailure{{ID: dead, Err: "bad", Dead: true}}))
	direct := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "d", Delivery: store.DeliveryDirect})
	directDead := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "e", Delivery: store.DeliveryDirect})
	require.NoError(t, st.MarkDead(ctx, pool, directDead, "bad"))
	_ = direct

	status, err = st.RelayOutboxStatus(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, int64(2), status.Pending, "the delayed row is pending too; direct rows are not counted")
	require.Equal(t, int64(1), status.Dead)
	require.Zero(t, status.DeadLetters)
	require.Greater(t, status.OldestPendingAge, time.Duration(0))
	require.Less(t, status.OldestPendingAge, time.Minute)
}

// Rows that failed together with the same delay (a broker outage) come
// back in the order they were claimed: one reading of the clock for the
// whole statement, not one per row, which the join's row order would
// shuffle, reordering a key's messages after every outage.
func TestMarkFailedKeepsTheClaimOrder(t *testing.T) {
	t.Parallel()
	ctx, pool, st, _ := relaySetup(t)
	var ids []uuid.UUID
	for range 200 {
		ids = append(ids, insertRelay(t, ctx, pool, st, store.Message{AggregateID: "k"}))
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	claimed := claimIDs(t, ctx, tx, st, len(ids))
	require.Equal(t, ids, claimed)
	failures := make([]store.RelayFailure, len(claimed))
	for i, id := range slices.Backward(claimed) {
		failures[len(claimed)-1-i] = store.RelayFailure{ID: id, Err: "broker down", Outage: true}
	}
	require.NoError(t, st.MarkFailed(ctx, tx, failures))
	require.NoError(t, tx.Commit(ctx))

	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.Equal(t, ids, claimIDs(t, ctx, tx, st, len(ids)), "claimed again in the order first claimed")
}

// A relay row that came due after the relay's drain began (a retry, a held
// command) counts for the look ahead, due now, however late the look; one
// due before the drain began (another relay's), or written due at once
// (announced by its writer), does not.
func TestNextRelayDueCountsRowsDueSinceTheClaim(t *testing.T) {
	t.Parallel()
	ctx, pool, st, schema := relaySetup(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	insertRelay(t, ctx, pool, st, store.Message{AggregateID: "now"})
	retry := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "retry", Delay: time.Minute})
	// The retry came due 3 s ago.
	_, err := pool.Exec(ctx, "UPDATE "+outbox+" SET created_at = now() - interval '10 s', available_at = now() - interval '3 s' WHERE id = $1", retry)
	require.NoError(t, err)
	_, ok, err := st.NextRelayDue(ctx, pool, time.Second)
	require.NoError(t, err)
	require.False(t, ok, "due before the drain began; the other row is announced")
	d, ok, err := st.NextRelayDue(ctx, pool, 5*time.Second)
	require.NoError(t, err)
	require.True(t, ok, "came due since the drain began")
	require.InDelta(t, -3, d.Seconds(), 1)
}
