package store_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
)

// deadLetter stores a dead letter at offset of topic for consumer and
// returns its id.
func deadLetter(t *testing.T, ctx context.Context, pool *pgxpool.Pool, st *store.Store, schema string, d store.DeadLetter) int64 {
	t.Helper()
	require.NoError(t, st.InsertDeadLetter(ctx, pool, &d))
	var id int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT max(id) FROM `+pgx.Identifier{schema}.Sanitize()+`.dead_letters`).Scan(&id))
	return id
}

func at(p int, o int64) (*int, *int64) { return &p, &o }

func TestDeadMessagesListAndRequeue(t *testing.T) {
	t.Parallel()
	ctx, pool, st, schema := relaySetup(t)
	var dead []uuid.UUID
	for i := range 5 {
		topic := "orders"
		if i%2 == 1 {
			topic = "payments"
		}
		id := insertRelay(t, ctx, pool, st, store.Message{Topic: topic, AggregateID: "k", Payload: []byte("12345")})
		require.NoError(t, st.MarkFailed(ctx, pool, []store.RelayFailure{{ID: id, Err: "attempts_exhausted: gave up", Dead: true}}))
		dead = append(dead, id)
	}
	insertRelay(t, ctx, pool, st, store.Message{AggregateID: "alive"})

	// Pages of two, oldest first.
	var got []uuid.UUID
	cursor := ""
	for range 5 {
		page, next, err := st.DeadMessages(ctx, pool, store.DeadFilter{Limit: 2, Cursor: cursor})
		require.NoError(t, err)
		for _, m := range page {
			got = append(got, m.ID)
			require.Equal(t, "attempts_exhausted: gave up", m.LastError)
			require.Equal(t, 1, m.Attempts)
			require.Equal(t, 5, m.PayloadBytes)
			require.Equal(t, store.DeliveryRelay, m.Delivery)
		}
		if next == "" {
			break
		}
		cursor = next
	}
	require.Equal(t, dead, got)

	payments, _, err := st.DeadMessages(ctx, pool, store.DeadFilter{Topic: "payments", Limit: 10})
	require.NoError(t, err)
	require.Len(t, payments, 2)
	none, _, err := st.DeadMessages(ctx, pool, store.DeadFilter{Since: time.Now().Add(time.Hour), Limit: 10})
	require.NoError(t, err)
	require.Empty(t, none)
	_, _, err = st.DeadMessages(ctx, pool, store.DeadFilter{Consumer: "c", Limit: 10})
	require.ErrorContains(t, err, "Consumer filters dead letters")
	_, _, err = st.DeadMessages(ctx, pool, store.DeadFilter{Cursor: "nonsense", Limit: 10})
	require.ErrorIs(t, err, store.ErrMalformedCursor)

	// Requeue: pending, due now, attempts reset, the reason kept; a row
	// that is not dead is left alone.
	alive := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "alive"})
	superseded := insertRelay(t, ctx, pool, st, store.Message{AggregateID: "late"})
	ok, err := st.SupersedeMessage(ctx, pool, superseded, "superseded: the step timed out waiting for its reply")
	require.NoError(t, err)
	require.True(t, ok)
	missing := uuid.Must(uuid.NewV7())
	done, why, err := st.RequeueDeadMessages(ctx, pool, []uuid.UUID{dead[0], dead[1], alive, superseded, missing})
	require.NoError(t, err)
	require.ElementsMatch(t, []uuid.UUID{dead[0], dead[1]}, done)
	require.Equal(t, map[uuid.UUID]string{
		alive: "its status is pending, not dead",
		superseded: "it was superseded on purpose, and sending it now could run a step after its saga moved on " +
			"(superseded: the step timed out waiting for its reply)",
		missing: "no such outbox message",
	}, why)
	require.Equal(t, store.OutboxDead, readOutbox(t, ctx, pool, schema, superseded).Status)
	for _, id := range dead[:2] {
		r := readOutbox(t, ctx, pool, schema, id)
		require.Equal(t, store.OutboxPending, r.Status)
		require.Zero(t, r.Attempts)
		require.Equal(t, "requeued; was: attempts_exhausted: gave up", *r.LastError)
		require.LessOrEqual(t, r.DueInSecond, 0.0)
	}
	require.Nil(t, readOutbox(t, ctx, pool, schema, alive).LastError)
	again, why, err := st.RequeueDeadMessages(ctx, pool, dead[:2])
	require.NoError(t, err)
	require.Empty(t, again, "requeued rows are not dead any more")
	require.Len(t, why, 2)

	status, err := st.OutboxStatus(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, int64(4), status.Dead)
}

func TestDeadLettersListAndCount(t *testing.T) {
	t.Parallel()
	ctx, pool, st, schema := relaySetup(t)
	var ids []int64
	for i := range 5 {
		consumer := "billing"
		if i%2 == 1 {
			consumer = "shipping"
		}
		p, o := at(0, int64(i))
		ids = append(ids, deadLetter(t, ctx, pool, st, schema, store.DeadLetter{Consumer: consumer, MessageID: uuid.NewString(),
			Topic: "orders", Partition: p, Offset: o, Key: []byte("k"), Value: []byte("value"),
			Headers: map[string]string{"h": "v"}, Reason: "refused\x1b[31m"}))
	}

	var got []int64
	cursor := ""
	for range 5 {
		page, next, err := st.DeadLetters(ctx, pool, store.DeadFilter{Limit: 2, Cursor: cursor})
		require.NoError(t, err)
		for _, d := range page {
			got = append(got, d.ID)
			require.Equal(t, "orders", d.Topic)
			require.Equal(t, 5, d.ValueBytes)
			require.Equal(t, []byte("k"), d.Key)
			require.Equal(t, map[string]string{"h": "v"}, d.Headers)
			require.Equal(t, "refused\x1b[31m", d.Reason, "stored as is: the CLI escapes it")
			require.Nil(t, d.RequeuedAt)
		}
		if next == "" {
			break
		}
		cursor = next
	}
	require.Equal(t, ids, got)
	billing, _, err := st.DeadLetters(ctx, pool, store.DeadFilter{Consumer: "billing", Limit: 10})
	require.NoError(t, err)
	require.Len(t, billing, 3)
	_, _, err = st.DeadLetters(ctx, pool, store.DeadFilter{Cursor: "eA", Limit: 10})
	require.ErrorIs(t, err, store.ErrMalformedCursor)

	status, err := st.OutboxStatus(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, int64(5), status.DeadLetters)
	relayStatus, err := st.RelayOutboxStatus(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, int64(5), relayStatus.DeadLetters)

	// A requeued letter is no longer counted nor listed, unless asked.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = st.RequeueDeadLetter(ctx, tx, ids[0], uuid.Must(uuid.NewV7()))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	status, err = st.OutboxStatus(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, int64(4), status.DeadLetters)
	page, _, err := st.DeadLetters(ctx, pool, store.DeadFilter{Limit: 10})
	require.NoError(t, err)
	require.Len(t, page, 4)
	page, _, err = st.DeadLetters(ctx, pool, store.DeadFilter{Limit: 10, IncludeRequeued: true})
	require.NoError(t, err)
	require.Len(t, page, 5)
	require.NotNil(t, page[0].RequeuedAt)
}

type relayRowHeaders struct {
	Topic, AggregateType, AggregateID, Type, Status, Delivery string
	Payload                                                   []byte
	Headers                                                   map[string]string
}

func readRequeued(t *testing.T, ctx context.Context, pool *pgxpool.Pool, schema string, id uuid.UUID) relayRowHeaders {
	t.Helper()
	var r relayRowHeaders
	require.NoError(t, pool.QueryRow(ctx, `SELECT topic, aggregatetype, aggregateid, type, status, delivery, payload, headers
		FROM `+pgx.Identifier{schema}.Sanitize()+`.outbox WHERE id = $1`, id).
		Scan(&r.Topic, &r.AggregateType, &r.AggregateID, &r.Type, &r.Status, &r.Delivery, &r.Payload, &r.Headers))
	return r
}

func TestRequeueDeadLetter(t *testing.T) {
	t.Parallel()
	ctx, pool, st, schema := relaySetup(t)
	q := pgx.Identifier{schema}.Sanitize()
	inboxKeys := func(consumer string) []string {
		rows, err := pool.Query(ctx, `SELECT key FROM `+q+`.inbox WHERE consumer = $1 ORDER BY key`, consumer)
		require.NoError(t, err)
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return keys
	}
	requeue := func(id int64) (*store.RequeuedLetter, error) {
		t.Helper()
		var res *store.RequeuedLetter
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			res, err = st.RequeueDeadLetter(ctx, tx, id, uuid.Must(uuid.NewV7()))
			return err
		})
		return res, err
	}

	t.Run("original bytes, message id kept, inbox key forgotten", func(t *testing.T) {
		msgID := uuid.NewString()
		raw := []store.RawHeader{
			{Key: []byte(store.HeaderMessageID), Value: []byte(msgID)},
			{Key: []byte(store.HeaderType), Value: []byte("order.created")},
			{Key: []byte("bin"), Value: []byte{0, 0xff, 1}},
			{Key: []byte("dup"), Value: []byte("1")},
			{Key: []byte("dup"), Value: []byte("2")},
		}
		p, o := at(2, 41)
		id := deadLetter(t, ctx, pool, st, schema, store.DeadLetter{Consumer: "billing", MessageID: msgID, Topic: "orders",
			Partition: p, Offset: o, Key: []byte("order-7"), Value: []byte{0, 1, 2}, RawHeaders: raw, Reason: "refused"})
		for _, c := range []string{"billing", "shipping"} {
			_, err := st.InsertInboxKey(ctx, pool, c, msgID)
			require.NoError(t, err)
		}
		res, err := requeue(id)
		require.NoError(t, err)
		require.Equal(t, msgID, res.MessageID)
		require.Equal(t, "billing", res.Consumer)
		require.NotEqual(t, msgID, res.OutboxID.String(), "a new outbox row")

		row := readRequeued(t, ctx, pool, schema, res.OutboxID)
		require.Equal(t, "orders", row.Topic)
		require.Equal(t, store.DeliveryRelay, row.Delivery)
		require.Equal(t, store.OutboxPending, row.Status)
		require.Equal(t, store.AggregateTypeDeadLetter, row.AggregateType)
		require.Equal(t, "order-7", row.AggregateID)
		require.Equal(t, "order.created", row.Type)
		require.Equal(t, []byte{0, 1, 2}, row.Payload)
		require.Len(t, row.Headers, 1)
		got, err := store.DecodeRawHeaders(row.Headers[store.RawHeadersKey])
		require.NoError(t, err)
		require.Equal(t, raw, got, "the headers exactly as received")

		require.Empty(t, inboxKeys("billing"), "the consumer that dead-lettered it processes it again")
		require.Equal(t, []string{msgID}, inboxKeys("shipping"), "other consumers still skip it")

		_, err = requeue(id)
		require.ErrorIs(t, err, store.ErrNotRequeueable)
		require.ErrorContains(t, err, "requeued already")
	})

	t.Run("unsafe message id: both forms of its inbox key go", func(t *testing.T) {
		msgID := "id\x00" + strings.Repeat("x", 600)
		p, o := at(0, 1)
		id := deadLetter(t, ctx, pool, st, schema, store.DeadLetter{Consumer: "c2", MessageID: msgID, Topic: "orders",
			Partition: p, Offset: o, RawHeaders: []store.RawHeader{{Key: []byte(store.HeaderMessageID), Value: []byte(msgID)}},
			Reason: "poison"})
		long := strings.Repeat("y", 600)
		_, err := st.InsertInboxKey(ctx, pool, "c2", safetext.Key(msgID))
		require.NoError(t, err)
		_, err = st.InsertInboxKey(ctx, pool, "c2", long)
		require.NoError(t, err)
		res, err := requeue(id)
		require.NoError(t, err)
		require.Equal(t, msgID, res.MessageID)
		require.Equal(t, []string{long}, inboxKeys("c2"))
		row := readRequeued(t, ctx, pool, schema, res.OutboxID)
		require.Empty(t, row.AggregateID, "no key")
	})

	t.Run("no message id: the id its position gave it", func(t *testing.T) {
		// What an inbox consumer called the original.
		original := inbox.FromKafka(kafka.Message{Topic: "orders", Partition: 3, Offset: 77, Value: []byte("v")})
		p, o := at(3, 77)
		id := deadLetter(t, ctx, pool, st, schema, store.DeadLetter{Consumer: "c3", MessageID: original.ID, Topic: "orders",
			Partition: p, Offset: o, Value: []byte("v"), RawHeaders: []store.RawHeader{{Key: []byte("a"), Value: []byte("b")}},
			Reason: "unknown type"})
		_, err := st.InsertInboxKey(ctx, pool, "c3", original.ID)
		require.NoError(t, err)
		res, err := requeue(id)
		require.NoError(t, err)
		require.Equal(t, original.ID, res.MessageID)
		require.Empty(t, inboxKeys("c3"))
		row := readRequeued(t, ctx, pool, schema, res.OutboxID)
		got, err := store.DecodeRawHeaders(row.Headers[store.RawHeadersKey])
		require.NoError(t, err)
		require.Equal(t, []store.RawHeader{{Key: []byte("a"), Value: []byte("b")},
			{Key: []byte(store.HeaderMessageID), Value: []byte(original.ID)}}, got)
	})

	t.Run("stored before raw headers were kept", func(t *testing.T) {
		msgID := uuid.NewString()
		p, o := at(0, 9)
		id := deadLetter(t, ctx, pool, st, schema, store.DeadLetter{Consumer: "c4", MessageID: msgID, Topic: "orders",
			Partition: p, Offset: o, Headers: map[string]string{store.HeaderMessageID: msgID, "z": "1", "a": "2"}, Reason: "old"})
		res, err := requeue(id)
		require.NoError(t, err)
		row := readRequeued(t, ctx, pool, schema, res.OutboxID)
		got, err := store.DecodeRawHeaders(row.Headers[store.RawHeadersKey])
		require.NoError(t, err)
		require.Equal(t, []store.RawHeader{{Key: []byte("a"), Value: []byte("2")},
			{Key: []byte(store.HeaderMessageID), Value: []byte(msgID)}, {Key: []byte("z"), Value: []byte("1")}}, got)
	})

	t.Run("cannot be requeued", func(t *testing.T) {
		for name, key := range map[string][]byte{"a NUL byte": []byte("k\x00"), "not valid UTF-8": {0xff, 0xfe}} {
			p, o := at(1, int64(len(name)))
			id := deadLetter(t, ctx, pool, st, schema, store.DeadLetter{Consumer: "c5", MessageID: uuid.NewString(),
				Topic: "orders", Partition: p, Offset: o, Key: key, Reason: "bad key"})
			_, err := requeue(id)
			require.ErrorIs(t, err, store.ErrNotRequeueable, name)
			require.ErrorContains(t, err, "dead letter "+strconv.FormatInt(id, 10)+" cannot be requeued: its key "+map[string]string{
				"a NUL byte": "contains a NUL byte", "not valid UTF-8": "is not valid UTF-8"}[name])
			var requeued *time.Time
			require.NoError(t, pool.QueryRow(ctx, `SELECT requeued_at FROM `+q+`.dead_letters WHERE id = $1`, id).Scan(&requeued))
			require.Nil(t, requeued, "nothing written")
		}
		_, err := requeue(1 << 40)
		require.ErrorIs(t, err, store.ErrNotRequeueable)
		require.ErrorContains(t, err, "no such dead letter")
		require.False(t, errors.Is(err, pgx.ErrNoRows))
	})
}

func TestRawHeadersRoundTrip(t *testing.T) {
	t.Parallel()
	for _, hs := range [][]store.RawHeader{
		{},
		{{Key: []byte("a"), Value: nil}},
		{{Key: []byte("\x00\xff"), Value: []byte{0, 1}}, {Key: []byte("\x00\xff"), Value: []byte("again")}},
	} {
		got, err := store.DecodeRawHeaders(store.EncodeRawHeaders(hs))
		require.NoError(t, err)
		require.Len(t, got, len(hs))
		for i := range hs {
			require.Equal(t, hs[i].Key, got[i].Key)
			require.Equal(t, string(hs[i].Value), string(got[i].Value))
		}
	}
	for _, bad := range []string{`{}`, `[{"k": "!!", "v": ""}]`, `[{"k": "", "v": "!!"}]`, `nope`} {
		_, err := store.DecodeRawHeaders(bad)
		require.Error(t, err, bad)
	}
}
