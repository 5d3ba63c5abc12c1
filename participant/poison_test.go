package participant_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/signing"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// The participant's side of issue #11: poison bytes in every field it
// reads, forged commands, reply topics, and a compensation that overtakes
// its forward step, all through the real Kafka protocol with a raw
// producer (franz-go), so that no client checks or changes the bytes.

const (
	benchTopic   = "inventory.commands"
	benchReplies = "sagaflow.commands.checkout.replies" // a default reply topic
)

// poisons are the three kinds of string PostgreSQL refuses: a NUL byte,
// invalid UTF-8, and a value past the btree index limit (random, so that
// PostgreSQL cannot compress it under the limit).
var poisons = []struct{ name, s string }{
	{"nul", "po\x00ison"},
	{"utf8", "po\xff\xfeison"},
	{"10kB", randomText(10 << 10)},
}

func randomText(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	r := rand.New(rand.NewPCG(3, 4))
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[r.IntN(len(letters))]
	}
	return string(b)
}

// bench is one inventory participant serving benchTopic over Kafka, with
// its relay publishing its replies.
type bench struct {
	*service
	kc    *kafkatest.Cluster
	codes sync.Map // order id -> the code its reserve is refused with
}

func newBench(t *testing.T, cfg participant.Config) *bench {
	t.Helper()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, benchTopic, benchReplies))
	b := &bench{service: newService(t, kc, providers{}), kc: kc}
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, "CREATE TABLE "+b.table("moves")+" (order_id text, move text); CREATE INDEX ON "+
		b.table("moves")+" (order_id)")
	require.NoError(t, err)
	cfg.Consumer, cfg.Schema, cfg.Logger = "inventory", b.schema, quiet
	p, err := participant.New(b.pool, &cfg)
	require.NoError(t, err)
	move := func(kind string) func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
		return func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
			if code, ok := b.codes.Load(c.Command.OrderID); ok {
				return struct{}{}, steps.Permanent(steps.WithCode(code.(string), errors.New("no stock")))
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+b.table("moves")+" VALUES ($1, $2)", c.Command.OrderID, kind)
			return struct{}{}, err
		}
	}
	require.NoError(t, participant.Handle(p, "inventory.reserve", move("reserve")))
	require.NoError(t, participant.Handle(p, "inventory.release", move("release")))
	testkit.Serve(t, kc.Addrs(), p, benchTopic, "inventory", inbox.ConsumerConfig{})
	return b
}

// command is a saga's command as the relay would publish it; tests change
// its fields to poison or forge it.
type command struct {
	id, typ, sagaID, stepKey, direction, replyTo string
	key, value                                   []byte
	extra                                        []kgo.RecordHeader
	sign                                         []byte // the key to sign with, if any
}

func newCommand(typ string, k steps.Key, orderID string) *command {
	return &command{id: uuid.NewString(), typ: typ, sagaID: k.SagaID.String(), stepKey: k.String(),
		direction: string(k.Direction), replyTo: benchReplies, key: []byte(k.SagaID.String()),
		value: []byte(`{"order_id":` + jsonString(orderID) + `}`)}
}

// jsonString quotes s for JSON, keeping invalid UTF-8 bytes as they are.
func jsonString(s string) string {
	if !utf8.ValidString(s) {
		return `"` + s + `"`
	}
	b, _ := json.Marshal(s)
	return string(b)
}

func (c *command) record() *kgo.Record {
	h := map[string]string{store.HeaderMessageID: c.id, store.HeaderType: c.typ, store.HeaderSagaID: c.sagaID,
		store.HeaderStepKey: c.stepKey, store.HeaderDirection: c.direction, store.HeaderReplyTo: c.replyTo}
	r := &kgo.Record{Topic: benchTopic, Key: c.key, Value: c.value}
	for _, name := range []string{store.HeaderMessageID, store.HeaderType, store.HeaderSagaID, store.HeaderStepKey,
		store.HeaderDirection, store.HeaderReplyTo} {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: name, Value: []byte(h[name])})
	}
	if c.sign != nil {
		sig := signing.Keys{Current: c.sign}.Sign(func(n string) string { return h[n] }, c.value)
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: signing.Header, Value: []byte(sig)})
	}
	r.Headers = append(r.Headers, c.extra...)
	return r
}

