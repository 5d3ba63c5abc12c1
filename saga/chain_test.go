package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// A saga of a local step, a remote one and a local one, in the hybrid mode,
// with the test as the participant: it reads the remote command from its
// topic and answers it with raw records.
type chainRig struct {
	*kafkaBundle
	def     *saga.Definition[order]
	replies string
	remote  string
	cl      *kgo.Client
}

func newChainRig(t *testing.T, name string) *chainRig {
	t.Helper()
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}}, replies, remote)
	local := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: local},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		}},
		saga.Step[order]{Name: "ship", Action: local},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	return &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}
}

// command waits for saga id's remote command on the participant's topic
// and returns its step key.
func (r *chainRig) command(t *testing.T, id uuid.UUID) string {
	t.Helper()
	var key string
	waitFor(t, 15*time.Second, func() bool {
		msgs, err := r.kc.ReadAll(context.Background(), r.remote)
		require.NoError(t, err)
		for _, m := range msgs {
			if string(m.Key) != id.String() {
				continue
			}
			for _, h := range m.Headers {
				if h.Key == store.HeaderStepKey {
					key = string(h.Value)
				}
			}
		}
		return key != ""
	}, "the remote command of saga %s", id)
	return key
}

// reply answers the command of step key for saga id with success.
func (r *chainRig) reply(t *testing.T, id uuid.UUID, key string) {
	t.Helper()
	produce(t, r.cl, &kgo.Record{Topic: r.replies, Partition: 0, Key: []byte(id.String()), Value: []byte(`{"ok":true,"result":{}}`),
		Headers: []kgo.RecordHeader{
			{Key: store.HeaderMessageID, Value: []byte(uuid.NewString())},
			{Key: store.HeaderType, Value: []byte(steps.ReplyType)},
			{Key: store.HeaderSagaID, Value: []byte(id.String())},
			{Key: store.HeaderStepKey, Value: []byte(key)},
		}})
}

func (r *chainRig) directCommands(t *testing.T, id uuid.UUID) int {
	t.Helper()
	return r.count(t, "SELECT count(*) FROM "+r.table("outbox")+" WHERE saga_id = $1 AND delivery = 'direct'", id)
}

// The local step before a remote one sends the remote command in its own
// transaction, and the reply runs the local step after it in the reply's:
// no command is written for a worker to claim in between, and a duplicate
// reply has no second effect.
func TestChainedStepsRunInTheTransactionBeforeThem(t *testing.T) {
	t.Parallel()
	r := newChainRig(t, "chain")
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	key := r.command(t, st.ID)
	// A batch's counters are added just after its commit, which the test
	// may see first.
	chained := func(want int64, what string) {
		waitFor(t, 5*time.Second, func() bool { return r.engine.Stats().Chained >= want }, what)
		require.Equal(t, want, r.engine.Stats().Chained, what)
	}
	chained(1, "pay's command was sent in pick's transaction")
	require.Zero(t, r.directCommands(t, st.ID), "no command was left for a worker to claim for pay")

	r.reply(t, st.ID, key)
	r.reply(t, st.ID, key) // a duplicate
	in := r.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
	chained(2, "ship ran in the reply's transaction")
	require.Zero(t, r.directCommands(t, st.ID), "ship's command was deleted with its step, not left stale")
	// The duplicate reply found the step done: still one effect each.
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
}

// A reply that reaches a paused saga completes its step, but the step after
// it does not run in the reply's transaction: its command waits, held, and
// runs once after the resume.
func TestChainedStepWaitsForAPause(t *testing.T) {
	t.Parallel()
	r := newChainRig(t, "chainpause")
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-2"}, nil)
	require.NoError(t, err)
	key := r.command(t, st.ID)
	require.NoError(t, r.engine.Pause(ctx, st.ID, "operator looks at it"))

	r.reply(t, st.ID, key)
	waitFor(t, 15*time.Second, func() bool {
		in, err := r.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		return in.Step == "ship"
	}, "the reply to be applied")
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, []string{"pick/forward"}, r.effects(t, st.ID), "ship did not run while paused")
	require.Equal(t, 1, r.count(t, "SELECT count(*) FROM "+r.table("outbox")+
		" WHERE saga_id = $1 AND delivery = 'direct' AND paused_from IS NOT NULL", st.ID), "ship's command is held")
	require.Equal(t, int64(1), r.engine.Stats().Chained, "only pay's send was chained")

	require.NoError(t, r.engine.Resume(ctx, st.ID, "looked at"))
	in := r.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
}
