package review34_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

const svcTopic = "svc.commands"

// kafkaRig is a schema, a kfake cluster, a relay on the schema, an engine
// (hybrid mode, or Kafka mode with allSteps) running saga "pay" (reserve
// locally, then charge remotely on svcTopic; refund compensates remotely),
// and a fake participant of svcTopic.
type kafkaRig struct {
	pool   *pgxpool.Pool
	schema string
	kc     *kafkatest.Cluster
	e      *saga.Engine
	def    *saga.Definition[order]
	p      *sagatest.Participant

	mu      sync.Mutex
	replies map[uuid.UUID][]json.RawMessage // what OnReply received
}

func newKafkaRig(t *testing.T, allSteps bool, answers map[string]sagatest.Answer) *kafkaRig {
	t.Helper()
	return newKafkaRigOn(t, allSteps, answers, false)
}

// newKafkaRigOn is newKafkaRig; with ownSchema the participant keeps its
// inbox and outbox in a schema of its own, as a real service would.
func newKafkaRigOn(t *testing.T, allSteps bool, answers map[string]sagatest.Answer, ownSchema bool) *kafkaRig {
	t.Helper()
	r := &kafkaRig{replies: map[uuid.UUID][]json.RawMessage{}}
	r.pool, r.schema = pgtest.Migrated(t)
	r.kc = kafkatest.New(t, kafkatest.SeedTopics(1, "sagaflow.commands.pay", "sagaflow.commands.pay.replies", svcTopic),
		kafkatest.AllowAutoTopicCreation())
	ctx := context.Background()
	w := relay.NewKafkaWriter(r.kc.Addrs(), nil)
	t.Cleanup(func() { w.Close() })
	rl, err := relay.New(r.pool, w, &relay.Config{Schema: r.schema, PollInterval: 50 * time.Millisecond, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	if err := rl.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = rl.Stop(c)
	})
	r.def = saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: time.Hour, Remote: &saga.Remote[order]{
			Topic: svcTopic, Type: "svc.charge", CompensateType: "svc.refund",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
			OnReply: func(_ context.Context, run *saga.StepRun, o *order, res json.RawMessage) error {
				r.mu.Lock()
				r.replies[run.SagaID] = append(r.replies[run.SagaID], append(json.RawMessage(nil), res...))
				r.mu.Unlock()
				o.Got = string(res)
				return nil
			},
		}},
		saga.Step[order]{Name: "ship", Action: noop})
	if answers == nil {
		answers = map[string]sagatest.Answer{"svc.charge": sagatest.Reply("ok"), "svc.refund": sagatest.Reply("refunded")}
	}
	pPool, pSchema := r.pool, r.schema
	if ownSchema {
		pPool, pSchema = pgtest.Migrated(t)
	}
	r.p = sagatest.NewParticipant(t, sagatest.ParticipantConfig{
		Brokers: r.kc.Addrs(), Topic: svcTopic, Pool: pPool, Schema: pSchema, Answers: answers, Logger: discard,
	})
	r.e = engine(t, r.pool, &saga.Config{Schema: r.schema, Kafka: &saga.KafkaConfig{Brokers: r.kc.Addrs(), AllSteps: allSteps}}, r.def)
	return r
}

func (r *kafkaRig) start(t *testing.T, o order) uuid.UUID {
	t.Helper()
	st, err := saga.Start(ctxT(t, 10*time.Second), r.e, r.def, o, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.ID
}

func (r *kafkaRig) repliesOf(id uuid.UUID) []json.RawMessage {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]json.RawMessage(nil), r.replies[id]...)
}

// callsOf are the participant's calls for saga id.
func (r *kafkaRig) callsOf(id uuid.UUID) []sagatest.Call {
	var out []sagatest.Call
	for _, c := range r.p.Calls() {
		if c.Key.SagaID == id {
			out = append(out, c)
		}
	}
	return out
}

var hostile = strings.Repeat("é\xff\x00<'\"\\", 1) + strings.Repeat("z", 10_000) + "\xfe\u2028"

