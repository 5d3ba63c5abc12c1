package natsbus_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/natsbus"
	"github.com/sagaflow/sagaflow/wire"
)

// server starts a throwaway server and connects to it.
func server(t testing.TB) (*natstest.Server, jetstream.JetStream) {
	t.Helper()
	srv := natstest.Start(t)
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(2*time.Second))
	require.NoError(t, err)
	return srv, js
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// publishErrs returns the per-message errors of a write, as the relay
// reads them.
func publishErrs(t *testing.T, err error, n int) []*relay.PublishError {
	t.Helper()
	var werrs kafka.WriteErrors
	require.ErrorAs(t, err, &werrs)
	require.Len(t, werrs, n)
	out := make([]*relay.PublishError, n)
	for i, e := range werrs {
		if e != nil {
			require.ErrorAs(t, e, &out[i], "entry %d", i)
		}
	}
	return out
}

func TestWriterCarriesKeyHeadersAndIDAndPartitionsByKey(t *testing.T) {
	t.Parallel()
	_, js := server(t)
	ctx := ctxT(t)
	const topic = "orders.events"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 4}))
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	m := kafka.Message{Topic: topic, Key: []byte("order-42"), Value: []byte("body\x00\xff"), Headers: []kafka.Header{
		{Key: wire.HeaderMessageID, Value: []byte("m-1")}, {Key: wire.HeaderType, Value: []byte("OrderPaid")},
		{Key: "traceparent", Value: []byte("00-abc-def-01")}, {Key: "x-bytes", Value: []byte("nul\x00 and \xff")}}}
	// The same message three times: the stream keeps it once (Nats-Msg-Id).
	require.NoError(t, w.WriteMessages(ctx, m, m))
	require.NoError(t, w.WriteMessages(ctx, m))
	info, err := js.Stream(ctx, natsbus.StreamName(topic))
	require.NoError(t, err)
	require.Equal(t, uint64(1), info.CachedInfo().State.Msgs, "deduplicated by the message id")

	r, err := natsbus.NewReader(js, "g", []string{topic}, &natsbus.ReaderOpts{AckWait: time.Second, PullWait: 200 * time.Millisecond})
	require.NoError(t, err)
	defer r.Close()
	got, err := r.FetchMessage(ctx)
	require.NoError(t, err)
	require.Equal(t, topic, got.Topic)
	require.Equal(t, wire.Partition([]byte("order-42"), 4), got.Partition, "the partition Kafka's Java client picks")
	require.Equal(t, int64(1), got.Offset, "the stream sequence")
	require.Equal(t, int64(2), got.HighWaterMark, "nothing else waits on the partition")
	require.Equal(t, []byte("order-42"), got.Key)
	require.Equal(t, m.Value, got.Value)
	require.WithinDuration(t, time.Now(), got.Time, time.Minute)
	require.ElementsMatch(t, m.Headers, got.Headers, "headers byte for byte, without the transport's own")
	require.NoError(t, r.CommitMessages(ctx, got))
	require.ErrorContains(t, r.CommitMessages(ctx, got), "not a message this reader holds")
	require.NoError(t, r.Close())
	_, err = r.FetchMessage(ctx)
	require.ErrorIs(t, err, natsbus.ErrClosed)
}

