package saga_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/signing"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// Issue #11 on the engine's side of the bus: poison bytes, forged and
// out-of-place messages, sent through the real Kafka protocol with a raw
// producer (franz-go), so that no client checks or changes the bytes.

// poisonStrings are the three kinds of string PostgreSQL refuses: a NUL
// byte, invalid UTF-8, and a value past the btree index limit (random, so
// that PostgreSQL cannot compress it under the limit).
var poisonStrings = []struct{ name, s string }{
	{"nul", "po\x00ison"},
	{"utf8", "po\xff\xfeison"},
	{"10kB", randomLetters(10 << 10)},
}

func randomLetters(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	r := rand.New(rand.NewPCG(11, 12))
	b := make([]byte, n)
	for i := range b {
		b[i] = letters[r.IntN(len(letters))]
	}
	return string(b)
}

// setupKafkaWith is setupKafka with a config of the test's and topics
// created up front.
func setupKafkaWith(t *testing.T, partitions int, cfg *saga.Config, topics ...string) *kafkaBundle {
	t.Helper()
	return setupKafkaRelayPoll(t, partitions, cfg, 50*time.Millisecond, topics...)
}

// setupKafkaRelayPoll is setupKafkaWith with a relay that polls every
// relayPoll.
func setupKafkaRelayPoll(t *testing.T, partitions int, cfg *saga.Config, relayPoll time.Duration, topics ...string) *kafkaBundle {
	t.Helper()
	return setupKafkaOn(t, kafkatest.New(t, kafkatest.SeedTopics(int32(partitions), topics...)), cfg, relayPoll)
}

// setupKafkaOn is setupKafkaRelayPoll on the cluster kc, which other
// bundles (tenants) may share.
func setupKafkaOn(t *testing.T, kc *kafkatest.Cluster, cfg *saga.Config, relayPoll time.Duration) *kafkaBundle {
	t.Helper()
	if cfg.Kafka == nil {
		cfg.Kafka = &saga.KafkaConfig{AllSteps: true}
	}
	cfg.Kafka.Brokers = kc.Addrs()
	b := setup(t, cfg)
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(b.pool, w, &relay.Config{Schema: b.schema, PollInterval: relayPoll, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
		require.NoError(t, w.Close())
	})
	return &kafkaBundle{bundle: b, kc: kc, r: r}
}

func rawProducer(t *testing.T, kc *kafkatest.Cluster) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}

// produce writes r as it is and returns its offset.
func produce(t *testing.T, cl *kgo.Client, r *kgo.Record) int64 {
	t.Helper()
	res := cl.ProduceSync(context.Background(), r)
	require.NoError(t, res.FirstErr())
	return res[0].Record.Offset
}

// deadLetterAt returns the engine's dead letter at a Kafka position: its
// key, value, raw headers (decoded) and reason; ok is false when there is
// none.
func (k *kafkaBundle) deadLetterAt(t *testing.T, topic string, offset int64) (key, value []byte, headers []kgo.RecordHeader, reason string, ok bool) {
	t.Helper()
	var raw []map[string]string
	err := k.pool.QueryRow(context.Background(), "SELECT msg_key, msg_value, raw_headers, reason FROM "+k.table("dead_letters")+
		" WHERE consumer = $1 AND topic = $2 AND kafka_offset = $3", store.InboxConsumerEngine, topic, offset).Scan(&key, &value, &raw, &reason)
	if err != nil {
		return nil, nil, nil, "", false
	}
	for _, h := range raw {
		name, err := base64.StdEncoding.DecodeString(h["k"])
		require.NoError(t, err)
		v, err := base64.StdEncoding.DecodeString(h["v"])
		require.NoError(t, err)
		headers = append(headers, kgo.RecordHeader{Key: string(name), Value: v})
	}
	return key, value, headers, reason, true
}

// commandRecord is a well-formed step command for saga id (which need not
// exist) on topic, partition 0.
func commandRecord(topic string, id uuid.UUID, sagaName, step string, version int64) *kgo.Record {
	payload, _ := json.Marshal(map[string]any{"saga_id": id, "saga": sagaName, "step": step, "direction": "forward", "epoch": 0, "version": version})
	return &kgo.Record{Topic: topic, Partition: 0, Key: []byte(id.String()), Value: payload, Headers: []kgo.RecordHeader{
		{Key: store.HeaderMessageID, Value: []byte(uuid.NewString())},
		{Key: store.HeaderType, Value: []byte("sagaflow.step")},
		{Key: store.HeaderSagaID, Value: []byte(id.String())},
		{Key: store.HeaderStepKey, Value: []byte(id.String() + "/" + step + "/forward/0")},
	}}
}

