package rabbitbus_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
	"github.com/sagaflow/sagaflow/wire"
)

// publishErrors returns each message's *relay.PublishError (nil when
// confirmed) from a WriteMessages result.
func publishErrors(t *testing.T, err error, n int) []*relay.PublishError {
	t.Helper()
	out := make([]*relay.PublishError, n)
	if err == nil {
		return out
	}
	var werrs kafka.WriteErrors
	require.ErrorAs(t, err, &werrs, "WriteMessages reports per message")
	require.Len(t, werrs, n)
	for i, e := range werrs {
		if e == nil {
			continue
		}
		var pe *relay.PublishError
		require.ErrorAs(t, e, &pe, "message %d: %v", i, e)
		out[i] = pe
	}
	return out
}

func TestWriterReaderRoundTripKeepsKeyHeadersAndBytes(t *testing.T) {
	t.Parallel()
	e := setup(t, 3)
	topic, group := e.name("orders"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	w := e.writer(t)

	bin := []byte{0, 0xff, 0xfe, 'x', 0}
	msgs := []kafka.Message{
		{Topic: topic, Key: []byte("k1"), Value: []byte(`{"n":1}`), Headers: []kafka.Header{
			{Key: wire.HeaderMessageID, Value: []byte("id-1")}, {Key: "traceparent", Value: []byte("00-abc")},
			{Key: "multi", Value: []byte("a")}, {Key: "multi", Value: []byte("b")}, {Key: "bin", Value: bin},
			{Key: "empty", Value: nil},
		}},
		{Topic: topic, Key: nil, Value: bin, Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte("id-2")}}},
		{Topic: topic, Key: []byte{}, Value: nil, Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte("id-3")}}},
	}
	require.NoError(t, w.WriteMessages(e.ctx, msgs...))

	r := e.reader(t, group, []string{topic}, nil)
	got := map[string]kafka.Message{}
	for range msgs {
		m := fetch(t, r, 10*time.Second)
		id, _ := header(m, wire.HeaderMessageID)
		got[id] = m
		require.NoError(t, r.CommitMessages(e.ctx, m))
	}
	m1 := got["id-1"]
	require.Equal(t, topic, m1.Topic)
	require.Equal(t, rabbitbus.Partition([]byte("k1"), 3), m1.Partition, "the partition is the key's")
	require.Equal(t, []byte("k1"), m1.Key)
	require.Equal(t, []byte(`{"n":1}`), m1.Value)
	require.WithinDuration(t, time.Now(), m1.Time, time.Minute)
	require.Equal(t, []kafka.Header{
		{Key: "bin", Value: bin}, {Key: "empty", Value: []byte{}}, {Key: "multi", Value: []byte("a")},
		{Key: "multi", Value: []byte("b")}, {Key: wire.HeaderMessageID, Value: []byte("id-1")},
		{Key: "traceparent", Value: []byte("00-abc")},
	}, m1.Headers, "headers sorted by name, repeated names in order, bytes as they were, the key header not shown")

	require.Nil(t, got["id-2"].Key, "no key stays no key")
	require.Equal(t, bin, got["id-2"].Value)
	require.NotNil(t, got["id-3"].Key, "an empty key stays an empty key")
	require.Empty(t, got["id-3"].Key)
	require.Empty(t, got["id-3"].Value)
	require.Equal(t, got["id-2"].Partition, got["id-3"].Partition, "keyless messages share the empty key's partition")

	// Committed twice: refused, as it names nothing pending.
	require.Error(t, r.CommitMessages(e.ctx, m1))
}

