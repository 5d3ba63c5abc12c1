// Package review23 reviews the NATS JetStream (transport/natsbus) and
// RabbitMQ (transport/rabbitbus) transports from their documentation only:
// each test attacks a promise of docs/transports.md, the packages' docs or
// the inbox's and relay's docs, through real PostgreSQL, a real nats-server
// and a real RabbitMQ. See FINDINGS.md.
package review23

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/transporttest"
	"github.com/sagaflow/sagaflow/wire"
)

// TestMain uses the transports' own harness: PostgreSQL found as the
// repository's tests find it, and a goroutine-leak check after a passing
// run, so every reader, writer and consumer a test opens is closed by it.
func TestMain(m *testing.M) { transporttest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// patience bounds every wait for something the docs promise will happen.
// It is generous on purpose: a 2-core machine shared with other packages.
const patience = 25 * time.Second

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// db is one test's migrated schema with an effects table: one row per
// message a handler processed, written in the message's transaction. key
// and hdr are indexed text columns, so that a key or header PostgreSQL
// cannot store (NUL, invalid UTF-8, past the btree limit) fails the
// handler's statement as it would in a real service.
type db struct {
	*testkit.DB
}

func newDB(t *testing.T) *db {
	t.Helper()
	d := &db{testkit.NewDB(t)}
	ctx := ctxFor(t, 20*time.Second)
	_, err := d.Pool.Exec(ctx, "CREATE TABLE "+d.Table("fx")+` (
		n bigint GENERATED ALWAYS AS IDENTITY,
		consumer text NOT NULL,
		msg_id text NOT NULL,
		key text NOT NULL,
		hdr text NOT NULL,
		val text NOT NULL,
		seq int NOT NULL)`)
	require.NoError(t, err)
	_, err = d.Pool.Exec(ctx, "CREATE INDEX ON "+d.Table("fx")+" (key); CREATE INDEX ON "+d.Table("fx")+" (hdr)")
	require.NoError(t, err)
	return d
}

// handler writes the message's key, its x-h header and its value to text
// columns, as a service that trusts its input would; the seq comes from
// the x-seq header (-1 when absent or unreadable).
func (d *db) handler(consumer string) inbox.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		seq := -1
		if s, ok := msg.Headers["x-seq"]; ok {
			if n, err := strconv.Atoi(s); err == nil {
				seq = n
			}
		}
		// The id is not the handler's to trust either: the attacks are on
		// the key, the x-h header and the value.
		id := msg.ID
		if !utf8.ValidString(id) || strings.ContainsRune(id, 0) || len(id) > 512 {
			id = fmt.Sprintf("unstorable id of %d bytes", len(id))
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+d.Table("fx")+
			" (consumer, msg_id, key, hdr, val, seq) VALUES ($1, $2, $3, $4, $5, $6)",
			consumer, id, string(msg.Key), msg.Headers["x-h"], string(msg.Value), seq)
		return err
	}
}

type effect struct {
	Consumer, ID, Key string
	Seq               int
}

func (d *db) effects(t *testing.T, consumer string) []effect {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	rows, err := d.Pool.Query(ctx, "SELECT consumer, msg_id, key, seq FROM "+d.Table("fx")+
		" WHERE consumer = $1 ORDER BY n", consumer)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (effect, error) {
		var e effect
		return e, r.Scan(&e.Consumer, &e.ID, &e.Key, &e.Seq)
	})
	require.NoError(t, err)
	return out
}

func (d *db) countEffects(t *testing.T, consumer string) int {
	return d.Count(t, "SELECT count(*) FROM "+d.Table("fx")+" WHERE consumer = $1", consumer)
}

type deadLetter struct {
	MessageID *string
	Topic     string
	Partition *int32
	Offset    *int64
	Key       []byte
	Value     []byte
	Reason    string
}

