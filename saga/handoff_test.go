package saga_test

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// slowShipRig is a chain rig (pick, remote pay, ship) whose ship ignores
// nothing but is slow on its first run: it waits 5 s for its context,
// which it honours. cancelled reports whether that first run saw its
// context end, and ships counts ship's runs by order.
type slowShipRig struct {
	*chainRig
	ships     sync.Map // order id → *atomic.Int32
	cancelled atomic.Bool
	first     chan struct{} // the first run returned
}

func newSlowShipRig(t *testing.T, name string, k *saga.KafkaConfig, commandTopic bool) *slowShipRig {
	t.Helper()
	r := &slowShipRig{first: make(chan struct{})}
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	topics := []string{replies, remote}
	if commandTopic {
		topics = append(topics, saga.CommandTopicDefault+"."+name)
	}
	kb := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: k}, topics...)
	var once atomic.Bool
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, kb.schema) }},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		}},
		saga.Step[order]{Name: "ship", Timeout: 30 * time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
				n, _ := r.ships.LoadOrStore(o.OrderID, new(atomic.Int32))
				n.(*atomic.Int32).Add(1)
				if once.CompareAndSwap(false, true) {
					defer close(r.first)
					select {
					case <-ctx.Done():
						r.cancelled.Store(true)
						return ctx.Err()
					case <-time.After(5 * time.Second):
					}
				}
				return recordEffect(ctx, run, kb.schema)
			}},
	)
	require.NoError(t, kb.engine.Register(def))
	kb.start(t)
	r.chainRig = &chainRig{kafkaBundle: kb, def: def, replies: replies, remote: remote, cl: rawProducer(t, kb.kc)}
	t.Cleanup(func() { <-r.first })
	return r
}

func (r *slowShipRig) shipped(id string) int32 {
	n, ok := r.ships.Load(id)
	if !ok {
		return 0
	}
	return n.(*atomic.Int32).Load()
}

// A step run at once on the reply worker (hybrid mode) that runs past
// KafkaConfig.ReplyStepLimit is given up: its context is cancelled, its
// transaction's connection closed, nothing of it recorded, and the reply
// is applied again on its own with the step's command, which an engine
// worker claims: the step runs there, once more, its effect kept once. For
// a while after, the same step after a reply is handed to a worker from
// the start, without being tried on the reply worker.
func TestAStepPastReplyStepLimitIsHandedToAWorker(t *testing.T) {
	t.Parallel()
	r := newSlowShipRig(t, "handoff", &saga.KafkaConfig{ReplyStepLimit: 100 * time.Millisecond}, false)
	r.logWrites(t)
	ctx := context.Background()

	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	in := r.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	<-r.first
	require.True(t, r.cancelled.Load(), "the first run's context was cancelled at the limit, not waited for")
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay",
		"reply_received:pay", "step_completed:pay", "step_completed:ship", "saga_completed"}, eventTypes(in),
		"nothing of the run given up is recorded")
	require.Equal(t, int32(2), r.shipped("o-1"))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
	require.Equal(t, []string{"pick direct", "pay relay", "ship direct"}, r.logged(t, "outbox_log", st.ID),
		"the reply was written with ship's command, for a worker")
	stats := r.engine.Stats()
	require.Equal(t, int64(1), stats.StepsHandedOff)
	require.Zero(t, stats.HandlersAbandoned)
	require.Zero(t, stats.AttemptsFailed)

	// The next saga's ship goes to a worker straight from its reply: run
	// once, the reply written with its command.
	st2, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-2"}, nil)
	require.NoError(t, err)
	pay := r.command(t, st2.ID)
	chained := r.engine.Stats().Chained // pick's success and pay's send, chained, are in
	r.reply(t, st2.ID, pay)
	in2 := r.waitTerminal(t, st2.ID)
	require.Equal(t, saga.StatusCompleted, in2.Status, "history: %v", eventTypes(in2))
	require.Equal(t, int32(1), r.shipped("o-2"))
	require.Equal(t, []string{"pick direct", "pay relay", "ship direct"}, r.logged(t, "outbox_log", st2.ID))
	require.Equal(t, int64(1), r.engine.Stats().StepsHandedOff, "not tried on the reply worker again")
	require.Equal(t, chained, r.engine.Stats().Chained, "ship did not run in the reply's transaction")
}