// TestParticipantAnswersHostileValues: Reply, Refuse and AnswerFunc with NUL
// bytes, invalid UTF-8 and 10 kB strings; each saga must end as its answer
// says, and a refusal must never look like a success.
func TestParticipantAnswersHostileValues(t *testing.T) {
	r := newKafkaRig(t, false, nil)
	wait := &sagatest.WaitOpts{Timeout: 20 * time.Second}

	type tc struct {
		name   string
		answer sagatest.Answer
		status saga.Status
		check  func(t *testing.T, id uuid.UUID, in *saga.Instance)
	}
	cases := []tc{
		{"reply plain", sagatest.Reply(map[string]string{"id": "ch_1"}), saga.StatusCompleted, func(t *testing.T, id uuid.UUID, in *saga.Instance) {
			if got := r.repliesOf(id); len(got) != 1 || string(got[0]) != `{"id":"ch_1"}` {
				t.Errorf("OnReply got %q", got)
			}
		}},
		{"reply 10 kB invalid UTF-8", sagatest.Reply(map[string]string{"s": strings.ReplaceAll(hostile, "\x00", "")}), saga.StatusCompleted, func(t *testing.T, id uuid.UUID, in *saga.Instance) {
			got := r.repliesOf(id)
			if len(got) != 1 {
				t.Fatalf("OnReply ran %d times", len(got))
			}
			var m map[string]string
			if err := json.Unmarshal(got[0], &m); err != nil || len(m["s"]) < 10_000 {
				t.Errorf("OnReply got %d bytes, %v", len(got[0]), err)
			}
		}},
		{"reply with NUL", sagatest.Reply(map[string]string{"s": "a\x00b"}), "", func(t *testing.T, id uuid.UUID, in *saga.Instance) {
			// OnReply puts the NUL into the state, which PostgreSQL cannot
			// store: the saga must end (state_encode), not hang.
			t.Logf("a reply with a NUL: %s %v", in.Status, in.LastError)
		}},
		{"reply null", sagatest.Reply(nil), saga.StatusCompleted, nil},
		{"refuse hostile", sagatest.Refuse("code"+hostile, "msg"+hostile), saga.StatusCompensated, func(t *testing.T, id uuid.UUID, in *saga.Instance) {
			if in.LastError == nil || in.LastError.Code == "" {
				t.Errorf("no last error code: %+v", in.LastError)
			}
			if got := r.repliesOf(id); len(got) != 0 {
				t.Errorf("OnReply ran on a refusal: %q", got)
			}
		}},
		{"refuse empty code and message", sagatest.Refuse("", ""), saga.StatusCompensated, func(t *testing.T, id uuid.UUID, in *saga.Instance) {
			if got := r.repliesOf(id); len(got) != 0 {
				t.Errorf("OnReply ran on a refusal: %q", got)
			}
		}},
		{"answerfunc permanent", sagatest.AnswerFunc(func(context.Context, sagatest.Call) (any, error) {
			return nil, steps.Permanent(steps.WithCode("nope", errors.New("no")))
		}), saga.StatusCompensated, func(t *testing.T, id uuid.UUID, in *saga.Instance) {
			if in.LastError == nil || in.LastError.Code != "nope" {
				t.Errorf("last error %+v, want code nope", in.LastError)
			}
		}},
		{"answerfunc panics", sagatest.AnswerFunc(func(context.Context, sagatest.Call) (any, error) {
			panic("boom")
		}), saga.StatusCompensated, nil},
		{"answerfunc (nil, nil)", sagatest.AnswerFunc(func(context.Context, sagatest.Call) (any, error) {
			return nil, nil
		}), saga.StatusCompleted, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r.p.Answer("svc.charge", c.answer)
			id := r.start(t, order{ID: c.name})
			f := newFake(t)
			var in *saga.Instance
			o := call(30*time.Second, func() { in = sagatest.WaitEnded(f, r.e, id, wait) })
			if o.hung || o.panicked != nil || f.Failed() {
				t.Fatalf("the saga did not end: %+v %.2000s", o, f.messages())
			}
			t.Logf("%s: %v", in.Status, in.LastError)
			if c.status != "" && in.Status != c.status {
				t.Fatalf("status %s, want %s\n%s", in.Status, c.status, timeline(in))
			}
			calls := r.callsOf(id)
			if len(calls) == 0 || calls[0].Type != "svc.charge" || !calls[0].Answered {
				t.Errorf("calls of the saga: %+v", calls)
			} else {
				var cmd order
				if err := json.Unmarshal(calls[0].Command, &cmd); err != nil || cmd.ID != c.name {
					t.Errorf("Call.Command %s: %v", calls[0].Command, err)
				}
				if calls[0].Key.Step != "charge" || calls[0].Direction != steps.Forward {
					t.Errorf("Call key %+v direction %q", calls[0].Key, calls[0].Direction)
				}
			}
			if c.check != nil {
				c.check(t, id, in)
			}
		})
	}
}

