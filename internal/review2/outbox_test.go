package review2_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// Docs: "A message with an illegal topic, NUL, invalid UTF-8 or over-long
// text, a negative delay or a sagaflow-… header is refused with
// ErrInvalidMessage naming the field, before anything is written" and
// "nothing is written then, and the caller's transaction stays usable."
func TestInsertTxRefusesUnstorableBytesInEveryField(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	exec(t, pool, schema, "CREATE TABLE %s.biz (n int)")
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)

	bad := map[string]string{
		"nul":      "a\x00b",
		"bad-utf8": "a\xff\xfeb",
		"10kB":     strings.Repeat("x", 10_000),
	}
	fields := []struct {
		name  string // what the error must name
		apply func(m *outbox.Message, v string)
	}{
		{"Topic", func(m *outbox.Message, v string) { m.Topic = v }},
		{"Key", func(m *outbox.Message, v string) { m.Key = v }},
		{"Type", func(m *outbox.Message, v string) { m.Type = v }},
		{"AggregateType", func(m *outbox.Message, v string) { m.AggregateType = v }},
		{"Header", func(m *outbox.Message, v string) { m.Headers = map[string]string{v: "ok"} }},
		{"Header", func(m *outbox.Message, v string) { m.Headers = map[string]string{"traceparent": v} }},
	}
	cases := 0
	for _, f := range fields {
		for what, v := range bad {
			m := msg("orders", "order-1", "OrderPaid")
			f.apply(&m, v)
			require.Error(t, m.Check(), "%s %s", f.name, what)

			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			exec := func() {
				_, err := tx.Exec(ctx, "INSERT INTO "+`"`+schema+`"`+".biz VALUES (1)")
				require.NoError(t, err, "%s %s: the caller's transaction is no longer usable", f.name, what)
			}
			exec()
			err = ob.InsertTx(ctx, tx, m)
			require.ErrorIs(t, err, outbox.ErrInvalidMessage, "%s %s", f.name, what)
			require.Contains(t, strings.ToLower(err.Error()), strings.ToLower(f.name), "%s %s: error does not name the field", f.name, what)
			require.NotContains(t, err.Error(), "\x00", "%s %s: the error repeats the NUL byte", f.name, what)
			require.LessOrEqual(t, len(err.Error()), 2000, "%s %s: the error repeats the 10 kB value", f.name, what)
			exec()
			require.NoError(t, ob.InsertTx(ctx, tx, msg("orders", "order-1", "OrderPaid")), "%s %s", f.name, what)
			require.NoError(t, tx.Commit(ctx), "%s %s", f.name, what)
			cases++
		}
	}
	st, err := ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(cases), st.Pending, "only the valid messages are written")
	require.Equal(t, 2*cases, count(t, pool, schema, "SELECT count(*) FROM %s.biz"))
}

// Docs: Topic is "letters, digits, '.', '_', '-'; at most 249 bytes", and an
// illegal topic is refused. Kafka also refuses "", "." and "..".
func TestInsertTxTopicBounds(t *testing.T) {
	t.Parallel()
	for _, topic := range []string{"", ".", "..", "a/b", "a b", "ordérs", strings.Repeat("t", 250)} {
		m := msg(topic, "k", "T")
		err := m.Check()
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, "topic %q accepted", topic)
		require.Contains(t, strings.ToLower(err.Error()), "topic", "topic %q", topic)
	}
	for _, topic := range []string{"a", "orders.events_v1-x", strings.Repeat("t", 249)} {
		m := msg(topic, "k", "T")
		require.NoError(t, m.Check(), "topic %q refused", topic)
	}
}

// Docs: MaxKeyBytes bounds Key, Type and AggregateType; MaxHeaderBytes bounds
// each header's name and value. The bounds themselves are allowed.
func TestInsertTxLengthBoundsAreInclusive(t *testing.T) {
	t.Parallel()
	at, over := strings.Repeat("k", outbox.MaxKeyBytes), strings.Repeat("k", outbox.MaxKeyBytes+1)
	hat, hover := strings.Repeat("h", outbox.MaxHeaderBytes), strings.Repeat("h", outbox.MaxHeaderBytes+1)
	ok := []outbox.Message{
		{Topic: "t", Key: at, Type: "T"},
		{Topic: "t", Key: "k", Type: at},
		{Topic: "t", Key: "k", Type: "T", AggregateType: at},
		{Topic: "t", Key: "k", Type: "T", Headers: map[string]string{hat: hat}},
	}
	for i, m := range ok {
		require.NoError(t, m.Check(), "case %d", i)
	}
	refused := map[string]outbox.Message{
		"key":           {Topic: "t", Key: over, Type: "T"},
		"type":          {Topic: "t", Key: "k", Type: over},
		"aggregatetype": {Topic: "t", Key: "k", Type: "T", AggregateType: over},
		"header":        {Topic: "t", Key: "k", Type: "T", Headers: map[string]string{"h": hover}},
		"delay":         {Topic: "t", Key: "k", Type: "T", Delay: -time.Second},
	}
	for field, m := range refused {
		err := m.Check()
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, field)
		require.Contains(t, strings.ToLower(err.Error()), field)
	}
	// Reserved names, in any case a consumer might compare them in.
	for _, name := range []string{"sagaflow-type", "sagaflow-message-id", "sagaflow-"} {
		m := outbox.Message{Topic: "t", Key: "k", Type: "T", Headers: map[string]string{name: "x"}}
		require.ErrorIs(t, m.Check(), outbox.ErrInvalidMessage, name)
	}
}