func setHeader(r *kgo.Record, name, value string) {
	for i := range r.Headers {
		if r.Headers[i].Key == name {
			r.Headers[i].Value = []byte(value)
			return
		}
	}
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: name, Value: []byte(value)})
}

// Every field of a command that the engine reads, with each kind of
// poison, on the one partition of the saga type's topic: each poisoned
// message is dead-lettered with its raw bytes, and a valid saga behind
// them all completes within seconds.
func TestKafkaEnginePoisonNeverStopsThePartition(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".kpoison"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1}, topic)
	def := threeSteps(k.bundle, "kpoison", nil)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	cl := rawProducer(t, k.kc)

	type sent struct {
		what   string
		offset int64
		rec    *kgo.Record
	}
	var all []sent
	for _, p := range poisonStrings {
		ghost := uuid.New() // a saga that does not exist: the command is parked whatever else it holds
		variants := map[string]func(r *kgo.Record){
			"message id":   func(r *kgo.Record) { setHeader(r, store.HeaderMessageID, p.s) },
			"type":         func(r *kgo.Record) { setHeader(r, store.HeaderType, p.s) },
			"saga id":      func(r *kgo.Record) { setHeader(r, store.HeaderSagaID, p.s) },
			"step key":     func(r *kgo.Record) { setHeader(r, store.HeaderStepKey, p.s) },
			"header name":  func(r *kgo.Record) { setHeader(r, p.s, "x") },
			"header value": func(r *kgo.Record) { setHeader(r, "x-note", p.s) },
			"key":          func(r *kgo.Record) { r.Key = []byte(p.s) },
			"value":        func(r *kgo.Record) { r.Value = []byte(p.s) },
			"held since":   func(r *kgo.Record) { setHeader(r, store.HeaderHeldSince, p.s) },
			"reply step key": func(r *kgo.Record) {
				setHeader(r, store.HeaderType, steps.ReplyType)
				setHeader(r, store.HeaderStepKey, p.s)
			},
			"reply saga id": func(r *kgo.Record) {
				setHeader(r, store.HeaderType, steps.ReplyType)
				setHeader(r, store.HeaderSagaID, p.s)
			},
		}
		for what, poison := range variants {
			r := commandRecord(topic, ghost, "kpoison", "reserve", 1)
			poison(r)
			all = append(all, sent{what: p.name + " in " + what, offset: produce(t, cl, r), rec: r})
		}
	}

	ctx := context.Background()
	asked := time.Now()
	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "behind the poison"}, nil)
	require.NoError(t, err)
	in := k.waitTerminalWithin(t, st.ID, 20*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status)
	t.Logf("the valid saga behind %d poisoned messages completed in %s", len(all), time.Since(asked).Round(time.Millisecond))

	for _, s := range all {
		key, value, headers, reason, ok := k.deadLetterAt(t, topic, s.offset)
		require.True(t, ok, "%s: no dead letter at offset %d", s.what, s.offset)
		require.Equal(t, s.rec.Key, key, s.what)
		require.Equal(t, s.rec.Value, value, s.what)
		require.Equal(t, s.rec.Headers, headers, "%s: the raw headers, in order", s.what)
		require.NotEmpty(t, reason, s.what)
	}
}

