package transporttest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/wire"
)

// Reader is what the suite consumes through: the reader seam of package
// inbox, with Close (saga.KafkaReader has the same methods).
type Reader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

// Broker is one case's broker, started by [Bus].Start. Every writer and
// reader it makes must dial through the [Link] it is given: the suite
// freezes a link to make its client look hung to the broker.
type Broker interface {
	// CreateTopic creates topic with the given number of partitions; it
	// fails the test when it cannot.
	CreateTopic(t *testing.T, topic string, partitions int)
	// NewWriter returns a writer for a relay. The suite closes it.
	NewWriter(t *testing.T, link *Link) relay.Writer
	// NewReader returns a member of group consuming topics, from the first
	// message for a group that has consumed nothing. The suite closes it.
	NewReader(t *testing.T, link *Link, group string, topics []string) Reader
	// Restart stops the broker and starts it again, keeping what it stored,
	// and returns at once once it is up: clients must find it again by
	// themselves. A transport that cannot restart its broker in a test
	// says in its doc what it does instead (cutting every connection with
	// [Network.Cut], say).
	Restart(t *testing.T)
}

// Bus describes a transport to the suite.
type Bus struct {
	// Name names the transport in test names.
	Name string
	// Start starts a broker for one case (or connects to one, with names
	// of the case's own); the case's cleanups stop it. Cases run in
	// parallel, each with its own broker, so that restarting one breaks no
	// other. net is the case's network: dial through its links.
	Start func(t *testing.T, net *Network) Broker
	// RedeliveryAfter is how long after a member of a group went silent
	// (hung, cut off) the broker gives its unacknowledged messages to
	// another member: the ack wait, or the session timeout.
	RedeliveryAfter time.Duration
}

// Main runs a package's tests with the suite's PostgreSQL harness; call it
// from TestMain. The suite finds PostgreSQL as sagaflow's own tests do:
// TEST_DATABASE_URL or DATABASE_URL, else 127.0.0.1:5432 (user postgres,
// trust), else a throwaway server from the PostgreSQL binaries.
func Main(m *testing.M) { pgtest.Main(m) }

// waitTimeout bounds each wait of a case for what it expects.
const waitTimeout = 30 * time.Second

// Run runs every case of the suite against b, each as a parallel subtest,
// end to end: rows of a real outbox in PostgreSQL, a relay with b's writer,
// b's broker, inbox consumers over b's readers, and an effects table that
// each processed message writes a row to in its transaction.
func Run(t *testing.T, b Bus) {
	t.Helper()
	if b.Start == nil || b.Name == "" || b.RedeliveryAfter <= 0 {
		t.Fatal("transporttest: Bus needs Name, Start and a positive RedeliveryAfter")
	}
	cases := []struct {
		name string
		fn   func(*testing.T, *env)
	}{
		{"AtLeastOnce", atLeastOnce},
		{"PerKeyOrder", perKeyOrder},
		{"DuplicatesDeduplicated", duplicates},
		{"PoisonParked", poison},
		{"BrokerRestart", brokerRestart},
		{"ConsumerKilledMidBatch", consumerKilled},
		{"RedeliveryAfterAckWait", redelivery},
		{"NewReaderAfterARestart", newReaderAfterARestart},
		{"UnroutableMessageParked", unroutable},
	}
	for _, c := range cases {
		t.Run(b.Name+"/"+c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, newEnv(t, b))
		})
	}
}

// effectType is the type of the suite's messages.
const effectType = "conformance.effect"

// env is one case's world.
type env struct {
	t      *testing.T
	bus    Bus
	broker Broker
	net    *Network
	pool   *pgxpool.Pool
	schema string
	ob     *outbox.Outbox
	topic  string
	group  string
	log    *slog.Logger
}

