package review3_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

type chargeCmd struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
}

// A typed participant.Handle handler fed by hand: the doc's example command,
// with a field the handler's type does not know, is served; a payload that
// does not decode into the type gets a malformed_command refusal; a panic a
// panic refusal; a permanent error the handler's code. Each refusal is a
// reply, and the next command is not held back.
func TestParticipantTypedHandler(t *testing.T) {
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, payTopic, replyTopic))
	ctx := context.Background()
	p, err := participant.New(pool, &participant.Config{Consumer: "payments", Schema: schema, SigningKey: signingKey})
	require.NoError(t, err)
	var runs atomic.Int64
	require.NoError(t, participant.Handle(p, "pay.charge", func(_ context.Context, _ pgx.Tx, c participant.Call[chargeCmd]) (map[string]string, error) {
		runs.Add(1)
		switch c.Command.OrderID {
		case "panic":
			panic("boom")
		case "declined":
			return nil, steps.Permanent(steps.WithCode("card_declined", errors.New("declined")))
		}
		return map[string]string{"charge_id": "ch_" + c.Command.OrderID, "key": c.Key.String()}, nil
	}))
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: "payments." + payTopic, Topic: payTopic,
		StartOffset: kafka.FirstOffset, MaxWait: 50 * time.Millisecond, CommitInterval: 0})
	cons, err := p.Inbox().NewConsumer(reader, &inbox.ConsumerConfig{Handlers: p.Handlers()})
	require.NoError(t, err)
	require.NoError(t, cons.Start(ctx))
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = cons.Stop(sctx)
		_ = reader.Close()
		_ = r.Stop(sctx)
		_ = w.Close()
	})
	prod := producer(t, kc)
	replies := collect(t, kc, replyTopic)

	cases := []struct {
		value    string
		ok       bool
		code     string
		resultIn string
	}{
		{`{"order_id":"o-42","amount_cents":4000,"currency":"EUR"}`, true, "", "ch_o-42"},
		{`{"order_id":42}`, false, participant.CodeMalformedCommand, ""},
		{`not json`, false, participant.CodeMalformedCommand, ""},
		{`{"order_id":"panic"}`, false, participant.CodePanic, ""},
		{`{"order_id":"declined"}`, false, "card_declined", ""},
		{`{"order_id":"o-43"}`, true, "", "ch_o-43"},
	}
	for _, c := range cases {
		s := newID()
		key := s + "/charge/forward/0"
		send(t, prod, payTopic, s, command("pay.charge", s, key, wire.Forward, []byte(c.value)), []byte(c.value))
		eventually(t, 15*time.Second, func() bool { return len(replies.with(wire.HeaderStepKey, key)) > 0 }, "a reply to "+c.value)
		rep, err := wire.DecodeReply(replies.with(wire.HeaderStepKey, key)[0].Value)
		require.NoError(t, err)
		require.Equal(t, c.ok, rep.OK, c.value)
		require.Equal(t, c.code, rep.Code, c.value)
		if c.ok {
			require.Contains(t, string(rep.Result), c.resultIn)
			require.Contains(t, string(rep.Result), key, "the handler's step key is the one received")
		}
	}
	require.EqualValues(t, 4, runs.Load(), "the handler ran for the four commands that decoded, once each")
}
