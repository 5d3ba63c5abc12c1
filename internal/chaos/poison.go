package chaos

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/signing"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/transport/natsbus"
	"github.com/sagaflow/sagaflow/wire"
)

// Injected is one message the parent wrote straight to a topic, past every
// sagaflow client, with where the broker put it.
type Injected struct {
	Kind      string // what it is and which field carries the bad bytes
	Topic     string
	Partition int32
	Offset    int64
	// Must says it must be dead-lettered. Otherwise it is a copy of a real,
	// signed message with bad bytes only in what the signature does not
	// cover: the consumer may process it as the duplicate it is, and the
	// checkers prove it changed nothing.
	Must bool

	record *kgo.Record // what was sent
}

// The classes of bytes PostgreSQL cannot store as they are (issue #11,
// point 1): a NUL byte, invalid UTF-8, and 10 kB of random hex (random, so
// that TOAST cannot compress it under the btree index limit).
var poisonClasses = []string{"nul", "utf8", "10kB"}

func poisonBytes(class string, rng *rand.Rand) string {
	tag := fmt.Sprintf("%08x", rng.Uint32())
	switch class {
	case "nul":
		return "poison\x00" + tag
	case "utf8":
		return "poison\xff\xfe" + tag
	}
	raw := make([]byte, 5000)
	for i := range raw {
		raw[i] = byte(rng.UintN(256))
	}
	return hex.EncodeToString(raw)
}

// The fields poison is put in. Unsigned ones: a copy that keeps a valid
// signature can carry bad bytes there.
var (
	poisonFields   = []string{"header-name", "header-value", "message-id", "key", "step-key", "reply-to", "value"}
	unsignedFields = []string{"header-name", "header-value", "message-id", "key"}
)

// sample is a real message, read back from an outbox.
type sample struct {
	key     string
	payload []byte
	headers map[string]string
}