// Kafka mode has no reply worker limit: every step runs on a partition, so
// the slow step after the reply runs there to its end, once.
func TestKafkaModeHasNoReplyStepLimit(t *testing.T) {
	t.Parallel()
	r := newSlowShipRig(t, "handoffkafka", &saga.KafkaConfig{AllSteps: true, ReplyStepLimit: 100 * time.Millisecond}, true)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	in := r.waitTerminalWithin(t, st.ID, 30*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.False(t, r.cancelled.Load())
	require.Equal(t, int32(1), r.shipped("o-1"))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
	require.Zero(t, r.engine.Stats().StepsHandedOff)
}

// idleReader is a Kafka reader that never has a message: an engine with it
// runs its workers on the outbox and consumes no reply.
type idleReader struct{}

func (idleReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	<-ctx.Done()
	return kafka.Message{}, ctx.Err()
}
func (idleReader) CommitMessages(context.Context, ...kafka.Message) error { return nil }
func (idleReader) Close() error                                           { return nil }

// A step run at once after a reply that ignores its context is abandoned
// with the reply; a cancel asked for meanwhile is applied by another engine
// while the abandoned attempt is being recorded (held up here by a test
// hook): the record does not move the saga, only the attempt's history is
// written, and the saga compensates as its cancel asked, each effect once.
// (See the next test for the record's fence.)
func TestAnAbandonedAtOnceStepIsNotRecordedOverAnotherEnginesCancel(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t) // the abandonment is logged as an error
	const name = "abandoncancel"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, HandlerGrace: 100 * time.Millisecond, Kafka: &saga.KafkaConfig{ReplyStepLimit: -1}}, replies, remote)
	ctx := context.Background()
	deaf := make(chan struct{}) // the deaf run started
	var ships atomic.Int32
	var sleepers testkit.Stragglers
	t.Cleanup(sleepers.Wait)
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay", CompensateType: name + ".refund",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		}},
		saga.Step[order]{Name: "ship", Timeout: 100 * time.Millisecond,
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				if ships.Add(1) == 1 {
					defer sleepers.Enter()()
					close(deaf)
					time.Sleep(time.Second) // ignores its context
					return nil
				}
				return recordEffect(ctx, run, k.schema)
			}},
	)
	require.NoError(t, k.engine.Register(def))
	recorded := make(chan struct{}, 1)
	k.engine.SetBeforeRecordAbandoned(func(uuid.UUID) {
		time.Sleep(1500 * time.Millisecond) // the other engine applies the cancel meanwhile
		recorded <- struct{}{}
	})
	k.start(t)
	other, err := saga.New(k.pool, &saga.Config{Schema: k.schema, Workers: 2, PollInterval: 50 * time.Millisecond, Logger: testLogger(t),
		Kafka: &saga.KafkaConfig{Brokers: k.kc.Addrs(), NewReader: func(string, []string) saga.KafkaReader { return idleReader{} }}})
	require.NoError(t, err)
	require.NoError(t, other.Register(def))
	require.NoError(t, other.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, other.Stop(ctx))
	})
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}

	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	<-deaf
	require.NoError(t, other.Cancel(ctx, st.ID, "customer changed their mind"))
	// The cancel compensates pay, remote: the saga waits for the refund's
	// reply, at the version the lost reply would have given it, while the
	// abandoned attempt is recorded.
	refund := ""
	waitFor(t, 15*time.Second, func() bool {
		msgs, err := r.kc.ReadAll(ctx, remote)
		require.NoError(t, err)
		for _, m := range msgs {
			for _, h := range m.Headers {
				if h.Key == store.HeaderStepKey {
					if key, err := steps.ParseKey(string(h.Value)); err == nil && key.SagaID == st.ID && key.Direction == steps.Compensate {
						refund = string(h.Value)
					}
				}
			}
		}
		return refund != ""
	}, "pay's refund command")
	<-recorded
	r.reply(t, st.ID, refund)
	in := r.waitTerminalWithin(t, st.ID, 30*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick/forward", "pick/compensate"}, r.effects(t, st.ID), "ship never ran; pick undone")
	require.Equal(t, int32(1), ships.Load())
	// The abandoned attempt is in the timeline, by its history entry only.
	waitFor(t, 10*time.Second, func() bool {
		var err error
		in, err = k.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		for _, e := range in.History {
			if e.Type == saga.EventStepFailed && e.Step == "ship" {
				require.Equal(t, saga.CodeAbandonedRunOn, e.ErrorCode)
				return true
			}
		}
		return false
	}, "the abandoned attempt in the timeline")
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
}

