package rabbitbus_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
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
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
	"github.com/sagaflow/sagaflow/wire"
)

// effects makes the table a handler writes its effect to: one row per
// processed message, in processing order.
func (e *env) effects(t *testing.T) {
	t.Helper()
	_, err := e.pool.Exec(e.ctx, "CREATE TABLE "+e.table("effects")+
		" (n bigint GENERATED ALWAYS AS IDENTITY, message_id text, key text, seq int, by text)")
	require.NoError(t, err)
}

// effect is a handler that records msg's id, key and the seq of its
// {"seq":n} payload in the message's transaction.
func (e *env) effect(by string) inbox.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		p, err := inbox.DecodeJSON[struct{ Seq int }](msg)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "INSERT INTO "+e.table("effects")+" (message_id, key, seq, by) VALUES ($1, $2, $3, $4)",
			msg.ID, string(msg.Key), p.Seq, by)
		return err
	}
}

type effectRow struct {
	ID, Key, By string
	Seq         int
}

func (e *env) effectRows(t *testing.T) []effectRow {
	t.Helper()
	rows, err := e.pool.Query(e.ctx, "SELECT message_id, key, seq, by FROM "+e.table("effects")+" ORDER BY n")
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (effectRow, error) {
		var x effectRow
		return x, r.Scan(&x.ID, &x.Key, &x.Seq, &x.By)
	})
	require.NoError(t, err)
	return out
}

// checkOncePerKeyOrder checks that every seq of want was processed exactly
// once and, per key, in increasing order.
func checkOncePerKeyOrder(t *testing.T, rows []effectRow, want int) {
	t.Helper()
	seen := map[int]int{}
	last := map[string]int{}
	for _, r := range rows {
		seen[r.Seq]++
		if prev, ok := last[r.Key]; ok {
			require.Greater(t, r.Seq, prev, "key %s out of order", r.Key)
		}
		last[r.Key] = r.Seq
	}
	require.Len(t, seen, want, "every message processed")
	for seq, n := range seen {
		require.Equal(t, 1, n, "seq %d processed %d times", seq, n)
	}
}

func (e *env) inbox(t *testing.T, consumer string) *inbox.Inbox {
	t.Helper()
	in, err := inbox.New(e.pool, &inbox.Config{Consumer: consumer, Schema: e.schema, Logger: quiet})
	require.NoError(t, err)
	return in
}

// start runs c until the test ends.
func start(t *testing.T, c *inbox.Consumer) {
	t.Helper()
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Stop(ctx)
	})
}

func (e *env) insertRow(t *testing.T, topic, key string, seq int) uuid.UUID {
	t.Helper()
	m := store.Message{ID: uuid.Must(uuid.NewV7()), Topic: topic, AggregateID: key, Type: "test.event",
		Payload: fmt.Appendf(nil, `{"seq":%d}`, seq)}
	require.NoError(t, e.st.InsertMessage(e.ctx, e.pool, &m))
	return m.ID
}

func (e *env) relay(t *testing.T, w relay.Writer) *relay.Relay {
	t.Helper()
	r, err := relay.New(e.pool, w, &relay.Config{Schema: e.schema, Logger: quiet, BatchSize: 16})
	require.NoError(t, err)
	return r
}

func drain(t *testing.T, ctx context.Context, r *relay.Relay) (published, failed int) {
	t.Helper()
	for range 1000 {
		p, f, err := r.RunOnce(ctx)
		require.NoError(t, err)
		if p == 0 && f == 0 {
			return published, failed
		}
		published += p
		failed += f
	}
	t.Fatal("drain: the outbox never ran dry")
	return
}

