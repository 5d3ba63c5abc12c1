package review23

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
	"github.com/sagaflow/sagaflow/wire"
)

// rabbitURL is the machine's broker (RABBITMQ_URL, else 127.0.0.1:5672
// guest/guest), or the test is skipped when none answers, as the
// transport's own tests do.
var rabbitURL = sync.OnceValues(func() (string, error) {
	url := os.Getenv("RABBITMQ_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := rabbitbus.Dial(url)()
	if err != nil {
		return "", err
	}
	_ = conn.Close()
	return url, nil
})

// rmq is one test's names on the shared broker: an exchange of its own and
// group and topic names with a random part, every queue it declares
// deleted when it ends.
type rmq struct {
	url   string
	id    string
	topo  rabbitbus.Topology
	admin *amqp.Connection

	mu     sync.Mutex
	queues []string
	exchs  []string
	socks  map[string][]net.Conn // the raw sockets of each killable client
}

func newRMQ(t *testing.T, partitions int) *rmq {
	t.Helper()
	url, err := rabbitURL()
	if err != nil {
		t.Skipf("no RabbitMQ: %v", err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	e := &rmq{url: url, id: hex.EncodeToString(b[:]), socks: map[string][]net.Conn{}}
	e.topo = rabbitbus.Topology{Exchange: "rv23-" + e.id, Partitions: partitions}
	e.exchs = append(e.exchs, e.topo.Exchange)
	e.admin, err = rabbitbus.Dial(url)()
	require.NoError(t, err)
	t.Cleanup(func() {
		defer e.admin.Close()
		ch, err := e.admin.Channel()
		if err != nil {
			t.Logf("cleanup: %v", err)
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, q := range e.queues {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				if ch, err = e.admin.Channel(); err != nil {
					return
				}
			}
		}
		for _, x := range e.exchs {
			_ = ch.ExchangeDelete(x, false, false)
		}
	})
	return e
}

// name is a group or topic name of this test only.
func (e *rmq) name(s string) string { return "rv23-" + e.id + "-" + s }

// track has the test delete group's queues of topics when it ends.
func (e *rmq) track(topo rabbitbus.Topology, group string, topics ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, tp := range topics {
		for p := range topo.Partitions {
			e.queues = append(e.queues, rabbitbus.QueueName(group, tp, p))
		}
	}
}

func (e *rmq) setup(t *testing.T, topics []string, groups ...string) {
	t.Helper()
	for _, g := range groups {
		e.track(e.topo, g, topics...)
	}
	ctx := ctxFor(t, 30*time.Second)
	require.NoError(t, rabbitbus.Setup(ctx, e.admin, topics, &rabbitbus.SetupOpts{Topology: e.topo, Groups: groups}))
}

// dial is a DialFunc whose sockets the test can cut as a crash would
// (kill), recorded under who.
func (e *rmq) dial(who string) rabbitbus.DialFunc {
	return func() (*amqp.Connection, error) {
		return amqp.DialConfig(e.url, amqp.Config{Heartbeat: 10 * time.Second,
			Dial: func(network, addr string) (net.Conn, error) {
				c, err := net.DialTimeout(network, addr, 10*time.Second)
				if err != nil {
					return nil, err
				}
				_ = c.SetDeadline(time.Now().Add(10 * time.Second)) // the handshake; cleared once open
				e.mu.Lock()
				e.socks[who] = append(e.socks[who], c)
				e.mu.Unlock()
				return c, nil
			}})
	}
}

// kill closes every socket who has opened: to the broker and to the
// client library, the process is gone, and nobody called Close.
func (e *rmq) kill(who string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, c := range e.socks[who] {
		_ = c.Close()
	}
	e.socks[who] = nil
}

func (e *rmq) writer(t *testing.T) *rabbitbus.Writer {
	t.Helper()
	w, err := rabbitbus.NewWriter(e.dial("writer"), &rabbitbus.WriterOpts{Topology: e.topo})
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func (e *rmq) reader(t *testing.T, who, group string, topics []string, opts *rabbitbus.ReaderOpts) *rabbitbus.Reader {
	t.Helper()
	e.track(e.topo, group, topics...)
	var o rabbitbus.ReaderOpts
	if opts != nil {
		o = *opts
	}
	o.Topology = e.topo
	r, err := rabbitbus.NewReader(e.dial(who), group, topics, &o)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// publishRaw publishes as a producer that speaks AMQP without sagaflow
// would: any headers, any message-id, to a partition's routing key.
func (e *rmq) publishRaw(t *testing.T, topic string, partition int, p amqp.Publishing) {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	ch, err := e.admin.Channel()
	require.NoError(t, err)
	defer ch.Close()
	require.NoError(t, ch.Confirm(false))
	conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, e.topo.Exchange, rabbitbus.RoutingKey(topic, partition), true, false, p)
	require.NoError(t, err)
	ok, err := conf.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, ok, "the broker confirmed the raw publish")
}

// Commits the reader never returned (an offset beyond or before, a
// partition or topic that does not exist), a second commit, and a commit
// of a good message mixed with a forged one: the docs say each bad one is
// an error, the others are acknowledged all the same, and a commit
// acknowledges exactly the messages given, so committing a later message
// of a partition before an earlier one must leave the earlier one
// unacknowledged: it comes back when the reader goes.
func TestRabbitForgedDuplicateAndOutOfOrderCommits(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("commits"), e.name("g")
	e.setup(t, []string{topic}, group)
	w := e.writer(t)
	var sent []kafka.Message
	for i := range 5 {
		sent = append(sent, goodMsg(topic, "k", i))
	}
	require.NoError(t, w.WriteMessages(ctx, sent...))

	a := e.reader(t, "a", group, []string{topic}, nil)
	m := make([]kafka.Message, 4)
	for i := range m {
		m[i] = fetchWithin(t, a, patience)
		s, _ := headerOf(m[i], "x-seq")
		require.Equal(t, strconv.Itoa(i), s, "a partition's messages in order")
	}
	forged := []struct {
		name string
		m    kafka.Message
	}{
		{"an offset the reader never returned", kafka.Message{Topic: topic, Partition: 0, Offset: m[3].Offset + 100}},
		{"the next offset, not fetched yet", kafka.Message{Topic: topic, Partition: 0, Offset: m[3].Offset + 1}},
		{"a negative offset", kafka.Message{Topic: topic, Partition: 0, Offset: -1}},
		{"a partition that does not exist", kafka.Message{Topic: topic, Partition: 5, Offset: m[0].Offset}},
		{"a topic the reader does not read", kafka.Message{Topic: e.name("nowhere"), Partition: 0, Offset: m[0].Offset}},
		{"the zero message", kafka.Message{}},
	}
	for _, f := range forged {
		err := a.CommitMessages(ctx, f.m)
		require.Error(t, err, "a commit of %s must fail", f.name)
		t.Logf("commit of %s: %v", f.name, err)
	}
	// Out of order: m1 before m0. Then a second commit of m1.
	require.NoError(t, a.CommitMessages(ctx, m[1]))
	require.Error(t, a.CommitMessages(ctx, m[1]), "a second commit must fail")
	// A good message with a forged one: an error, and m2 acknowledged
	// all the same.
	require.Error(t, a.CommitMessages(ctx, kafka.Message{Topic: topic, Partition: 0, Offset: 77}, m[2]))
	require.Error(t, a.CommitMessages(ctx, m[2]), "m2 was acknowledged by the mixed commit")
	// The next message, fetched now, is not taken for committed by the
	// forged commits named before. (Its offset grows; it is taken from
	// the clock since review23's F3, so it is not m3's plus one.)
	m4 := fetchWithin(t, a, patience)
	require.Greater(t, m4.Offset, m[3].Offset)
	// Nothing else acknowledged: m0, m3 and m4 come back to the next
	// reader, in order, and m1 and m2 do not.
	require.NoError(t, a.Close())
	b := e.reader(t, "b", group, []string{topic}, nil)
	var again []string
	for range 3 {
		x := fetchWithin(t, b, patience)
		s, _ := headerOf(x, "x-seq")
		again = append(again, s)
		require.NoError(t, b.CommitMessages(ctx, x))
	}
	require.Equal(t, []string{"0", "3", "4"}, again, "exactly what was not acknowledged, in order")
	fetchNone(t, b, 2*time.Second, "a message that was acknowledged came again")
}

// Bytes PostgreSQL refuses in every field, sent through the RabbitMQ
// writer, plus what only a raw AMQP producer can send (header values that
// are not bytes, nested tables, arrays), end to end through an inbox
// consumer: each poison message is dead-lettered at once with a reason and
// its raw bytes; nothing is lost and nothing behind it on the partition
// waits. A message with only an AMQP message-id, sent twice, has one
// effect.
func TestRabbitPoisonIsParkedAndHoldsNothingBack(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("poison"), e.name("svc")
	e.setup(t, []string{topic}, group)
	w := e.writer(t)

	big := testkit.RandomLetters(10_000)
	poison := map[string]kafka.Message{} // by message id
	seq := 0
	var msgs []kafka.Message
	good := func(key string) {
		msgs = append(msgs, goodMsg(topic, key, seq))
		seq++
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
	bad := func(edit func(m *kafka.Message)) {
		m := goodMsg(topic, "k1", -1)
		edit(&m)
		id, _ := headerOf(m, wire.HeaderMessageID)
		poison[id] = m
		msgs = append(msgs, m)
	}
	good("k1")
	bad(func(m *kafka.Message) { m.Key = []byte("k1\x00nul") })
	good("k2")
	bad(func(m *kafka.Message) { m.Key = []byte("k1\xff\xfe") })
	good("k1")
	bad(func(m *kafka.Message) { m.Key = []byte(big) })
	bad(func(m *kafka.Message) { setHdr(m, "x-h", "a\x00b") })
	good("k3")
	bad(func(m *kafka.Message) { setHdr(m, "x-h", "a\xc3\x28") })
	bad(func(m *kafka.Message) { setHdr(m, "x-h", big) })
	bad(func(m *kafka.Message) { m.Value = []byte("v\x00") })
	good("k2")
	bad(func(m *kafka.Message) { m.Value = []byte{0xff, 'v'} })
	bad(func(m *kafka.Message) { setHdr(m, wire.HeaderType, "good\x00") })
	bad(func(m *kafka.Message) { m.Headers = append(m.Headers, hdr(wire.HeaderType, "good")) })
	weird := goodMsg(topic, "k3", seq)
	setHdr(&weird, wire.HeaderMessageID, "id\x00\xff"+big)
	msgs = append(msgs, weird, weird) // the copy must be skipped
	seq++
	good("k1")
	require.NoError(t, w.WriteMessages(ctx, msgs...))

	// A raw AMQP producer: header values of every AMQP type. Each message
	// must be processed or dead-lettered; none may be lost or stall the
	// partition. Their ids are the AMQP message-id only.
	raw := map[string]amqp.Table{
		"int header":                  {"sagaflow-type": "good", "x-h": int32(7)},
		"nested table":                {"sagaflow-type": amqp.Table{"a": "b"}},
		"array header":                {"sagaflow-type": "good", "x-h": []interface{}{"a", int32(1), nil}},
		"key as an int":               {"sagaflow-type": "good", rabbitbus.KeyHeader: int64(5)},
		"key as a table":              {"sagaflow-type": "good", rabbitbus.KeyHeader: amqp.Table{"k": "v"}},
		"decimal and time":            {"sagaflow-type": "good", "x-h": amqp.Decimal{Scale: 2, Value: 12345}, "x-t": time.Unix(1, 0)},
		"nil and bool":                {"sagaflow-type": "good", "x-h": nil, "x-b": true, "x-f": 1.5},
		"type as bytes, x-h with NUL": {"sagaflow-type": []byte("good"), "x-h": []byte("a\x00b")},
		"no headers":                  nil,
		"type twice, array":           {"sagaflow-type": []interface{}{"good", "good"}},
	}
	rawIDs := map[string]string{}
	for name, h := range raw {
		id := "amqp-" + uuid.NewString()
		rawIDs[id] = name
		e.publishRaw(t, topic, 0, amqp.Publishing{MessageId: id, Headers: h, Body: []byte("raw"), DeliveryMode: amqp.Persistent})
	}
	// The AMQP message-id as the only id, twice: one effect.
	dupID := "amqp-dup-" + uuid.NewString()
	for range 2 {
		e.publishRaw(t, topic, 0, amqp.Publishing{MessageId: dupID, DeliveryMode: amqp.Persistent, Body: []byte("dup"),
			Headers: amqp.Table{"sagaflow-type": "good", "x-seq": []byte(strconv.Itoa(seq)), rabbitbus.KeyHeader: []byte("k9")}})
	}
	seq++
	last := goodMsg(topic, "k4", seq)
	seq++
	require.NoError(t, w.WriteMessages(ctx, last))

	r := e.reader(t, "r", group, []string{topic}, nil)
	d.consume(t, "svc", r, nil)
	lastID, _ := headerOf(last, wire.HeaderMessageID)
	if !waitUntil(patience, func() bool {
		return d.Count(t, "SELECT count(*) FROM "+d.Table("fx")+" WHERE msg_id = $1", lastID) == 1
	}) {
		d.explain(t, "svc")
		t.Fatalf("the last message was not processed within %v: something holds the partition", patience)
	}
	time.Sleep(300 * time.Millisecond)
	fx := d.effects(t, "svc")
	var goodFx []effect
	effectIDs := map[string]int{}
	for _, x := range fx {
		effectIDs[x.ID]++
		if x.Seq >= 0 {
			goodFx = append(goodFx, x)
		}
	}
	checkOrder(t, goodFx, seq)
	require.Equal(t, 1, effectIDs[dupID], "an AMQP message-id deduplicates")
	dead := d.deadLetters(t, "svc")
	deadIDs := map[string]deadLetter{}
	for _, dl := range dead {
		require.NotEmpty(t, strings.TrimSpace(dl.Reason))
		require.NotNil(t, dl.MessageID)
		deadIDs[*dl.MessageID] = dl
		t.Logf("dead: key %.20q reason %.160s", dl.Key, dl.Reason)
	}
	for id, m := range poison {
		dl, ok := deadIDs[id]
		require.True(t, ok, "poison message with key %.20q not dead-lettered", m.Key)
		require.Equal(t, m.Key, dl.Key, "raw key bytes kept")
		require.Equal(t, m.Value, dl.Value, "raw value bytes kept")
	}
	for id, name := range rawIDs {
		_, isDead := deadIDs[id]
		n := effectIDs[id]
		require.True(t, isDead != (n == 1), "raw message %q: dead-lettered %v, effects %d: it must be exactly one of the two", name, isDead, n)
		var keys []string
		for _, x := range fx {
			if x.ID == id {
				keys = append(keys, x.Key)
			}
		}
		t.Logf("raw message %q: dead-lettered %v, processed with key %q", name, isDead, keys)
	}
	require.Len(t, deadIDs, len(dead), "one dead letter per message")
	for _, dl := range dead {
		_, p := poison[*dl.MessageID]
		_, r := rawIDs[*dl.MessageID]
		require.True(t, p || r, "a good message was dead-lettered: %s", dl.Reason)
	}
}

// restartRun runs one reader and inbox consumer of group until want
// effects and dead letters exist, or patience passes, then stops and
// closes them: a service restarted between deliveries.
func restartRun(t *testing.T, e *rmq, d *db, who, group, topic string, wantEffects, wantDead int) bool {
	t.Helper()
	r, err := rabbitbus.NewReader(e.dial(who), group, []string{topic}, &rabbitbus.ReaderOpts{Topology: e.topo})
	require.NoError(t, err)
	stop := d.consume(t, "svc", r, nil)
	ok := waitUntil(patience, func() bool {
		return d.countEffects(t, "svc") >= wantEffects && d.countDead(t, "svc") >= wantDead
	})
	stop()
	require.NoError(t, r.Close())
	if !ok {
		d.explain(t, "svc")
		ch, err := e.admin.Channel()
		require.NoError(t, err)
		defer ch.Close()
		q, err := ch.QueueDeclarePassive(rabbitbus.QueueName(group, topic, 0), true, false, false, false, nil)
		require.NoError(t, err)
		t.Logf("reader %s: want %d effects and %d dead letters, have %d and %d; messages left in the queue: %d",
			who, wantEffects, wantDead, d.countEffects(t, "svc"), d.countDead(t, "svc"), q.Messages)
	}
	return ok
}

// A message without any id (another producer's AMQP message, no
// sagaflow-message-id, no message-id) is identified by the inbox by
// topic/partition/offset, "which a redelivery keeps". rabbitbus's Offset
// is the reader's own count, from 0 for every new reader: the first
// message a restarted service reads must not be taken for the one its
// previous run processed at the same count.
func TestRabbitRestartedReaderDoesNotSkipIDlessMessages(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	d := newDB(t)
	topic, group := e.name("restart"), e.name("svc")
	e.setup(t, []string{topic}, group)
	plain := func(seq int) amqp.Publishing {
		return amqp.Publishing{DeliveryMode: amqp.Persistent, Body: []byte("v"),
			Headers: amqp.Table{"sagaflow-type": "good", "x-seq": []byte(strconv.Itoa(seq)), rabbitbus.KeyHeader: []byte("k")}}
	}
	// Since F2's fix an inbox consumer of rabbitbus parks an id-less
	// message (it could not be deduplicated): each run's message must be
	// dead-lettered, the second not taken for the first's (one dead letter
	// per position, and the positions used to repeat).
	e.publishRaw(t, topic, 0, plain(0))
	require.True(t, restartRun(t, e, d, "first", group, topic, 0, 1), "the first run parks its message")
	e.publishRaw(t, topic, 0, plain(1))
	require.True(t, restartRun(t, e, d, "second", group, topic, 0, 2),
		"the restarted service parks the new message (not skipped as a duplicate of the first run's)")
	require.Zero(t, d.countEffects(t, "svc"), "an id-less message is parked, not processed")
}

// The other side of F2 (an id-less message redelivered with a new Offset
// was processed again) is now transport/rabbitbus's
// TestAMessageWithoutAnIDIsDeadLetteredNotDoubled: such a message is parked.

// A poison message (of sagaflow's own, with a sagaflow-message-id) must be
// dead-lettered, never dropped. The inbox stores one dead letter per
// position; with rabbitbus a restarted reader's positions repeat, so the
// second run's first poison message sits at the position of the first
// run's.
func TestRabbitRestartedReaderDeadLettersPoisonAtAReusedOffset(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("restart-poison"), e.name("svc")
	e.setup(t, []string{topic}, group)
	w := e.writer(t)
	poisonMsg := func() kafka.Message {
		m := goodMsg(topic, "k", -1)
		m.Headers[1].Value = []byte("no-such-type") // sagaflow-type: no handler, dead-lettered at once
		return m
	}
	require.NoError(t, w.WriteMessages(ctx, poisonMsg()))
	require.True(t, restartRun(t, e, d, "first", group, topic, 0, 1), "the first run dead-letters its poison message")
	second := poisonMsg()
	require.NoError(t, w.WriteMessages(ctx, second, goodMsg(topic, "k", 0)))
	ok := restartRun(t, e, d, "second", group, topic, 1, 2)
	require.True(t, ok, "the restarted service dead-letters the second poison message (a dead letter per message, not per reused offset)")
}

// Two tenants on one broker: each with an exchange of its own, but the
// same group and topic names (as two deployments of one service would
// have). Nothing may cross.
func TestRabbitTenantsWithTheirOwnExchangesDoNotCross(t *testing.T) {
	t.Skip("O3: queues are named <group>/<topic>/<p> whatever the exchange, so two exchanges share a group's queues")
	t.Parallel()
	e := newRMQ(t, 1)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("orders"), e.name("billing")
	topoA := e.topo
	topoB := rabbitbus.Topology{Exchange: e.topo.Exchange + "-b", Partitions: 1}
	e.mu.Lock()
	e.exchs = append(e.exchs, topoB.Exchange)
	e.mu.Unlock()
	e.track(topoA, group, topic)
	for _, topo := range []rabbitbus.Topology{topoA, topoB} {
		require.NoError(t, rabbitbus.Setup(ctx, e.admin, []string{topic}, &rabbitbus.SetupOpts{Topology: topo, Groups: []string{group}}))
	}
	wA, err := rabbitbus.NewWriter(e.dial("wa"), &rabbitbus.WriterOpts{Topology: topoA})
	require.NoError(t, err)
	t.Cleanup(func() { _ = wA.Close() })
	var sent []kafka.Message
	for i := range 5 {
		sent = append(sent, goodMsg(topic, "k", i))
	}
	require.NoError(t, wA.WriteMessages(ctx, sent...))
	rB, err := rabbitbus.NewReader(e.dial("rb"), group, []string{topic}, &rabbitbus.ReaderOpts{Topology: topoB})
	require.NoError(t, err)
	t.Cleanup(func() { _ = rB.Close() })
	d.consume(t, "tenant-b", rB, nil)
	testkit.Hold(t, 3*time.Second, "tenant B's reader sees nothing of tenant A's exchange", func() bool {
		return d.countEffects(t, "tenant-b") == 0
	})
}

// Tenants told apart by names, as the docs' topology allows: two groups of
// different names on one topic each get every message; a third topic's
// messages reach neither.
func TestRabbitTenantsByNameDoNotCross(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 2)
	dA, dB := newDB(t), newDB(t)
	tA, tB := e.name("a.orders"), e.name("b.orders")
	gA, gB := e.name("billing-a"), e.name("billing-b")
	e.setup(t, []string{tA}, gA, gB)
	e.setup(t, []string{tB}, gB)
	idsA := dA.insertRows(t, tA, []string{"a1", "a2", "a3"}, 0, 12)
	idsB := dB.insertRows(t, tB, []string{"b1", "b2"}, 0, 8)
	dA.runRelay(t, e.writer(t))
	dB.runRelay(t, e.writer(t))
	dA.consume(t, "billing", e.reader(t, "ra", gA, []string{tA}, nil), nil)
	dB.consume(t, "billing", e.reader(t, "rb", gB, []string{tB}, nil), nil)
	dB.consume(t, "audit", e.reader(t, "rc", gB, []string{tA}, nil), nil)
	testkit.WaitFor(t, patience, "every tenant's messages processed", func() bool {
		return dA.countEffects(t, "billing") >= 12 && dB.countEffects(t, "billing") >= 8 && dB.countEffects(t, "audit") >= 12
	})
	time.Sleep(300 * time.Millisecond)
	onlyFrom(t, dA.effects(t, "billing"), idsA, 12)
	onlyFrom(t, dB.effects(t, "billing"), idsB, 8)
	onlyFrom(t, dB.effects(t, "audit"), idsA, 12)
}

// A reader killed (its sockets cut, no Close) while it holds fetched
// messages: the standby gets them at once, in order; the killed reader's
// late commit fails with ErrRedelivered; and when the killed reader
// fetches again it must not hand out what it had buffered from its dead
// channel while the standby runs the partition.
func TestRabbitKilledReaderHandsOverInOrder(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("kill"), e.name("g")
	e.setup(t, []string{topic}, group)
	w := e.writer(t)
	var sent []kafka.Message
	for i := range 6 {
		sent = append(sent, goodMsg(topic, "k", i))
	}
	require.NoError(t, w.WriteMessages(ctx, sent...))
	a := e.reader(t, "a", group, []string{topic}, nil)
	m0 := fetchWithin(t, a, patience) // a subscribes first: it runs the partition
	b := e.reader(t, "b", group, []string{topic}, nil)
	bCtx, bCancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	_, err := b.FetchMessage(bCtx) // b subscribes: a standby
	bCancel()
	require.Error(t, err, "a standby gets nothing while the active reader runs")
	time.Sleep(200 * time.Millisecond) // a has its prefetch buffered by now

	e.kill("a")
	var order []string
	for range 6 {
		x := fetchWithin(t, b, patience)
		s, _ := headerOf(x, "x-seq")
		order = append(order, s)
		require.NoError(t, b.CommitMessages(ctx, x))
	}
	require.Equal(t, []string{"0", "1", "2", "3", "4", "5"}, order, "the standby gets everything a held, in order")
	err = a.CommitMessages(ctx, m0)
	require.ErrorIs(t, err, rabbitbus.ErrRedelivered, "the killed reader's late commit")
	// a reconnects on its next fetch; everything is b's, so it gets nothing.
	fetchNone(t, a, 3*time.Second, "the killed reader handed out a message the standby had already taken over")
}

// Two members with Members/Member over four partitions, one of them killed
// mid-run while its consumer keeps going (its reader reconnects): every
// message is processed once, each key in order.
func TestRabbitMembersKeepKeyOrderThroughAKill(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 4)
	d := newDB(t)
	topic, group := e.name("order"), e.name("svc")
	e.setup(t, []string{topic}, group)
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	const n = 96
	d.insertRows(t, topic, keys, 0, n)
	h := d.handler("svc")
	slow := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		time.Sleep(5 * time.Millisecond)
		return h(ctx, tx, msg)
	}
	opts := func(member int) *rabbitbus.ReaderOpts {
		return &rabbitbus.ReaderOpts{Members: 2, Member: member, StandbyDelay: 300 * time.Millisecond}
	}
	d.consume(t, "svc", e.reader(t, "m0", group, []string{topic}, opts(0)), slow)
	d.consume(t, "svc", e.reader(t, "m1", group, []string{topic}, opts(1)), slow)
	d.runRelay(t, e.writer(t))
	testkit.WaitFor(t, patience, "a third of the messages processed", func() bool { return d.countEffects(t, "svc") >= n/3 })
	e.kill("m0")
	if !waitUntil(patience, func() bool { return d.countEffects(t, "svc") >= n }) {
		d.explain(t, "svc")
		t.Fatalf("%d of %d processed", d.countEffects(t, "svc"), n)
	}
	time.Sleep(300 * time.Millisecond)
	checkOrder(t, d.effects(t, "svc"), n)
}

// Setup is idempotent; a queue declared again with other arguments is an
// error that names it, and leaves the caller's connection usable; bad
// names and options are refused with ErrInvalidConfig naming the fault,
// without a panic, in Setup and in both constructors.
func TestRabbitSetupAndConstructorsRefuseBadArguments(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 2)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("setup"), e.name("g")
	e.track(e.topo, group, topic)
	opts := &rabbitbus.SetupOpts{Topology: e.topo, Groups: []string{group}, MaxLength: 10}
	require.NoError(t, rabbitbus.Setup(ctx, e.admin, []string{topic}, opts))
	require.NoError(t, rabbitbus.Setup(ctx, e.admin, []string{topic}, opts), "idempotent")
	err := rabbitbus.Setup(ctx, e.admin, []string{topic}, &rabbitbus.SetupOpts{Topology: e.topo, Groups: []string{group}, MaxLength: 20})
	require.Error(t, err, "another MaxLength for an existing queue")
	require.Contains(t, err.Error(), rabbitbus.QueueName(group, topic, 0), "the error names the queue")
	require.NoError(t, rabbitbus.Setup(ctx, e.admin, []string{topic}, opts), "the connection is still usable")

	bad := []struct {
		name   string
		topics []string
		opts   *rabbitbus.SetupOpts
		names  string
	}{
		{"negative partitions", []string{topic}, &rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: e.topo.Exchange, Partitions: -1}}, "artition"},
		{"too many partitions", []string{topic}, &rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: e.topo.Exchange, Partitions: rabbitbus.PartitionsMax + 1}}, "artition"},
		{"a negative MaxLength", []string{topic}, &rabbitbus.SetupOpts{Topology: e.topo, MaxLength: -1}, "MaxLength"},
		{"an empty topic", []string{""}, &rabbitbus.SetupOpts{Topology: e.topo}, "topic"},
		{"a topic with a slash", []string{"a/b"}, &rabbitbus.SetupOpts{Topology: e.topo}, "a/b"},
		{"a topic with a wildcard #", []string{"a.#"}, &rabbitbus.SetupOpts{Topology: e.topo}, "a.#"},
		{"a topic with a wildcard *", []string{"a.*"}, &rabbitbus.SetupOpts{Topology: e.topo}, "a.*"},
		{"a group with a slash", []string{topic}, &rabbitbus.SetupOpts{Topology: e.topo, Groups: []string{"a/b"}}, "a/b"},
		{"an empty group", []string{topic}, &rabbitbus.SetupOpts{Topology: e.topo, Groups: []string{""}}, "group"},
	}
	for _, b := range bad {
		err := rabbitbus.Setup(ctx, e.admin, b.topics, b.opts)
		require.Error(t, err, b.name)
		require.ErrorIs(t, err, rabbitbus.ErrInvalidConfig, "%s: %v", b.name, err)
		require.Contains(t, err.Error(), b.names, "%s: the error names the fault", b.name)
	}
	var serr error
	require.NotPanics(t, func() { serr = rabbitbus.Setup(ctx, nil, []string{topic}, &rabbitbus.SetupOpts{Topology: e.topo}) })
	require.Error(t, serr, "a nil connection")
	// A reserved exchange name: the broker refuses it; Setup says so.
	err = rabbitbus.Setup(ctx, e.admin, []string{topic}, &rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: "amq.rv23-" + e.id, Partitions: 1}})
	require.Error(t, err, "a reserved exchange name")
	t.Logf("reserved exchange: %v", err)

	dial := e.dial("x")
	readers := []struct {
		name   string
		dial   rabbitbus.DialFunc
		group  string
		topics []string
		opts   *rabbitbus.ReaderOpts
		names  string
	}{
		{"a nil dial", nil, group, []string{topic}, nil, "dial"},
		{"an empty group", dial, "", []string{topic}, nil, "group"},
		{"a group with a slash", dial, "a/b", []string{topic}, nil, "a/b"},
		{"no topics", dial, group, nil, nil, "topic"},
		{"a topic with a slash", dial, group, []string{"a/b"}, nil, "a/b"},
		{"a topic with a wildcard", dial, group, []string{"a.#"}, nil, "a.#"},
		{"Member out of range", dial, group, []string{topic}, &rabbitbus.ReaderOpts{Members: 2, Member: 2}, "Member"},
		{"a negative Member", dial, group, []string{topic}, &rabbitbus.ReaderOpts{Members: 2, Member: -1}, "Member"},
		{"negative Members", dial, group, []string{topic}, &rabbitbus.ReaderOpts{Members: -1}, "Members"},
		{"a Member without Members", dial, group, []string{topic}, &rabbitbus.ReaderOpts{Member: 1}, "Member"},
		{"a negative Prefetch", dial, group, []string{topic}, &rabbitbus.ReaderOpts{Prefetch: -1}, "Prefetch"},
		{"a negative StandbyDelay", dial, group, []string{topic}, &rabbitbus.ReaderOpts{StandbyDelay: -time.Second}, "StandbyDelay"},
		{"too many partitions", dial, group, []string{topic}, &rabbitbus.ReaderOpts{Topology: rabbitbus.Topology{Partitions: 5000}}, "artition"},
	}
	for _, c := range readers {
		var r *rabbitbus.Reader
		var err error
		require.NotPanics(t, func() { r, err = rabbitbus.NewReader(c.dial, c.group, c.topics, c.opts) }, c.name)
		if r != nil {
			_ = r.Close()
		}
		require.ErrorIs(t, err, rabbitbus.ErrInvalidConfig, "%s: %v", c.name, err)
		require.Contains(t, err.Error(), c.names, "%s: the error names the fault", c.name)
	}
	writers := []struct {
		name  string
		dial  rabbitbus.DialFunc
		opts  *rabbitbus.WriterOpts
		names string
	}{
		{"a nil dial", nil, nil, "dial"},
		{"negative partitions", dial, &rabbitbus.WriterOpts{Topology: rabbitbus.Topology{Partitions: -1}}, "artition"},
		{"a negative MaxMessageBytes", dial, &rabbitbus.WriterOpts{MaxMessageBytes: -1}, "MaxMessageBytes"},
	}
	for _, c := range writers {
		var w *rabbitbus.Writer
		var err error
		require.NotPanics(t, func() { w, err = rabbitbus.NewWriter(c.dial, c.opts) }, c.name)
		if w != nil {
			_ = w.Close()
		}
		require.ErrorIs(t, err, rabbitbus.ErrInvalidConfig, "%s: %v", c.name, err)
		require.Contains(t, err.Error(), c.names, "%s: the error names the fault", c.name)
	}
}

