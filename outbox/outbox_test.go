package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func newOutbox(t *testing.T) (*pgxpool.Pool, string, *outbox.Outbox) {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(t, err)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	return pool, schema, ob
}

func count(t *testing.T, pool *pgxpool.Pool, schema string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "outbox"}.Sanitize()).Scan(&n))
	return n
}

// A message commits and rolls back with the caller's transaction.
func TestInsertTxJoinsTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, ob := newOutbox(t)
	msg := outbox.Message{Topic: "orders.events", Key: "o-1", Type: "OrderPaid", Payload: []byte(`{"id":"o-1"}`)}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, ob.InsertTx(ctx, tx, msg))
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, count(t, pool, schema), "a rolled back transaction leaves no message")

	id := uuid.Must(uuid.NewV7())
	msg.ID = id
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.InsertTx(ctx, tx, msg) }))
	var topic, key, typ, status string
	var payload []byte
	require.NoError(t, pool.QueryRow(ctx, "SELECT topic, aggregateid, type, payload, status FROM "+
		pgx.Identifier{schema, "outbox"}.Sanitize()+" WHERE id = $1 AND delivery = 'relay'", id).Scan(&topic, &key, &typ, &payload, &status))
	require.Equal(t, []string{"orders.events", "o-1", "OrderPaid", `{"id":"o-1"}`, "pending"}, []string{topic, key, typ, string(payload), status})

	st, err := ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.Pending)
}

// Bad input is refused before anything is written, with an error that
// names the field, and the caller's transaction stays usable.
func TestInsertTxRefusesWhatCannotBeStored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, ob := newOutbox(t)
	good := outbox.Message{Topic: "t", Key: "k", Type: "T", Payload: []byte{0, 0xff}}
	long := strings.Repeat("x", 10_000)
	for name, tc := range map[string]struct {
		mut  func(*outbox.Message)
		want string
	}{
		"empty topic":          {func(m *outbox.Message) { m.Topic = "" }, "Topic"},
		"topic with a space":   {func(m *outbox.Message) { m.Topic = "a b" }, "Topic"},
		"NUL in key":           {func(m *outbox.Message) { m.Key = "a\x00b" }, "Key"},
		"invalid UTF-8 type":   {func(m *outbox.Message) { m.Type = "\xff\xfe" }, "Type"},
		"10 kB key":            {func(m *outbox.Message) { m.Key = long }, "Key"},
		"10 kB aggregate type": {func(m *outbox.Message) { m.AggregateType = long }, "AggregateType"},
		"reserved header":      {func(m *outbox.Message) { m.Headers = map[string]string{"Sagaflow-Type": "command"} }, "sagaflow's own"},
		"empty header name":    {func(m *outbox.Message) { m.Headers = map[string]string{"": "v"} }, "empty name"},
		"NUL in header value":  {func(m *outbox.Message) { m.Headers = map[string]string{"traceparent": "\x00"} }, `header "traceparent"`},
		"10 kB header value":   {func(m *outbox.Message) { m.Headers = map[string]string{"h": long} }, `header "h"`},
		// The headers column is JSON: invalid UTF-8 would arrive as U+FFFD.
		"invalid UTF-8 header value": {func(m *outbox.Message) { m.Headers = map[string]string{"h": "a\xffb"} }, `header "h"`},
		"invalid UTF-8 key":          {func(m *outbox.Message) { m.Key = "\xc3" }, "Key"},
		"NUL in header name":         {func(m *outbox.Message) { m.Headers = map[string]string{"a\x00": "v"} }, "header name"},
		"negative delay":             {func(m *outbox.Message) { m.Delay = -time.Second }, "Delay"},
	} {
		m := good
		tc.mut(&m)
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			err := ob.InsertTx(ctx, tx, m)
			require.ErrorIs(t, err, outbox.ErrInvalidMessage, name)
			require.ErrorContains(t, err, tc.want, name)
			// The transaction is still usable: the refusal wrote nothing.
			return ob.InsertTx(ctx, tx, good)
		})
		require.NoError(t, err, name)
	}
	require.ErrorIs(t, ob.InsertTx(ctx, nil, good), outbox.ErrInvalidMessage)
	require.Equal(t, 14, count(t, pool, schema), "only the good messages were written")
}