func TestRelayThroughRabbitMQToInboxOncePerKeyInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t, 3)
	topic, group := e.name("orders"), e.name("payments")
	e.effects(t)
	r := e.reader(t, group, []string{topic}, nil)
	c, err := e.inbox(t, "payments").NewConsumer(r, &inbox.ConsumerConfig{Default: e.effect("one")})
	require.NoError(t, err)
	start(t, c) // declares the group's queues when it connects
	waitFor(t, 10*time.Second, "the reader's queues", func() bool {
		ch, err := e.admin.Channel()
		if err != nil {
			return false
		}
		defer ch.Close()
		_, err = ch.QueueDeclarePassive(rabbitbus.QueueName(group, topic, 2), true, false, false, false, nil)
		return err == nil
	})

	const n = 60
	for i := range n {
		e.insertRow(t, topic, fmt.Sprintf("order-%d", i%7), i)
	}
	rl := e.relay(t, e.writer(t))
	published, failed := drain(t, e.ctx, rl)
	require.Equal(t, n, published)
	require.Zero(t, failed)

	waitFor(t, 20*time.Second, "every message processed", func() bool {
		return e.count(t, "SELECT count(*) FROM "+e.table("effects")) >= n
	})
	rows := e.effectRows(t)
	checkOncePerKeyOrder(t, rows, n)
	require.Equal(t, n, e.count(t, "SELECT count(*) FROM "+e.table("outbox")+" WHERE status = 'published'"))
	require.Zero(t, e.count(t, "SELECT count(*) FROM "+e.table("dead_letters")))
}

func TestRelayRowWithNoQueueBoundIsRetriedNotLost(t *testing.T) {
	t.Parallel()
	e := setup(t, 2)
	topic, group := e.name("late"), e.name("g")
	id := e.insertRow(t, topic, "k", 1)
	rl := e.relay(t, e.writer(t))
	published, failed := drain(t, e.ctx, rl)
	require.Zero(t, published)
	require.Equal(t, 1, failed)
	var status, lastErr string
	var attempts int
	require.NoError(t, e.pool.QueryRow(e.ctx, "SELECT status, attempts, last_error FROM "+e.table("outbox")+" WHERE id = $1", id).
		Scan(&status, &attempts, &lastErr))
	require.Equal(t, "pending", status, "kept for a later attempt")
	require.Equal(t, 1, attempts, "an attempt spent: a queue may never come")
	require.Contains(t, lastErr, "unroutable")

	// The consumers' queues appear; the retry goes through.
	e.setupGroups(t, []string{topic}, group)
	_, err := e.pool.Exec(e.ctx, "UPDATE "+e.table("outbox")+" SET available_at = now() WHERE id = $1", id)
	require.NoError(t, err)
	published, _ = drain(t, e.ctx, rl)
	require.Equal(t, 1, published)
	rd := e.reader(t, group, []string{topic}, nil)
	m := fetch(t, rd, 10*time.Second)
	got, _ := header(m, wire.HeaderMessageID)
	require.Equal(t, id.String(), got)
	require.NoError(t, rd.CommitMessages(e.ctx, m))
}

func TestDuplicatePublishHasOneEffect(t *testing.T) {
	t.Parallel()
	e := setup(t, 2)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	e.effects(t)
	w := e.writer(t)
	msg := func(id string, seq int) kafka.Message {
		return kafka.Message{Topic: topic, Key: []byte("k"), Value: fmt.Appendf(nil, `{"seq":%d}`, seq),
			Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte(id)}}}
	}
	// The relay published, crashed before marking the row, and published
	// it again; a foreign producer set only the AMQP message id, twice.
	require.NoError(t, w.WriteMessages(e.ctx, msg("m-1", 1), msg("m-1", 1), msg("m-2", 2)))
	require.NoError(t, w.WriteMessages(e.ctx, msg("m-1", 1)))
	ch, err := e.admin.Channel()
	require.NoError(t, err)
	defer ch.Close()
	for range 2 {
		require.NoError(t, ch.PublishWithContext(e.ctx, e.topo.Exchange, rabbitbus.RoutingKey(topic, rabbitbus.Partition([]byte("k"), 2)),
			true, false, amqp.Publishing{MessageId: "m-3", Body: []byte(`{"seq":3}`), Headers: amqp.Table{rabbitbus.KeyHeader: []byte("k")}}))
	}

	r := e.reader(t, group, []string{topic}, nil)
	c, err := e.inbox(t, "svc").NewConsumer(r, &inbox.ConsumerConfig{Default: e.effect("one")})
	require.NoError(t, err)
	start(t, c)
	waitFor(t, 15*time.Second, "the three messages", func() bool {
		return e.count(t, "SELECT count(*) FROM "+e.table("effects")) >= 3
	})
	// The duplicates come after the first copies on the same partition:
	// once all six are acknowledged, nothing is left to process.
	waitFor(t, 15*time.Second, "the queue to drain", func() bool {
		q, err := ch.QueueDeclarePassive(rabbitbus.QueueName(group, topic, rabbitbus.Partition([]byte("k"), 2)), true, false, false, false, nil)
		return err == nil && q.Messages == 0
	})
	rows := e.effectRows(t)
	require.Equal(t, []effectRow{{"m-1", "k", "one", 1}, {"m-2", "k", "one", 2}, {"m-3", "k", "one", 3}}, rows)
}