// samples returns up to 20 recent messages of type typ of the outbox of
// schema bound for topic (none moved back by an engine that could not run
// them yet).
func (e *Env) samples(ctx context.Context, schema, topic, typ string) ([]sample, error) {
	rows, err := e.Pool.Query(ctx, `SELECT aggregateid, payload, headers::text FROM `+schema+`.outbox
	    WHERE topic = $1 AND type = $2 AND delivery = 'relay' AND aggregatetype <> 'sagaflow.held' ORDER BY created_at DESC LIMIT 20`, topic, typ)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []sample
	for rows.Next() {
		var s sample
		var h string
		if err := rows.Scan(&s.key, &s.payload, &h); err != nil {
			return nil, err
		}
		if err := json.Unmarshal([]byte(h), &s.headers); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// WaitForCharges waits, up to d, until the orders outbox has a charge
// command for InjectPoison to copy.
func (e *Env) WaitForCharges(ctx context.Context, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		s, err := e.samples(ctx, OrdersSchema, PaymentsTopic, ChargeType)
		if err == nil && len(s) > 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// rec is a record being built: headers by name, plus extra raw ones.
type rec struct {
	topic   string
	key     string
	value   []byte
	headers map[string]string
	extra   []kgo.RecordHeader
}

func (r *rec) sign(keys signing.Keys) {
	delete(r.headers, signing.Header)
	keys.SignMap(r.headers, r.value)
}

// spoil puts bad bytes of class into field.
func (r *rec) spoil(field, class string, rng *rand.Rand) {
	bad := poisonBytes(class, rng)
	switch field {
	case "header-name":
		r.extra = append(r.extra, kgo.RecordHeader{Key: "x-" + bad, Value: []byte("v")})
	case "header-value":
		r.extra = append(r.extra, kgo.RecordHeader{Key: "traceparent", Value: []byte(bad)})
	case "message-id":
		r.headers[store.HeaderMessageID] = bad
		delete(r.headers, store.HeaderHeldID)
	case "key":
		r.key = bad
	case "step-key":
		r.headers[store.HeaderStepKey] = bad
	case "reply-to":
		r.headers[store.HeaderReplyTo] = bad
	case "value":
		r.value = []byte(bad)
	}
}

func (r *rec) record(partition int32) *kgo.Record {
	out := &kgo.Record{Topic: r.topic, Partition: partition, Key: []byte(r.key), Value: r.value}
	names := make([]string, 0, len(r.headers))
	for n := range r.headers {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		out.Headers = append(out.Headers, kgo.RecordHeader{Key: n, Value: []byte(r.headers[n])})
	}
	out.Headers = append(out.Headers, r.extra...)
	return out
}

func copyHeaders(h map[string]string) map[string]string {
	out := make(map[string]string, len(h))
	for k, v := range h {
		out[k] = v
	}
	return out
}

// syntheticCharge is a charge command for a saga that does not exist, for
// when no real one is at hand yet.
func syntheticCharge() sample {
	id := uuid.New()
	key := steps.Key{SagaID: id, Step: "charge", Direction: steps.Forward, Epoch: 0}.String()
	payload, _ := json.Marshal(chargeCmd{Key: "poison-" + id.String(), Sent: time.Now()})
	return sample{key: id.String(), payload: payload, headers: map[string]string{
		store.HeaderMessageID: uuid.New().String(), store.HeaderType: ChargeType, store.HeaderSagaID: id.String(),
		store.HeaderStepKey: key, store.HeaderReplyTo: saga.CommandTopicDefault + "." + SagaName + ".replies",
		store.HeaderDirection: string(steps.Forward),
	}}
}

// commandType is the type of an engine's step commands.
const commandType = wire.TypeStep

// syntheticCommand is an engine's step command for a saga that does not
// exist.
func syntheticCommand() sample {
	id := uuid.New()
	payload, _ := json.Marshal(map[string]any{"saga_id": id, "saga": SagaName, "step": "reserve", "direction": "forward", "epoch": 0, "version": 1})
	return sample{key: id.String(), payload: payload, headers: map[string]string{
		store.HeaderMessageID: uuid.New().String(), store.HeaderType: commandType, store.HeaderSagaID: id.String(),
		store.HeaderStepKey: steps.Key{SagaID: id, Step: "reserve", Direction: steps.Forward}.String(),
	}}
}

func pick(rng *rand.Rand, from []sample, or func() sample) sample {
	if len(from) == 0 {
		return or()
	}
	s := from[rng.IntN(len(from))]
	s.headers = copyHeaders(s.headers)
	return s
}

// poisonKinds are the messages InjectPoison writes, in turn. Each builds a
// record from real messages of the system (or a synthetic one when none is
// at hand yet) and reports whether it must be dead-lettered.
var poisonKinds = []string{
	"engine-forged-step", "engine-forged-ok", "engine-bad-id", "participant-forged-refund", "participant-copy", "participant-resigned",
}

// InjectPoison writes n bad messages with a raw Kafka client, among the
// valid traffic, each of a kind of poisonKinds in turn with bytes of each
// class of poisonClasses (NUL, invalid UTF-8, 10 kB) in one of its fields:
//
//   - engine-forged-step: a copy of a real step command naming another step,
//     its signature no longer valid, to the engine's command topic;
//   - engine-forged-ok: an unsigned "ok" reply for a real charge step, to
//     the engine's reply topic;
//   - engine-bad-id: a signed copy of a real command or reply whose message
//     id is the bad bytes (a command must be dead-lettered; a reply, whose
//     id plays no part in applying it, may be processed as the duplicate
//     it is);
//   - participant-forged-refund: a forged compensation of a real charge, its
//     signature no longer valid, to the participant;
//   - participant-copy: a signed copy of a real charge with bad bytes in
//     what the signature does not cover (message id, key, a header's name or
//     value): the participant may process it, as the duplicate it is;
//   - participant-resigned: a charge signed by a trusted but broken
//     producer, with a bad step key or reply topic.
//
// Every kind but participant-copy and a reply's engine-bad-id must be dead-lettered, with its raw
// bytes, without holding back anything behind it; participant-copy must
// change nothing (the checkers see every effect once).
func (e *Env) InjectPoison(ctx context.Context, n int, rng *rand.Rand) error {
	cmdTopic, replyTopic := Topics()[0], Topics()[1]
	commands, err := e.samples(ctx, OrdersSchema, cmdTopic, commandType)
	if err != nil {
		return fmt.Errorf("chaos: inject poison: %w", err)
	}
	charges, err := e.samples(ctx, OrdersSchema, PaymentsTopic, ChargeType)
	if err != nil {
		return fmt.Errorf("chaos: inject poison: %w", err)
	}
	replies, err := e.samples(ctx, PaymentsSchema, replyTopic, steps.ReplyType)
	if err != nil {
		return fmt.Errorf("chaos: inject poison: %w", err)
	}
	keys := signing.Keys{Current: SigningKey}
	e.mu.Lock()
	turn := e.poisonTurn
	e.poisonTurn += n
	e.mu.Unlock()

	var recs []*kgo.Record
	var out []Injected
	for i := range n {
		t := turn + i
		kind := poisonKinds[t%len(poisonKinds)]
		if !e.AllSteps && (kind == "engine-forged-step" || (kind == "engine-bad-id" && len(replies) == 0)) {
			// In the hybrid mode no engine reads the command topic: the
			// engine's door on the bus is its reply topic.
			kind = "engine-forged-ok"
		}
		class := poisonClasses[(t/len(poisonKinds))%len(poisonClasses)]
		var r rec
		must := true
		field := poisonFields[rng.IntN(len(poisonFields))]
		switch kind {
		case "engine-forged-step":
			s := pick(rng, commands, syntheticCommand)
			var cmd map[string]any
			_ = json.Unmarshal(s.payload, &cmd)
			if cmd == nil {
				cmd = map[string]any{}
			}
			if cmd["step"] == "ship" {
				cmd["step"] = "reserve"
			} else {
				cmd["step"] = "ship"
			}
			payload, _ := json.Marshal(cmd)
			s.headers[store.HeaderMessageID] = uuid.New().String()
			delete(s.headers, store.HeaderHeldID)
			r = rec{topic: cmdTopic, key: s.key, value: payload, headers: s.headers} // its old signature
		case "engine-forged-ok":
			s := pick(rng, charges, syntheticCharge)
			ok, _ := json.Marshal(steps.Reply{OK: true, Result: json.RawMessage(`{}`)})
			r = rec{topic: replyTopic, key: s.key, value: ok, headers: map[string]string{
				store.HeaderMessageID: uuid.New().String(), store.HeaderType: steps.ReplyType,
				store.HeaderSagaID: s.headers[store.HeaderSagaID], store.HeaderStepKey: s.headers[store.HeaderStepKey],
			}}
		case "engine-bad-id":
			field = "message-id"
			if (t%2 == 0 || !e.AllSteps) && len(replies) > 0 { // hybrid: always a reply
				// A reply's id plays no part in applying it: a signed copy
				// with any id is the duplicate it is, and changes nothing.
				s := pick(rng, replies, nil)
				r = rec{topic: replyTopic, key: s.key, value: s.payload, headers: s.headers}
				must = false
			} else {
				s := pick(rng, commands, syntheticCommand)
				r = rec{topic: cmdTopic, key: s.key, value: s.payload, headers: s.headers}
				r.sign(keys)
			}
		case "participant-forged-refund":
			s := pick(rng, charges, syntheticCharge)
			k, err := steps.ParseKey(s.headers[store.HeaderStepKey])
			if err == nil {
				k.Direction = steps.Compensate
				s.headers[store.HeaderStepKey] = k.String()
			}
			s.headers[store.HeaderType] = RefundType
			s.headers[store.HeaderDirection] = string(steps.Compensate)
			s.headers[store.HeaderMessageID] = uuid.New().String()
			r = rec{topic: PaymentsTopic, key: s.key, value: s.payload, headers: s.headers} // its old signature
		case "participant-copy":
			field = unsignedFields[rng.IntN(len(unsignedFields))]
			if len(charges) == 0 {
				// No real charge yet: an unsigned one, which must be refused.
				s := syntheticCharge()
				r = rec{topic: PaymentsTopic, key: s.key, value: s.payload, headers: s.headers}
				break
			}
			s := pick(rng, charges, nil)
			r = rec{topic: PaymentsTopic, key: s.key, value: s.payload, headers: s.headers}
			must = false
		case "participant-resigned":
			field = []string{"step-key", "reply-to"}[rng.IntN(2)]
			s := pick(rng, charges, syntheticCharge)
			// A new id: under the real one, the participant would skip it
			// as a duplicate before looking at it.
			s.headers[store.HeaderMessageID] = uuid.New().String()
			r = rec{topic: PaymentsTopic, key: s.key, value: s.payload, headers: s.headers}
		}
		r.spoil(field, class, rng)
		if kind == "participant-resigned" {
			r.sign(keys) // after the bad bytes: the signature is valid
		}
		recs = append(recs, r.record(rng.Int32N(4)))
		out = append(out, Injected{Kind: kind + "/" + class + "/" + field, Topic: r.topic, Must: must})
	}

	if e.Bus == BusNATS {
		return e.injectNATS(ctx, recs, out)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.Kafka.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		return fmt.Errorf("chaos: inject poison: %w", err)
	}
	defer cl.Close()
	// Long enough to ride out any outage of the soak: a write that failed
	// would leave a message at a position nobody recorded.
	pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := cl.ProduceSync(pctx, recs...).FirstErr(); err != nil {
		return fmt.Errorf("chaos: inject poison: %w", err)
	}
	for i, r := range recs {
		out[i].Partition, out[i].Offset, out[i].record = r.Partition, r.Offset, r
	}
	e.mu.Lock()
	e.injected = append(e.injected, out...)
	e.mu.Unlock()
	return nil
}

// injectNATS publishes recs over NATS with the protocol itself (see
// publishRawNATS): each to its partition's subject, its key in
// natsbus.KeyHeader. What is recorded as sent is what a natsbus.Reader
// returns for it (the key out of the headers, the headers by name), so
// that the checkers compare a dead letter with the bytes that were sent.
func (e *Env) injectNATS(ctx context.Context, recs []*kgo.Record, out []Injected) error {
	msgs := make([]rawNATSMsg, len(recs))
	for i, r := range recs {
		hs := append(slices.Clone(r.Headers), kgo.RecordHeader{Key: natsbus.KeyHeader, Value: r.Key})
		msgs[i] = rawNATSMsg{subject: natsbus.Subject(r.Topic, int(r.Partition)), headers: hs, data: r.Value}
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	seqs, err := publishRawNATS(pctx, e.NATS.Addr(), msgs)
	if err != nil {
		return err
	}
	for i, r := range recs {
		r.Offset = int64(seqs[i])
		r.Headers = natsOrder(r.Headers)
		out[i].Partition, out[i].Offset, out[i].record = r.Partition, r.Offset, r
	}
	e.mu.Lock()
	e.injected = append(e.injected, out...)
	e.mu.Unlock()
	return nil
}
