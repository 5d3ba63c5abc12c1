package review23

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/natsbus"
	"github.com/sagaflow/sagaflow/wire"
)

// natsConnect opens a connection of its own to srv (one per member, so a
// test can kill one member's connection), closed when the test ends.
func natsConnect(t *testing.T, srv *natstest.Server, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(srv.URL(), append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond),
		nats.Timeout(2 * time.Second)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(5*time.Second))
	require.NoError(t, err)
	return nc, js
}

// hpub publishes one message with the NATS protocol itself (HPUB on a
// plain TCP connection), so that its header block can be anything, as a
// hostile or broken producer's can; nats.go would refuse to send most of
// these.
func hpub(t *testing.T, srv *natstest.Server, subject, hdrBlock, payload string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", srv.Addr(), 5*time.Second)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	br := bufio.NewReader(c)
	_, err = br.ReadString('\n') // INFO
	require.NoError(t, err)
	_, err = fmt.Fprintf(c, "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n"+
		"HPUB %s %d %d\r\n%s%s\r\nPING\r\n", subject, len(hdrBlock), len(hdrBlock)+len(payload), hdrBlock, payload)
	require.NoError(t, err)
	for {
		l, err := br.ReadString('\n')
		require.NoError(t, err)
		require.False(t, strings.HasPrefix(l, "-ERR"), "the server refused the raw publish: %s", l)
		if l == "PONG\r\n" {
			return
		}
	}
}

func natsServer(t *testing.T) (*natstest.Server, jetstream.JetStream) {
	t.Helper()
	srv := natstest.Start(t)
	_, js := natsConnect(t, srv)
	return srv, js
}