func newEnv(t *testing.T, b Bus) *env {
	pool, schema := pgtest.NewSchema(t)
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		t.Fatalf("transporttest: migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+pgx.Identifier{schema, "effects"}.Sanitize()+` (
		n bigserial PRIMARY KEY, message_id text NOT NULL, k text NOT NULL, seq int NOT NULL, body text NOT NULL, note text)`); err != nil {
		t.Fatalf("transporttest: create effects: %v", err)
	}
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	net := NewNetwork()
	e := &env{t: t, bus: b, net: net, pool: pool, schema: schema, ob: ob,
		topic: "conformance." + randomHex(6), group: "conformance-" + randomHex(4),
		log: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	e.broker = b.Start(t, net)
	return e
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// testWriter sends log lines to the test's log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func (e *env) table(name string) string { return pgx.Identifier{e.schema, name}.Sanitize() }

// startRelay starts a relay of the case's outbox with a new writer.
func (e *env) startRelay() {
	w := e.broker.NewWriter(e.t, e.net.Link())
	e.t.Cleanup(func() { _ = w.Close() })
	r, err := relay.New(e.pool, w, &relay.Config{
		Schema: e.schema, PollInterval: 50 * time.Millisecond, PublishTimeout: 3 * time.Second,
		Backoff: func(int) time.Duration { return 100 * time.Millisecond }, OutageBackoffMax: 300 * time.Millisecond,
		Logger: e.log,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	if err := r.Start(context.Background()); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { stop(e.t, "relay", r.Stop) })
}

func stop(t *testing.T, what string, fn func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := fn(ctx); err != nil {
		t.Errorf("transporttest: stop %s: %v", what, err)
	}
}

// reader returns a new member of the case's group over its own link.
func (e *env) reader(link *Link) Reader {
	if link == nil {
		link = e.net.Link()
	}
	r := e.broker.NewReader(e.t, link, e.group, []string{e.topic})
	e.t.Cleanup(func() {
		link.Thaw()
		_ = r.Close()
	})
	return r
}

// consume starts an inbox consumer of the case's group over r. The
// handler writes one effects row per message: its id, key, sequence number
// and body, and its x-note header. A body "poison" is refused for good.
func (e *env) consume(r Reader) *inbox.Consumer {
	in, err := inbox.New(e.pool, &inbox.Config{Consumer: e.group, Schema: e.schema, Logger: e.log})
	if err != nil {
		e.t.Fatal(err)
	}
	c, err := in.NewConsumer(r, &inbox.ConsumerConfig{
		Handlers:     map[string]inbox.HandlerFunc{effectType: e.handle},
		RetryInitial: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond, MaxAttempts: 5, Retention: -1,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	if err := c.Start(context.Background()); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { stop(e.t, "consumer", c.Stop) })
	return c
}

type refused struct{ error }

func (refused) Permanent() bool { return true }

func (e *env) handle(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
	seqText, body, ok := strings.Cut(string(msg.Value), "|")
	seq, err := strconv.Atoi(seqText)
	switch {
	case !ok || err != nil:
		return refused{fmt.Errorf("payload %q is not seq|body", msg.Value)}
	case body == "poison":
		return refused{errors.New("the handler refuses this message for good")}
	}
	var note *string
	if v, ok := msg.Headers["x-note"]; ok {
		note = &v
	}
	_, err = tx.Exec(ctx, "INSERT INTO "+e.table("effects")+" (message_id, k, seq, body, note) VALUES ($1, $2, $3, $4, $5)",
		msg.ID, string(msg.Key), seq, body, note)
	return err
}

// msg is a message the case writes to its outbox.
type msg struct {
	key   string
	seq   int
	body  string
	id    uuid.UUID // zero: a new one
	topic string    // "": the case's topic
}

// write inserts msgs into the outbox in one transaction, in order.
func (e *env) write(msgs ...msg) {
	e.t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		for _, m := range msgs {
			topic := m.topic
			if topic == "" {
				topic = e.topic
			}
			if err := e.ob.InsertTx(ctx, tx, outbox.Message{ID: m.id, Topic: topic, Key: m.key, Type: effectType,
				Payload: []byte(strconv.Itoa(m.seq) + "|" + m.body)}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		e.t.Fatalf("transporttest: write to the outbox: %v", err)
	}
}

// interleaved returns perKey messages for each of keys, round robin:
// k0/1, k1/1, …, k0/2, k1/2, …
func interleaved(keys []string, perKey int) []msg {
	var out []msg
	for s := 1; s <= perKey; s++ {
		for _, k := range keys {
			out = append(out, msg{key: k, seq: s, body: "ok"})
		}
	}
	return out
}

func keys(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = "key-" + strconv.Itoa(i)
	}
	return out
}

// effect is a row of the effects table.
type effect struct {
	N         int64
	MessageID string
	Key       string
	Seq       int
	Body      string
}

func (e *env) effects() []effect {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), "SELECT n, message_id, k, seq, body FROM "+e.table("effects")+" ORDER BY n")
	if err != nil {
		e.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[effect])
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *env) count(query string) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), query).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// deadReasons returns the reasons of the dead letters, oldest first.
func (e *env) deadReasons() []string {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), "SELECT reason FROM "+e.table("dead_letters")+" ORDER BY id")
	if err != nil {
		e.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}

// waitUntil polls cond until it holds, failing the test after d.
func (e *env) waitUntil(d time.Duration, what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("transporttest: %s: not within %v", what, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitEffects waits until the effects table has n rows.
func (e *env) waitEffects(n int) {
	e.t.Helper()
	q := "SELECT count(*) FROM " + e.table("effects")
	e.waitUntil(waitTimeout, fmt.Sprintf("%d effects", n), func() bool { return e.count(q) >= n })
}

// checkEffects asserts exactly want effects, each message's once, and each
// key's in the order of its sequence numbers.
func (e *env) checkEffects(want int) []effect {
	e.t.Helper()
	got := e.effects()
	if len(got) != want {
		e.t.Fatalf("transporttest: %d effects, want %d", len(got), want)
	}
	seen := map[string]bool{}
	last := map[string]int{}
	for _, f := range got {
		if seen[f.MessageID] {
			e.t.Fatalf("transporttest: message %s had two effects", f.MessageID)
		}
		seen[f.MessageID] = true
		if f.Seq <= last[f.Key] {
			var ofKey []effect
			for _, g := range got {
				if g.Key == f.Key {
					ofKey = append(ofKey, g)
				}
			}
			e.t.Fatalf("transporttest: key %s: effect of seq %d after seq %d: out of order; the key's effects: %+v", f.Key, f.Seq, last[f.Key], ofKey)
		}
		last[f.Key] = f.Seq
	}
	return got
}

// settle waits a little so that a late duplicate or a message that should
// not arrive has a chance to show up before the counts are checked.
func settle() { time.Sleep(300 * time.Millisecond) }

// 1. Every message written arrives, across two members of a group and
// several partitions, and none has two effects.
func atLeastOnce(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 4)
	e.consume(e.reader(nil))
	e.consume(e.reader(nil))
	e.startRelay()
	all := interleaved(keys(20), 10)
	e.write(all[:100]...)
	e.write(all[100:]...)
	e.waitEffects(len(all))
	settle()
	e.checkEffects(len(all))
	if n := len(e.deadReasons()); n != 0 {
		t.Fatalf("transporttest: %d dead letters, want none: %q", n, e.deadReasons())
	}
}

// 2. Keys interleaved over fewer partitions than keys, consumed by two
// members: each key's effects are in the order its messages were written.
func perKeyOrder(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 3)
	e.consume(e.reader(nil))
	e.consume(e.reader(nil))
	e.startRelay()
	all := interleaved(keys(6), 30)
	for i := 0; i < len(all); i += 20 {
		e.write(all[i:min(i+20, len(all))]...)
	}
	e.waitEffects(len(all))
	settle()
	got := e.checkEffects(len(all))
	inKeyOrder(t, got)
}

// 3. The same message published twice by a producer, and once more by an
// operator's replay through the relay, has one effect: the inbox (or the
// broker's own deduplication) drops the copies.
func duplicates(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 2)
	e.consume(e.reader(nil))
	e.startRelay()
	id := uuid.New()
	e.write(msg{key: "dup", seq: 1, body: "first", id: id})
	e.waitEffects(1)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	// The relay marks the row published after the broker took it, so the
	// consumer's effect can come first; the replay takes published rows
	// only (a CI run replayed none).
	e.waitUntil(waitTimeout, "the row marked published", func() bool {
		st, err := e.ob.Status(ctx)
		return err == nil && st.Pending == 0
	})

	// A producer that retried: the same message, id and all, again.
	w := e.broker.NewWriter(t, e.net.Link())
	defer w.Close()
	same := kafka.Message{Topic: e.topic, Key: []byte("dup"), Value: []byte("1|first"), Headers: []kafka.Header{
		{Key: wire.HeaderMessageID, Value: []byte(id.String())}, {Key: wire.HeaderType, Value: []byte(effectType)}}}
	if err := w.WriteMessages(ctx, same, same); err != nil {
		t.Fatalf("transporttest: publish the copies: %v", err)
	}
	// The operator's replay: the relay publishes the row once more.
	res, err := e.ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Key: "dup"}, RatePerSecond: 1000})
	if err != nil || res.Republished != 1 {
		t.Fatalf("transporttest: replay: %v, %+v", err, res)
	}
	e.waitUntil(waitTimeout, "the replayed row published", func() bool {
		st, err := e.ob.Status(ctx)
		return err == nil && st.Pending == 0
	})
	// A message behind the copies on the same key: once it has had its
	// effect, every copy before it on the partition has been consumed.
	e.write(msg{key: "dup", seq: 2, body: "second"})
	e.waitEffects(2)
	settle()
	got := e.checkEffects(2)
	if got[0].MessageID != id.String() || got[1].Body != "second" {
		t.Fatalf("transporttest: effects %+v", got)
	}
}

// 4. Messages that can never be processed are dead-lettered with a reason
// and do not hold back the messages behind them on their key: one the
// handler refuses, bodies PostgreSQL refuses (NUL, invalid UTF-8), and,
// from a producer that is not sagaflow, an id of invalid UTF-8 with a 10 kB
// header holding NUL that the handler stores, and a type with a NUL.
func poison(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 1)
	e.consume(e.reader(nil))
	e.startRelay()
	const k = "poisoned"
	e.write(
		msg{key: k, seq: 1, body: "ok"},
		msg{key: k, seq: 2, body: "poison"},
		msg{key: k, seq: 3, body: "nul\x00byte"},
		msg{key: k, seq: 4, body: "bad\xff\xfeutf8"},
		msg{key: k, seq: 5, body: "ok"},
	)
	e.waitEffects(2)

	w := e.broker.NewWriter(t, e.net.Link())
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	big := strings.Repeat("x", 5000) + "\x00" + strings.Repeat("\xff", 5000)
	if err := w.WriteMessages(ctx,
		kafka.Message{Topic: e.topic, Key: []byte(k), Value: []byte("6|ok"), Headers: []kafka.Header{
			{Key: wire.HeaderMessageID, Value: []byte("id-\xff\xfe")}, {Key: wire.HeaderType, Value: []byte(effectType)},
			{Key: "x-note", Value: []byte(big)}}},
		kafka.Message{Topic: e.topic, Key: []byte(k), Value: []byte("7|ok"), Headers: []kafka.Header{
			{Key: wire.HeaderMessageID, Value: []byte(uuid.NewString())}, {Key: wire.HeaderType, Value: []byte("conformance.\x00effect")}}},
	); err != nil {
		t.Fatalf("transporttest: publish the foreign messages: %v", err)
	}
	e.write(msg{key: k, seq: 8, body: "ok"})
	e.waitEffects(3)
	settle()
	got := e.checkEffects(3)
	for i, seq := range []int{1, 5, 8} {
		if got[i].Seq != seq {
			t.Fatalf("transporttest: effects %+v, want seqs 1, 5, 8", got)
		}
	}
	reasons := e.deadReasons()
	want := []string{
		"refused by its handler: the handler refuses this message for good",
		"PostgreSQL refused the message's content",
		"PostgreSQL refused the message's content",
		"PostgreSQL refused the message's content",
		"unknown message type",
	}
	if len(reasons) != len(want) {
		t.Fatalf("transporttest: dead letters %q, want %d", reasons, len(want))
	}
	for i, w := range want {
		if !strings.Contains(reasons[i], w) {
			t.Fatalf("transporttest: dead letter %d: reason %q, want it to say %q", i, reasons[i], w)
		}
	}
}

// 5. Messages written before, during and after a broker restart all have
// exactly one effect.
func brokerRestart(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 2)
	e.consume(e.reader(nil))
	e.consume(e.reader(nil))
	e.startRelay()
	all := interleaved(keys(8), 10)
	e.write(all[:40]...)
	e.waitEffects(10)
	e.broker.Restart(t)
	e.write(all[40:]...)
	e.waitEffects(len(all))
	settle()
	e.checkEffects(len(all))
}

// countingReader records what a reader fetched, and with dropCommits
// never commits: a process killed after its transactions committed and
// before its commits reached the broker.
type countingReader struct {
	Reader
	dropCommits bool

	mu      sync.Mutex
	fetched []string
	dropped int
}

func (r *countingReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	m, err := r.Reader.FetchMessage(ctx)
	if err == nil {
		r.mu.Lock()
		r.fetched = append(r.fetched, inbox.FromKafka(m).ID)
		r.mu.Unlock()
	}
	return m, err
}

func (r *countingReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	if r.dropCommits {
		r.mu.Lock()
		r.dropped += len(msgs)
		r.mu.Unlock()
		return nil
	}
	return r.Reader.CommitMessages(ctx, msgs...)
}

func (r *countingReader) snapshot() ([]string, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.fetched...), r.dropped
}

// 6. A member processes messages and dies before committing any; another
// member of the group gets them again and they have no second effect, and
// nothing is lost.
func consumerKilled(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 2)
	first := &countingReader{Reader: e.reader(nil), dropCommits: true}
	c1 := e.consume(first)
	e.startRelay()
	all := interleaved(keys(6), 5)
	e.write(all...)
	e.waitUntil(waitTimeout, "the first member processed a message", func() bool {
		_, dropped := first.snapshot()
		return dropped >= 1
	})
	stop(t, "first consumer", c1.Stop)
	if err := first.Close(); err != nil {
		t.Fatalf("transporttest: close the first member: %v", err)
	}
	processed, _ := first.snapshot()
	before := e.count("SELECT count(*) FROM " + e.table("effects"))

	second := &countingReader{Reader: e.reader(nil)}
	e.consume(second)
	e.waitEffects(len(all))
	settle()
	e.checkEffects(len(all))
	again, _ := second.snapshot()
	redelivered := 0
	for _, id := range processed {
		for _, a := range again {
			if a == id {
				redelivered++
				break
			}
		}
	}
	if before < 1 || redelivered < 1 {
		t.Fatalf("transporttest: the case did not exercise a redelivery: %d effects before the kill, %d of them fetched again", before, redelivered)
	}
}

// 7. A member fetches a message and hangs (its connection frozen, never
// committing): after the redelivery delay another member gets the message,
// which has one effect, and the messages behind it follow.
func redelivery(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 1)
	e.startRelay()
	e.write(msg{key: "stall", seq: 1, body: "held"})
	link := e.net.Link()
	hung := e.reader(link)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	m, err := hung.FetchMessage(ctx)
	if err != nil {
		t.Fatalf("transporttest: the first member's fetch: %v", err)
	}
	if string(m.Value) != "1|held" {
		t.Fatalf("transporttest: the first member fetched %q", m.Value)
	}
	link.Freeze()
	start := time.Now()
	e.consume(e.reader(nil))
	e.write(msg{key: "stall", seq: 2, body: "behind"})
	e.waitUntil(e.bus.RedeliveryAfter+waitTimeout, "redelivery to the second member", func() bool {
		return e.count("SELECT count(*) FROM "+e.table("effects")) >= 2
	})
	t.Logf("redelivered and processed %v after the first member hung", time.Since(start).Round(time.Millisecond))
	settle()
	got := e.checkEffects(2)
	if got[0].Body != "held" || got[1].Body != "behind" {
		t.Fatalf("transporttest: effects %+v", got)
	}
}

// 8. A service restarted: its consumer and reader stop, and a new reader of
// the group takes over. Each message is processed once or dead-lettered,
// whatever the transport's positions do across readers: none is skipped as
// a duplicate of one the earlier reader saw, and a poison message is not
// lost because an earlier one was parked at the same position (a reader
// that counted its offsets from 0 again did both).
func newReaderAfterARestart(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 1)
	e.startRelay()
	const k = "restarted"
	r := e.reader(nil)
	c := e.consume(r)
	e.write(msg{key: k, seq: 1, body: "ok"}, msg{key: k, seq: 2, body: "poison"})
	e.waitEffects(1)
	e.waitUntil(waitTimeout, "the first poison message dead-lettered", func() bool { return len(e.deadReasons()) >= 1 })
	settle() // its offset committed
	stop(t, "the first consumer", c.Stop)
	if err := r.Close(); err != nil {
		t.Fatalf("transporttest: close the first reader: %v", err)
	}
	e.consume(e.reader(nil))
	e.write(msg{key: k, seq: 3, body: "ok"}, msg{key: k, seq: 4, body: "poison"})
	e.waitEffects(2)
	e.waitUntil(waitTimeout, "the second poison message dead-lettered", func() bool { return len(e.deadReasons()) >= 2 })
	settle()
	got := e.checkEffects(2)
	if got[0].Seq != 1 || got[1].Seq != 3 {
		t.Fatalf("transporttest: effects %+v, want seqs 1 and 3", got)
	}
	if reasons := e.deadReasons(); len(reasons) != 2 {
		t.Fatalf("transporttest: dead letters %q, want the two poison messages", reasons)
	}
}

// inKeyOrder fails the test unless each key's effects have the sequence
// numbers 1, 2, 3, … in that order.
func inKeyOrder(t *testing.T, got []effect) {
	t.Helper()
	perKey := map[string][]int{}
	for _, f := range got {
		perKey[f.Key] = append(perKey[f.Key], f.Seq)
	}
	for k, seqs := range perKey {
		for i, s := range seqs {
			if s != i+1 {
				t.Fatalf("transporttest: key %s: effects in order %v", k, seqs)
			}
		}
	}
}

// 9. A message for a topic the broker does not have (no topic, stream or
// queue: a typo in a producer's topic) is refused by the writer for that
// message alone: the relay parks its row dead after its attempts, and every
// message written with it, before it, after it and while it is retried, has
// its effect, in order per key.
func unroutable(t *testing.T, e *env) {
	e.broker.CreateTopic(t, e.topic, 2)
	e.consume(e.reader(nil))
	e.startRelay()
	missing := e.topic + ".missing"
	all := interleaved(keys(4), 10)
	first := append(slices.Clone(all[:20]), msg{key: "key-1", seq: 1000, body: "unroutable", topic: missing})
	e.write(first...)
	e.write(all[20:]...)
	e.waitEffects(len(all))
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var status, lastErr string
	e.waitUntil(waitTimeout, "the unroutable row parked dead", func() bool {
		err := e.pool.QueryRow(ctx, "SELECT status, coalesce(last_error, '') FROM "+e.table("outbox")+" WHERE topic = $1", missing).
			Scan(&status, &lastErr)
		return err == nil && status == "dead"
	})
	if lastErr == "" {
		t.Fatal("transporttest: the unroutable row is dead with no last_error")
	}
	settle()
	got := e.checkEffects(len(all))
	inKeyOrder(t, got)
	t.Logf("the unroutable row: %s", lastErr)
}