func TestWriterReportsAnUnroutableMessageAsARetryNotASilentDrop(t *testing.T) {
	t.Parallel()
	e := setup(t, 2)
	bound, unbound, group := e.name("bound"), e.name("nobody"), e.name("g")
	e.setupGroups(t, []string{bound}, group)
	w := e.writer(t)

	msgs := []kafka.Message{
		{Topic: bound, Key: []byte("a"), Value: []byte("1")},
		{Topic: unbound, Key: []byte("a"), Value: []byte("lost?")},
		{Topic: bound, Key: []byte("b"), Value: []byte("2")},
		{Topic: unbound, Key: []byte("b"), Value: []byte("lost?")},
		{Topic: bound, Key: []byte("c"), Value: []byte("3")},
	}
	pes := publishErrors(t, w.WriteMessages(e.ctx, msgs...), len(msgs))
	for i, pe := range pes {
		if msgs[i].Topic == bound {
			require.Nil(t, pe, "message %d was routed and confirmed", i)
			continue
		}
		require.NotNil(t, pe, "message %d had no queue: reported", i)
		require.False(t, pe.Permanent, "a queue may be bound later: retried")
		require.False(t, pe.Outage)
		require.Contains(t, pe.Error(), "unroutable")
		require.Contains(t, pe.Error(), unbound)
	}

	// The channel is still good: the next write works.
	require.NoError(t, w.WriteMessages(e.ctx, kafka.Message{Topic: bound, Value: []byte("4")}))
	r := e.reader(t, group, []string{bound}, nil)
	var vals []string
	for range 4 {
		m := fetch(t, r, 10*time.Second)
		vals = append(vals, string(m.Value))
		require.NoError(t, r.CommitMessages(e.ctx, m))
	}
	require.ElementsMatch(t, []string{"1", "2", "3", "4"}, vals)
}