func natsReader(t *testing.T, js jetstream.JetStream, group string, topics []string, ackWait time.Duration) *natsbus.Reader {
	t.Helper()
	r, err := natsbus.NewReader(js, group, topics, &natsbus.ReaderOpts{AckWait: ackWait,
		PullWait: 300 * time.Millisecond, AckTimeout: 5 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func natsWriter(t *testing.T, js jetstream.JetStream) *natsbus.Writer {
	t.Helper()
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func fetchWithin(t *testing.T, r interface {
	FetchMessage(context.Context) (kafka.Message, error)
}, d time.Duration) kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		m, err := r.FetchMessage(ctx)
		if err == nil {
			return m
		}
		if ctx.Err() != nil {
			t.Fatalf("no message within %v: %v", d, err)
		}
		time.Sleep(20 * time.Millisecond) // a background failure: the doc says to try again
	}
}

// fetchNone fails the test if r returns a message within d.
func fetchNone(t *testing.T, r interface {
	FetchMessage(context.Context) (kafka.Message, error)
}, d time.Duration, why string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for ctx.Err() == nil {
		m, err := r.FetchMessage(ctx)
		if err == nil {
			t.Fatalf("%s: got partition %d offset %d key %q", why, m.Partition, m.Offset, m.Key)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func streamMsgs(t *testing.T, js jetstream.JetStream, topic string) uint64 {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	s, err := js.Stream(ctx, natsbus.StreamName(topic))
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	return info.State.Msgs
}

// Commits the reader never returned, commits of another topic or of a
// partition that does not exist, a commit from the wrong member and a
// second commit of one message must all fail and acknowledge nothing: the
// held message must still be held, and come back whole when its reader
// closes. Out-of-order commits across partitions must work.
func TestNATSForgedDuplicateAndOutOfOrderCommits(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic, other = "rv.commits", "rv.other"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 2}))
	require.NoError(t, natsbus.Setup(ctx, js, []string{other}, nil))
	w := natsWriter(t, js)
	// Two keys on two different partitions, two messages each.
	var keys []string
	for i := 0; len(keys) < 2; i++ {
		k := "k" + strconv.Itoa(i)
		if len(keys) == 0 || wire.Partition([]byte(k), 2) != wire.Partition([]byte(keys[0]), 2) {
			keys = append(keys, k)
		}
	}
	var sent []kafka.Message
	for seq := range 4 {
		sent = append(sent, goodMsg(topic, keys[seq%2], seq))
	}
	require.NoError(t, w.WriteMessages(ctx, sent...))
	require.NoError(t, w.WriteMessages(ctx, goodMsg(other, "x", 99)))

	_, jsA := natsConnect(t, srv)
	_, jsB := natsConnect(t, srv)
	// An ack wait of 3 s: the test closes a, and F1 must not stall it.
	a := natsReader(t, jsA, "g", []string{topic}, 3*time.Second)
	b := natsReader(t, jsB, "g", []string{other}, 3*time.Second)
	o := fetchWithin(t, b, patience) // another member's message: a must not be able to commit it
	first := fetchWithin(t, a, patience)
	require.Equal(t, topic, first.Topic)

	forged := []struct {
		name string
		m    kafka.Message
	}{
		{"an offset the reader never returned", kafka.Message{Topic: topic, Partition: first.Partition, Offset: first.Offset + 1000}},
		{"an offset before the held one", kafka.Message{Topic: topic, Partition: first.Partition, Offset: first.Offset - 1}},
		{"a partition that does not exist", kafka.Message{Topic: topic, Partition: 7, Offset: first.Offset}},
		{"a negative partition", kafka.Message{Topic: topic, Partition: -1, Offset: first.Offset}},
		{"a topic the reader does not read", kafka.Message{Topic: "rv.nowhere", Partition: first.Partition, Offset: first.Offset}},
		{"the zero message", kafka.Message{}},
		{"a message another member holds", o},
	}
	for _, f := range forged {
		err := a.CommitMessages(ctx, f.m)
		require.Error(t, err, "a commit of %s must fail", f.name)
		t.Logf("commit of %s: %v", f.name, err)
	}

	// Out of order across partitions: the second partition's message first.
	second := fetchWithin(t, a, patience)
	if second.Partition == first.Partition {
		t.Fatalf("a partition delivered two messages at once (MaxAckPending 1): %d and %d", first.Offset, second.Offset)
	}
	require.NoError(t, a.CommitMessages(ctx, second), "a commit of a held message of the other partition")
	require.Error(t, a.CommitMessages(ctx, second), "a second commit of one message must fail")
	require.NoError(t, b.CommitMessages(ctx, o))

	// Nothing acknowledged first: close a, and another member gets it
	// back, unchanged, first on its partition.
	require.NoError(t, a.Close())
	_, jsC := natsConnect(t, srv)
	c := natsReader(t, jsC, "g", []string{topic}, 3*time.Second)
	got := map[string]int{}
	for _, m := range []kafka.Message{first, second} {
		s, _ := headerOf(m, "x-seq")
		got[s]++
	}
	var back kafka.Message
	for {
		back = fetchWithin(t, c, patience)
		if back.Partition == first.Partition {
			break
		}
		s, _ := headerOf(back, "x-seq")
		got[s]++
		require.NoError(t, c.CommitMessages(ctx, back))
	}
	require.Equal(t, first.Offset, back.Offset, "the held message comes back first on its partition: a forged commit acknowledged it")
	id1, _ := headerOf(first, wire.HeaderMessageID)
	id2, _ := headerOf(back, wire.HeaderMessageID)
	require.Equal(t, id1, id2)
	require.NoError(t, c.CommitMessages(ctx, back))
	require.Error(t, c.CommitMessages(ctx, back), "committed twice")
	require.Error(t, c.CommitMessages(ctx, first), "a message the closed reader returned, committed by another")
	// Every message is delivered in the end, none skipped.
	for len(got) < 4 {
		fctx, cancel := context.WithTimeout(ctx, patience)
		m, err := c.FetchMessage(fctx)
		cancel()
		if err != nil {
			t.Fatalf("got %v, then nothing: %v; first %d/%d second %d/%d; consumers: %s", got, err,
				first.Partition, first.Offset, second.Partition, second.Offset, consumerState(t, js, topic, "g", 2))
		}
		s, _ := headerOf(m, "x-seq")
		got[s]++
		require.NoError(t, c.CommitMessages(ctx, m))
	}
	for s, n := range got {
		require.Equal(t, 1, n, "seq %s delivered %d times", s, n)
	}
}

// Bytes PostgreSQL refuses, in every field that comes off the wire, end to
// end through an inbox consumer over JetStream: each poison message is
// dead-lettered at once (the inbox's default MaxAttempts is about an hour),
// with a reason and its raw bytes, and the good messages behind it on the
// same partition, of its key and of others, still have their effects.
func TestNATSPoisonIsParkedAndHoldsNothingBack(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.poison"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, nil)) // one partition: everything in one line
	w := natsWriter(t, js)

	// First on the partition, header blocks only a raw producer can send:
	// a line without a colon, a name that is not a token, an empty name,
	// a status line, a key of bytes PostgreSQL refuses, another protocol
	// version. None has a usable type: each must be dead-lettered, and
	// none may stall the partition.
	rawBlocks := []string{
		"NATS/1.0\r\nno-colon-line\r\nsagaflow-type: good\r\n\r\n",
		"NATS/1.0\r\nbad name: v\r\nsagaflow-key: k\r\n\r\n",
		"NATS/1.0\r\n: empty name\r\n\r\n",
		"NATS/1.0 503\r\n\r\n",
		"NATS/1.0\r\nsagaflow-key: \xff\x00\r\n\r\n",
		"XXXX/9.9\r\n\r\n",
	}
	for _, b := range rawBlocks {
		hpub(t, srv, natsbus.Subject(topic, 0), b, "raw")
	}

	big := testkit.RandomLetters(10_000)
	poison := map[string]kafka.Message{}
	var msgs []kafka.Message
	seq := 0
	good := func(key string) {
		msgs = append(msgs, goodMsg(topic, key, seq))
		seq++
	}
	bad := func(name string, edit func(m *kafka.Message)) {
		m := goodMsg(topic, "k1", -1)
		edit(&m)
		poison[name] = m
		msgs = append(msgs, m)
	}
	setHdr := func(m *kafka.Message, k, v string) {
		for i := range m.Headers {
			if m.Headers[i].Key == k {
				m.Headers[i].Value = []byte(v)
				return
			}
		}
		m.Headers = append(m.Headers, hdr(k, v))
	}
	good("k1")
	bad("key with NUL", func(m *kafka.Message) { m.Key = []byte("k1\x00nul") })
	good("k2")
	bad("key of invalid UTF-8", func(m *kafka.Message) { m.Key = []byte("k1\xff\xfe") })
	good("k1")
	bad("key of 10 kB", func(m *kafka.Message) { m.Key = []byte(big) })
	bad("header with NUL", func(m *kafka.Message) { setHdr(m, "x-h", "a\x00b") })
	good("k3")
	bad("header of invalid UTF-8", func(m *kafka.Message) { setHdr(m, "x-h", "a\xc3\x28") })
	bad("header of 10 kB", func(m *kafka.Message) { setHdr(m, "x-h", big) })
	bad("value with NUL", func(m *kafka.Message) { m.Value = []byte("v\x00") })
	good("k2")
	bad("value of invalid UTF-8", func(m *kafka.Message) { m.Value = []byte{0xff, 'v'} })
	bad("type with NUL", func(m *kafka.Message) { setHdr(m, wire.HeaderType, "good\x00") })
	bad("type of invalid UTF-8", func(m *kafka.Message) { setHdr(m, wire.HeaderType, "\xffgood") })
	bad("type repeated", func(m *kafka.Message) { m.Headers = append(m.Headers, hdr(wire.HeaderType, "good")) })
	// A good message whose id PostgreSQL could not store as it is: the
	// inbox records its hash, and it is processed.
	weird := goodMsg(topic, "k3", seq)
	setHdr(&weird, wire.HeaderMessageID, "id\x00\xff"+big)
	msgs = append(msgs, weird)
	seq++
	good("k1")
	good("k4")
	require.NoError(t, w.WriteMessages(ctx, msgs...), "a transport writer carries these bytes")
	// The weird id again, later: its copy must be skipped by the inbox.
	// (Within the stream's window the stream itself may drop it.)
	require.NoError(t, w.WriteMessages(ctx, weird))
	good("k2")
	require.NoError(t, w.WriteMessages(ctx, msgs[len(msgs)-1]))

	// nats.go reports the header blocks it cannot decode on the
	// connection's error handler; keep them out of the test's output.
	_, jsR := natsConnect(t, srv, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	r := natsReader(t, jsR, "svc", []string{topic}, 2*time.Second)
	d.consume(t, "svc", r, nil)
	wantDead := len(poison) + len(rawBlocks)
	if !waitUntil(patience, func() bool {
		return d.countEffects(t, "svc") >= seq && d.countDead(t, "svc") >= wantDead
	}) {
		d.explain(t, "svc")
		t.Fatalf("after %v: %d of %d good messages processed, %d of %d poison messages dead-lettered",
			patience, d.countEffects(t, "svc"), seq, d.countDead(t, "svc"), wantDead)
	}
	time.Sleep(300 * time.Millisecond) // room for a doubled effect or letter to show
	checkOrder(t, d.effects(t, "svc"), seq)
	dead := d.deadLetters(t, "svc")
	require.Len(t, dead, wantDead, "one dead letter per poison message")
	byValue := map[string]kafka.Message{}
	for _, m := range poison {
		id, _ := headerOf(m, wire.HeaderMessageID)
		byValue[id] = m
	}
	for _, dl := range dead {
		require.NotEmpty(t, strings.TrimSpace(dl.Reason), "a dead letter says why")
		require.Equal(t, topic, dl.Topic)
		require.NotNil(t, dl.Partition)
		require.NotNil(t, dl.Offset, "a dead letter keeps its position")
		require.NotNil(t, dl.MessageID)
		if *dl.Offset <= int64(len(rawBlocks)) { // the raw ones, first on the stream
			require.Equal(t, []byte("raw"), dl.Value)
			if *dl.Offset == 5 {
				require.Equal(t, []byte("\xff\x00"), dl.Key, "the key's raw bytes, from a raw header block")
			}
			var rawHeaders *string
			require.NoError(t, d.Pool.QueryRow(ctx, "SELECT raw_headers::text FROM "+d.Table("dead_letters")+
				" WHERE consumer = 'svc' AND kafka_offset = $1", *dl.Offset).Scan(&rawHeaders))
			t.Logf("dead (raw): offset %d key %q raw headers %v reason %.160s", *dl.Offset, dl.Key, deref(rawHeaders), dl.Reason)
			continue
		}
		m, ok := byValue[*dl.MessageID]
		require.True(t, ok, "dead letter %q is not one of the poison messages (reason %s)", *dl.MessageID, dl.Reason)
		require.Equal(t, m.Key, dl.Key, "the dead letter keeps the key's raw bytes")
		require.Equal(t, m.Value, dl.Value, "the dead letter keeps the value's raw bytes")
		t.Logf("dead: key %.20q reason %.160s", dl.Key, dl.Reason)
	}
}

// Two tenants on one server: two schemas, two groups of the same name on
// two topics whose names escape alike ("." is "_2e" in a stream name), and
// a second group fanning out from one of them. Nothing crosses.
func TestNATSTenantsOnOneServerDoNotCross(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	const tA, tB = "tenant.orders", "tenant_2eorders"
	require.NotEqual(t, natsbus.StreamName(tA), natsbus.StreamName(tB))
	require.NoError(t, natsbus.Setup(ctx, js, []string{tA, tB}, &natsbus.SetupOpts{Partitions: 2}))
	dA, dB := newDB(t), newDB(t)
	idsA := dA.insertRows(t, tA, []string{"a1", "a2", "a3"}, 0, 15)
	idsB := dB.insertRows(t, tB, []string{"b1", "b2"}, 0, 10)
	_, jsA := natsConnect(t, srv)
	_, jsB := natsConnect(t, srv)
	dA.runRelay(t, natsWriter(t, jsA))
	dB.runRelay(t, natsWriter(t, jsB))

	// The same group name in both tenants; group names that might collide
	// once escaped (ConsumerName("x", 10) against ConsumerName("x_p1", 0)).
	dA.consume(t, "billing", natsReader(t, jsA, "billing", []string{tA}, 5*time.Second), nil)
	dB.consume(t, "billing", natsReader(t, jsB, "billing", []string{tB}, 5*time.Second), nil)
	dB.consume(t, "audit", natsReader(t, jsB, "x_p1", []string{tA}, 5*time.Second), nil)
	testkit.WaitFor(t, patience, "every tenant's messages processed", func() bool {
		return dA.countEffects(t, "billing") >= 15 && dB.countEffects(t, "billing") >= 10 && dB.countEffects(t, "audit") >= 15
	})
	time.Sleep(300 * time.Millisecond)
	onlyFrom(t, dA.effects(t, "billing"), idsA, 15)
	onlyFrom(t, dB.effects(t, "billing"), idsB, 10)
	onlyFrom(t, dB.effects(t, "audit"), idsA, 15)
	require.Zero(t, dA.countDead(t, "billing")+dB.countDead(t, "billing")+dB.countDead(t, "audit"))
}

// A member killed in the middle of a message (its connection closed, no
// Reader.Close, its transaction rolled back) gives the message to another
// member after the ack wait, in its place in the key's order.
func TestNATSMemberKilledMidMessage(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.kill"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, nil))
	d.insertRows(t, topic, []string{"k0", "k1"}, 0, 20)
	d.runRelay(t, natsWriter(t, js))

	ncA, jsA := natsConnect(t, srv)
	rA, err := natsbus.NewReader(jsA, "svc", []string{topic}, &natsbus.ReaderOpts{AckWait: 2 * time.Second,
		PullWait: 300 * time.Millisecond})
	require.NoError(t, err)
	entered := make(chan struct{})
	var once sync.Once
	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "svc", Schema: d.Schema, Logger: quiet})
	require.NoError(t, err)
	h := d.handler("svc")
	cA, err := in.NewConsumer(rA, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{
		"good": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			if msg.Headers["x-seq"] == "5" {
				once.Do(func() { close(entered) })
				<-ctx.Done() // the process "dies" here: its transaction rolls back
				return ctx.Err()
			}
			return h(ctx, tx, msg)
		}}, RetryInitial: 20 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, cA.Start(context.Background()))
	testkit.Recv(t, entered, patience, "member A holding message 5")

	ncA.Close() // killed: the connection goes, nobody calls Close
	stopCtx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_ = cA.Stop(stopCtx) // the handler's context ends, its transaction rolls back
	cancel()
	closed := make(chan error, 1)
	go func() { closed <- rA.Close() }()
	testkit.Recv(t, closed, patience, "Close of a reader whose connection was killed returns")

	_, jsB := natsConnect(t, srv)
	d.consume(t, "svc", natsReader(t, jsB, "svc", []string{topic}, 2*time.Second), nil)
	testkit.WaitFor(t, patience, "member B processed everything", func() bool { return d.countEffects(t, "svc") >= 20 })
	time.Sleep(300 * time.Millisecond)
	checkOrder(t, d.effects(t, "svc"), 20)
}