// A message with neither a sagaflow-message-id header nor an AMQP
// message-id has no identity that survives a redelivery over RabbitMQ (its
// Offset changes): an inbox consumer dead-letters it with that reason
// rather than risk a second effect, and the messages behind it go on (one
// with only the AMQP message-id is processed once). Found by review23 (F2):
// it was processed, and a redelivered copy processed again.
func TestAMessageWithoutAnIDIsDeadLetteredNotDoubled(t *testing.T) {
	t.Parallel()
	e := setup(t, 1)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	e.effects(t)
	ch, err := e.admin.Channel()
	require.NoError(t, err)
	defer ch.Close()
	for _, p := range []amqp.Publishing{
		{Body: []byte(`{"seq":1}`), Headers: amqp.Table{rabbitbus.KeyHeader: []byte("k")}},
		{MessageId: "m-2", Body: []byte(`{"seq":2}`), Headers: amqp.Table{rabbitbus.KeyHeader: []byte("k")}},
	} {
		require.NoError(t, ch.PublishWithContext(e.ctx, e.topo.Exchange, rabbitbus.RoutingKey(topic, 0), true, false, p))
	}
	r := e.reader(t, group, []string{topic}, nil)
	c, err := e.inbox(t, "svc").NewConsumer(r, &inbox.ConsumerConfig{Default: e.effect("one")})
	require.NoError(t, err)
	start(t, c)
	waitFor(t, 15*time.Second, "the message with an id", func() bool {
		return e.count(t, "SELECT count(*) FROM "+e.table("effects")) >= 1
	})
	waitFor(t, 15*time.Second, "the dead letter", func() bool {
		return e.count(t, "SELECT count(*) FROM "+e.table("dead_letters")+" WHERE consumer = 'svc'") >= 1
	})
	require.Equal(t, []effectRow{{"m-2", "k", "one", 2}}, e.effectRows(t))
	var reason string
	var value []byte
	require.NoError(t, e.pool.QueryRow(e.ctx, "SELECT reason, msg_value FROM "+e.table("dead_letters")+
		" WHERE consumer = 'svc'").Scan(&reason, &value))
	require.Contains(t, reason, "could not be deduplicated")
	require.Equal(t, `{"seq":1}`, string(value), "the raw bytes kept")
}

// poisons are the three kinds of string PostgreSQL refuses: a NUL byte,
// invalid UTF-8, and a 10 kB value past the btree index limit.
var poisons = []struct{ name, s string }{
	{"nul", "po\x00ison"},
	{"utf8", "po\xff\xfeison"},
	{"10kB", randomText(10 << 10)},
}

func randomText(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[r.IntN(len(letters))]
	}
	return string(b)
}