// A step that fails with an error code PostgreSQL cannot store, or whose
// own write PostgreSQL refuses, fails (or is retried) like any other: it
// never holds back the healthy saga claimed in the same batch.
func TestPoisonedStepNeverHoldsBackItsBatch(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 1, BatchSize: 8})
	def := saga.Define("poisoned", saga.Step[order]{Name: "one", Retry: &saga.RetryPolicy{MaxAttempts: 1},
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			switch s.OrderID {
			case "healthy":
				return recordEffect(ctx, run, b.schema)
			case "write":
				_, err := run.Tx.Exec(ctx, "INSERT INTO "+b.table("effects")+" (saga_id, step, direction, key) VALUES ($1, $2, 'forward', $3)",
					run.SagaID, "po\x00ison", run.IdempotencyKey())
				return err
			}
			for _, p := range poisonStrings {
				if s.OrderID == p.name {
					return steps.Permanent(steps.WithCode(p.s, errors.New("refused with a "+p.name+" code: "+p.s)))
				}
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	var ids []uuid.UUID
	for _, o := range []string{"nul", "utf8", "10kB", "write", "healthy"} {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: o}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	b.start(t) // all five are claimed in one batch
	healthy := b.waitTerminalWithin(t, ids[4], 10*time.Second)
	require.Equal(t, saga.StatusCompleted, healthy.Status)
	require.Equal(t, []string{"one/forward"}, b.effects(t, ids[4]))
	for i, p := range poisonStrings {
		in := b.waitTerminalWithin(t, ids[i], 10*time.Second)
		require.Equal(t, saga.StatusCompensated, in.Status, p.name)
		require.NotEmpty(t, in.LastError.Code, p.name)
		require.NotContains(t, in.LastError.Code, "\x00", p.name)
		require.LessOrEqual(t, len(in.LastError.Code), 256, p.name)
	}
	in := b.waitTerminalWithin(t, ids[3], 10*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Contains(t, in.LastError.Message, "invalid byte sequence", "PostgreSQL's own refusal is the step's error")
	require.Empty(t, b.effects(t, ids[3]))
}

// A command for a saga type this engine does not register, stamped ten
// years ahead by its producer, is moved out of the partition: the sagas
// behind it run at once, and its grace is counted in database time from its
// first hold, not from the producer's clock. One stamped eleven minutes ago
// is not parked at once either.
func TestUnknownSagaCommandFromTheFutureDoesNotDelayOthers(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".kfuture"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1}, topic)
	def := threeSteps(k.bundle, "kfuture", nil)
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()
	// A saga of a type that a newer release registers, whose command ended
	// up on this topic.
	legacy := uuid.New()
	_, err := k.pool.Exec(ctx, "INSERT INTO "+k.table("saga_instances")+
		" (id, saga_name, status, step_index, step_name, direction, state) VALUES ($1, 'newer-type', 'running', 0, 'first', 'forward', '{}')", legacy)
	require.NoError(t, err)
	k.start(t)
	cl := rawProducer(t, k.kc)
	future := commandRecord(topic, legacy, "newer-type", "first", 1)
	future.Timestamp = time.Now().AddDate(10, 0, 0)
	produce(t, cl, future)
	past := commandRecord(topic, legacy, "newer-type", "first", 1)
	past.Timestamp = time.Now().Add(-11 * time.Minute)
	pastOffset := produce(t, cl, past)

	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, k.waitTerminalWithin(t, st.ID, 15*time.Second).Status)
	waitFor(t, 10*time.Second, func() bool {
		return k.count(t, "SELECT count(*) FROM "+k.table("outbox")+" WHERE saga_id = $1 AND status = 'pending' AND headers ? $2",
			legacy, store.HeaderHeldSince) >= 2
	}, "both commands to be held in the outbox")
	_, _, _, _, parked := k.deadLetterAt(t, topic, pastOffset)
	require.False(t, parked, "the producer's old timestamp does not count against the grace")
}

// With signing on, a forged reply, cancel or command without a valid
// signature has no effect: it is dead-lettered as unverified. Without
// signing, a command that passes the version fence but names another step,
// or is not the command the saga wrote, is refused.
func TestForgedMessagesHaveNoEffect(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".kforged"
	key := []byte("shared secret")
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{SigningKey: key, AllSteps: true}}, topic)
	var charges atomic.Int64
	def := threeSteps(k.bundle, "kforged", map[string]saga.StepFunc[order]{
		"charge/forward": func(ctx context.Context, run *saga.StepRun, s *order) error {
			if charges.Add(1) == 1 {
				return steps.RetryAfter(2*time.Second, errors.New("provider busy"))
			}
			return nil
		},
	})
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	sagaVersion := k.versionAfterFirstFailure(t, st.ID)
	cl := rawProducer(t, k.kc)

	forgedCommand := commandRecord(topic, st.ID, "kforged", "ship", sagaVersion)
	forgedCancel := commandRecord(topic, st.ID, "kforged", "charge", sagaVersion)
	setHeader(forgedCancel, store.HeaderType, "sagaflow.cancel")
	forgedReply := commandRecord(topic, st.ID, "kforged", "charge", sagaVersion)
	setHeader(forgedReply, store.HeaderType, steps.ReplyType)
	forgedReply.Value = []byte(`{"ok":true}`)
	wrongKey := commandRecord(topic, st.ID, "kforged", "ship", sagaVersion)
	setHeader(wrongKey, signing.Header, signing.Keys{Current: []byte("another key")}.Sign(func(n string) string {
		for _, h := range wrongKey.Headers {
			if h.Key == n {
				return string(h.Value)
			}
		}
		return ""
	}, wrongKey.Value))
	var offsets []int64
	for _, r := range []*kgo.Record{forgedCommand, forgedCancel, forgedReply, wrongKey} {
		offsets = append(offsets, produce(t, cl, r))
	}
	for _, o := range offsets {
		waitFor(t, 10*time.Second, func() bool {
			_, _, _, reason, ok := k.deadLetterAt(t, topic, o)
			return ok && len(reason) > 0
		}, "the forged message at offset %d to be dead-lettered", o)
		_, _, _, reason, _ := k.deadLetterAt(t, topic, o)
		require.Contains(t, reason, saga.CodeUnverified)
	}
	require.Equal(t, int64(1), charges.Load(), "no forged command ran the step early")
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID))
	require.NotContains(t, eventTypes(in), "saga_cancelled:charge")
	require.Zero(t, k.count(t, "SELECT count(*) FROM "+k.table("saga_cancel_requests")))
}