// A running reader keeps what it holds alive past the ack wait: a member
// slower than AckWait does not lose its message to another member (the
// docs: AckWait is a failure detector, not a bound on handling), and its
// late commit succeeds. Then Close gives back what it holds at once.
func TestNATSSlowMemberKeepsItsMessagePastTheAckWait(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.slow"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, nil))
	w := natsWriter(t, js)
	require.NoError(t, w.WriteMessages(ctx, goodMsg(topic, "k", 0), goodMsg(topic, "k", 1), goodMsg(topic, "k", 2)))
	_, jsA := natsConnect(t, srv)
	_, jsB := natsConnect(t, srv)
	const ackWait = time.Second
	a := natsReader(t, jsA, "svc", []string{topic}, ackWait)
	m0 := fetchWithin(t, a, patience)
	b := natsReader(t, jsB, "svc", []string{topic}, ackWait)
	fetchNone(t, b, 5*ackWait, "a running member holds its message past the ack wait; the other member got a message")
	require.NoError(t, a.CommitMessages(ctx, m0), "the slow member's commit, long after the ack wait")
	// a may have pulled the next message already: Close gives it back at
	// once, far sooner than a one-minute ack wait would.
	require.NoError(t, a.Close())
	var seqs []string
	for len(seqs) < 2 {
		m := fetchWithin(t, b, 15*time.Second)
		s, _ := headerOf(m, "x-seq")
		seqs = append(seqs, s)
		require.NoError(t, b.CommitMessages(ctx, m))
	}
	require.Equal(t, []string{"1", "2"}, seqs, "the rest, once each, in order")
}

