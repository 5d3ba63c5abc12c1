package review17

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
)

type cmd struct {
	ID string `json:"id"`
}

// hybrid is testkit.Hybrid's rig with relays that poll once a minute: an
// orchestrator schema and a participant schema serving "<name>.pay".
type hybrid struct {
	kc           *kafkatest.Cluster
	orders, part *testkit.DB
	topic        string
	fx           *testkit.Effects
	pays         counter
}

func newHybrid(t *testing.T, name string) *hybrid {
	t.Helper()
	topic, replies := name+".participant", saga.CommandTopicDefault+"."+name+".replies"
	h := &hybrid{topic: topic}
	h.kc = kafkatest.New(t, kafkatest.SeedTopics(1, topic, replies))
	h.orders = testkit.NewDB(t)
	h.part = testkit.NewDB(t)
	longRelay(t, h.kc.Addrs(), h.orders)
	longRelay(t, h.kc.Addrs(), h.part)
	h.fx = testkit.NewEffects(t, h.orders)
	pfx := testkit.NewEffects(t, h.part)
	p, err := participant.New(h.part.Pool, &participant.Config{Consumer: name + "-svc", Schema: h.part.Schema, Logger: testkit.Discard,
		ReplyTopics: []string{replies}})
	require.NoError(t, err)
	require.NoError(t, participant.Handle(p, name+".pay", func(ctx context.Context, tx pgx.Tx, c participant.Call[cmd]) (map[string]string, error) {
		h.pays.Add(c.Command.ID)
		_, err := tx.Exec(ctx, `INSERT INTO `+pfx.Table()+` (saga_id, what) VALUES ($1, 'pay')`, c.SagaID)
		return map[string]string{"ref": "pay-" + c.Command.ID}, err
	}))
	testkit.Serve(t, h.kc.Addrs(), p, topic, name+"-svc", inbox.ConsumerConfig{})
	return h
}

func (h *hybrid) config(workers int) *saga.Config {
	c := config(h.orders, workers)
	c.Kafka = &saga.KafkaConfig{Brokers: h.kc.Addrs(), SessionTimeout: 6 * time.Second}
	return c
}

// pick (local) -> pay (remote) -> ship (local, flaky, run after the reply)
// -> done.
func (h *hybrid) def(name string, r *runs, back time.Duration, fails func(o *ord) int) *saga.Definition[ord] {
	return saga.Define(name,
		saga.Step[ord]{Name: "pick", Action: rec(h.fx, "pick"), Compensate: rec(h.fx, "unpick")},
		saga.Step[ord]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[ord]{Topic: h.topic, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) { return cmd{ID: o.ID}, nil },
			OnReply: func(ctx context.Context, run *saga.StepRun, o *ord, res json.RawMessage) error {
				var v map[string]string
				if err := json.Unmarshal(res, &v); err != nil {
					return err
				}
				o.Tag = v["ref"]
				return h.fx.Record(ctx, run, "paid")
			}}},
		saga.Step[ord]{Name: "ship", Action: flaky(h.fx, r, "ship", fails), Retry: backoff(5, back)},
		saga.Step[ord]{Name: "done", Action: rec(h.fx, "done")},
	)
}

