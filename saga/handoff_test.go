package saga_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
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