func TestWriterSaysWhatEachFailureMeans(t *testing.T) {
	t.Parallel()
	srv, js := server(t)
	ctx := ctxT(t)
	require.NoError(t, natsbus.Setup(ctx, js, []string{"small"}, &natsbus.SetupOpts{MaxMsgSize: 1000}))
	w, err := natsbus.NewWriter(js, &natsbus.WriterOpts{MetadataTTL: 50 * time.Millisecond})
	require.NoError(t, err)
	ok := kafka.Message{Topic: "small", Value: []byte("fine")}
	err = w.WriteMessages(ctx,
		kafka.Message{Topic: "nostream", Value: []byte("x")},
		kafka.Message{Topic: "small", Value: make([]byte, 2000)},
		kafka.Message{Topic: "small", Value: make([]byte, 2<<20)},
		kafka.Message{Topic: "bad..topic"},
		kafka.Message{Topic: "small", Headers: []kafka.Header{{Key: "x", Value: []byte("two\r\nlines")}}},
		kafka.Message{Topic: "small", Headers: []kafka.Header{{Key: "Nats-Expected-Stream", Value: []byte("other")}}},
		kafka.Message{Topic: "small", Headers: []kafka.Header{{Key: "bad name", Value: []byte("v")}}},
		kafka.Message{Topic: "small", Key: []byte(" padded")},
		ok,
	)
	pe := publishErrs(t, err, 9)
	require.False(t, pe[0].Permanent || pe[0].Outage, "no stream: retried, spending an attempt")
	require.ErrorContains(t, pe[0], "no stream sagaflow_nostream for topic nostream")
	for i, code := range map[int]string{1: relay.CodeTooLarge, 2: relay.CodeTooLarge, 3: relay.CodeInvalidTopic,
		4: relay.CodeMalformedHeaders, 5: relay.CodeMalformedHeaders, 6: relay.CodeMalformedHeaders, 7: relay.CodeMalformedHeaders} {
		require.True(t, pe[i].Permanent, "entry %d: %v", i, pe[i])
		require.Equal(t, code, pe[i].Code, "entry %d: %v", i, pe[i])
	}
	require.Nil(t, pe[8], "the good message went through")

	// A stream created later is found once the writer's metadata expires.
	require.NoError(t, natsbus.Setup(ctx, js, []string{"nostream"}, nil))
	time.Sleep(60 * time.Millisecond)
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Topic: "nostream", Value: []byte("x")}))

	// The server down: an outage, for every message.
	srv.Kill()
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	err = w.WriteMessages(short, ok, ok)
	for i, e := range publishErrs(t, err, 2) {
		require.True(t, e.Outage, "entry %d: %v", i, e)
	}
	require.NoError(t, w.Close())
	require.ErrorIs(t, w.WriteMessages(ctx, ok), natsbus.ErrClosed)
}

func TestSetupIsIdempotentAndKeepsPartitions(t *testing.T) {
	t.Parallel()
	_, js := server(t)
	ctx := ctxT(t)
	opts := &natsbus.SetupOpts{Partitions: 3, Groups: []string{"g.1"}}
	require.NoError(t, natsbus.Setup(ctx, js, []string{"t1", "a.b"}, opts))
	require.NoError(t, natsbus.Setup(ctx, js, []string{"t1", "a.b"}, opts))
	c, err := js.Consumer(ctx, natsbus.StreamName("a.b"), natsbus.ConsumerName("g.1", 2))
	require.NoError(t, err)
	cfg := c.CachedInfo().Config
	require.Equal(t, "a.b.2", cfg.FilterSubject)
	require.Equal(t, 1, cfg.MaxAckPending)
	require.Equal(t, -1, cfg.MaxDeliver)
	require.Equal(t, jetstream.AckExplicitPolicy, cfg.AckPolicy)
	err = natsbus.Setup(ctx, js, []string{"t1"}, &natsbus.SetupOpts{Partitions: 4})
	require.ErrorContains(t, err, "changing a topic's partitions moves keys")
	for _, bad := range []string{"", "a..b", ".a", "a.", "a b", "a.*", "a.>"} {
		require.ErrorIs(t, natsbus.Setup(ctx, js, []string{bad}, nil), natsbus.ErrInvalidConfig, "topic %q", bad)
	}
	_, err = natsbus.NewReader(js, "", []string{"t1"}, nil)
	require.ErrorIs(t, err, natsbus.ErrInvalidConfig)
}

func TestNamesAreDistinct(t *testing.T) {
	t.Parallel()
	seen := map[string]string{}
	for _, topic := range []string{"a.b", "a_b", "a-b", "a_2eb", "A.b", strings.Repeat("x", 300), strings.Repeat("x", 301)} {
		name := natsbus.StreamName(topic)
		require.LessOrEqual(t, len(name), 200)
		require.NotContains(t, name, ".")
		prev, dup := seen[name]
		require.False(t, dup, "%q and %q share stream %s", prev, topic, name)
		seen[name] = topic
	}
	require.NotEqual(t, natsbus.ConsumerName("g_p1", 2), natsbus.ConsumerName("g", 12))
	require.Equal(t, "orders.events.3", natsbus.Subject("orders.events", 3))
}