func TestCommandsForAnotherStepAreRefused(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".kwrongstep"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1}, topic)
	var charges atomic.Int64
	def := threeSteps(k.bundle, "kwrongstep", map[string]saga.StepFunc[order]{
		"charge/forward": func(ctx context.Context, run *saga.StepRun, s *order) error {
			if charges.Add(1) == 1 {
				return steps.RetryAfter(3*time.Second, errors.New("provider busy"))
			}
			return nil
		},
	})
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	// charge failed once and waits 3 s for its retry.
	version := k.versionAfterFirstFailure(t, st.ID)
	cl := rawProducer(t, k.kc)
	// Forged commands with the right version: one naming another step, one
	// naming the current step but not the saga's own command (sent early to
	// skip the backoff).
	produce(t, cl, commandRecord(topic, st.ID, "kwrongstep", "ship", version))
	early := produce(t, cl, commandRecord(topic, st.ID, "kwrongstep", "charge", version))
	waitFor(t, 10*time.Second, func() bool {
		return k.engine.Stats().StaleDiscarded >= 2
	}, "the forged commands (up to offset %d) to be refused", early)
	require.Equal(t, int64(1), charges.Load(), "the retry did not run early")
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, int64(2), charges.Load())
	// The failed first attempt's effect was rolled back with it.
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID))
}

// versionAfterFirstFailure waits for saga id's current step to have failed
// once, and returns the saga's version then.
func (k *kafkaBundle) versionAfterFirstFailure(t *testing.T, id uuid.UUID) int64 {
	t.Helper()
	return sagatest.Wait(t, k.engine, id, sagatest.Cond("fail its step once", func(in *saga.Instance) bool {
		return in.Attempt == 1
	}), &sagatest.WaitOpts{Timeout: 10 * time.Second}).Version
}

// An outcome that PostgreSQL refuses, whatever its cause, parks its saga
// with a storable error; the other sagas of the batch go on.
func TestRefusedOutcomeParksItsSagaNotTheBatch(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	b := setup(t, &saga.Config{Workers: 1, BatchSize: 8})
	def := saga.Define("refused-outcome", saga.Step[order]{Name: "one", Retry: &saga.RetryPolicy{MaxAttempts: 1},
		Action: func(ctx context.Context, run *saga.StepRun, s *order) error {
			if s.OrderID == "bad" {
				return steps.Permanent(errors.New("declined"))
			}
			return recordEffect(ctx, run, b.schema)
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	bad, err := saga.Start(ctx, b.engine, def, order{OrderID: "bad"}, nil)
	require.NoError(t, err)
	var good []uuid.UUID
	for range 3 {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: "good"}, nil)
		require.NoError(t, err)
		good = append(good, st.ID)
	}
	// The bad saga's failure is made unstorable on its way to PostgreSQL.
	b.engine.SetOutcomeHook(func(id uuid.UUID, lastError *string) *string {
		if id == bad.ID && lastError != nil {
			s := *lastError + "\x00"
			return &s
		}
		return lastError
	})
	b.start(t)
	for _, id := range good {
		require.Equal(t, saga.StatusCompleted, b.waitTerminalWithin(t, id, 10*time.Second).Status)
	}
	in := b.waitTerminalWithin(t, bad.ID, 10*time.Second)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, saga.CodeInvalidOutcome, in.LastError.Code)
	require.Contains(t, in.LastError.Message, "could not be stored")
}