// The relay over the RabbitMQ writer: every failure of one batch is
// reported on its own row as the docs list them, the good rows are
// published in the same cycle, and a row nobody consumes is parked after
// MaxAttempts, never dropped.
func TestRabbitRelayReportsEachFailureOnItsRow(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	d := newDB(t)
	ctx := ctxFor(t, 60*time.Second)
	topic, group := e.name("relay"), e.name("svc")
	e.setup(t, []string{topic}, group)
	w, err := rabbitbus.NewWriter(e.dial("writer"), &rabbitbus.WriterOpts{Topology: e.topo, MaxMessageBytes: 64 << 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	good0 := d.insertRaw(t, topic, "k", `{"x-seq":"0"}`, []byte("a"))
	unrouted := d.insertRaw(t, e.name("nobody"), "k2", `{}`, []byte("b"))
	longName := strings.Repeat("n", 300)
	parked := map[uuid.UUID]string{
		d.insertRaw(t, topic, "k", `{"`+longName+`":"v"}`, []byte("c")):                       relay.CodeRejected,
		d.insertRaw(t, topic, "k", `{"x-sagaflow-key":"forged"}`, []byte("d")):                relay.CodeRejected,
		d.insertRaw(t, topic, "k", `{}`, make([]byte, 100<<10)):                               relay.CodeTooLarge,
		d.insertRaw(t, topic, "k", `{"x-h":"`+strings.Repeat("h", 200<<10)+`"}`, []byte("e")): relay.CodeTooLarge,
		d.insertRaw(t, e.name("bad/topic"), "k", `{}`, []byte("f")):                           relay.CodeInvalidTopic,
		d.insertRaw(t, e.name("bad#topic"), "k", `{}`, []byte("g")):                           relay.CodeInvalidTopic,
	}
	good1 := d.insertRaw(t, topic, "k", `{"x-seq":"1"}`, []byte("h"))
	rl, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, Logger: quiet, BatchSize: 64, MaxAttempts: 2,
		MaxMessageBytes: 1 << 20, PublishTimeout: 10 * time.Second, Backoff: func(int) time.Duration { return 50 * time.Millisecond }})
	require.NoError(t, err)
	for range 3 {
		_, _, err := rl.RunOnce(ctx)
		require.NoError(t, err)
	}
	for id, code := range parked {
		s := d.row(t, id)
		require.Equal(t, "dead", s.Status, "row %s: %s", id, s.LastError)
		require.True(t, strings.HasPrefix(s.LastError, code), "row %s: want %s, got %.200q", id, code, s.LastError)
	}
	s := d.row(t, unrouted)
	require.NotEqual(t, "published", s.Status, "a message no queue is bound for is not published")
	require.GreaterOrEqual(t, s.Attempts, 1, "an unroutable message spends an attempt: %+v", s)
	require.Equal(t, "published", d.row(t, good0).Status)
	require.Equal(t, "published", d.row(t, good1).Status)
	testkit.WaitFor(t, patience, "the unroutable row parked after MaxAttempts", func() bool {
		_, _, err := rl.RunOnce(ctx)
		require.NoError(t, err)
		return d.row(t, unrouted).Status == "dead"
	})
	require.True(t, strings.HasPrefix(d.row(t, unrouted).LastError, relay.CodeAttemptsExhausted), d.row(t, unrouted).LastError)
	r := e.reader(t, "r", group, []string{topic}, nil)
	var seqs []string
	for range 2 {
		m := fetchWithin(t, r, patience)
		v, _ := headerOf(m, "x-seq")
		seqs = append(seqs, v)
		require.NoError(t, r.CommitMessages(ctx, m))
	}
	require.Equal(t, []string{"0", "1"}, seqs)
	fetchNone(t, r, 1500*time.Millisecond, "a parked row reached the queue")
}