// The hybrid mode: the local step run at once after a reply fails 0-3
// times (150 ms backoff), so its retry is written by the Kafka worker that
// applied the reply, which does not look at the queue: each retry must
// still run when due, not at the poll.
func TestHybridRetryAfterAReply(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	const name = "hyb"
	h := newHybrid(t, name)
	var r runs
	const back = 150 * time.Millisecond
	def := h.def(name, &r, back, func(o *ord) int { var n int; fmt.Sscanf(o.ID, "h%d", &n); return n % 4 })
	e, _ := testkit.StartEngine(t, h.orders.Pool, h.config(2), def)
	// The first saga alone, until the group has formed and replies flow.
	var ids []uuid.UUID
	st, err := saga.Start(ctx, e, def, ord{ID: "h0"}, nil)
	require.NoError(t, err)
	ids = append(ids, st.ID)
	endedWithin(t, e, st.ID, 30*time.Second)
	for i := 1; i < 8; i++ {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("h", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		in := endedWithin(t, e, id, 3*back+prompt)
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		require.Equal(t, i%4, count(in, saga.EventStepFailed, "ship"), timeline(in))
		requireOnce(t, h.fx, id, map[string]int{"pick": 1, "paid": 1, "ship": 1, "done": 1})
		k := fmt.Sprint("h", i)
		require.EqualValues(t, 1, h.pays.Get(k))
		for _, g := range r.gaps(k + "/ship") {
			require.GreaterOrEqual(t, g, back-30*time.Millisecond, "a retry ran early")
			require.Less(t, g, back+lateBy, "a retry after a reply waited past its backoff")
		}
	}
	t.Logf("stats %+v", e.Stats())
}

// The hybrid mode, a pause while the retry of the step run after a reply
// waits: it does not run during the pause, and runs promptly on Resume.
func TestHybridPauseAroundARetryAfterAReply(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	const name = "hpz"
	h := newHybrid(t, name)
	var r runs
	const back = 500 * time.Millisecond
	def := h.def(name, &r, back, func(*ord) int { return 1 })
	e, _ := testkit.StartEngine(t, h.orders.Pool, h.config(2), def)
	st, err := saga.Start(ctx, e, def, ord{ID: "z"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, 30*time.Second, "ship's first failure", func() bool { return r.n("z/ship") == 1 })
	require.NoError(t, e.Pause(ctx, st.ID, "look"))
	testkit.Hold(t, back+700*time.Millisecond, "the paused retry does not run", func() bool { return r.n("z/ship") == 1 })
	resumed := time.Now()
	require.NoError(t, e.Resume(ctx, st.ID, "go"))
	in := endedWithin(t, e, st.ID, prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	require.Less(t, r.times("z/ship")[1].Sub(resumed), lateBy)
	requireOnce(t, h.fx, st.ID, map[string]int{"pick": 1, "paid": 1, "ship": 1, "done": 1})
}

// kafkaMode is a schema whose engine carries every step over Kafka, with
// its relay polling once a minute.
func kafkaMode(t *testing.T, name string) (*testkit.DB, *kafkatest.Cluster, func(int) *saga.Config) {
	t.Helper()
	topic := name + ".commands"
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, topic+"."+name))
	d := testkit.NewDB(t)
	longRelay(t, kc.Addrs(), d)
	return d, kc, func(workers int) *saga.Config {
		c := config(d, workers)
		c.CommandTopic = topic
		c.Kafka = &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second}
		return c
	}
}