// A participant's reply is untrusted too: a refusal whose code or text
// PostgreSQL cannot store compensates the saga with a storable code, and
// replies behind it on the reply topic's one partition are applied.
func TestReplyWithPoisonCodeCompensatesAndOthersGoOn(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".kreply"
	replies := topic + ".replies"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1}, topic, replies, "kreply.participant")
	def := saga.Define("kreply", saga.Step[order]{Name: "remote", Timeout: 20 * time.Second, Remote: &saga.Remote[order]{
		Topic: "kreply.participant", Type: "kreply.do",
		Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
	}})
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	for _, name := range []string{"nul", "utf8", "10kB", "healthy"} {
		st, err := saga.Start(ctx, k.engine, def, order{OrderID: name}, nil)
		require.NoError(t, err)
		ids[name] = st.ID
	}
	// Act as the participant: read each command and answer it raw.
	cmds := map[uuid.UUID][]kgo.RecordHeader{}
	waitFor(t, 15*time.Second, func() bool {
		msgs, err := k.kc.ReadAll(ctx, "kreply.participant")
		require.NoError(t, err)
		for _, m := range msgs {
			var hs []kgo.RecordHeader
			var sagaID uuid.UUID
			for _, h := range m.Headers {
				hs = append(hs, kgo.RecordHeader{Key: h.Key, Value: h.Value})
				if h.Key == store.HeaderSagaID {
					sagaID = uuid.MustParse(string(h.Value))
				}
			}
			cmds[sagaID] = hs
		}
		return len(cmds) == len(ids)
	}, "the four remote commands")
	cl := rawProducer(t, k.kc)
	reply := func(id uuid.UUID, body string) {
		var stepKey string
		for _, h := range cmds[id] {
			if h.Key == store.HeaderStepKey {
				stepKey = string(h.Value)
			}
		}
		produce(t, cl, &kgo.Record{Topic: replies, Partition: 0, Key: []byte(id.String()), Value: []byte(body), Headers: []kgo.RecordHeader{
			{Key: store.HeaderMessageID, Value: []byte("java-" + id.String())}, // not a UUID: any storable id is fine
			{Key: store.HeaderType, Value: []byte(steps.ReplyType)},
			{Key: store.HeaderSagaID, Value: []byte(id.String())},
			{Key: store.HeaderStepKey, Value: []byte(stepKey)},
		}})
	}
	for _, p := range poisonStrings {
		code, _ := json.Marshal(p.s) // invalid UTF-8 becomes U+FFFD in JSON, as any encoder would send it
		reply(ids[p.name], `{"ok":false,"code":`+string(code)+`,"error":`+string(code)+`}`)
	}
	reply(ids["healthy"], `{"ok":true,"result":{}}`)

	require.Equal(t, saga.StatusCompleted, k.waitTerminalWithin(t, ids["healthy"], 15*time.Second).Status)
	for _, p := range poisonStrings {
		in := k.waitTerminalWithin(t, ids[p.name], 15*time.Second)
		require.Equal(t, saga.StatusCompensated, in.Status, p.name)
		require.NotContains(t, in.LastError.Code, "\x00", p.name)
		require.LessOrEqual(t, len(in.LastError.Code), 256, p.name)
	}
}

// A reply is applied whatever its message id (a Java service's, 600 bytes
// long, with bytes PostgreSQL refuses): the id is not what makes a reply
// count. A reply whose saga-id header disagrees with its step key is refused.
func TestReplyIDsMayBeAnything(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".kreplyid"
	replies := topic + ".replies"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1}, topic, replies, "kreplyid.participant")
	def := saga.Define("kreplyid", saga.Step[order]{Name: "remote", Timeout: 20 * time.Second, Remote: &saga.Remote[order]{
		Topic: "kreplyid.participant", Type: "kreplyid.do",
		Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
	}})
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	ctx := context.Background()
	ids := []string{randomLetters(600), "nul\x00id", "utf8\xffid", randomLetters(10 << 10), ""}
	sagas := make([]uuid.UUID, len(ids)+1)
	for i := range sagas {
		st, err := saga.Start(ctx, k.engine, def, order{OrderID: fmt.Sprint(i)}, nil)
		require.NoError(t, err)
		sagas[i] = st.ID
	}
	cl := rawProducer(t, k.kc)
	reply := func(id uuid.UUID, msgID string, sagaHeader string) int64 {
		return produce(t, cl, &kgo.Record{Topic: replies, Partition: 0, Key: []byte(id.String()), Value: []byte(`{"ok":true,"result":{}}`),
			Headers: []kgo.RecordHeader{
				{Key: store.HeaderMessageID, Value: []byte(msgID)},
				{Key: store.HeaderType, Value: []byte(steps.ReplyType)},
				{Key: store.HeaderSagaID, Value: []byte(sagaHeader)},
				{Key: store.HeaderStepKey, Value: []byte(id.String() + "/remote/forward/0")},
			}})
	}
	// The commands must be out, so that each saga waits for its reply.
	waitFor(t, 15*time.Second, func() bool {
		msgs, err := k.kc.ReadAll(ctx, "kreplyid.participant")
		require.NoError(t, err)
		return len(msgs) == len(sagas)
	}, "the remote commands")
	last := sagas[len(ids)]
	mismatch := reply(last, uuid.NewString(), sagas[0].String())
	for i, msgID := range ids {
		reply(sagas[i], msgID, sagas[i].String())
	}
	for i := range ids {
		require.Equal(t, saga.StatusCompleted, k.waitTerminalWithin(t, sagas[i], 15*time.Second).Status, "reply id #%d", i)
	}
	_, _, _, reason, ok := k.deadLetterAt(t, replies, mismatch)
	require.True(t, ok, "the reply naming another saga in its header is dead-lettered")
	require.Contains(t, reason, "names saga")
	in, err := k.engine.Get(ctx, last)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status, "the mismatched reply was not applied")
}