// Close hands back at once what a reader held: with an ack wait of a
// minute, another member gets every message within seconds. A reader
// closed right after its first fetch still has pulls in flight on its
// other partitions; the rounds make that moment likely.
func TestNATSCloseGivesBackAtOnce(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	ctx := ctxFor(t, 80*time.Second)
	const rounds, partitions, msgs = 20, 8, 16
	var stalled []string
	for round := range rounds {
		topic := fmt.Sprintf("rv.close%d", round)
		require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: partitions}))
		w := natsWriter(t, js)
		var sent []kafka.Message
		for i := range msgs {
			sent = append(sent, goodMsg(topic, "k"+strconv.Itoa(i), i))
		}
		require.NoError(t, w.WriteMessages(ctx, sent...))
		ncA, jsA := natsConnect(t, srv)
		ncB, jsB := natsConnect(t, srv)
		a, err := natsbus.NewReader(jsA, "svc", []string{topic}, &natsbus.ReaderOpts{AckWait: time.Minute, PullWait: 300 * time.Millisecond})
		require.NoError(t, err)
		held := fetchWithin(t, a, patience)
		require.NoError(t, a.Close())
		_, err = a.FetchMessage(ctx)
		require.ErrorIs(t, err, natsbus.ErrClosed)
		b, err := natsbus.NewReader(jsB, "svc", []string{topic}, &natsbus.ReaderOpts{AckWait: time.Minute, PullWait: 300 * time.Millisecond})
		require.NoError(t, err)
		seen := map[string]int{}
		for len(seen) < msgs {
			fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			m, err := b.FetchMessage(fctx)
			cancel()
			if err != nil {
				stalled = append(stalled, fmt.Sprintf("round %d: %d of %d messages within 5 s of Close (the closed reader had returned partition %d offset %d); consumers: %s",
					round, len(seen), msgs, held.Partition, held.Offset, consumerState(t, js, topic, "svc", partitions)))
				break
			}
			s, _ := headerOf(m, "x-seq")
			seen[s]++
			require.NoError(t, b.CommitMessages(ctx, m))
		}
		require.NoError(t, b.Close())
		require.NoError(t, w.Close())
		ncA.Close()
		ncB.Close()
		if len(stalled) > 0 {
			break // one is enough to show it
		}
	}
	for _, s := range stalled {
		t.Log(s)
	}
	require.Empty(t, stalled, "rounds in which a message stayed with the closed reader (ack wait one minute)")
}

