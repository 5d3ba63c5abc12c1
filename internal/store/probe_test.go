package store_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/wire"
)

// TestInboxProbeUsesTheKeyWrittenInGo: a saga is Processed only when the
// inbox holds the key of its current step and the command being run
// carries that key (the outbox row's step_key column, or the key given to
// LockSagas). A stale command whose own key is in the inbox, claimed in
// the same batch before the current one, does not make the current step
// look done.
func TestInboxProbeUsesTheKeyWrittenInGo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, st, id := sagaAtCharge(t, 2, 5)
	table := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	key := func(step string, epoch int) string {
		return wire.Key{SagaID: wire.UUID(id), Step: step, Direction: wire.Forward, Epoch: epoch}.String()
	}
	current, stale := key("charge", 2), key("reserve", 2)
	command := func(stepKey string) {
		require.NoError(t, st.InsertMessage(ctx, pool, &store.Message{ID: uuid.Must(uuid.NewV7()), Topic: "cmds",
			Delivery: store.DeliveryDirect, AggregateType: "saga.orders", AggregateID: id.String(), Type: wire.TypeStep,
			Payload: []byte("{}"), SagaID: &id, StepKey: &stepKey}))
	}
	processed := func(key string) {
		_, err := pool.Exec(ctx, "INSERT INTO "+table("inbox")+" (consumer, key) VALUES ($1, $2)", store.InboxConsumerEngine, key)
		require.NoError(t, err)
	}
	claim := func() bool {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { require.NoError(t, tx.Rollback(ctx)) }()
		var claimed []store.Claimed
		var sagas map[uuid.UUID]*store.LockedSaga
		q := &pgx.Batch{}
		st.QueueClaimAndLock(q, "cmds", 10, []string{"saga.orders"}, 0, &claimed, &sagas)
		require.NoError(t, tx.SendBatch(ctx, q).Close())
		require.Len(t, claimed, 2)
		require.True(t, sagas[id].Locked)
		return sagas[id].Processed
	}
	lock := func(stepKey string) bool {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { require.NoError(t, tx.Rollback(ctx)) }()
		sagas, err := st.LockSagas(ctx, tx, []uuid.UUID{id}, stepKey)
		require.NoError(t, err)
		return sagas[id].Processed
	}

	command(stale)
	command(current)
	processed(stale)
	require.False(t, claim(), "the stale command's key is in the inbox, the current step's is not")
	require.False(t, lock(stale), "a key that is not the saga's current step's")
	require.False(t, lock(current))
	require.False(t, lock(""))

	processed(current)
	require.True(t, claim(), "the current step's key is in the inbox")
	require.True(t, lock(current))
	require.False(t, lock(""), "no key given, nothing probed")
}

// sagaAtCharge migrates a schema of its own and inserts a running saga of
// type orders at its step charge, forward, in run epoch at version.
func sagaAtCharge(t *testing.T, epoch int, version int64) (*pgxpool.Pool, string, *store.Store, uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	pool, st, schema := newStore(t)
	id := uuid.Must(uuid.NewV7())
	_, err := pool.Exec(ctx, "INSERT INTO "+pgx.Identifier{schema, "saga_instances"}.Sanitize()+
		` (id, saga_name, status, step_index, step_name, direction, epoch, state, version) VALUES ($1, 'orders', 'running', 1, 'charge', 'forward', $2, '{}', $3)`,
		id, epoch, version)
	require.NoError(t, err)
	return pool, schema, st, id
}
