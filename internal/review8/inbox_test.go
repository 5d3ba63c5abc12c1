package review8_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// Inbox consumers deal with the messages a kafka-go reader has ready
// several to a transaction (inbox.Consumer.Batched), and fall back to one
// at a time when one of them is poison, refused or fails. inbox/doc.go's
// promises must hold across that: each message's effect once, poison
// dead-lettered once with its reason and never holding the partition, a
// dead letter's id not recorded (so a forged copy cannot shadow the
// genuine message), offsets committed only after the transaction, order
// kept through retries.

const (
	inTopic = "review8.payments"
	inGroup = "review8-payments"
)

type inboxRig struct {
	*db
	kc *kafkatest.Cluster
	cl *kgo.Client
	in *inbox.Inbox
}

func newInboxRig(t *testing.T) *inboxRig {
	t.Helper()
	d := newDB(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, inTopic))
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: "payments", Schema: d.Schema})
	require.NoError(t, err)
	return &inboxRig{db: d, kc: kc, cl: cl, in: in}
}

// msg is a message with the headers the relay sets; note travels in the
// x-note header, as raw bytes.
func msg(typ, id, note string) *kgo.Record {
	r := &kgo.Record{Topic: inTopic, Partition: 0, Key: []byte("order-1"), Value: []byte(`{"amount":1}`)}
	if typ != "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: wire.HeaderType, Value: []byte(typ)})
	}
	if id != "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: wire.HeaderMessageID, Value: []byte(id)})
	}
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: "x-note", Value: []byte(note)})
	return r
}

func (r *inboxRig) produce(t *testing.T, recs ...*kgo.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	require.NoError(t, r.cl.ProduceSync(ctx, recs...).FirstErr())
}

func (r *inboxRig) reader(t *testing.T) *kafka.Reader {
	t.Helper()
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.kc.Addrs(), GroupID: inGroup, Topic: inTopic,
		StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond,
		HeartbeatInterval: 500 * time.Millisecond, JoinGroupBackoff: 200 * time.Millisecond, CommitInterval: 0})
	t.Cleanup(func() { _ = rd.Close() })
	return rd
}

// committed is the group's committed offset of partition 0, -1 for none.
func (r *inboxRig) committed() int64 {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(r.kc.Addrs()...), Transport: tr}
	res, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: inGroup, Topics: map[string][]int{inTopic: {0}}})
	if err != nil || res.Error != nil || len(res.Topics[inTopic]) != 1 || res.Topics[inTopic][0].Error != nil {
		return -1
	}
	return res.Topics[inTopic][0].CommittedOffset
}