// produce writes the commands' records, in order, to partition 0 with a
// franz-go client, and returns each one's offset.
func (b *bench) produce(t *testing.T, cmds ...*command) []int64 {
	t.Helper()
	recs := make([]*kgo.Record, len(cmds))
	for i, c := range cmds {
		recs[i] = c.record()
	}
	return b.produceRecords(t, recs...)
}

func (b *bench) produceRecords(t *testing.T, recs ...*kgo.Record) []int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for _, r := range recs {
		r.Partition = 0
	}
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	offsets := make([]int64, len(recs))
	for i, r := range recs {
		offsets[i] = r.Offset
	}
	return offsets
}

// replies returns the replies written for the step key, oldest first.
func (b *bench) replies(t *testing.T, stepKey string) []steps.Reply {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), "SELECT payload FROM "+b.table("outbox")+
		" WHERE step_key = $1 AND type = $2 ORDER BY created_at, id", stepKey, steps.ReplyType)
	require.NoError(t, err)
	payloads, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	require.NoError(t, err)
	out := make([]steps.Reply, len(payloads))
	for i, p := range payloads {
		require.NoError(t, json.Unmarshal(p, &out[i]))
	}
	return out
}

// waitReplies polls until every step key has a reply, and fails the test
// after the deadline.
func (b *bench) waitReplies(t *testing.T, deadline time.Time, keys ...string) {
	t.Helper()
	for {
		var n int
		require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT count(DISTINCT step_key) FROM "+b.table("outbox")+
			" WHERE step_key = ANY($1) AND type = $2", keys, steps.ReplyType).Scan(&n))
		if n == len(keys) {
			return
		}
		require.True(t, time.Now().Before(deadline), "only %d of %d commands were answered in time", n, len(keys))
		time.Sleep(20 * time.Millisecond)
	}
}

type deadLetter struct {
	Reason     string
	Key, Value []byte
	RawHeaders []store.RawHeader
}

// deadLetterAt returns the dead letter of the message at offset, or nil.
func (b *bench) deadLetterAt(t *testing.T, offset int64) *deadLetter {
	t.Helper()
	var d deadLetter
	var raw []byte
	err := b.pool.QueryRow(context.Background(), "SELECT reason, msg_key, msg_value, raw_headers FROM "+b.table("dead_letters")+
		" WHERE consumer = 'inventory' AND kafka_offset = $1", offset).Scan(&d.Reason, &d.Key, &d.Value, &raw)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	require.NoError(t, err)
	var hs []struct{ K, V []byte } // base64 in JSON
	require.NoError(t, json.Unmarshal(raw, &hs))
	for _, h := range hs {
		d.RawHeaders = append(d.RawHeaders, store.RawHeader{Key: h.K, Value: h.V})
	}
	return &d
}

// requireDeadLetter checks that the record at offset is a dead letter with
// its raw bytes, for the reason want.
func (b *bench) requireDeadLetter(t *testing.T, name string, offset int64, rec *kgo.Record, want string) {
	t.Helper()
	d := b.deadLetterAt(t, offset)
	require.NotNil(t, d, "%s: dead-lettered", name)
	require.Contains(t, d.Reason, want, name)
	require.Equal(t, rec.Key, d.Key, "%s: the raw key", name)
	require.Equal(t, rec.Value, d.Value, "%s: the raw value", name)
	require.Len(t, d.RawHeaders, len(rec.Headers), name)
	for j, h := range rec.Headers {
		require.Equal(t, []byte(h.Key), d.RawHeaders[j].Key, "%s: raw header %d's name", name, j)
		require.Equal(t, h.Value, d.RawHeaders[j].Value, "%s: raw header %d's value", name, j)
	}
}

func (b *bench) moves(t *testing.T, orderID, kind string) int {
	t.Helper()
	return b.count(t, "SELECT count(*) FROM "+b.table("moves")+" WHERE order_id = $1 AND move = $2", orderID, kind)
}