// A handler slower than anything else in the test holds its partition:
// the standby (same group, no Members) gets nothing meanwhile, and the
// message is handled once.
func TestRabbitSlowHandlerKeepsItsPartition(t *testing.T) {
	t.Parallel()
	e := newRMQ(t, 1)
	d := newDB(t)
	topic, group := e.name("slow"), e.name("svc")
	e.setup(t, []string{topic}, group)
	d.insertRows(t, topic, []string{"k"}, 0, 4)
	var calls [4]atomic.Int32
	h := d.handler("svc")
	var entered atomic.Bool
	mk := func() inbox.HandlerFunc {
		return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			n, _ := strconv.Atoi(msg.Headers["x-seq"])
			calls[n].Add(1)
			if n == 1 {
				entered.Store(true)
				time.Sleep(4 * time.Second)
			}
			return h(ctx, tx, msg)
		}
	}
	d.consume(t, "svc", e.reader(t, "a", group, []string{topic}, nil), mk())
	d.runRelay(t, e.writer(t))
	testkit.WaitFor(t, patience, "the slow message in its handler", entered.Load)
	d.consume(t, "svc", e.reader(t, "b", group, []string{topic}, nil), mk())
	testkit.WaitFor(t, patience, "every message processed", func() bool { return d.countEffects(t, "svc") >= 4 })
	time.Sleep(300 * time.Millisecond)
	checkOrder(t, d.effects(t, "svc"), 4)
	for i := range calls {
		require.EqualValues(t, 1, calls[i].Load(), "handler calls of message %d", i)
	}
}