// TestParticipantRetriedAnswerAndNoReply: an AnswerFunc error leaves the
// command to be retried (it shows in Calls again); NoReply records an
// unanswered call, and the reply timeout passes with Clock.Advance.
func TestParticipantRetriedAnswerAndNoReply(t *testing.T) {
	r := newKafkaRig(t, false, nil)
	var n sync.Map
	r.p.Answer("svc.charge", sagatest.AnswerFunc(func(_ context.Context, c sagatest.Call) (any, error) {
		v, _ := n.LoadOrStore(c.Key.SagaID, new(int))
		p := v.(*int)
		*p++
		if *p == 1 {
			return nil, errors.New("transient")
		}
		return "ok", nil
	}))
	id := r.start(t, order{ID: "retried"})
	in := sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 30 * time.Second})
	if in.Status != saga.StatusCompleted {
		t.Fatalf("%s", sagatest.Describe(in))
	}
	if calls := r.callsOf(id); len(calls) != 2 {
		t.Errorf("a command retried once shows %d times in Calls, want 2: %+v", len(calls), calls)
	}

	r.p.Answer("svc.charge", sagatest.NoReply())
	id = r.start(t, order{ID: "lost"})
	sagatest.Wait(t, r.e, id, sagatest.Event("command_sent:charge"), &sagatest.WaitOpts{Timeout: 20 * time.Second})
	deadline := time.Now().Add(20 * time.Second)
	for len(r.callsOf(id)) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	calls := r.callsOf(id)
	if len(calls) != 1 || calls[0].Answered {
		t.Fatalf("NoReply's call: %+v", calls)
	}
	// The reply is due in an hour; a minute must not time it out.
	c := sagatest.NewClock(r.pool, r.schema, r.e)
	if err := c.Advance(ctxT(t, 10*time.Second), time.Minute); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if in := get(t, r.e, id); in.Status != saga.StatusRunning {
		t.Fatalf("a minute timed out an hour's reply: %s", sagatest.Describe(in))
	}
	if err := c.Advance(ctxT(t, 10*time.Second), 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	in = sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 20 * time.Second})
	if in.Status != saga.StatusCompensated {
		t.Fatalf("%s", sagatest.Describe(in))
	}
	// The compensation went to the participant as a refund.
	var refunds int
	for _, c := range r.callsOf(id) {
		if c.Type == "svc.refund" && c.Direction == steps.Compensate {
			refunds++
		}
	}
	if refunds != 1 {
		t.Errorf("refunds %d, calls %+v", refunds, r.callsOf(id))
	}
}

// TestParticipantForgedAndDuplicateCommands: a command delivered again is
// deduplicated by its step key and does not show again in Calls; a forged
// command (bad key, unknown type) is dead-lettered and must not show in
// Calls as answered nor move any saga.
func TestParticipantForgedAndDuplicateCommands(t *testing.T) {
	r := newKafkaRig(t, false, nil)
	id := r.start(t, order{ID: "dup"})
	in := sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 30 * time.Second})
	if in.Status != saga.StatusCompleted {
		t.Fatalf("%s", sagatest.Describe(in))
	}
	before := len(r.p.Calls())
	msgs, err := r.kc.ReadAll(ctxT(t, 20*time.Second), svcTopic)
	if err != nil || len(msgs) == 0 {
		t.Fatalf("read %s: %d, %v", svcTopic, len(msgs), err)
	}
	orig := msgs[0]
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(r.kc.Addrs()...), Topic: svcTopic, BatchTimeout: 10 * time.Millisecond, Transport: tr}
	defer w.Close()
	dup := kafka.Message{Key: orig.Key, Value: orig.Value, Headers: orig.Headers}
	// A forged copy: another type with the same key, and one whose payload
	// is 10 kB of garbage.
	forgedType := kafka.Message{Key: orig.Key, Value: orig.Value, Headers: setHeader(orig.Headers, "unknown.type")}
	garbage := kafka.Message{Key: orig.Key, Value: []byte(hostile), Headers: orig.Headers}
	if err := w.WriteMessages(ctxT(t, 20*time.Second), dup, dup, forgedType, garbage); err != nil {
		t.Fatal(err)
	}
	// Let the participant consume them.
	time.Sleep(3 * time.Second)
	after := r.p.Calls()
	t.Logf("calls before %d after %d: %+v", before, len(after), after[before:])
	if len(after) != before {
		for _, c := range after[before:] {
			t.Logf("new call: %s %s answered=%v %.100s", c.Type, c.Key, c.Answered, c.Command)
		}
		t.Errorf("Calls grew from %d to %d after duplicates and forgeries", before, len(after))
	}
	in2 := get(t, r.e, id)
	if in2.Status != saga.StatusCompleted || len(in2.History) != len(in.History) {
		t.Errorf("the ended saga moved: %s\n%s", in2.Status, timeline(in2))
	}
}