func TestWriterRefusesWhatItCannotCarryForGood(t *testing.T) {
	t.Parallel()
	e := setup(t, 1)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	w, err := rabbitbus.NewWriter(e.dial, &rabbitbus.WriterOpts{Topology: e.topo, MaxMessageBytes: 64 << 10})
	require.NoError(t, err)
	defer w.Close()

	long := strings.Repeat("h", 256)
	msgs := []kafka.Message{
		{Topic: topic, Value: []byte("ok-1")},
		{Topic: "bad topic*", Value: []byte("x")},
		{Topic: topic, Value: bytes.Repeat([]byte("v"), 65<<10)},
		{Topic: topic, Value: []byte("x"), Headers: []kafka.Header{{Key: long, Value: []byte("v")}}},
		{Topic: topic, Value: []byte("x"), Headers: []kafka.Header{{Key: rabbitbus.KeyHeader, Value: []byte("forged")}}},
		// Fits MaxMessageBytes but not a frame (128 kB by default): the
		// headers cannot be split over frames.
		{Topic: topic, Value: []byte("x"), Headers: []kafka.Header{{Key: "big", Value: bytes.Repeat([]byte("b"), 60<<10)},
			{Key: "big2", Value: bytes.Repeat([]byte("b"), 3<<10)}}},
		{Topic: topic, Value: []byte("ok-2"), Headers: []kafka.Header{
			{Key: wire.HeaderMessageID, Value: []byte(strings.Repeat("i", 300))}, // too long for the message-id property: header only
			{Key: "ten-kB", Value: bytes.Repeat([]byte{0, 0xff}, 5<<10)},
		}},
	}
	pes := publishErrors(t, w.WriteMessages(e.ctx, msgs...), len(msgs))
	require.Nil(t, pes[0])
	require.True(t, pes[1].Permanent)
	require.Equal(t, relay.CodeInvalidTopic, pes[1].Code)
	require.True(t, pes[2].Permanent)
	require.Equal(t, relay.CodeTooLarge, pes[2].Code)
	require.Contains(t, pes[2].Error(), "MaxMessageBytes")
	require.True(t, pes[3].Permanent)
	require.Equal(t, relay.CodeRejected, pes[3].Code)
	require.Contains(t, pes[3].Error(), "header name")
	require.True(t, pes[4].Permanent)
	require.Contains(t, pes[4].Error(), "reserved")
	if pes[5] != nil {
		// 63 kB of headers fit a 128 kB frame: this only checks that a
		// frame-sized refusal, if any, is permanent.
		require.True(t, pes[5].Permanent)
	}
	require.Nil(t, pes[6])

	r := e.reader(t, group, []string{topic}, nil)
	var vals []string
	for range 2 + boolInt(pes[5] == nil) {
		m := fetch(t, r, 10*time.Second)
		vals = append(vals, string(m.Value))
		if string(m.Value) == "ok-2" {
			id, _ := header(m, wire.HeaderMessageID)
			require.Len(t, id, 300)
			tk, _ := header(m, "ten-kB")
			require.Equal(t, bytes.Repeat([]byte{0, 0xff}, 5<<10), []byte(tk))
		}
		require.NoError(t, r.CommitMessages(e.ctx, m))
	}
	require.Contains(t, vals, "ok-1")
	require.Contains(t, vals, "ok-2")
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestWriterHeadersLargerThanAFrameAreTooLarge(t *testing.T) {
	t.Parallel()
	e := setup(t, 1)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	w := e.writer(t)
	msgs := []kafka.Message{
		{Topic: topic, Value: []byte("before")},
		{Topic: topic, Value: []byte("x"), Headers: []kafka.Header{{Key: "big", Value: bytes.Repeat([]byte("b"), 200<<10)}}},
		{Topic: topic, Value: []byte("after")},
	}
	pes := publishErrors(t, w.WriteMessages(e.ctx, msgs...), len(msgs))
	require.Nil(t, pes[0])
	require.NotNil(t, pes[1])
	require.True(t, pes[1].Permanent, "%v", pes[1])
	require.Equal(t, relay.CodeTooLarge, pes[1].Code)
	require.Nil(t, pes[2], "the connection survived: nothing oversized was sent")
}

func TestWriterBrokerNackIsARetry(t *testing.T) {
	t.Parallel()
	e := setup(t, 1)
	topic, group := e.name("t"), e.name("g")
	e.track(group, topic)
	require.NoError(t, rabbitbus.Setup(e.ctx, e.admin, []string{topic},
		&rabbitbus.SetupOpts{Topology: e.topo, Groups: []string{group}, MaxLength: 2}))
	w := e.writer(t)
	// A quorum queue enforces its length bound a little late (the limit is
	// checked against what the queue had committed): send one message at a
	// time until the queue refuses one.
	confirmed := map[string]bool{}
	var nack *relay.PublishError
	for i := 0; nack == nil && i < 50; i++ {
		v := fmt.Sprintf("%d", i)
		pe := publishErrors(t, w.WriteMessages(e.ctx, kafka.Message{Topic: topic, Value: []byte(v)}), 1)[0]
		if pe == nil {
			confirmed[v] = true
			continue
		}
		nack = pe
	}
	require.NotNil(t, nack, "the queue is full (reject-publish): refused, not dropped")
	require.False(t, nack.Permanent)
	require.False(t, nack.Outage)
	require.Contains(t, nack.Error(), "nack")
	require.GreaterOrEqual(t, len(confirmed), 2)

	// Every message the broker confirmed is in the queue.
	r := e.reader(t, group, []string{topic}, &rabbitbus.ReaderOpts{MaxLength: 2})
	for len(confirmed) > 0 {
		m := fetch(t, r, 10*time.Second)
		require.True(t, confirmed[string(m.Value)], "only confirmed messages are queued: %q", m.Value)
		delete(confirmed, string(m.Value))
		require.NoError(t, r.CommitMessages(e.ctx, m))
	}
}

func TestWriterDialFailureIsAnOutage(t *testing.T) {
	t.Parallel()
	w, err := rabbitbus.NewWriter(rabbitbus.Dial("amqp://guest:guest@127.0.0.1:1/"), nil)
	require.NoError(t, err)
	defer w.Close()
	pes := publishErrors(t, w.WriteMessages(context.Background(), kafka.Message{Topic: "t", Value: []byte("x")}), 1)
	require.True(t, pes[0].Outage, "%v", pes[0])
}

func TestWriterReconnectsAfterItsConnectionIsCut(t *testing.T) {
	t.Parallel()
	e := setup(t, 1)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	p := newProxy(t, brokerAddr(t, e.url))
	w, err := rabbitbus.NewWriter(rabbitbus.Dial(p.url(e.url)), &rabbitbus.WriterOpts{Topology: e.topo})
	require.NoError(t, err)
	defer w.Close()
	require.NoError(t, w.WriteMessages(e.ctx, kafka.Message{Topic: topic, Value: []byte("1")}))

	p.cut() // every connection through the proxy is closed
	p.refuse(true)
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
	err = w.WriteMessages(ctx, kafka.Message{Topic: topic, Value: []byte("2")})
	cancel()
	pes := publishErrors(t, err, 1)
	require.NotNil(t, pes[0])
	require.True(t, pes[0].Outage, "a cut connection or a refused dial is an outage: %v", pes[0])

	p.refuse(false)
	waitFor(t, 10*time.Second, "the writer to reconnect", func() bool {
		return w.WriteMessages(e.ctx, kafka.Message{Topic: topic, Value: []byte("2")}) == nil
	})
	r := e.reader(t, group, []string{topic}, nil)
	seen := map[string]bool{}
	for len(seen) < 2 {
		m := fetch(t, r, 10*time.Second)
		seen[string(m.Value)] = true
		require.NoError(t, r.CommitMessages(e.ctx, m))
	}
}