// Two schemas are two tenants: one's messages never show in the other's.
func TestOutboxesOfTwoSchemasAreApart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	poolA, _, a := newOutbox(t)
	_, _, b := newOutbox(t)
	require.NoError(t, pgx.BeginFunc(ctx, poolA, func(tx pgx.Tx) error {
		return a.InsertTx(ctx, tx, outbox.Message{Topic: "t", Key: "k", Type: "T"})
	}))
	sa, err := a.Status(ctx)
	require.NoError(t, err)
	sb, err := b.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), sa.Pending)
	require.Equal(t, int64(0), sb.Pending)

	_, err = outbox.New(nil, "pg_catalog")
	require.ErrorIs(t, err, migrations.ErrInvalidSchema)
	_, err = outbox.New(nil, "")
	require.NoError(t, err, "empty means the default schema")
}

// The commit wakes the relay: a LISTEN on the schema's channel hears it, so
// the relay does not wait for its poll.
func TestInsertTxWakesTheRelay(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, schema, ob := newOutbox(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{schema + "_sagaflow"}.Sanitize())
	require.NoError(t, err)

	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return ob.InsertTx(ctx, tx, outbox.Message{Topic: "orders.events", Key: "k", Type: "T"})
	}))
	n, err := conn.Conn().WaitForNotification(ctx)
	require.NoError(t, err)
	require.Equal(t, "orders.events", n.Payload)
}

// Under WakeAfterCommit, the commit says nothing; wake, after it, wakes the
// relay. A saga started with StartTx in the same transaction is covered too
// (see saga's TestStartTxWakesAfterCommit).
func TestInsertTxLeavesTheWakeUpToAfterTheCommit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, schema, ob := newOutbox(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{schema + "_sagaflow"}.Sanitize())
	require.NoError(t, err)
	heard := func(within time.Duration) string {
		wctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		n, err := conn.Conn().WaitForNotification(wctx)
		if err != nil {
			return ""
		}
		return n.Payload
	}

	wctx, wake := outbox.WakeAfterCommit(ctx)
	require.NoError(t, pgx.BeginFunc(wctx, pool, func(tx pgx.Tx) error {
		return ob.InsertTx(wctx, tx, outbox.Message{Topic: "orders.events", Key: "k", Type: "T"})
	}))
	require.Equal(t, 1, count(t, pool, schema))
	require.Empty(t, heard(300*time.Millisecond), "the commit notified")
	require.NoError(t, wake(ctx, pool))
	require.Equal(t, "orders.events", heard(5*time.Second), "wake did not notify")
	// Called again, it has nothing left to send.
	require.NoError(t, wake(ctx, pool))
	require.Empty(t, heard(300*time.Millisecond))
}

// End to end: a message written with InsertTx reaches Kafka through the
// relay with its id as the message id header, and Replay publishes it once
// more, capped, after a dry run that changes nothing.
func TestInsertedMessageIsPublishedAndReplayed(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, schema, ob := newOutbox(t)
	cluster := kafkatest.New(t, kafkatest.SeedTopics(1, "orders.events"))
	w := relay.NewKafkaWriter(cluster.Addrs(), nil)
	defer w.Close()
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: time.Hour})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	defer r.Stop(context.WithoutCancel(ctx))

	id := uuid.Must(uuid.NewV7())
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return ob.InsertTx(ctx, tx, outbox.Message{ID: id, Topic: "orders.events", Key: "o-7", Type: "OrderPaid",
			Payload: []byte("paid"), Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}})
	}))
	published := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool {
			st, err := ob.Status(ctx)
			return err == nil && st.Published == 1 && st.Pending == 0 && count(t, pool, schema) == 1 &&
				len(must(cluster.ReadAll(ctx, "orders.events"))) == n
		}, 20*time.Second, 20*time.Millisecond, "published %d times", n)
	}
	published(1) // the poll is an hour away: the notification woke the relay
	msgs, err := cluster.ReadAll(ctx, "orders.events")
	require.NoError(t, err)
	headers := map[string]string{}
	for _, h := range msgs[0].Headers {
		headers[h.Key] = string(h.Value)
	}
	require.Equal(t, "o-7", string(msgs[0].Key))
	require.Equal(t, "paid", string(msgs[0].Value))
	require.Equal(t, id.String(), headers["sagaflow-message-id"])
	require.Equal(t, "OrderPaid", headers["sagaflow-type"])
	require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", headers["traceparent"])

	dry, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Key: "o-7"}, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{id}, dry.Matched)
	require.Zero(t, dry.Republished)
	none, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Key: "other"}})
	require.NoError(t, err)
	require.Empty(t, none.Matched)

	res, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Topic: "orders.events"}, RatePerSecond: 100})
	require.NoError(t, err)
	require.Equal(t, int64(1), res.Republished)
	published(2)

	_, err = ob.Replay(ctx, outbox.ReplayOpts{Max: outbox.ReplayMaxLimit + 1})
	require.ErrorContains(t, err, "Max")
	_, err = ob.Replay(ctx, outbox.ReplayOpts{RatePerSecond: -1})
	require.ErrorContains(t, err, "RatePerSecond")
}