// Two members of one group over four partitions, handlers of uneven speed:
// each key's messages are processed once, in order.
func TestNATSTwoMembersKeepKeyOrder(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.order"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 4}))
	keys := []string{"a", "b", "c", "d", "e", "f"}
	const n = 90
	d.insertRows(t, topic, keys, 0, n)
	d.runRelay(t, natsWriter(t, js))
	h := d.handler("svc")
	var byA, byB atomic.Int32
	slow := func(by *atomic.Int32, pause time.Duration) inbox.HandlerFunc {
		return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			by.Add(1)
			time.Sleep(pause)
			return h(ctx, tx, msg)
		}
	}
	_, jsA := natsConnect(t, srv)
	_, jsB := natsConnect(t, srv)
	d.consume(t, "svc", natsReader(t, jsA, "svc", []string{topic}, 5*time.Second), slow(&byA, 15*time.Millisecond))
	d.consume(t, "svc", natsReader(t, jsB, "svc", []string{topic}, 5*time.Second), slow(&byB, time.Millisecond))
	testkit.WaitFor(t, patience, "every message processed", func() bool { return d.countEffects(t, "svc") >= n })
	time.Sleep(300 * time.Millisecond)
	checkOrder(t, d.effects(t, "svc"), n)
	t.Logf("handled by A %d, by B %d", byA.Load(), byB.Load())
}

// Setup is idempotent, refuses to change partitions, and refuses bad
// arguments before it sends anything, with an error that names the fault.
// The constructors refuse bad arguments the same way, without panicking.
func TestNATSSetupAndConstructorsRefuseBadArguments(t *testing.T) {
	t.Parallel()
	_, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.setup"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 2, Groups: []string{"g"}}))
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 2, Groups: []string{"g"}}), "idempotent")
	w := natsWriter(t, js)
	require.NoError(t, w.WriteMessages(ctx, goodMsg(topic, "k", 0)))

	err := natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 3})
	require.Error(t, err, "Setup must refuse to change the partitions")
	require.Contains(t, err.Error(), topic, "the error names the topic")
	require.Contains(t, err.Error(), "2")
	require.Contains(t, err.Error(), "3")
	err = natsbus.Setup(ctx, js, []string{topic}, nil)
	require.Error(t, err, "nil options mean one partition, which is a change too")
	require.Equal(t, uint64(1), streamMsgs(t, js, topic), "the stream is left as it was")

	bad := []struct {
		name   string
		topics []string
		opts   *natsbus.SetupOpts
		names  string // what the error must mention
	}{
		{"negative partitions", []string{"rv.a"}, &natsbus.SetupOpts{Partitions: -1}, "artition"},
		{"negative replicas", []string{"rv.a"}, &natsbus.SetupOpts{Replicas: -1}, "eplica"},
		{"negative max age", []string{"rv.a"}, &natsbus.SetupOpts{MaxAge: -time.Second}, "MaxAge"},
		{"negative duplicates", []string{"rv.a"}, &natsbus.SetupOpts{Duplicates: -time.Second}, "uplicates"},
		{"negative ack wait", []string{"rv.a"}, &natsbus.SetupOpts{AckWait: -time.Second, Groups: []string{"g"}}, "AckWait"},
		{"an empty topic", []string{""}, nil, "topic"},
		{"a topic with a blank", []string{"rv a"}, nil, "rv a"},
		{"a topic with a wildcard", []string{"rv.*"}, nil, "rv.*"},
		{"a topic with a tail wildcard", []string{"rv.>"}, nil, "rv.>"},
		{"a topic with an empty token", []string{"rv..a"}, nil, "rv..a"},
		{"a good topic then a bad one", []string{"rv.first", "rv bad"}, nil, "rv bad"},
		{"an empty group", []string{"rv.a"}, &natsbus.SetupOpts{Groups: []string{""}}, "group"},
		{"no topics", nil, nil, "topic"},
	}
	for _, b := range bad {
		err := natsbus.Setup(ctx, js, b.topics, b.opts)
		require.Error(t, err, b.name)
		require.ErrorIs(t, err, natsbus.ErrInvalidConfig, "%s: %v", b.name, err)
		require.Contains(t, err.Error(), b.names, "%s: the error names the fault", b.name)
	}
	// Checked before anything is sent: the good topic of a refused list
	// has no stream.
	_, err = js.Stream(ctx, natsbus.StreamName("rv.first"))
	require.ErrorIs(t, err, jetstream.ErrStreamNotFound, "a refused Setup created the list's good topic")
	// A retention shorter than the default deduplication window (O1, since
	// fixed): the window follows it; one set longer is still refused.
	require.NoError(t, natsbus.Setup(ctx, js, []string{"rv.short"}, &natsbus.SetupOpts{MaxAge: time.Minute}))
	err = natsbus.Setup(ctx, js, []string{"rv.short2"}, &natsbus.SetupOpts{MaxAge: time.Minute, Duplicates: 2 * time.Minute})
	require.ErrorIs(t, err, natsbus.ErrInvalidConfig)
	require.Error(t, natsbus.Setup(ctx, nil, []string{"rv.a"}, nil), "a nil JetStream")

	readers := []struct {
		name   string
		js     jetstream.JetStream
		group  string
		topics []string
		opts   *natsbus.ReaderOpts
		names  string
	}{
		{"a nil JetStream", nil, "g", []string{topic}, nil, "js"},
		{"an empty group", js, "", []string{topic}, nil, "group"},
		{"no topics", js, "g", nil, nil, "topic"},
		{"an empty topic", js, "g", []string{""}, nil, "topic"},
		{"a topic with a wildcard", js, "g", []string{"rv.*"}, nil, "rv.*"},
		{"a negative ack wait", js, "g", []string{topic}, &natsbus.ReaderOpts{AckWait: -time.Second}, "AckWait"},
		{"a negative pull wait", js, "g", []string{topic}, &natsbus.ReaderOpts{PullWait: -time.Second}, "PullWait"},
		{"a negative ack timeout", js, "g", []string{topic}, &natsbus.ReaderOpts{AckTimeout: -time.Second}, "AckTimeout"},
	}
	for _, c := range readers {
		var r *natsbus.Reader
		var err error
		require.NotPanics(t, func() { r, err = natsbus.NewReader(c.js, c.group, c.topics, c.opts) }, c.name)
		if r != nil {
			_ = r.Close()
		}
		require.ErrorIs(t, err, natsbus.ErrInvalidConfig, "%s: %v", c.name, err)
		require.Contains(t, err.Error(), c.names, "%s: the error names the fault", c.name)
	}
	var werr error
	require.NotPanics(t, func() { _, werr = natsbus.NewWriter(nil, nil) })
	require.ErrorIs(t, werr, natsbus.ErrInvalidConfig)
}

