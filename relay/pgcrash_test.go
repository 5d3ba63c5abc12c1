package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// TestMarksUndoneByAPostgreSQLCrashArePublishedAgain drains batches and
// crashes a PostgreSQL of its own (immediate shutdown: WAL not yet written
// is lost) at once after each drain, five times. The relay's marks commit
// without waiting for their WAL to reach the disk, so a crash can undo
// them: such rows must be pending again after recovery and published by the
// next drain. At the end every row is published and on the topic at least
// once: a crash loses no message.
func TestMarksUndoneByAPostgreSQLCrashArePublishedAgain(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := pgtest.StartServer(ctx)
	if err != nil {
		t.Skipf("no PostgreSQL server of the test's own to crash: %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop(context.Background()) })
	const schema = "sagaflow"
	st, err := store.New(schema)
	require.NoError(t, err)
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, topicOrders))
	w := relay.NewKafkaWriter(kc.Addrs(), &relay.WriterOpts{MaxAttempts: 1})
	defer w.Close()

	// connect returns a pool and a relay on the server as it runs now.
	connect := func() (*pgxpool.Pool, *relay.Relay) {
		pool, err := pgxpool.New(ctx, srv.ConnString())
		require.NoError(t, err)
		r, err := relay.New(pool, w, &relay.Config{Schema: schema, Logger: quiet})
		require.NoError(t, err)
		return pool, r
	}
	pool, _ := connect()
	_, err = migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	pool.Close()

	written := map[string]bool{}
	undone := 0
	for round := range 5 {
		pool, r := connect()
		var pending int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM sagaflow.outbox WHERE status = 'pending'`).Scan(&pending))
		undone += pending
		for i := range 200 {
			m := store.Message{ID: uuid.Must(uuid.NewV7()), Topic: topicOrders, AggregateID: fmt.Sprintf("k-%d", i%7),
				Type: "test.event", Payload: fmt.Appendf(nil, `{"round":%d,"seq":%d}`, round, i)}
			require.NoError(t, st.InsertMessage(ctx, pool, &m))
			written[m.ID.String()] = true
		}
		published, failed := drain(t, ctx, r)
		require.Zero(t, failed)
		require.Equal(t, 200+pending, published, "round %d: this round's rows and the %d a crash left pending", round, pending)
		require.NoError(t, srv.Kill())
		pool.Close()
		require.NoError(t, srv.Restart(ctx))
	}
	pool, r := connect()
	defer pool.Close()
	var pending int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM sagaflow.outbox WHERE status = 'pending'`).Scan(&pending))
	undone += pending
	published, _ := drain(t, ctx, r)
	require.Equal(t, pending, published)

	var notPublished int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM sagaflow.outbox WHERE status <> 'published'`).Scan(&notPublished))
	require.Zero(t, notPublished)
	onTopic := map[string]int{}
	msgs, err := kc.ReadAll(ctx, topicOrders)
	require.NoError(t, err)
	for _, m := range msgs {
		id, ok := header(m, store.HeaderMessageID)
		require.True(t, ok)
		onTopic[id]++
	}
	for id := range written {
		require.Positive(t, onTopic[id], "row %s was written and is on no partition", id)
	}
	t.Logf("%d rows, %d messages on the topic; %d marks undone by the five crashes and published again", len(written), len(msgs), undone)
}