// TestParticipantPoisonNeverStopsThePartition sends each kind of poison in
// every field a participant reads (message id, key, any header's name and
// value, the type, saga id, direction, step key and reply-to headers, the
// value, a string the handler writes, and the code a handler refuses with),
// each followed on the same partition by a valid command. Every valid
// command is answered within seconds. A poison that is only carried
// (an id, a key, an unknown header) does no harm; a refusal's code is made
// storable; a command that cannot be trusted or answered, or whose
// handler's write PostgreSQL refuses, is dead-lettered at once with its raw
// bytes, with no effect and no reply.
func TestParticipantPoisonNeverStopsThePartition(t *testing.T) {
	t.Parallel()
	b := newBench(t, participant.Config{})

	type outcome int
	const (
		ok outcome = iota
		refused
		dead
	)
	type poisonCase struct {
		name    string
		cmd     *command
		sent    string // the step key as built, before any change
		outcome outcome
		want    string // the refusal's code, or a part of the dead letter's reason
	}
	var cases []poisonCase
	add := func(name string, o outcome, want string, change func(c *command, order string)) {
		order := fmt.Sprintf("o-%d", len(cases))
		c := newCommand("inventory.reserve", steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}, order)
		sent := c.stepKey
		change(c, order)
		cases = append(cases, poisonCase{name: name, cmd: c, sent: sent, outcome: o, want: want})
	}
	for _, p := range poisons {
		add("message id "+p.name, ok, "", func(c *command, _ string) { c.id = p.s })
		add("key "+p.name, ok, "", func(c *command, _ string) { c.key = []byte(p.s) })
		add("header name "+p.name, ok, "", func(c *command, _ string) { c.extra = []kgo.RecordHeader{{Key: p.s, Value: []byte("v")}} })
		add("header value "+p.name, ok, "", func(c *command, _ string) {
			c.extra = []kgo.RecordHeader{{Key: "traceparent", Value: []byte(p.s)}}
		})
		add("refusal code "+p.name, refused, p.s, func(_ *command, order string) { b.codes.Store(order, p.s) })
		add("type "+p.name, dead, "unknown message type", func(c *command, _ string) { c.typ = p.s })
		add("saga id "+p.name, dead, participant.CodeNotASagaCommand, func(c *command, _ string) { c.sagaID = p.s })
		add("direction "+p.name, dead, participant.CodeNotASagaCommand, func(c *command, _ string) { c.direction = p.s })
		add("step key "+p.name, dead, participant.CodeNotASagaCommand, func(c *command, _ string) {
			c.stepKey = c.sagaID + "/" + p.s + "/forward/0"
		})
		add("reply-to "+p.name, dead, participant.CodeReplyTopicRefused, func(c *command, _ string) { c.replyTo = p.s })
		add("value "+p.name, refused, participant.CodeMalformedCommand, func(c *command, _ string) { c.value = []byte(p.s) })
		o := dead
		if p.name == "utf8" {
			o = ok // encoding/json decodes invalid UTF-8 as U+FFFD
		}
		add("handler's write "+p.name, o, "PostgreSQL refused the message's content", func(c *command, _ string) {
			c.value = []byte(`{"order_id":` + jsonString(p.s) + `}`)
		})
	}
	add("reply-to not allowed", dead, participant.CodeReplyTopicRefused, func(c *command, _ string) { c.replyTo = "attacker.replies" })
	add("reply-to twice", dead, "ambiguous", func(c *command, _ string) {
		c.extra = []kgo.RecordHeader{{Key: store.HeaderReplyTo, Value: []byte("attacker.replies")}}
	})

	var cmds []*command
	var valid []string
	for i, c := range cases {
		v := newCommand("inventory.reserve", steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}, fmt.Sprintf("valid-%d", i))
		cmds = append(cmds, c.cmd, v)
		valid = append(valid, v.stepKey)
	}
	start := time.Now()
	offsets := b.produce(t, cmds...)
	b.waitReplies(t, start.Add(15*time.Second), valid...)

	for i := range valid {
		require.Equal(t, 1, b.moves(t, fmt.Sprintf("valid-%d", i), "reserve"), "valid command %d ran once", i)
	}
	for i, c := range cases {
		order := fmt.Sprintf("o-%d", i)
		replies := b.replies(t, c.sent)
		switch c.outcome {
		case ok:
			require.Nil(t, b.deadLetterAt(t, offsets[2*i]), c.name)
			require.Len(t, replies, 1, c.name)
			require.True(t, replies[0].OK, c.name)
		case refused:
			require.Nil(t, b.deadLetterAt(t, offsets[2*i]), c.name)
			require.Len(t, replies, 1, c.name)
			require.False(t, replies[0].OK, c.name)
			require.Equal(t, 0, b.moves(t, order, "reserve"), "%s: a refusal undoes the handler's writes", c.name)
			if c.want == participant.CodeMalformedCommand {
				require.Equal(t, c.want, replies[0].Code, c.name)
				continue
			}
			// The poisoned code, made storable.
			code := replies[0].Code
			require.True(t, utf8.ValidString(code) && !strings.Contains(code, "\x00") && len(code) <= 200+len("…"),
				"%s: the code is storable: %q", c.name, code)
			require.Equal(t, safetext.Text(c.want, 200), code, c.name)
		case dead:
			b.requireDeadLetter(t, c.name, offsets[2*i], cmds[2*i].record(), c.want)
			require.Empty(t, replies, "%s: no reply", c.name)
			require.Equal(t, 0, b.moves(t, order, "reserve"), "%s: no effect", c.name)
		}
	}
}