// A reader started before its topic's stream exists reports the missing
// stream from FetchMessage and, once Setup made it, delivers.
func TestNATSReaderWaitsForItsStream(t *testing.T) {
	t.Parallel()
	_, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.late"
	r := natsReader(t, js, "svc", []string{topic}, 2*time.Second)
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	_, err := r.FetchMessage(fctx)
	cancel()
	require.Error(t, err)
	t.Logf("fetch before the stream exists: %v", err)
	require.False(t, errors.Is(err, context.DeadlineExceeded),
		"the doc says FetchMessage returns the background failure (the stream missing), not only the context's end: %v", err)
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, nil))
	w := natsWriter(t, js)
	require.NoError(t, w.WriteMessages(ctx, goodMsg(topic, "k", 7)))
	m := fetchWithin(t, r, patience)
	s, _ := headerOf(m, "x-seq")
	require.Equal(t, "7", s)
	require.NoError(t, r.CommitMessages(ctx, m))
}

// Broker deduplication within the window and the inbox's beyond it: a
// relay's replay within the window is stored once; ids that differ only
// late in a long id are two messages; a copy with a fresh Nats-Msg-Id (a
// replay outside the window) reaches the consumer and has no second effect.
func TestNATSDeduplicationByIDs(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.dedup"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 2}))
	w := natsWriter(t, js)
	ids := d.insertRows(t, topic, []string{"k"}, 0, 3)
	rl := d.newRelay(t, w, 0)
	drainRelay(t, rl)
	require.Equal(t, uint64(3), streamMsgs(t, js, topic))
	ob, err := outbox.New(d.Pool, d.Schema)
	require.NoError(t, err)
	res, err := ob.Replay(ctx, outbox.ReplayOpts{RatePerSecond: 1000})
	require.NoError(t, err)
	require.EqualValues(t, 3, res.Republished)
	drainRelay(t, rl)
	require.Equal(t, uint64(3), streamMsgs(t, js, topic), "a replay within the window is stored once")

	long := strings.Repeat("x", 300)
	m1, m2 := goodMsg(topic, "k", 3), goodMsg(topic, "k", 4)
	m1.Headers[0].Value = []byte(long + "a")
	m2.Headers[0].Value = []byte(long + "b")
	require.NoError(t, w.WriteMessages(ctx, m1, m2))
	require.Equal(t, uint64(5), streamMsgs(t, js, topic), "two ids that share a long prefix are two messages")

	// A copy of message 0 published outside the window: another
	// Nats-Msg-Id, the same sagaflow-message-id.
	nc, _ := natsConnect(t, srv)
	copyMsg := nats.NewMsg(natsbus.Subject(topic, wire.Partition([]byte("k"), 2)))
	copyMsg.Header.Set(wire.HeaderMessageID, ids[0].String())
	copyMsg.Header.Set(wire.HeaderType, "good")
	copyMsg.Header.Set("x-seq", "0")
	copyMsg.Header.Set("x-h", "h")
	copyMsg.Header.Set(natsbus.KeyHeader, "k")
	copyMsg.Header.Set("Nats-Msg-Id", "operator-replay-"+uuid.NewString())
	copyMsg.Data = []byte("v0")
	jsRaw, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = jsRaw.PublishMsg(ctx, copyMsg)
	require.NoError(t, err)
	require.Equal(t, uint64(6), streamMsgs(t, js, topic))

	d.consume(t, "svc", natsReader(t, js, "svc", []string{topic}, 2*time.Second), nil)
	testkit.WaitFor(t, patience, "every message processed", func() bool { return d.countEffects(t, "svc") >= 5 })
	// The copy is the last message of its partition: once the consumer's
	// group has acknowledged everything, it was seen and skipped.
	testkit.WaitFor(t, patience, "the group acknowledged every message", func() bool {
		total := 0
		for p := range 2 {
			c, err := js.Consumer(ctx, natsbus.StreamName(topic), natsbus.ConsumerName("svc", p))
			if err != nil {
				return false
			}
			info, err := c.Info(ctx)
			if err != nil {
				return false
			}
			total += int(info.NumPending) + info.NumAckPending
		}
		return total == 0
	})
	checkOrder(t, d.effects(t, "svc"), 5)
}