func (d *db) deadLetters(t *testing.T, consumer string) []deadLetter {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	rows, err := d.Pool.Query(ctx, "SELECT message_id, topic, kafka_partition, kafka_offset, msg_key, msg_value, reason FROM "+
		d.Table("dead_letters")+" WHERE consumer = $1 ORDER BY id", consumer)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (deadLetter, error) {
		var x deadLetter
		return x, r.Scan(&x.MessageID, &x.Topic, &x.Partition, &x.Offset, &x.Key, &x.Value, &x.Reason)
	})
	require.NoError(t, err)
	return out
}

func (d *db) countDead(t *testing.T, consumer string) int {
	return d.Count(t, "SELECT count(*) FROM "+d.Table("dead_letters")+" WHERE consumer = $1", consumer)
}

// consume runs an inbox consumer named consumer over r until the test ends
// (or until the returned stop is called), with the effects handler for
// type "good" and the inbox's default MaxAttempts: a message PostgreSQL
// refuses must be dead-lettered at once, not after an hour of retries.
func (d *db) consume(t *testing.T, consumer string, r inbox.Reader, h inbox.HandlerFunc) (stop func()) {
	t.Helper()
	in, err := inbox.New(d.Pool, &inbox.Config{Consumer: consumer, Schema: d.Schema, Logger: quiet})
	require.NoError(t, err)
	if h == nil {
		h = d.handler(consumer)
	}
	c, err := in.NewConsumer(r, &inbox.ConsumerConfig{
		Handlers:     map[string]inbox.HandlerFunc{"good": h},
		RetryInitial: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond,
	})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := c.Stop(ctx); err != nil {
			t.Errorf("stop consumer %s: %v", consumer, err)
		}
	}
	t.Cleanup(stop)
	return stop
}

// insertRows writes n outbox rows of topic, type "good", keys round robin
// over keys, seq 0..n-1 in an x-seq header, in one transaction each so that
// their order is their written order.
func (d *db) insertRows(t *testing.T, topic string, keys []string, from, n int) []uuid.UUID {
	t.Helper()
	ctx := ctxFor(t, 20*time.Second)
	ids := make([]uuid.UUID, 0, n)
	for i := from; i < from+n; i++ {
		id := uuid.Must(uuid.NewV7())
		hdr := fmt.Sprintf(`{"x-seq":"%d","x-h":"h"}`, i)
		_, err := d.Pool.Exec(ctx, "INSERT INTO "+d.Table("outbox")+
			" (id, topic, aggregateid, type, payload, headers) VALUES ($1, $2, $3, 'good', $4, $5::jsonb)",
			id, topic, keys[i%len(keys)], []byte(fmt.Sprintf("v%d", i)), hdr)
		require.NoError(t, err)
		ids = append(ids, id)
	}
	return ids
}

// insertRaw writes one outbox row with the given headers JSON, bypassing
// outbox.Message.Check, as another producer writing SQL would.
func (d *db) insertRaw(t *testing.T, topic, key, headers string, payload []byte) uuid.UUID {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	id := uuid.Must(uuid.NewV7())
	_, err := d.Pool.Exec(ctx, "INSERT INTO "+d.Table("outbox")+
		" (id, topic, aggregateid, type, payload, headers) VALUES ($1, $2, $3, 'good', $4, $5::jsonb)",
		id, topic, key, payload, headers)
	require.NoError(t, err)
	return id
}

type rowState struct {
	Status    string
	Attempts  int
	LastError string
}

func (d *db) row(t *testing.T, id uuid.UUID) rowState {
	t.Helper()
	ctx := ctxFor(t, 10*time.Second)
	var s rowState
	var le *string
	require.NoError(t, d.Pool.QueryRow(ctx, "SELECT status, attempts, last_error FROM "+d.Table("outbox")+
		" WHERE id = $1", id).Scan(&s.Status, &s.Attempts, &le))
	if le != nil {
		s.LastError = *le
	}
	return s
}