// setHeader returns headers with the message type header replaced.
func setHeader(hs []kafka.Header, typ string) []kafka.Header {
	out := make([]kafka.Header, 0, len(hs))
	for _, h := range hs {
		if strings.Contains(strings.ToLower(h.Key), "type") {
			h = kafka.Header{Key: h.Key, Value: []byte(typ)}
		}
		out = append(out, h)
	}
	return out
}

// TestParticipantMisuse: a config missing what is required, an answer that
// cannot be encoded, and Answer for a type not configured must fail the test
// with a message naming the problem, never panic or pass.
func TestParticipantMisuse(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, svcTopic))
	good := func() sagatest.ParticipantConfig {
		return sagatest.ParticipantConfig{Brokers: kc.Addrs(), Topic: svcTopic, Pool: pool, Schema: schema,
			Answers: map[string]sagatest.Answer{"svc.charge": sagatest.Reply("ok")}, Logger: discard}
	}
	cases := []struct {
		name string
		mod  func(*sagatest.ParticipantConfig)
		want string
	}{
		{"no brokers", func(c *sagatest.ParticipantConfig) { c.Brokers = nil }, "Brokers"},
		{"no topic", func(c *sagatest.ParticipantConfig) { c.Topic = "" }, "Topic"},
		{"no pool", func(c *sagatest.ParticipantConfig) { c.Pool = nil }, "Pool"},
		{"no schema", func(c *sagatest.ParticipantConfig) { c.Schema = "" }, "Schema"},
		{"schema not there", func(c *sagatest.ParticipantConfig) { c.Schema = "no_such_schema_r34" }, "no_such_schema_r34"},
		{"no answers", func(c *sagatest.ParticipantConfig) { c.Answers = nil }, "Answers"},
		{"zero answer", func(c *sagatest.ParticipantConfig) { c.Answers = map[string]sagatest.Answer{"svc.charge": {}} }, "svc.charge"},
		{"nil answer func", func(c *sagatest.ParticipantConfig) {
			c.Answers = map[string]sagatest.Answer{"svc.charge": sagatest.AnswerFunc(nil)}
		}, "svc.charge"},
		{"empty type", func(c *sagatest.ParticipantConfig) { c.Answers = map[string]sagatest.Answer{"": sagatest.Reply(1)} }, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := good()
			c.mod(&cfg)
			f := newFake(t)
			o := call(20*time.Second, func() { sagatest.NewParticipant(f, cfg) })
			if o.panicked != nil {
				t.Fatalf("NewParticipant panicked: %v", o.panicked)
			}
			if o.hung {
				t.Fatalf("NewParticipant hung")
			}
			if !f.Failed() {
				t.Fatalf("NewParticipant accepted %s (returned after %v)", c.name, o.took)
			}
			if c.want != "" && !strings.Contains(f.messages(), c.want) {
				t.Errorf("the failure does not name %q: %s", c.want, f.messages())
			}
		})
	}
	t.Run("answer of an unconfigured type", func(t *testing.T) {
		f := newFake(t)
		var p *sagatest.Participant
		o := call(20*time.Second, func() { p = sagatest.NewParticipant(f, good()) })
		if o.panicked != nil || f.Failed() || p == nil {
			t.Fatalf("a good config failed: %+v %s", o, f.messages())
		}
		o = call(10*time.Second, func() { p.Answer("svc.other", sagatest.Reply(1)) })
		t.Logf("Answer(unknown): %+v %q", o, f.messages())
		if o.panicked != nil {
			t.Fatalf("Answer panicked: %v", o.panicked)
		}
		if !f.Failed() {
			t.Fatalf("Answer of an unconfigured type passed")
		}
		if !strings.Contains(f.messages(), "svc.other") {
			t.Errorf("the failure does not name the type: %s", f.messages())
		}
	})
	// F4, fixed: Answer refuses what NewParticipant refuses.
	for name, a := range map[string]sagatest.Answer{"zero Answer": {}, "AnswerFunc(nil)": sagatest.AnswerFunc(nil)} {
		t.Run("answer changed to a "+name, func(t *testing.T) {
			f := newFake(t)
			var p *sagatest.Participant
			o := call(20*time.Second, func() { p = sagatest.NewParticipant(f, good()) })
			if o.panicked != nil || f.Failed() || p == nil {
				t.Fatalf("a good config failed: %+v %s", o, f.messages())
			}
			o = call(10*time.Second, func() { p.Answer("svc.charge", a) })
			mustFail(t, f, o, "svc.charge", "zero Answer or AnswerFunc(nil)")
		})
	}
}