// Docs: "Payload is the message's value, any bytes; nil is sent as empty",
// "Every copy carries the same sagaflow-message-id", and the relay sets
// sagaflow-type and keeps the caller's headers.
func TestPayloadAnyBytesPublishedByteForByte(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "bytes"))
	payload := []byte{0, 0xff, 0xfe, 'a', 0, '\n'}
	id := insert(t, pool, schema, outbox.Message{
		Topic: "bytes", Key: "k-1", Type: "Weird", AggregateType: "thing", Payload: payload,
		Headers: map[string]string{"traceparent": "00-abc-def-01", "x-empty": ""},
	})
	nilID := insert(t, pool, schema, outbox.Message{Topic: "bytes", Key: "k-1", Type: "Nil"})
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 2)

	got, err := kc.ReadAll(context.Background(), "bytes")
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, payload, got[0].Value)
	require.Equal(t, "k-1", string(got[0].Key))
	v, n := header(got[0], "sagaflow-message-id")
	require.Equal(t, 1, n)
	require.Equal(t, id.String(), v)
	v, _ = header(got[0], "sagaflow-type")
	require.Equal(t, "Weird", v)
	v, _ = header(got[0], "traceparent")
	require.Equal(t, "00-abc-def-01", v)
	_, n = header(got[0], "x-empty")
	require.Equal(t, 1, n, "an empty header value is kept")
	require.Empty(t, got[1].Value)
	v, _ = header(got[1], "sagaflow-message-id")
	require.Equal(t, nilID.String(), v)
}

// Docs say nothing of a Message.ID inserted twice. The worst outcome would be
// silence: the second message, with another payload, lost without an error.
func TestInsertTxSameIDTwice(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	id := uuid.Must(uuid.NewV7())
	first := msg("orders", "k", "First")
	first.ID = id
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.InsertTx(ctx, tx, first) }))

	second := msg("orders", "k", "Second")
	second.ID = id
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	err = ob.InsertTx(ctx, tx, second)
	require.Error(t, err, "a second message with the same id was accepted silently")
	t.Logf("same id twice: %v (ErrInvalidMessage: %v)", err, errors.Is(err, outbox.ErrInvalidMessage))
	require.Contains(t, err.Error(), id.String(), "the error does not say which id is taken")
	_, usable := tx.Exec(ctx, "SELECT 1")
	t.Logf("caller's transaction usable after the duplicate: %v", usable == nil)
	require.Equal(t, 1, count(t, pool, schema, "SELECT count(*) FROM %s.outbox WHERE id = $1 AND type = 'First'", id))
}

// Docs: "pool is needed only by Outbox.Status and Outbox.Replay; nil is fine
// for a service that only inserts." Calling them anyway must not panic.
func TestOutboxWithoutPoolStatusAndReplay(t *testing.T) {
	t.Parallel()
	ob, err := outbox.New(nil, "some_schema")
	require.NoError(t, err)
	func() {
		defer func() { require.Nil(t, recover(), "Status on an Outbox without pool panicked") }()
		_, err = ob.Status(context.Background())
		require.Error(t, err)
	}()
	func() {
		defer func() { require.Nil(t, recover(), "Replay on an Outbox without pool panicked") }()
		_, err = ob.Replay(context.Background(), outbox.ReplayOpts{DryRun: true})
		require.Error(t, err)
	}()
	_, err = outbox.New(nil, `bad"schema`)
	require.Error(t, err)
}

// Docs: "Delay holds the message back this long after the database's now()."
// The relay must not publish it early.
func TestDelayedMessageWaits(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "later"))
	m := msg("later", "k", "T")
	m.Delay = time.Hour
	insert(t, pool, schema, m)
	n, failed, err := newRelay(t, pool, schema, kc, relay.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, n+failed)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	st, err := ob.Status(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(1), st.Pending)
}