// newRelay returns a relay on d's schema through w, not started: tests
// call RunOnce, or start it with runRelay.
func (d *db) newRelay(t *testing.T, w relay.Writer, maxAttempts int) *relay.Relay {
	t.Helper()
	r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, Logger: quiet, BatchSize: 64,
		PollInterval: 50 * time.Millisecond, MaxAttempts: maxAttempts, PublishTimeout: 10 * time.Second,
		Backoff: func(int) time.Duration { return 50 * time.Millisecond }})
	require.NoError(t, err)
	return r
}

// runRelay starts a relay through w until the test ends.
func (d *db) runRelay(t *testing.T, w relay.Writer) {
	t.Helper()
	r := d.newRelay(t, w, 0)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := r.Stop(ctx); err != nil {
			t.Errorf("stop relay: %v", err)
		}
	})
}

// drainRelay runs RunOnce until a cycle finds nothing to do.
func drainRelay(t *testing.T, r *relay.Relay) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	for range 200 {
		p, f, err := r.RunOnce(ctx)
		require.NoError(t, err)
		if p == 0 && f == 0 {
			return
		}
	}
	t.Fatal("relay never drained")
}

// checkOrder checks that effects hold seqs 0..n-1 exactly once each, and,
// per key, in increasing order.
func checkOrder(t *testing.T, fx []effect, n int) {
	t.Helper()
	seen := map[int]int{}
	last := map[string]int{}
	for _, e := range fx {
		seen[e.Seq]++
		if prev, ok := last[e.Key]; ok && e.Seq <= prev {
			t.Errorf("key %q: seq %d after %d (out of order)", e.Key, e.Seq, prev)
		}
		last[e.Key] = e.Seq
	}
	var missing, doubled []int
	for i := range n {
		switch seen[i] {
		case 0:
			missing = append(missing, i)
		case 1:
		default:
			doubled = append(doubled, i)
		}
	}
	sort.Ints(missing)
	require.Empty(t, missing, "seqs without an effect")
	require.Empty(t, doubled, "seqs with two effects")
	require.Len(t, fx, n)
}

func hdr(k, v string) kafka.Header { return kafka.Header{Key: k, Value: []byte(v)} }

// goodMsg is a message the effects handler processes, as a foreign producer
// writing through a transport's Writer would send it.
func goodMsg(topic, key string, seq int) kafka.Message {
	return kafka.Message{Topic: topic, Key: []byte(key), Value: []byte("ok"), Headers: []kafka.Header{
		hdr(wire.HeaderMessageID, uuid.NewString()), hdr(wire.HeaderType, "good"),
		hdr("x-seq", strconv.Itoa(seq)), hdr("x-h", "h")}}
}

func headerOf(m kafka.Message, name string) (string, bool) {
	for _, h := range m.Headers {
		if h.Key == name {
			return string(h.Value), true
		}
	}
	return "", false
}

// waitUntil polls cond until it holds or d passes, and reports whether it
// held, for tests that explain a failure before failing.
func waitUntil(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// explain logs what the consumer did so far, for a failure message.
func (d *db) explain(t *testing.T, consumer string) {
	t.Helper()
	for _, e := range d.effects(t, consumer) {
		t.Logf("effect: key %.20q seq %d id %.40q", e.Key, e.Seq, e.ID)
	}
	for _, dl := range d.deadLetters(t, consumer) {
		t.Logf("dead: key %.20q offset %v reason %.200s", dl.Key, deref(dl.Offset), dl.Reason)
	}
}

func deref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

// onlyFrom requires that the effects fx come from the messages ids only
// (nothing crossed from another tenant), n of them in key order.
func onlyFrom(t *testing.T, fx []effect, ids []uuid.UUID, n int) {
	t.Helper()
	want := map[string]bool{}
	for _, id := range ids {
		want[id.String()] = true
	}
	for _, x := range fx {
		require.True(t, want[x.ID], "message %s of key %s crossed tenants", x.ID, x.Key)
	}
	checkOrder(t, fx, n)
}