// TestParticipantUnencodableReply: Reply of a value JSON cannot encode (a
// channel, NaN) is a mistake in the test; it must fail the test, or at least
// not pass it by making the saga look answered.
func TestParticipantUnencodableReply(t *testing.T) {
	for _, v := range []struct {
		name string
		val  any
	}{{"channel", make(chan int)}, {"NaN", math.NaN()}} {
		t.Run(v.name, func(t *testing.T) {
			r := newKafkaRig(t, false, map[string]sagatest.Answer{"svc.charge": sagatest.Reply(v.val), "svc.refund": sagatest.Reply(nil)})
			id := r.start(t, order{ID: "x"})
			f := newFake(t)
			var in *saga.Instance
			o := call(30*time.Second, func() { in = sagatest.WaitEnded(f, r.e, id, &sagatest.WaitOpts{Timeout: 8 * time.Second}) })
			if o.panicked != nil {
				t.Fatalf("panicked: %v", o.panicked)
			}
			if in != nil && in.Status == saga.StatusCompleted {
				t.Fatalf("a reply that cannot be encoded completed the saga: %s", sagatest.Describe(in))
			}
			t.Logf("wait: failed=%v %.400s", f.Failed(), f.messages())
			if in != nil {
				t.Logf("saga %s %v", in.Status, in.LastError)
			}
		})
	}
}

