package store_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/wire"
)

// LastReply finds the latest reply of a step key and nothing else (not a
// command with the same key, not another key's reply), through the index
// of migration 006 rather than by reading the whole outbox.
func TestLastReplyTakesTheLatestReplyByIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, st, schema := newStore(t)
	sagaID := uuid.Must(uuid.NewV7())
	key := wire.Key{SagaID: wire.UUID(sagaID), Step: "charge", Direction: wire.Forward}.String()
	other := wire.Key{SagaID: wire.UUID(sagaID), Step: "ship", Direction: wire.Forward}.String()

	_, found, err := st.LastReply(ctx, pool, key)
	require.NoError(t, err)
	require.False(t, found)

	insert := func(typ, stepKey, payload string, delay time.Duration) {
		t.Helper()
		k := stepKey
		require.NoError(t, st.InsertMessage(ctx, pool, &store.Message{ID: uuid.Must(uuid.NewV7()), Topic: "t",
			Type: typ, AggregateID: sagaID.String(), Payload: []byte(payload), StepKey: &k}))
		time.Sleep(delay)
	}
	insert(wire.TypeReply, key, "first", 5*time.Millisecond)
	insert(wire.TypeReply, key, "second", 5*time.Millisecond)
	insert(wire.TypeStep, key, "a command", 0)
	insert(wire.TypeReply, other, "another step", 0)
	payload, found, err := st.LastReply(ctx, pool, key)
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, "second", string(payload))

	// The planner can serve the lookup from the partial index; with
	// sequential scans priced out, it does.
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, "EXPLAIN SELECT payload FROM "+pgx.Identifier{schema, "outbox"}.Sanitize()+
			" WHERE type = '"+wire.TypeReply+"' AND step_key = $1 ORDER BY created_at DESC LIMIT 1", key)
		if err != nil {
			return err
		}
		plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.Contains(t, strings.Join(plan, "\n"), "outbox_reply_step_key")
		return err
	}))
}