// The relay over the NATS writer: each failure of a batch is reported on
// its own row, as the docs list them, and the good rows of the batch are
// published in the same cycle, in order per key.
func TestNATSRelayReportsEachFailureOnItsRow(t *testing.T) {
	t.Parallel()
	_, js := natsServer(t)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.relay"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{MaxMsgSize: 1000}))
	w := natsWriter(t, js)
	good0 := d.insertRaw(t, topic, "k", `{"x-seq":"0"}`, []byte("a"))
	noStream := d.insertRaw(t, "rv.nostream", "k2", `{}`, []byte("b"))
	parked := map[uuid.UUID]string{
		d.insertRaw(t, topic, "k", `{"x-h":"two\r\nlines"}`, []byte("c")):           relay.CodeMalformedHeaders,
		d.insertRaw(t, topic, "k", `{"Nats-Expected-Stream":"other"}`, []byte("d")): relay.CodeMalformedHeaders,
		d.insertRaw(t, topic, "k", `{"bad name":"v"}`, []byte("e")):                 relay.CodeMalformedHeaders,
		d.insertRaw(t, topic, "k", `{"x-h":" padded"}`, []byte("f")):                relay.CodeMalformedHeaders,
		d.insertRaw(t, topic, "k", `{"sagaflow-key":"forged"}`, []byte("g")):        relay.CodeMalformedHeaders,
		d.insertRaw(t, topic, "k", `{}`, make([]byte, 2000)):                        relay.CodeTooLarge,
		d.insertRaw(t, "rv.bad*topic", "k", `{}`, []byte("h")):                      relay.CodeInvalidTopic,
	}
	good1 := d.insertRaw(t, topic, "k", `{"x-seq":"1"}`, []byte("i"))
	rl := d.newRelay(t, w, 2)
	for range 3 { // the first cycle holds back the key's rows behind a failure
		_, _, err := rl.RunOnce(ctx)
		require.NoError(t, err)
	}
	for id, code := range parked {
		s := d.row(t, id)
		require.Equal(t, "dead", s.Status, "row %s: %s", id, s.LastError)
		require.True(t, strings.HasPrefix(s.LastError, code), "row %s: want code %s, got %q", id, code, s.LastError)
	}
	s := d.row(t, noStream)
	require.NotEqual(t, "published", s.Status)
	require.GreaterOrEqual(t, s.Attempts, 1, "no stream spends an attempt: %+v", s)
	require.Contains(t, s.LastError, "rv.nostream")
	require.Equal(t, "published", d.row(t, good0).Status)
	require.Equal(t, "published", d.row(t, good1).Status)
	testkit.WaitFor(t, patience, "the row without a stream parked after MaxAttempts", func() bool {
		_, _, err := rl.RunOnce(ctx)
		require.NoError(t, err)
		return d.row(t, noStream).Status == "dead"
	})
	require.True(t, strings.HasPrefix(d.row(t, noStream).LastError, relay.CodeAttemptsExhausted))
	// The two good rows are on the stream, 0 before 1.
	r := natsReader(t, js, "svc", []string{topic}, 2*time.Second)
	var seqs []string
	for range 2 {
		m := fetchWithin(t, r, patience)
		v, _ := headerOf(m, "x-seq")
		seqs = append(seqs, v)
		require.NoError(t, r.CommitMessages(ctx, m))
	}
	require.Equal(t, []string{"0", "1"}, seqs)
	require.Equal(t, uint64(2), streamMsgs(t, js, topic), "nothing parked reached the stream")
}

// HighWaterMark-Offset-1 is the number of messages still waiting on the
// partition, and offsets grow within a partition.
func TestNATSLagFromHighWaterMark(t *testing.T) {
	t.Parallel()
	_, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.lag"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 2}))
	w := natsWriter(t, js)
	var sent []kafka.Message
	for i := range 10 {
		sent = append(sent, goodMsg(topic, "k"+strconv.Itoa(i%3), i))
	}
	require.NoError(t, w.WriteMessages(ctx, sent...))
	waiting := map[int]int{}
	for _, m := range sent {
		waiting[wire.Partition(m.Key, 2)]++
	}
	r := natsReader(t, js, "svc", []string{topic}, 5*time.Second)
	last := map[int]int64{}
	for range 10 {
		m := fetchWithin(t, r, patience)
		waiting[m.Partition]--
		require.Greater(t, m.Offset, last[m.Partition], "offsets grow within a partition")
		last[m.Partition] = m.Offset
		require.Equal(t, int64(waiting[m.Partition]), m.HighWaterMark-m.Offset-1,
			fmt.Sprintf("lag of partition %d at offset %d", m.Partition, m.Offset))
		require.NoError(t, r.CommitMessages(ctx, m))
	}
}