// run runs c until cond holds (or fails the test after 30 s), then stops it.
func run(t *testing.T, c *inbox.Consumer, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	end := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(end) {
			cancel()
			<-done
			t.Fatal("timed out waiting for the consumer")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	require.NoError(t, <-done)
}

// effectIDs lists the effects (message ids) in commit order.
func (r *inboxRig) effectIDs(t *testing.T) []string {
	t.Helper()
	rows, err := r.Pool.Query(context.Background(), `SELECT what FROM `+r.fx.Table()+` ORDER BY seq`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

type deadRow struct {
	ID     string
	Reason string
	Offset int64
}

func (r *inboxRig) dead(t *testing.T) []deadRow {
	t.Helper()
	rows, err := r.Pool.Query(context.Background(), `SELECT coalesce(message_id, ''), reason, kafka_offset FROM `+r.Table("dead_letters")+` ORDER BY kafka_offset`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[deadRow])
	require.NoError(t, err)
	return out
}

// handler writes the message's id as its effect and its note to the
// indexed notes table (where poison notes are refused); "refuse" is a
// permanent refusal, "flaky:N" fails the first N calls.
type handler struct {
	r     *inboxRig
	mu    sync.Mutex
	calls map[string]int
	block func(ctx context.Context, m inbox.Message) error
}

func newHandler(r *inboxRig) *handler { return &handler{r: r, calls: map[string]int{}} }

func (h *handler) handle(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	h.mu.Lock()
	h.calls[m.ID]++
	n := h.calls[m.ID]
	h.mu.Unlock()
	if h.block != nil {
		if err := h.block(ctx, m); err != nil {
			return err
		}
	}
	note := m.Headers["x-note"]
	if note == "refuse" {
		return steps.Permanent(errors.New("review8: refused"))
	}
	var flaky int
	if _, err := fmt.Sscanf(note, "flaky:%d", &flaky); err == nil && n <= flaky {
		return fmt.Errorf("review8: transient failure %d of %s", n, m.ID)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+h.r.fx.Table()+` (what) VALUES ($1)`, m.ID); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO `+h.r.Table("notes")+` (note) VALUES ($1)`, note)
	return err
}

func (h *handler) callsOf(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls[id]
}

func ids(prefix string, n int) []string {
	var out []string
	for i := range n {
		out = append(out, prefix+strconv.Itoa(i))
	}
	return out
}

// A backlog of 60 genuine messages with, among them, a copy of a genuine
// message (different bytes, same id), PostgreSQL poison in the handler's
// write (NUL, invalid UTF-8, 10 kB in an indexed column), and three
// forgeries that copy a genuine message's id and come just before it
// (unknown type, a repeated sagaflow header, a permanent refusal). Every
// genuine message has its effect once and in order, each poison and forgery
// is dead-lettered once with a reason, the genuine messages the forgeries
// copied are not taken for duplicates, and the group's offset ends past
// everything.
func TestConsumerBatchWithPoisonDuplicatesAndForgeries(t *testing.T) {
	t.Parallel()
	r := newInboxRig(t)
	var recs []*kgo.Record
	deadWant := map[int64]string{}
	off := int64(0)
	add := func(rec *kgo.Record, dead string) {
		recs = append(recs, rec)
		if dead != "" {
			deadWant[off] = dead
		}
		off++
	}
	for i := range 60 {
		id := "m-" + strconv.Itoa(i)
		switch i {
		case 30:
			add(msg("refund", id, "forged: unknown type"), id)
		case 45:
			add(msg("charge", id, "refuse"), id)
		case 50:
			f := msg("charge", id, "forged: repeated header")
			f.Headers = append(f.Headers, kgo.RecordHeader{Key: wire.HeaderType, Value: []byte("charge")})
			add(f, id)
		}
		add(msg("charge", id, "ok-"+id), "")
		switch i {
		case 5:
			add(msg("charge", id, "a copy with other bytes"), "")
		case 10, 25, 40:
			p := poison[map[int]int{10: 0, 25: 1, 40: 2}[i]]
			add(msg("charge", "p-"+p.name, p.s), "p-"+p.name)
		}
	}
	// A clean tail of 40, so that some batch holds no poison whatever the
	// reader's fetches make of the boundaries (every batch of 16 before it
	// can hold one, and a batch with poison is run one at a time).
	for _, id := range ids("t-", 40) {
		add(msg("charge", id, "ok-"+id), "")
	}
	r.produce(t, recs...)
	h := newHandler(r)
	c, err := r.in.NewConsumer(r.reader(t), &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge": h.handle}, BatchSize: 16})
	require.NoError(t, err)
	run(t, c, func() bool { return r.committed() == int64(len(recs)) })

	require.Equal(t, append(ids("m-", 60), ids("t-", 40)...), r.effectIDs(t), "each genuine message once, in order")
	got := r.dead(t)
	require.Len(t, got, len(deadWant), "dead letters: %+v", got)
	for _, d := range got {
		require.Equal(t, deadWant[d.Offset], d.ID, "dead letter at offset %d", d.Offset)
		require.NotEmpty(t, d.Reason)
		t.Logf("dead at %d (%s): %.120q", d.Offset, d.ID, d.Reason)
	}
	require.Positive(t, c.Batched(), "the backlog was dealt with several to a transaction")
	again := 0
	for _, id := range ids("m-", 60) {
		if h.callsOf(id) > 1 {
			again++
		}
	}
	t.Logf("batched %d of %d messages; %d genuine messages' handlers ran more than once (a batch rolled back and run one at a time)",
		c.Batched(), len(recs), again)
}

// A message whose handler fails twice with an error that is not permanent,
// in the middle of a backlog: it is retried and holds its partition, so the
// effects stay in offset order, each once, and nothing is dead-lettered.
func TestConsumerBatchRetryKeepsOrder(t *testing.T) {
	t.Parallel()
	r := newInboxRig(t)
	var recs []*kgo.Record
	for i := range 40 {
		note := "ok"
		if i == 17 || i == 18 {
			note = "flaky:2"
		}
		recs = append(recs, msg("charge", "m-"+strconv.Itoa(i), note))
	}
	r.produce(t, recs...)
	h := newHandler(r)
	c, err := r.in.NewConsumer(r.reader(t), &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge": h.handle}, BatchSize: 16,
		RetryInitial: 20 * time.Millisecond, RetryMax: 50 * time.Millisecond})
	require.NoError(t, err)
	run(t, c, func() bool { return r.committed() == int64(len(recs)) })
	require.Equal(t, ids("m-", 40), r.effectIDs(t))
	require.Empty(t, r.dead(t))
	require.Equal(t, 3, h.callsOf("m-17"), "two failures, then success")
	t.Logf("batched %d", c.Batched())
}

// The consumer is stopped (its context cancelled) while a handler in the
// middle of a batch runs (a poison message before it was dead-lettered).
// Nothing of the unfinished batch commits, no offset is committed past a
// message without its effect, and the next member of the group processes
// the rest: every message once, the poison dead-lettered once ("A Consumer
// stores a dead letter once per Kafka position").
func TestConsumerCancelledMidBatchLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	r := newInboxRig(t)
	var recs []*kgo.Record
	for i := range 50 {
		if i == 10 {
			recs = append(recs, msg("charge", "p-nul", poison[0].s)) // dead-lettered before the crash
		}
		recs = append(recs, msg("charge", "m-"+strconv.Itoa(i), "ok"))
	}
	r.produce(t, recs...)
	h := newHandler(r)
	entered := make(chan struct{})
	var once sync.Once
	h.block = func(ctx context.Context, m inbox.Message) error {
		if m.ID == "m-25" && h.callsOf("m-25") == 1 {
			once.Do(func() { close(entered) })
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(20 * time.Second):
				return errors.New("review8: the handler's context was never cancelled")
			}
		}
		return nil
	}
	first := r.reader(t)
	c, err := r.in.NewConsumer(first, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge": h.handle}, BatchSize: 16})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("m-25 never reached")
	}
	cancel()
	require.NoError(t, testkit.Recv(t, done, 40*time.Second, "Run to return after its context ended"), "Run returns nil when its context ends")
	require.NoError(t, first.Close())

	committed := r.committed()
	effects := r.effectIDs(t)
	t.Logf("after the cancel: committed offset %d, %d effects", committed, len(effects))
	require.LessOrEqual(t, committed, int64(26), "no offset committed past m-25 (offset 26), which did not commit")
	require.GreaterOrEqual(t, int64(len(effects)+len(r.dead(t))), committed, "every message before the committed offset has its effect or dead letter")
	require.NotContains(t, effects, "m-25")

	h.block = nil
	second := r.reader(t)
	c2, err := r.in.NewConsumer(second, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge": h.handle}, BatchSize: 16})
	require.NoError(t, err)
	run(t, c2, func() bool { return r.committed() == int64(len(recs)) })
	require.Equal(t, ids("m-", 50), r.effectIDs(t), "every message once, in order")
	dead := r.dead(t)
	require.Len(t, dead, 1, "the poison message is dead-lettered once, redelivered or not: %+v", dead)
	require.Equal(t, "p-nul", dead[0].ID)
}

// A handler that sets a transaction-local setting (set_config(..., true),
// as row-level-security code does for a tenant) only for the messages that
// carry one. Each message is documented to run "inside the transaction
// that records it" (HandlerFunc), so a message without a tenant must see
// none. Batched, it sees the tenant of the message before it.
func TestConsumerBatchDoesNotLeakTransactionState(t *testing.T) {
	t.Parallel()
	r := newInboxRig(t)
	var recs []*kgo.Record
	for i := range 40 {
		rec := msg("charge", "m-"+strconv.Itoa(i), "ok")
		if i%2 == 0 {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: "x-tenant", Value: []byte("tenant-" + strconv.Itoa(i))})
		}
		recs = append(recs, rec)
	}
	r.produce(t, recs...)
	var leaks atomic.Int32
	var example atomic.Value
	hd := func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if tn := m.Headers["x-tenant"]; tn != "" {
			if _, err := tx.Exec(ctx, `SELECT set_config('review8.tenant', $1, true)`, tn); err != nil {
				return err
			}
		}
		var seen string
		if err := tx.QueryRow(ctx, `SELECT coalesce(current_setting('review8.tenant', true), '')`).Scan(&seen); err != nil {
			return err
		}
		if m.Headers["x-tenant"] == "" && seen != "" {
			leaks.Add(1)
			example.Store(fmt.Sprintf("%s (no tenant) saw tenant %q", m.ID, seen))
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+r.fx.Table()+` (what) VALUES ($1)`, m.ID)
		return err
	}
	c, err := r.in.NewConsumer(r.reader(t), &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{"charge": hd}})
	require.NoError(t, err)
	run(t, c, func() bool { return r.committed() == int64(len(recs)) })
	var txs int
	require.NoError(t, r.Pool.QueryRow(context.Background(), `SELECT count(DISTINCT txid) FROM `+r.fx.Table()).Scan(&txs))
	t.Logf("40 messages in %d transactions; batched %d; %d handlers saw another message's transaction-local setting", txs, c.Batched(), leaks.Load())
	if leaks.Load() > 0 {
		t.Skipf("FINDING F2: a handler sees the transaction-local state of other messages' handlers: %v", example.Load())
	}
}

var _ = json.Marshal