func TestPoisonIsDeadLetteredAndNeverHoldsBackThePartition(t *testing.T) {
	t.Parallel()
	e := setup(t, 1) // one partition: everything behind the poison waits if it stalls
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	_, err := e.pool.Exec(e.ctx, "CREATE TABLE "+e.table("received")+" (field text, value text); CREATE INDEX ON "+
		e.table("received")+" (value)")
	require.NoError(t, err)

	var mu sync.Mutex
	var valid []string
	cfg := &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{
		"valid": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			mu.Lock()
			defer mu.Unlock()
			valid = append(valid, string(msg.Value))
			return nil
		},
		// Writes what it got to an indexed text column, as a service
		// might: PostgreSQL refuses the poison.
		"naive": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			ins := "INSERT INTO " + e.table("received") + " VALUES ($1, $2)"
			for _, h := range msg.RawHeaders {
				if _, err := tx.Exec(ctx, ins, string(h.Key), string(h.Value)); err != nil {
					return fmt.Errorf("record header: %w", err)
				}
			}
			_, err := tx.Exec(ctx, ins, "value", string(msg.Value))
			return err
		},
		// Refuses for good what it cannot decode.
		"strict": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			_, err := inbox.DecodeJSON[struct{ N int }](msg)
			return err
		},
	}, RetryInitial: 10 * time.Millisecond}

	hdr := func(k, v string) kafka.Header { return kafka.Header{Key: k, Value: []byte(v)} }
	type poisonCase struct {
		name string
		msg  kafka.Message
		dead bool
	}
	var cases []poisonCase
	for _, p := range poisons {
		cases = append(cases,
			poisonCase{"message id " + p.name, kafka.Message{Value: []byte("id-" + p.name),
				Headers: []kafka.Header{hdr(wire.HeaderType, "valid"), hdr(wire.HeaderMessageID, p.s)}}, false},
			poisonCase{"header value " + p.name, kafka.Message{Value: []byte("v"),
				Headers: []kafka.Header{hdr(wire.HeaderType, "naive"), hdr("x-trace", p.s)}}, true},
			poisonCase{"value " + p.name, kafka.Message{Value: []byte(p.s),
				Headers: []kafka.Header{hdr(wire.HeaderType, "naive")}}, true},
			poisonCase{"type " + p.name, kafka.Message{Value: []byte("v"),
				Headers: []kafka.Header{hdr(wire.HeaderType, p.s)}}, true},
		)
		if len(p.s) <= 255 {
			cases = append(cases, poisonCase{"header name " + p.name, kafka.Message{Value: []byte("v"),
				Headers: []kafka.Header{hdr(wire.HeaderType, "naive"), hdr(p.s, "v")}}, true})
		}
	}
	cases = append(cases,
		poisonCase{"permanent handler error", kafka.Message{Value: []byte("not json"),
			Headers: []kafka.Header{hdr(wire.HeaderType, "strict")}}, true},
		poisonCase{"repeated message id", kafka.Message{Value: []byte("twice"),
			Headers: []kafka.Header{hdr(wire.HeaderType, "valid"), hdr(wire.HeaderMessageID, "a"), hdr(wire.HeaderMessageID, "b")}}, true},
	)
	var msgs []kafka.Message
	var want []string
	for i, c := range cases {
		c.msg.Topic = topic
		if !slices.ContainsFunc(c.msg.Headers, func(h kafka.Header) bool { return h.Key == wire.HeaderMessageID }) {
			// An id-less message is parked for that alone over RabbitMQ
			// (TestAMessageWithoutAnIDIsDeadLetteredNotDoubled): each
			// poison here has an id, so that its own reason is what parks it.
			c.msg.Headers = append(c.msg.Headers, hdr(wire.HeaderMessageID, fmt.Sprintf("p-%d", i)))
		}
		v := fmt.Sprintf("after %d", i)
		want = append(want, v)
		msgs = append(msgs, c.msg, kafka.Message{Topic: topic, Value: []byte(v),
			Headers: []kafka.Header{hdr(wire.HeaderType, "valid"), hdr(wire.HeaderMessageID, fmt.Sprintf("m-%d", i))}})
	}
	require.NoError(t, e.writer(t).WriteMessages(e.ctx, msgs...))

	r := e.reader(t, group, []string{topic}, nil)
	c, err := e.inbox(t, "svc").NewConsumer(r, cfg)
	require.NoError(t, err)
	began := time.Now()
	start(t, c)
	waitFor(t, 20*time.Second, "every valid message", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, v := range valid {
			if strings.HasPrefix(v, "after ") {
				n++
			}
		}
		return n == len(want)
	})
	require.Less(t, time.Since(began), 15*time.Second, "no poison held the partition")
	mu.Lock()
	var got []string
	for _, v := range valid {
		if strings.HasPrefix(v, "after ") {
			got = append(got, v)
		}
	}
	mu.Unlock()
	require.Equal(t, want, got, "every valid message behind a poison was processed, in order")

	var wantDead int
	for _, c := range cases {
		if c.dead {
			wantDead++
		}
	}
	waitFor(t, 10*time.Second, "the dead letters", func() bool {
		return e.count(t, "SELECT count(*) FROM "+e.table("dead_letters")+" WHERE consumer = 'svc'") == wantDead
	})
	// One reader, one partition: the offsets grow with the messages, so
	// the dead letters in offset order are the dead cases in order.
	rows, err := e.pool.Query(e.ctx, "SELECT reason, msg_value FROM "+e.table("dead_letters")+
		" WHERE consumer = 'svc' ORDER BY kafka_offset")
	require.NoError(t, err)
	type dl struct {
		reason string
		value  []byte
	}
	dead, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (dl, error) {
		var d dl
		return d, r.Scan(&d.reason, &d.value)
	})
	require.NoError(t, err)
	n := 0
	for _, c := range cases {
		if !c.dead {
			continue
		}
		require.Less(t, n, len(dead), "%s: dead-lettered", c.name)
		require.Equal(t, c.msg.Value, dead[n].value, "%s: the raw value kept", c.name)
		require.NotEmpty(t, dead[n].reason)
		require.NotContains(t, dead[n].reason, "could not be deduplicated", "%s: parked for its own reason", c.name)
		n++
	}
}