// kafkaBusy runs, in Kafka mode, first -> second -> done, where second's
// command is consumed while a transaction of the test holds the saga for
// held: it is moved back to the outbox again and again meanwhile. It
// returns how long after the holder let go second ran (within), and when,
// since the hold began, each move-back was seen.
func kafkaBusy(t *testing.T, name string, held, within time.Duration) (time.Duration, []time.Duration) {
	t.Helper()
	ctx := context.Background()
	d, _, cfg := kafkaMode(t, name)
	fx := testkit.NewEffects(t, d)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	var pid atomic.Uint32
	var runs2 atomic.Int32
	var at2 atomic.Int64
	def := busyDef(name, fx, gate, &pid, &runs2, &at2)
	e, _ := testkit.StartEngine(t, d.Pool, cfg(2), def)
	st, err := saga.Start(ctx, e, def, ord{ID: "k"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, 30*time.Second, "first to be held", func() bool { return gate.Entered() == 1 })
	h := hold(t, d, lockKey(t, d, pid.Load()))
	gate.Open()
	testkit.Recv(t, h.grabbed, prompt, "the test's transaction to take the saga's lock")
	testkit.WaitFor(t, prompt, "second's command to be moved back", func() bool { return e.Stats().Deferred > 0 })
	cadence := deferrals(e, held)
	deferred := e.Stats().Deferred
	require.Zero(t, runs2.Load(), "second ran while another transaction held its saga")
	h.Release()
	if os.Getenv("REVIEW17_PATIENT") != "" { // to measure, not to test
		within = 2 * poll
	}
	in := endedWithin(t, e, st.ID, within)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	lag := time.Duration(at2.Load() - h.released.Load())
	t.Logf("second ran %s after the holder let go; moved back %d times while held, at %v; stats %+v", lag, deferred, cadence, e.Stats())
	require.Greater(t, deferred, int64(1), "moved back once and never published again while held: left to the relay's poll")
	require.EqualValues(t, 1, runs2.Load())
	requireOnce(t, fx, st.ID, map[string]int{"first": 1, "second": 1, "done": 1})
	return lag, cadence
}

// Kafka mode: the next step's command is consumed while another
// transaction holds its saga, so it is moved back to the outbox, "a relay
// row due 20 ms later", again and again while the saga is held (0.8 s);
// the relays must be told when it is due, so that the step runs promptly
// once the saga is free, not at the relays' poll.
func TestKafkaModeBusySagaRequeued(t *testing.T) {
	parallel(t)
	lag, _ := kafkaBusy(t, "kbusy", holdFor(), prompt)
	require.Less(t, lag, prompt)
}

// Kafka mode, the saga held for 7 s: docs/architecture.md says a command
// moved back because its saga was busy "is a relay row due 20 ms later".
// The gaps between move-backs grew by half each time, without a cap seen up
// to 14 s, so a saga held for 30 s ran 12 s after it was free (FINDINGS.md,
// F1, fixed: the delay now stops at 2 s, the Postgres-only deferral's cap).
// A gap may add the relay's and the consumer's latency to those 2 s: 500 ms
// are allowed for them.
func TestKafkaModeBusyRequeueCadence(t *testing.T) {
	parallel(t)
	const held = 7 * time.Second
	lag, cadence := kafkaBusy(t, "kcad", held, 10*time.Second)
	require.NotEmpty(t, cadence)
	// The run after the release is the last publish: its gap counts too.
	cadence = append(cadence, held+lag)
	var worst time.Duration
	for i := 1; i < len(cadence); i++ {
		worst = max(worst, cadence[i]-cadence[i-1])
	}
	require.LessOrEqual(t, worst, 2500*time.Millisecond, "the gaps between move-backs of a busy saga's command: %v", cadence)
}

// Kafka mode: a step that fails once with a 300 ms backoff. Its retry is
// an outbox row due later; with the relay polling once a minute, it must
// still be published when due.
func TestKafkaModeRetry(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	const name = "kretry"
	d, _, cfg := kafkaMode(t, name)
	fx := testkit.NewEffects(t, d)
	var r runs
	const back = 300 * time.Millisecond
	def := chain(name, fx, &r, backoff(4, back), func(o *ord) int { var n int; fmt.Sscanf(o.ID, "k%d", &n); return 1 + n%2 })
	e, _ := testkit.StartEngine(t, d.Pool, cfg(2), def)
	var ids []uuid.UUID
	for i := range 4 {
		st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint("k", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		testkit.WaitFor(t, 30*time.Second, "the first run", func() bool { return r.n(fmt.Sprint("k", i, "/act")) >= 1 })
		in := endedWithin(t, e, id, 2*back+prompt)
		require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
		requireOnce(t, fx, id, map[string]int{"pick": 1, "act": 1, "done": 1})
		for _, g := range r.gaps(fmt.Sprint("k", i, "/act")) {
			require.GreaterOrEqual(t, g, back-30*time.Millisecond)
			require.Less(t, g, back+lateBy, "a retry in Kafka mode waited past its backoff")
		}
	}
}