// TestForgedCompensationBeforeItsForwardIsRefusedNotSwallowed: a
// compensation for a saga's step that arrives before the step's forward
// command (forged here; a relay retry can reorder them too) closes the
// step, and the forward, when the saga sends it, is refused with
// compensated_before_run: the saga compensates at once, instead of
// waiting for the step's reply timeout, and the step's effect never runs.
func TestForgedCompensationBeforeItsForwardIsRefusedNotSwallowed(t *testing.T) {
	t.Parallel()
	s := newSystem(t, true)
	ctx := context.Background()
	id := uuid.Must(uuid.NewV7())
	forged := newCommand("inventory.release", steps.Key{SagaID: id, Step: "reserve", Direction: steps.Compensate}, "o-forged")
	b := &bench{service: s.inventory, kc: s.kc}
	b.produce(t, forged)
	deadline := time.Now().Add(15 * time.Second)
	for s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'") == 0 {
		require.True(t, time.Now().Before(deadline), "the forged compensation was not processed")
		time.Sleep(20 * time.Millisecond)
	}

	_, err := saga.Start(ctx, s.engine, s.def, checkout{OrderID: "o-forged", Amount: 40}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	in := s.wait(t, id)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, participant.CodeCompensatedBeforeRun, in.LastError.Code, "refused, not timed out")
	require.Less(t, in.UpdatedAt.Sub(in.CreatedAt), reserveTimeout, "the saga did not wait for the reply timeout")
	require.Equal(t, 0, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'reserve'"),
		"the step's effect did not run after its compensation")
}