// The record of an abandoned at-once step is its history entry only, with
// no fence to pass: here a test hook moves the saga's version by one while
// the attempt is being recorded, standing in for any other write that took
// the version the lost reply would have given the saga (another engine's
// cancel, as CI once saw). The saga is not moved by the record: the
// reply's message runs again and applies the reply (OnReply's effect once),
// and ship runs on a worker. (Fenced on that version, the record once
// moved the saga to ship's retry, and the reply, run again, was dropped as
// stale with its effect.)
func TestAnAbandonedAtOnceStepRecordsOnlyItsHistory(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t) // the abandonment is logged as an error
	const name = "abandonhistory"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, HandlerGrace: 100 * time.Millisecond, Kafka: &saga.KafkaConfig{ReplyStepLimit: -1}}, replies, remote)
	ctx := context.Background()
	var ships atomic.Int32
	var sleepers testkit.Stragglers
	t.Cleanup(sleepers.Wait)
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
			OnReply: func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error {
				return recordEffect(ctx, run, k.schema)
			},
		}},
		saga.Step[order]{Name: "ship", Timeout: 100 * time.Millisecond,
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				if ships.Add(1) == 1 {
					defer sleepers.Enter()()
					time.Sleep(time.Second) // ignores its context
					return nil
				}
				return recordEffect(ctx, run, k.schema)
			}},
	)
	require.NoError(t, k.engine.Register(def))
	k.engine.SetBeforeRecordAbandoned(func(id uuid.UUID) {
		require.NoError(t, k.engine.WaitUnlocked(ctx, id))
		_, err := k.pool.Exec(ctx, "UPDATE "+k.table("saga_instances")+" SET version = version + 1 WHERE id = $1", id)
		require.NoError(t, err)
	})
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}

	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	in := r.waitTerminalWithin(t, st.ID, 30*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay",
		"step_failed:ship", // the abandoned attempt, by its history entry
		"reply_received:pay", "step_completed:pay", "step_completed:ship", "saga_completed"}, eventTypes(in))
	require.Equal(t, []string{"pick/forward", "pay/forward", "ship/forward"}, r.effects(t, st.ID), "OnReply's effect once")
	require.Equal(t, int32(2), ships.Load())
}