func TestReaderReconnectsAndTheBrokerRedeliversWhatWasNotAcked(t *testing.T) {
	t.Parallel()
	e := setup(t, 1)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	require.NoError(t, e.writer(t).WriteMessages(e.ctx,
		kafka.Message{Topic: topic, Value: []byte("1")}, kafka.Message{Topic: topic, Value: []byte("2")}))

	p := newProxy(t, brokerAddr(t, e.url))
	r, err := rabbitbus.NewReader(rabbitbus.Dial(p.url(e.url)), group, []string{topic}, &rabbitbus.ReaderOpts{Topology: e.topo})
	require.NoError(t, err)
	defer r.Close()
	first := fetch(t, r, 10*time.Second)
	require.Equal(t, "1", string(first.Value))
	p.cut()

	// The next fetches reconnect, and the broker delivers "1" again before
	// "2". ("2", sent ahead on the cut connection, may come first from the
	// reader's buffer before the cut is noticed: its commit fails and the
	// broker delivers it again too.)
	var again kafka.Message
	var stale []kafka.Message
	waitFor(t, 15*time.Second, "the redelivery", func() bool {
		ctx, cancel := context.WithTimeout(e.ctx, time.Second)
		defer cancel()
		m, err := r.FetchMessage(ctx)
		if err != nil {
			return false
		}
		if string(m.Value) != "1" {
			stale = append(stale, m)
			return false
		}
		again = m
		return true
	})
	for _, m := range stale {
		require.Equal(t, "2", string(m.Value))
		require.ErrorIs(t, r.CommitMessages(e.ctx, m), rabbitbus.ErrRedelivered)
	}
	require.Equal(t, "1", string(again.Value))
	require.NotEqual(t, first.Offset, again.Offset, "a redelivery is a new fetch")
	err = r.CommitMessages(e.ctx, first)
	require.ErrorIs(t, err, rabbitbus.ErrRedelivered, "the first copy's channel is gone")
	require.NoError(t, r.CommitMessages(e.ctx, again))
	second := fetch(t, r, 10*time.Second)
	require.Equal(t, "2", string(second.Value))
	require.NoError(t, r.CommitMessages(e.ctx, second))
}