// The relay over NATS parks what the stream refuses for good, with its
// code, and publishes the rest.
func TestRelayParksWhatTheStreamRefuses(t *testing.T) {
	t.Parallel()
	_, js := server(t)
	ctx := ctxT(t)
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	require.NoError(t, natsbus.Setup(ctx, js, []string{"small"}, &natsbus.SetupOpts{MaxMsgSize: 1000}))
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := ob.InsertTx(ctx, tx, outbox.Message{Topic: "small", Key: "k", Type: "t", Payload: make([]byte, 5000)}); err != nil {
			return err
		}
		return ob.InsertTx(ctx, tx, outbox.Message{Topic: "small", Key: "k", Type: "t", Payload: []byte("ok")})
	}))
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	require.NoError(t, err)
	published, failed, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, published)
	require.Equal(t, 1, failed)
	var status, lastErr string
	require.NoError(t, pool.QueryRow(ctx, "SELECT status, last_error FROM "+pgx.Identifier{schema, "outbox"}.Sanitize()+
		" WHERE length(payload) = 5000").Scan(&status, &lastErr))
	require.Equal(t, "dead", status)
	require.Contains(t, lastErr, relay.CodeTooLarge)
	require.Contains(t, lastErr, "message size exceeds maximum")
}

// A batch committed at once, with a message given twice and one this reader
// never returned among its messages: the two bad ones are reported by their
// positions, and every good one is acknowledged: each partition's next
// message comes, and nothing comes again after AckWait.
func TestCommitOfABatchAcknowledgesEachGoodMessage(t *testing.T) {
	t.Parallel()
	_, js := server(t)
	ctx := ctxT(t)
	const topic, parts = "orders.batch", 4
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: parts}))
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	// Two messages on each partition.
	perPart := map[int]int{}
	var ms []kafka.Message
	for i := 0; len(ms) < 2*parts; i++ {
		key := []byte("order-" + strconv.Itoa(i))
		p := wire.Partition(key, parts)
		if perPart[p] == 2 {
			continue
		}
		perPart[p]++
		ms = append(ms, kafka.Message{Topic: topic, Key: key, Value: []byte("v"),
			Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte("m-" + strconv.Itoa(i))}}})
	}
	require.NoError(t, w.WriteMessages(ctx, ms...))

	const ackWait = 2 * time.Second
	r, err := natsbus.NewReader(js, "g", []string{topic}, &natsbus.ReaderOpts{AckWait: ackWait, PullWait: 200 * time.Millisecond})
	require.NoError(t, err)
	defer r.Close()
	fetch := func() []kafka.Message {
		var got []kafka.Message
		for range parts {
			m, err := r.FetchMessage(ctx)
			require.NoError(t, err)
			got = append(got, m)
		}
		return got
	}
	first := fetch()
	forged := first[0]
	forged.Offset = 999_999
	err = r.CommitMessages(ctx, first[0], first[1], first[0], forged, first[2], first[3])
	require.Error(t, err)
	require.Equal(t, 2, strings.Count(err.Error(), "not a message this reader holds"), "%v", err)
	require.Contains(t, err.Error(), "/999999: not a message", "the forged one named by its position")

	second := fetch() // each partition's next: the acknowledgements landed
	seen := map[int]bool{}
	for _, m := range second {
		seen[m.Partition] = true
		for _, f := range first {
			require.NotEqual(t, f.Offset, m.Offset, "partition %d gave its first message again: its acknowledgement was lost", m.Partition)
		}
	}
	require.Len(t, seen, parts)
	require.NoError(t, r.CommitMessages(ctx, second...))

	quiet, cancel := context.WithTimeout(ctx, ackWait+time.Second)
	defer cancel()
	m, err := r.FetchMessage(quiet)
	require.Error(t, err, "a message came again after AckWait: %s/%d/%d", m.Topic, m.Partition, m.Offset)
}