// consumerState describes group's consumers of topic, for failure messages.
func consumerState(t *testing.T, js jetstream.JetStream, topic, group string, partitions int) string {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	var b strings.Builder
	for p := range partitions {
		c, err := js.Consumer(ctx, natsbus.StreamName(topic), natsbus.ConsumerName(group, p))
		if err != nil {
			fmt.Fprintf(&b, "[p%d: %v] ", p, err)
			continue
		}
		info, err := c.Info(ctx)
		if err != nil {
			fmt.Fprintf(&b, "[p%d: %v] ", p, err)
			continue
		}
		fmt.Fprintf(&b, "[p%d: pending %d ack-pending %d redelivered %d waiting %d ackfloor %d delivered %d] ", p,
			info.NumPending, info.NumAckPending, info.NumRedelivered, info.NumWaiting, info.AckFloor.Stream, info.Delivered.Stream)
	}
	return b.String()
}

// Kafka allows topics of 249 bytes; escaped for a stream name, one full of
// dots is about 500. Two such topics that differ in their last byte, and
// two long groups that differ in theirs, must stay apart ("two topics
// never share a stream").
func TestNATSLongNamesStayDistinct(t *testing.T) {
	t.Parallel()
	_, js := natsServer(t)
	ctx := ctxFor(t, 60*time.Second)
	base := strings.Repeat("a.", 124)
	t1, t2 := base+"b", base+"c"
	require.Len(t, t1, 249)
	require.NotEqual(t, natsbus.StreamName(t1), natsbus.StreamName(t2))
	g1, g2 := strings.Repeat("g.", 150)+"1", strings.Repeat("g.", 150)+"2"
	require.NotEqual(t, natsbus.ConsumerName(g1, 0), natsbus.ConsumerName(g2, 0))
	require.NoError(t, natsbus.Setup(ctx, js, []string{t1, t2}, &natsbus.SetupOpts{Groups: []string{g1, g2}}))
	w := natsWriter(t, js)
	require.NoError(t, w.WriteMessages(ctx, goodMsg(t1, "k", 1), goodMsg(t2, "k", 2)))
	for _, c := range []struct {
		group, topic, seq string
	}{{g1, t1, "1"}, {g2, t1, "1"}, {g1, t2, "2"}} {
		r := natsReader(t, js, c.group, []string{c.topic}, 5*time.Second)
		m := fetchWithin(t, r, patience)
		s, _ := headerOf(m, "x-seq")
		require.Equal(t, c.seq, s, "group %.8s… of topic …%s", c.group, c.topic[len(c.topic)-3:])
		require.Equal(t, c.topic, m.Topic)
		require.NoError(t, r.CommitMessages(ctx, m))
		fetchNone(t, r, 500*time.Millisecond, "a second message on a one-message topic")
	}
}

// The NATS counterpart of F2: a message without any id is identified by
// the inbox by topic/partition/offset, and natsbus's Offset is the stream
// sequence, so a restarted service processes a new id-less message, and a
// redelivered one (its reader closed before the commit) is skipped.
func TestNATSIDlessMessagesAcrossRestartAndRedelivery(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	const topic = "rv.idless"
	require.NoError(t, natsbus.Setup(ctx, js, []string{topic}, nil))
	nc, _ := natsConnect(t, srv)
	raw, err := jetstream.New(nc)
	require.NoError(t, err)
	publish := func(seq int) {
		m := nats.NewMsg(natsbus.Subject(topic, 0))
		m.Header.Set(wire.HeaderType, "good")
		m.Header.Set("x-seq", strconv.Itoa(seq))
		m.Header.Set(natsbus.KeyHeader, "k")
		m.Data = []byte("v")
		_, err := raw.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "svc", Schema: d.Schema, Logger: quiet})
	require.NoError(t, err)
	h := d.handler("svc")
	publish(0)
	publish(1)
	// First run: processes 0, processes 1 but closes before committing it.
	r1, err := natsbus.NewReader(js, "svc", []string{topic}, &natsbus.ReaderOpts{AckWait: 2 * time.Second, PullWait: 300 * time.Millisecond})
	require.NoError(t, err)
	m := fetchWithin(t, r1, patience)
	ok, err := in.Process(ctx, inbox.FromKafka(m), h)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, r1.CommitMessages(ctx, m))
	m = fetchWithin(t, r1, patience)
	ok, err = in.Process(ctx, inbox.FromKafka(m), h)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, r1.Close())
	publish(2)
	// Second run: 1 again (skipped), then 2 (processed).
	r2 := natsReader(t, js, "svc", []string{topic}, 2*time.Second)
	var processed []bool
	for range 2 {
		m := fetchWithin(t, r2, patience)
		ok, err := in.Process(ctx, inbox.FromKafka(m), h)
		require.NoError(t, err)
		processed = append(processed, ok)
		require.NoError(t, r2.CommitMessages(ctx, m))
	}
	require.Equal(t, []bool{false, true}, processed, "the redelivered copy skipped, the new message processed")
	checkOrder(t, d.effects(t, "svc"), 3)
}
