package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

// TestRequeuedDeadLetterIsPublishedAsReceived sends messages with a raw
// producer, as a foreign service would, dead-letters them as a consumer
// does, requeues them, and checks that the relay publishes each one again
// byte for byte, under its original message id, so that only the consumer
// that dead-lettered it processes it again.
func TestRequeuedDeadLetterIsPublishedAsReceived(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.kc.Addrs()...))
	require.NoError(t, err)
	defer cl.Close()
	withID := uuid.NewString()
	originals := []*kgo.Record{
		{Topic: topicBroken, Key: []byte("order-1"), Value: []byte{0, 0xff, 'x'}, Headers: []kgo.RecordHeader{
			{Key: store.HeaderMessageID, Value: []byte(withID)},
			{Key: store.HeaderType, Value: []byte("order.created")},
			{Key: "dup", Value: []byte("1")}, {Key: "dup", Value: []byte("2")},
			{Key: "bin\x00", Value: []byte{0xfe, 0}},
		}},
		// No message id, no key: consumers know it by its position.
		{Topic: topicBroken, Value: []byte("anonymous"), Headers: []kgo.RecordHeader{{Key: store.HeaderType, Value: []byte("x")}}},
	}
	require.NoError(t, cl.ProduceSync(e.ctx, originals...).FirstErr())

	received := e.read(t, topicBroken)
	require.Len(t, received, 2)
	// Consumer "billing" dead-letters both; "shipping" processed both.
	billing, err := inbox.New(e.pool, &inbox.Config{Consumer: "billing", Schema: e.schema, Logger: quiet})
	require.NoError(t, err)
	shipping, err := inbox.New(e.pool, &inbox.Config{Consumer: "shipping", Schema: e.schema, Logger: quiet})
	require.NoError(t, err)
	noop := func(context.Context, pgx.Tx, inbox.Message) error { return nil }
	var letters []int64
	for _, m := range received {
		msg := inbox.FromKafka(m)
		ok, err := shipping.Process(e.ctx, msg, noop)
		require.NoError(t, err)
		require.True(t, ok)
		_, err = billing.DeadLetter(e.ctx, msg, "refused")
		require.NoError(t, err)
		// The raw bytes, as a consumer that keeps them stores them.
		raw := make([]store.RawHeader, len(m.Headers))
		for i, h := range m.Headers {
			raw[i] = store.RawHeader{Key: []byte(h.Key), Value: h.Value}
		}
		_, err = e.pool.Exec(e.ctx, `UPDATE `+pgx.Identifier{e.schema}.Sanitize()+`.dead_letters SET raw_headers = $1::jsonb
			WHERE consumer = 'billing' AND kafka_offset = $2`, store.EncodeRawHeaders(raw), m.Offset)
		require.NoError(t, err)
		var id int64
		require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT id FROM `+pgx.Identifier{e.schema}.Sanitize()+`.dead_letters
			WHERE consumer = 'billing' AND kafka_offset = $1`, m.Offset).Scan(&id))
		letters = append(letters, id)
	}

	for _, id := range letters {
		require.NoError(t, pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
			_, err := e.st.RequeueDeadLetter(e.ctx, tx, id, uuid.Must(uuid.NewV7()))
			return err
		}))
	}
	r := e.relay(t, e.writer(t), relay.Config{})
	published, failed := drain(t, e.ctx, r)
	require.Equal(t, 2, published)
	require.Zero(t, failed)

	all := e.read(t, topicBroken)
	require.Len(t, all, 4)
	for i, again := range all[2:] {
		orig := received[i]
		require.Equal(t, orig.Value, again.Value)
		require.Equal(t, orig.Key, again.Key)
		require.Equal(t, orig.Headers, again.Headers[:len(orig.Headers)], "the original headers, in order")
		if i == 0 {
			require.Len(t, again.Headers, len(orig.Headers), "nothing added")
			id, _ := header(again, store.HeaderMessageID)
			require.Equal(t, withID, id, "the original message id")
		} else {
			require.Len(t, again.Headers, len(orig.Headers)+1)
			id, _ := header(again, store.HeaderMessageID)
			require.Equal(t, inbox.FromKafka(orig).ID, id, "the id its position gave the original")
		}
		msg := inbox.FromKafka(again)
		require.Equal(t, inbox.FromKafka(orig).ID, msg.ID)
		ok, err := shipping.Process(e.ctx, msg, noop)
		require.NoError(t, err)
		require.False(t, ok, "a consumer that processed the original skips the copy")
		handled := false
		ok, err = billing.Process(e.ctx, msg, func(context.Context, pgx.Tx, inbox.Message) error {
			handled = true
			return nil
		})
		require.NoError(t, err)
		require.True(t, ok && handled, "the consumer that dead-lettered it processes it")
	}
}

// TestRawHeadersRowsAreBuiltExactly checks what the relay makes of a row
// that carries raw headers, and parks one whose raw headers are malformed.
func TestRawHeadersRowsAreBuiltExactly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	f := &fakeWriter{}
	r := e.relay(t, f, relay.Config{MaxMessageBytes: 4096})
	raw := []store.RawHeader{{Key: []byte("a"), Value: []byte("1")}, {Key: []byte("a"), Value: nil}}
	good := e.insert(t, topicOrders, "", 1, func(m *store.Message) {
		m.Headers = map[string]string{store.RawHeadersKey: store.EncodeRawHeaders(raw)}
	})
	malformed := e.insert(t, topicOrders, "k", 2, func(m *store.Message) {
		m.Headers = map[string]string{store.RawHeadersKey: "[{]"}
	})
	mixed := e.insert(t, topicOrders, "k", 3, func(m *store.Message) {
		m.Headers = map[string]string{store.RawHeadersKey: store.EncodeRawHeaders(raw), "traceparent": "00-x"}
	})
	big := e.insert(t, topicOrders, "k", 4, func(m *store.Message) {
		m.Headers = map[string]string{store.RawHeadersKey: store.EncodeRawHeaders(
			[]store.RawHeader{{Key: []byte("h"), Value: []byte(strings.Repeat("v", 5000))}})}
	})
	p, n, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, p)
	require.Equal(t, 3, n)
	got := f.delivered(topicOrders)
	require.Len(t, got, 1)
	require.Nil(t, got[0].Key, "an empty aggregateid is no key")
	require.Equal(t, []kafka.Header{{Key: "a", Value: []byte("1")}, {Key: "a", Value: []byte{}}}, got[0].Headers)
	require.Equal(t, store.OutboxPublished, e.row(t, good).Status)
	for id, want := range map[uuid.UUID]string{
		malformed: relay.CodeMalformedHeaders + ": " + store.RawHeadersKey + ": raw headers are not a JSON array",
		mixed:     relay.CodeMalformedHeaders + fmt.Sprintf(": %s must be the only entry of the headers, not one of 2", store.RawHeadersKey),
		big:       relay.CodeTooLarge + ": message is ",
	} {
		row := e.row(t, id)
		require.Equal(t, store.OutboxDead, row.Status)
		require.True(t, strings.HasPrefix(row.LastError, want), "%q, want prefix %q", row.LastError, want)
	}
}