// Status and Replay need a pool; an outbox made for inserts only says so.
func TestInsertOnlyOutboxSaysWhatItLacks(t *testing.T) {
	t.Parallel()
	ob, err := outbox.New(nil, "sagaflow")
	require.NoError(t, err)
	_, err = ob.Status(context.Background())
	require.ErrorContains(t, err, "needs the pool")
	_, err = ob.Replay(context.Background(), outbox.ReplayOpts{})
	require.ErrorContains(t, err, "needs the pool")
}

func must[T any](v T, err error) T {
	if err != nil {
		var zero T
		return zero
	}
	return v
}

// A running relay deletes published rows past its Retention, and only
// those: dead rows and rows published recently stay; DeletePublished does
// the same on demand.
func TestRelayDeletesOldPublishedRows(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, schema, ob := newOutbox(t)
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	for _, key := range []string{"old", "dead", "recent"} {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.InsertTx(ctx, tx, outbox.Message{Topic: "t", Key: key, Type: "T"})
		}))
	}
	_, err := pool.Exec(ctx, "UPDATE "+table+" SET status = 'published', published_at = now() - interval '3 hours' WHERE aggregateid = 'old'")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, "UPDATE "+table+" SET status = 'dead', last_error = 'x', created_at = now() - interval '3 hours' WHERE aggregateid = 'dead'")
	require.NoError(t, err)

	cluster := kafkatest.New(t, kafkatest.SeedTopics(1, "t"))
	w := relay.NewKafkaWriter(cluster.Addrs(), nil)
	defer w.Close()
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, Retention: 2 * time.Hour, RetentionInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	require.Eventually(t, func() bool {
		var left []string
		rows, err := pool.Query(ctx, "SELECT aggregateid || ':' || status FROM "+table+" ORDER BY aggregateid")
		require.NoError(t, err)
		left, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return len(left) == 2 && left[0] == "dead:dead" && left[1] == "recent:published"
	}, 20*time.Second, 10*time.Millisecond, "the old published row goes; the dead and the recent ones stay")
	require.NoError(t, r.Stop(ctx))

	n, err := ob.DeletePublished(ctx, time.Nanosecond, 1)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "the recent row, once it is older than asked")
	require.Equal(t, 1, count(t, pool, schema), "the dead row is never deleted")
	_, err = ob.DeletePublished(ctx, 0, 1)
	require.ErrorContains(t, err, "must be positive")
	_, err = relay.New(pool, w, &relay.Config{Schema: schema, RetentionInterval: -1})
	require.ErrorIs(t, err, relay.ErrInvalidConfig)
}

// An id already in the outbox is refused with ErrDuplicateID: nothing is
// written twice.
func TestInsertTxRefusesATakenID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, ob := newOutbox(t)
	msg := outbox.Message{ID: uuid.Must(uuid.NewV7()), Topic: "t", Key: "k", Type: "T"}
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.InsertTx(ctx, tx, msg) }))
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.InsertTx(ctx, tx, msg) })
	require.ErrorIs(t, err, outbox.ErrDuplicateID)
	require.ErrorContains(t, err, msg.ID.String())
	require.Equal(t, 1, count(t, pool, schema))
}