// TestKafkaModeWithTheKit: in Kafka mode (AllSteps) the kit's waits, the
// clock (a retry backoff of an hour) and the participant work as documented.
func TestKafkaModeWithTheKit(t *testing.T) {
	r := newKafkaRig(t, true, nil)
	var tries sync.Map
	flaky := saga.Define("flaky",
		saga.Step[order]{Name: "first", Action: noop},
		saga.Step[order]{Name: "again", Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return time.Hour }},
			Action: func(_ context.Context, run *saga.StepRun, _ *order) error {
				v, _ := tries.LoadOrStore(run.SagaID, new(int))
				p := v.(*int)
				*p++
				if *p == 1 {
					return errors.New("down")
				}
				return nil
			}})
	if err := r.kc.CreateTopic("sagaflow.commands.flaky", 1); err != nil {
		t.Fatal(err)
	}
	e2 := engine(t, r.pool, &saga.Config{Schema: r.schema, CommandTopic: "sagaflow.commands",
		Kafka: &saga.KafkaConfig{Brokers: r.kc.Addrs(), AllSteps: true, GroupID: "r34-flaky"}}, flaky)
	id := r.start(t, order{ID: "kafka-mode"})
	in := sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 40 * time.Second})
	sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve", "command_sent:charge", "reply_received:charge",
		"step_completed:charge", "step_completed:ship", "saga_completed")

	st, err := saga.Start(ctxT(t, 10*time.Second), e2, flaky, order{ID: "f"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sagatest.Wait(t, e2, st.ID, sagatest.Event("step_failed:again"), &sagatest.WaitOpts{Timeout: 40 * time.Second})
	begun := time.Now()
	if err := sagatest.NewClock(r.pool, r.schema, e2).Advance(ctxT(t, 10*time.Second), time.Hour); err != nil {
		t.Fatal(err)
	}
	in = sagatest.WaitEnded(t, e2, st.ID, &sagatest.WaitOpts{Timeout: 30 * time.Second})
	t.Logf("the retry ran %v after Advance", time.Since(begun))
	sagatest.RequireTimeline(t, in, "saga_started", "step_completed:first", "step_failed:again", "step_completed:again", "saga_completed")
}

// TestParticipantAnswerChangedConcurrently: Answer is changed from several
// goroutines while commands flow and Calls is read (the race detector
// watches); every saga ends as one of the answers says, and Calls holds
// each forward command once. After the participant stopped, Calls and
// Answer still work.
func TestParticipantAnswerChangedConcurrently(t *testing.T) {
	var p *sagatest.Participant
	t.Cleanup(func() {
		// Runs after the participant's own cleanup (cleanups run last
		// first): the participant has stopped.
		o := call(10*time.Second, func() {
			_ = p.Calls()
			p.Answer("svc.charge", sagatest.Reply("late"))
		})
		if o.panicked != nil || o.hung {
			t.Errorf("Calls/Answer after the participant stopped: %+v", o)
		}
	})
	r := newKafkaRig(t, false, nil)
	p = r.p
	const n = 12
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if (i+g)%2 == 0 {
					r.p.Answer("svc.charge", sagatest.Reply(map[string]int{"i": i}))
				} else {
					r.p.Answer("svc.charge", sagatest.Refuse("no", "no"))
				}
				_ = r.p.Calls()
				time.Sleep(time.Millisecond)
			}
		}()
	}
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = r.start(t, order{ID: uuid.NewString()})
	}
	for _, id := range ids {
		in := sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 40 * time.Second})
		if in.Status != saga.StatusCompleted && in.Status != saga.StatusCompensated {
			t.Errorf("saga %s: %s", id, sagatest.Describe(in))
		}
		fw := 0
		for _, c := range r.callsOf(id) {
			if c.Type == "svc.charge" {
				fw++
			}
		}
		if fw != 1 {
			t.Errorf("saga %s: %d forward calls: %+v", id, fw, r.callsOf(id))
		}
		if in.Status == saga.StatusCompleted && len(r.repliesOf(id)) != 1 {
			t.Errorf("a completed saga's OnReply ran %d times", len(r.repliesOf(id)))
		}
	}
	close(stop)
	wg.Wait()
}

// TestParticipantOnItsOwnSchema: "a migrated schema, the engine's own or
// (as a real service would have) another": the participant on a schema of
// its own answers, its relay publishes the replies, and a refusal then a
// NoReply timed out by the engine's clock compensate with a refund.
func TestParticipantOnItsOwnSchema(t *testing.T) {
	r := newKafkaRigOn(t, false, nil, true)
	id := r.start(t, order{ID: "own-1"})
	if in := sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 30 * time.Second}); in.Status != saga.StatusCompleted {
		t.Fatalf("%s", sagatest.Describe(in))
	}
	r.p.Answer("svc.charge", sagatest.NoReply())
	id = r.start(t, order{ID: "own-2"})
	sagatest.Wait(t, r.e, id, sagatest.Event("command_sent:charge"), &sagatest.WaitOpts{Timeout: 20 * time.Second})
	deadline := time.Now().Add(20 * time.Second)
	for len(r.callsOf(id)) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if err := sagatest.NewClock(r.pool, r.schema, r.e).Advance(ctxT(t, 10*time.Second), 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	in := sagatest.WaitEnded(t, r.e, id, &sagatest.WaitOpts{Timeout: 30 * time.Second})
	if in.Status != saga.StatusCompensated {
		t.Fatalf("%s", sagatest.Describe(in))
	}
	calls := r.callsOf(id)
	if len(calls) != 2 || calls[0].Answered || calls[1].Type != "svc.refund" || !calls[1].Answered {
		t.Fatalf("calls: %+v", calls)
	}
}