// TestParticipantRefusesUnsignedCommandsWhenSigningIsOn: with a signing
// key, an unsigned command (a forged compensation, say), one signed with
// another key, and one whose payload was changed after signing, are
// dead-lettered before any effect: no inbox record, no handler run, no
// reply. Commands signed with the key or a previous one run, and the
// participant's replies carry a signature that verifies on the wire, after
// the relay.
func TestParticipantRefusesUnsignedCommandsWhenSigningIsOn(t *testing.T) {
	t.Parallel()
	oldKey, key := []byte("the previous key"), []byte("the current key")
	b := newBench(t, participant.Config{SigningKey: key, VerifyKeys: [][]byte{oldKey}})

	step := func() steps.Key { return steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward} }
	target := step()
	forgedComp := newCommand("inventory.release", steps.Key{SagaID: target.SagaID, Step: "reserve", Direction: steps.Compensate}, "o-target")
	otherKey := newCommand("inventory.reserve", step(), "o-other-key")
	otherKey.sign = []byte("an attacker's key")
	tampered := newCommand("inventory.reserve", step(), "o-tampered")
	tampered.sign = key
	tamperedRec := tampered.record()
	tamperedRec.Value = []byte(`{"order_id":"o-tampered-changed"}`)
	signedOld := newCommand("inventory.reserve", step(), "o-old")
	signedOld.sign = oldKey
	genuine := newCommand("inventory.reserve", target, "o-target")
	genuine.sign = key

	recs := []*kgo.Record{forgedComp.record(), otherKey.record(), tamperedRec, signedOld.record(), genuine.record()}
	offsets := b.produceRecords(t, recs...)
	b.waitReplies(t, time.Now().Add(15*time.Second), signedOld.stepKey, genuine.stepKey)

	for i, name := range []string{"unsigned", "signed with another key", "changed after signing"} {
		b.requireDeadLetter(t, name, offsets[i], recs[i], participant.CodeUnverified)
	}
	for _, c := range []*command{forgedComp, otherKey, tampered} {
		require.Empty(t, b.replies(t, c.stepKey))
		require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE key = $1 OR key = $2", c.id, c.stepKey),
			"no inbox record for a command that was not verified")
	}
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("moves")+" WHERE move = 'release' OR order_id LIKE 'o-tampered%' OR order_id = 'o-other-key'"))
	require.Equal(t, 1, b.moves(t, "o-old", "reserve"), "a previous key is still accepted")
	require.Equal(t, 1, b.moves(t, "o-target", "reserve"), "the forged compensation did not close the genuine step")
	require.True(t, b.replies(t, genuine.stepKey)[0].OK)

	// The replies, as the relay published them, verify under the key.
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.kc.Addrs()...), kgo.ConsumeTopics(benchReplies),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) < 2 {
		fs := cl.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "the relay did not publish both replies")
		fs.EachRecord(func(r *kgo.Record) { got = append(got, r) })
	}
	require.Len(t, got, 2)
	for _, r := range got {
		get := func(name string) string {
			for _, h := range r.Headers {
				if h.Key == name {
					return string(h.Value)
				}
			}
			return ""
		}
		require.NotEmpty(t, get(signing.Header))
		require.NoError(t, signing.Keys{Current: key}.Verify(get, r.Value), "the reply's signature verifies after the relay")
		require.ErrorIs(t, signing.Keys{Current: oldKey}.Verify(get, r.Value), signing.ErrInvalid, "and is made with the current key")
	}
}

func TestParticipantConfigIsValidated(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.NewSchema(t)
	for _, tc := range []struct {
		cfg  participant.Config
		want string
	}{
		{participant.Config{ReplyTopics: []string{"ok.replies", "no spaces"}}, "ReplyTopics[1]"},
		{participant.Config{VerifyKeys: [][]byte{[]byte("k")}}, "VerifyKeys needs SigningKey"},
		{participant.Config{SigningKey: []byte("k"), VerifyKeys: [][]byte{nil}}, "VerifyKeys[0] is empty"},
	} {
		tc.cfg.Consumer, tc.cfg.Schema = "inventory", schema
		_, err := participant.New(pool, &tc.cfg)
		require.ErrorIs(t, err, participant.ErrInvalidConfig)
		require.ErrorContains(t, err, tc.want)
	}
}

func TestDefaultReplyTopicsAreTheEnginesDefaults(t *testing.T) {
	t.Parallel()
	require.True(t, participant.IsDefaultReplyTopic(saga.CommandTopicDefault+".checkout.replies"))
	require.True(t, participant.IsDefaultReplyTopic(saga.CommandTopicDefault+".orders_v2.replies"))
	for _, topic := range []string{
		"", "orders.replies", saga.CommandTopicDefault + ".replies", saga.CommandTopicDefault + ".checkout",
		saga.CommandTopicDefault + ".check out.replies", saga.CommandTopicDefault + ".a\x00.replies",
		"x" + saga.CommandTopicDefault + ".checkout.replies", saga.CommandTopicDefault + "." + strings.Repeat("a", 250) + ".replies",
	} {
		require.False(t, participant.IsDefaultReplyTopic(topic), "%q", topic)
	}
}
