package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// An outbox row written with Wakes in the context notifies nothing at its
// commit; the Notifier does, after. Without Wakes, the commit notifies.
func TestDeferredWakeNotifiesAfterTheCommitNotInIt(t *testing.T) {
	t.Parallel()
	ctx, pool, st, _ := relaySetup(t)

	listener, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	_, err = listener.Exec(ctx, "LISTEN "+pgx.Identifier{st.Channel()}.Sanitize())
	require.NoError(t, err)
	next := func(within time.Duration) *pgconn.Notification {
		wctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		n, err := listener.Conn().WaitForNotification(wctx)
		if err != nil {
			return nil
		}
		return n
	}
	insert := func(ctx context.Context, topic string) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, st.InsertMessageNotify(ctx, tx, &store.Message{ID: uuid.New(), Topic: topic, Type: "t", Payload: []byte("{}")}))
		require.NoError(t, tx.Commit(ctx))
	}

	// Deferred: the commit says nothing.
	wctx, wakes := store.WithWakes(ctx)
	insert(wctx, "deferred.topic")
	require.Nil(t, next(300*time.Millisecond), "the transaction notified at its commit")
	// The owner of the transaction notifies after it.
	wakes.Notify(store.NewNotifier(pool, nil))
	n := next(5 * time.Second)
	require.NotNil(t, n, "no notification after the commit")
	require.Equal(t, "deferred.topic", n.Payload)

	// Not deferred: the commit notifies.
	insert(ctx, "plain.topic")
	n = next(5 * time.Second)
	require.NotNil(t, n, "no notification at the commit")
	require.Equal(t, "plain.topic", n.Payload)
}