// After a reply, the local step run at once and the remote step's Command
// run after it in the same update share the reply worker's limit: a
// Command that runs past it is given up, the reply applied again on its
// own, and a worker runs the local step and then sends. For a while after,
// the local step still runs at once after the reply, and the remote step's
// command is written with it for a worker.
func TestACommandAfterAReplyAndALocalStepPastTheLimitIsHandedOff(t *testing.T) {
	t.Parallel()
	var bills sync.Map // order id → *atomic.Int32
	var cancelled atomic.Bool
	var sleepers testkit.Stragglers
	t.Cleanup(sleepers.Wait)
	r := newChainRigOf(t, "handoffcmd", &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{ReplyStepLimit: 100 * time.Millisecond}},
		func(remote string) []saga.Step[order] {
			return []saga.Step[order]{
				{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{Topic: remote, Type: "handoffcmd.pay",
					Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil }}},
				{Name: "pack", Action: func(context.Context, *saga.StepRun, *order) error { return nil }},
				{Name: "bill", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{Topic: remote, Type: "handoffcmd.bill",
					Command: func(ctx context.Context, _ *saga.StepRun, o *order) (any, error) {
						n, _ := bills.LoadOrStore(o.OrderID, new(atomic.Int32))
						if n.(*atomic.Int32).Add(1) == 1 && o.OrderID == "o-1" {
							defer sleepers.Enter()()
							select {
							case <-ctx.Done():
								cancelled.Store(true)
								return nil, ctx.Err()
							case <-time.After(5 * time.Second):
							}
						}
						return o, nil
					}}},
			}
		})
	r.logWrites(t)
	ctx := context.Background()
	built := func(id string) int32 {
		n, ok := bills.Load(id)
		if !ok {
			return 0
		}
		return n.(*atomic.Int32).Load()
	}
	// What the outbox got: o-1's pay reply was written again on its own
	// with pack's command (after the cut), and a worker ran pack and sent
	// bill; o-2's pack ran with the reply, written with bill's command for
	// a worker, which sent it. Both ran ship with bill's reply.
	writes := map[string][]string{
		"o-1": {"pick direct", "pay relay", "pack direct", "bill relay"},
		"o-2": {"pick direct", "pay relay", "bill direct", "bill relay"},
	}
	for _, o := range []string{"o-1", "o-2"} {
		st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: o}, nil)
		require.NoError(t, err)
		r.reply(t, st.ID, r.commandFor(t, st.ID, "pay"))
		r.reply(t, st.ID, r.commandFor(t, st.ID, "bill"))
		in := r.waitTerminal(t, st.ID)
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", o, eventTypes(in))
		require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
		require.Equal(t, writes[o], r.logged(t, "outbox_log", st.ID), o)
	}
	require.True(t, cancelled.Load(), "the first build was cut at the limit")
	require.Equal(t, int32(2), built("o-1"))
	require.Equal(t, int32(1), built("o-2"), "not tried on the reply worker again")
	require.Equal(t, int64(1), r.engine.Stats().StepsHandedOff)
}

// A claimed remote step's Command that returns success although a cancel
// was asked for while it ran (it ignored its context, or the request was
// recorded just before it returned) sends nothing: the request is applied
// in the step's place, as when it interrupts the Command. (Seen in CI once
// the step after a reply could be handed to a worker: bill sent after
// Cancel returned, review15's TestOperatorJustBeforeTheReplyOrCommandReturns.)
func TestACancelWhileAClaimedCommandRunsStopsTheSend(t *testing.T) {
	t.Parallel()
	const name = "claimedcancel"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}}, replies, remote)
	ctx := context.Background()
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	def := saga.Define(name,
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
				return o, gate.Pass(context.Background()) // returns when the test says, whatever its ctx
			},
		}},
		saga.Step[order]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, 15*time.Second, "pay's Command", func() bool { return gate.Entered() == 1 })
	require.NoError(t, k.engine.Cancel(ctx, st.ID, "customer changed their mind"))
	gate.Open()
	in := k.waitTerminalWithin(t, st.ID, 30*time.Second)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.NotContains(t, eventTypes(in), "command_sent:pay")
	testkit.Hold(t, time.Second, "nothing sent to the participant", func() bool {
		msgs, err := k.kc.ReadAll(ctx, remote)
		require.NoError(t, err)
		return len(msgs) == 0
	})
	require.Empty(t, k.effects(t, st.ID))
}