// A refusal that names no command (a participant that does not send
// in_reply_to) is applied, and the engine says, once per remote step, that
// such a participant is open to a copy of an old refusal failing a resumed
// step. A refusal that names its command is applied without a word.
func TestRefusalNamingNoCommandIsWarnedOnce(t *testing.T) {
	t.Parallel()
	topic := saga.CommandTopicDefault + ".unaddr"
	replies := topic + ".replies"
	logs := &testkit.Buffer{}
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))},
		topic, replies, "unaddr.participant")
	def := saga.Define("unaddr", saga.Step[order]{Name: "remote", Timeout: 20 * time.Second, Remote: &saga.Remote[order]{
		Topic: "unaddr.participant", Type: "unaddr.do",
		Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
	}})
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	ctx := context.Background()
	var ids []uuid.UUID
	for i := range 3 {
		st, err := saga.Start(ctx, k.engine, def, order{OrderID: fmt.Sprint("o-", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	cmds := map[uuid.UUID]map[string]string{}
	waitFor(t, 15*time.Second, func() bool {
		msgs, err := k.kc.ReadAll(ctx, "unaddr.participant")
		require.NoError(t, err)
		for _, m := range msgs {
			hs := map[string]string{}
			for _, h := range m.Headers {
				hs[h.Key] = string(h.Value)
			}
			cmds[uuid.MustParse(hs[store.HeaderSagaID])] = hs
		}
		return len(cmds) == len(ids)
	}, "the three remote commands")
	cl := rawProducer(t, k.kc)
	refuse := func(id uuid.UUID, inReplyTo string) {
		body := `{"ok":false,"code":"declined","error":"no"}`
		if inReplyTo != "" {
			body = `{"ok":false,"code":"declined","error":"no","in_reply_to":"` + inReplyTo + `"}`
		}
		produce(t, cl, &kgo.Record{Topic: replies, Partition: 0, Key: []byte(id.String()), Value: []byte(body), Headers: []kgo.RecordHeader{
			{Key: store.HeaderMessageID, Value: []byte(uuid.NewString())},
			{Key: store.HeaderType, Value: []byte(steps.ReplyType)},
			{Key: store.HeaderSagaID, Value: []byte(id.String())},
			{Key: store.HeaderStepKey, Value: []byte(cmds[id][store.HeaderStepKey])},
		}})
	}
	const warning = "a participant's refusal names no command"
	// The first names its command: applied, nothing said.
	refuse(ids[0], cmds[ids[0]][store.HeaderMessageID])
	in := k.waitTerminalWithin(t, ids[0], 15*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, "declined", in.LastError.Code)
	require.NotContains(t, logs.String(), warning)
	// The other two name none: applied, and said once.
	refuse(ids[1], "")
	refuse(ids[2], "")
	for _, id := range ids[1:] {
		in := k.waitTerminalWithin(t, id, 15*time.Second)
		require.Equal(t, saga.StatusCompensated, in.Status)
		require.Equal(t, "declined", in.LastError.Code)
	}
	require.Equal(t, 1, strings.Count(logs.String(), warning), logs.String())
	require.Contains(t, logs.String(), "saga=unaddr step=remote")
}