// A member of the group dies (its connection closed, nothing given back)
// between the acknowledgements of one batch: the acknowledged messages
// never come again, each other one comes again after AckWait to another
// member, and every partition then goes on with its next message, in
// order. First with half the batch acknowledged; then with the connection
// closed while the whole batch's acknowledgements are in flight, where any
// of them may or may not have landed. Nothing is lost.
func TestReaderDiesBetweenTheAcknowledgementsOfABatch(t *testing.T) {
	t.Parallel()
	srv, js := server(t)
	ctx := ctxT(t)
	const topic, parts, perPart = "orders.dies", 8, 4
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: parts}))
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	order := map[int][]string{} // each partition's message ids, as written
	var ms []kafka.Message
	for i := 0; len(ms) < perPart*parts; i++ {
		key := []byte("order-" + strconv.Itoa(i))
		p := wire.Partition(key, parts)
		if len(order[p]) == perPart {
			continue
		}
		id := "m-" + strconv.Itoa(i)
		order[p] = append(order[p], id)
		ms = append(ms, kafka.Message{Topic: topic, Key: key, Value: []byte(id),
			Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte(id)}}})
	}
	for _, m := range ms { // one at a time: each partition's order is the written one
		require.NoError(t, w.WriteMessages(ctx, m))
	}
	pos := func(p int, m kafka.Message) int {
		i := slices.Index(order[p], string(m.Value))
		require.GreaterOrEqual(t, i, 0, "partition %d gave %q, not one of its messages", p, m.Value)
		return i
	}

	const ackWait = time.Second
	member := func() (*natsbus.Reader, *nats.Conn) {
		nc, err := nats.Connect(srv.URL())
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		mjs, err := jetstream.New(nc)
		require.NoError(t, err)
		r, err := natsbus.NewReader(mjs, "g", []string{topic}, &natsbus.ReaderOpts{AckWait: ackWait, PullWait: 200 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() }) // a dead member's goroutines stop with the test
		return r, nc
	}
	// batch fetches one message of each partition, as positions in order.
	batch := func(r *natsbus.Reader) (map[int]int, []kafka.Message) {
		at := map[int]int{}
		var got []kafka.Message
		for len(at) < parts {
			m, err := r.FetchMessage(ctx)
			require.NoError(t, err)
			_, again := at[m.Partition]
			require.False(t, again, "partition %d gave a second message while its first was held", m.Partition)
			at[m.Partition] = pos(m.Partition, m)
			got = append(got, m)
		}
		return at, got
	}

	a, anc := member()
	first, got := batch(a)
	var half []kafka.Message
	for _, m := range got {
		require.Zero(t, first[m.Partition], "partition %d did not start with its first message", m.Partition)
		if m.Partition < parts/2 {
			half = append(half, m)
		}
	}
	require.NoError(t, a.CommitMessages(ctx, half...))
	anc.Close() // dies: the other half is neither acknowledged nor given back

	b, bnc := member()
	t0 := time.Now()
	second, got := batch(b)
	for p := range parts {
		want := 1 // acknowledged: the next one
		if p >= parts/2 {
			want = 0 // not: the same one again
		}
		require.Equal(t, want, second[p], "partition %d", p)
	}
	require.GreaterOrEqual(t, time.Since(t0), ackWait/2, "the unacknowledged half came before AckWait: something gave it back")

	// b dies with the whole batch's acknowledgements in flight.
	done := make(chan error, 1)
	go func() { done <- b.CommitMessages(ctx, got...) }()
	time.Sleep(300 * time.Microsecond) // some acknowledgements go out, if not all
	bnc.Close()
	t.Logf("the commit that the closed connection cut: %v", <-done)

	c, _ := member()
	landed := 0
	third, got := batch(c)
	for p := range parts {
		switch third[p] {
		case second[p] + 1:
			landed++
		case second[p]:
		default:
			require.Fail(t, "out of order", "partition %d: after position %d came %d", p, second[p], third[p])
		}
	}
	require.NoError(t, c.CommitMessages(ctx, got...))
	second = third
	t.Logf("acknowledgements that landed before the connection closed: %d of %d", landed, parts)
	// The rest, to the end of each partition: nothing lost, nothing again.
	left := 0
	for p := range parts {
		left += perPart - 1 - second[p]
	}
	for range left {
		m, err := c.FetchMessage(ctx)
		require.NoError(t, err)
		p := m.Partition
		require.Equal(t, second[p]+1, pos(p, m), "partition %d out of order", p)
		second[p]++
		require.NoError(t, c.CommitMessages(ctx, m))
	}
	for p := range parts {
		require.Equal(t, perPart-1, second[p], "partition %d did not reach its last message", p)
	}
	quiet, cancel := context.WithTimeout(ctx, ackWait+time.Second)
	defer cancel()
	m, err := c.FetchMessage(quiet)
	require.Error(t, err, "a message came again after every one was acknowledged: %s/%d/%q", m.Topic, m.Partition, m.Value)
}