// TestConsumerKilledMidBatchAnotherReaderTakesOver: consumer A (its
// connection through a proxy) is in the middle of a message, with more
// fetched ahead and none of them acknowledged, when its connection is cut;
// its transaction still commits. Consumer B of the same group, a standby,
// becomes the partitions' active consumer, receives what A had not
// acknowledged, skips what A committed (the inbox), and processes the
// rest: every message once, each key in order.
func TestConsumerKilledMidBatchAnotherReaderTakesOver(t *testing.T) {
	t.Parallel()
	e := setup(t, 2)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	e.effects(t)
	const n = 40
	var msgs []kafka.Message
	for i := range n {
		key := fmt.Sprintf("k%d", i%5)
		msgs = append(msgs, kafka.Message{Topic: topic, Key: []byte(key), Value: fmt.Appendf(nil, `{"seq":%d}`, i),
			Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: fmt.Appendf(nil, "m-%d", i)}}})
	}
	require.NoError(t, e.writer(t).WriteMessages(e.ctx, msgs...))

	p := newProxy(t, brokerAddr(t, e.url))
	ra, err := rabbitbus.NewReader(rabbitbus.Dial(p.url(e.url)), group, []string{topic}, &rabbitbus.ReaderOpts{Topology: e.topo})
	require.NoError(t, err)
	defer ra.Close()
	in := e.inbox(t, "svc")
	var calls atomic.Int32
	midway, release := make(chan struct{}), make(chan struct{})
	effectA := e.effect("a")
	ca, err := in.NewConsumer(ra, &inbox.ConsumerConfig{Default: func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		if calls.Add(1) == 6 {
			close(midway)
			<-release
		}
		return effectA(ctx, tx, msg)
	}})
	require.NoError(t, err)
	start(t, ca)
	<-midway

	// B subscribes after A: a standby for both partitions.
	rb := e.reader(t, group, []string{topic}, nil)
	cb, err := in.NewConsumer(rb, &inbox.ConsumerConfig{Default: e.effect("b")})
	require.NoError(t, err)
	start(t, cb)

	p.refuse(true) // A cannot come back
	p.cut()
	close(release) // A's sixth transaction commits; its ack cannot go out

	waitFor(t, 20*time.Second, "every message processed", func() bool {
		return e.count(t, "SELECT count(*) FROM "+e.table("effects")) >= n
	})
	rows := e.effectRows(t)
	checkOncePerKeyOrder(t, rows, n)
	var byA, byB int
	for _, r := range rows {
		if r.By == "a" {
			byA++
		} else {
			byB++
		}
	}
	require.Equal(t, 6, byA, "A processed six before it died")
	require.Equal(t, n-6, byB, "B processed the rest")
}

func TestMembersSpreadPartitionsAndAStandbyTakesOver(t *testing.T) {
	t.Parallel()
	e := setup(t, 4)
	topic, group := e.name("t"), e.name("g")
	e.setupGroups(t, []string{topic}, group)
	opts := func(member int) *rabbitbus.ReaderOpts {
		// A standby delay well past the time both members take to connect,
		// even on a loaded machine: a standby that subscribed first would
		// take the other's partitions.
		return &rabbitbus.ReaderOpts{Members: 2, Member: member, StandbyDelay: 2 * time.Second}
	}
	r0 := e.reader(t, group, []string{topic}, opts(0))
	r1 := e.reader(t, group, []string{topic}, opts(1))
	// Connect both (a fetch that times out connects and subscribes).
	for _, r := range []*rabbitbus.Reader{r0, r1} {
		ctx, cancel := context.WithTimeout(e.ctx, 200*time.Millisecond)
		_, err := r.FetchMessage(ctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
	}
	time.Sleep(2500 * time.Millisecond) // past StandbyDelay: both stand by for the other's share

	// One key per partition.
	keys := map[int]string{}
	for i := 0; len(keys) < 4; i++ {
		k := fmt.Sprintf("key-%d", i)
		if _, ok := keys[rabbitbus.Partition([]byte(k), 4)]; !ok {
			keys[rabbitbus.Partition([]byte(k), 4)] = k
		}
	}
	w := e.writer(t)
	for p := range 4 {
		require.NoError(t, w.WriteMessages(e.ctx, kafka.Message{Topic: topic, Key: []byte(keys[p]), Value: []byte("x")}))
	}
	for _, member := range []int{0, 1} {
		r := []*rabbitbus.Reader{r0, r1}[member]
		for range 2 {
			m := fetch(t, r, 10*time.Second)
			require.Equal(t, member, m.Partition%2, "member %d runs partitions p%%2 == %d", member, member)
			require.NoError(t, r.CommitMessages(e.ctx, m))
		}
	}

	// Member 0 goes away: member 1, standing by, takes its partitions.
	require.NoError(t, r0.Close())
	for p := range 4 {
		require.NoError(t, w.WriteMessages(e.ctx, kafka.Message{Topic: topic, Key: []byte(keys[p]), Value: []byte("y")}))
	}
	parts := map[int]bool{}
	for range 4 {
		m := fetch(t, r1, 10*time.Second)
		parts[m.Partition] = true
		require.NoError(t, r1.CommitMessages(e.ctx, m))
	}
	require.Len(t, parts, 4, "the standby runs every partition")
}
