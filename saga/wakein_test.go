package saga_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// A command deferred because another transaction held its saga is due
// again 5 ms later. The worker that deferred it looks for the next due
// command after its commit; when that look came after the 5 ms (a loaded
// machine), it saw the command as due already, took it for one another
// worker held, and slept for PollInterval: a minute here. Found from a CI
// run where a saga sat at a step for 20 s in a test whose engine polls once
// a minute. The worker now wakes itself when the deferral is due.
func TestADeferredCommandIsRunWhenDueNotAtTheNextPoll(t *testing.T) {
	t.Parallel()
	b, def := pollingOnceAMinute(t, "deferwake")
	ctx := context.Background()
	// The worker's first look after a batch that deferred comes 100 ms
	// late, as on a loaded machine.
	var slowed atomic.Bool
	b.engine.SetIdle(func() {
		if b.engine.Stats().Deferred > 0 && slowed.CompareAndSwap(false, true) {
			time.Sleep(100 * time.Millisecond)
		}
	})
	b.start(t)
	// The listener's connect wakes every worker: let it come first.
	waitFor(t, 10*time.Second, func() bool { return b.engine.Health(ctx).Ready }, "the engine to be ready")

	// The saga starts while another transaction holds its execution lock.
	id := startLocked(t, b, def, "the command to be deferred")

	in := b.waitTerminalWithin(t, id, 10*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.True(t, slowed.Load(), "the worker's look was not slowed")
	require.Equal(t, []string{"pick/forward"}, b.effects(t, id))
}

// In the hybrid mode the step after a reply runs on the Kafka worker that
// applied the reply. When it fails, its retry is a direct command due after
// the backoff, written by that Kafka worker, which wakes no engine worker
// for later: the idle workers had looked before it was written, and it ran
// at their next poll, a minute here. The engine now wakes a worker when
// the retry is due.
func TestARetryWrittenAfterAReplyRunsAfterItsBackoff(t *testing.T) {
	t.Parallel()
	const name = "retrywake"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, PollInterval: time.Minute, Kafka: &saga.KafkaConfig{}}, replies, remote)
	ctx := context.Background()
	var ships atomic.Int32
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		}},
		saga.Step[order]{Name: "ship", Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 200 * time.Millisecond }},
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				if ships.Add(1) == 1 {
					return errors.New("the carrier is busy")
				}
				return recordEffect(ctx, run, k.schema)
			}},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}

	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	in := r.waitTerminalWithin(t, st.ID, 10*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay", "reply_received:pay",
		"step_completed:pay", "step_failed:ship", "step_completed:ship", "saga_completed"}, eventTypes(in))
	require.Equal(t, int32(2), ships.Load())
}

// In Kafka mode a command whose saga another transaction holds is moved
// back to the outbox as a relay row due 20 ms later, so that its partition
// moves on. The relay, idle, had looked ahead before that row was written
// and published it at its next poll, a minute here (a second by default).
// The engine now notifies the relays when the row is due.
func TestAHeldKafkaCommandIsPublishedWhenDueNotAtTheRelaysNextPoll(t *testing.T) {
	t.Parallel()
	const name = "holdwake"
	b, r := kafkaModeWithSlowRelay(t, name)
	ctx := context.Background()
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return recordEffect(ctx, run, b.schema)
		}})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	waitFor(t, 10*time.Second, func() bool { return b.engine.Health(ctx).Ready && r.Check(ctx).Ready }, "the engine and the relay to be ready")

	// The saga starts while another transaction holds its execution lock;
	// its command is published at once (the start notifies the relay), and
	// the engine moves it back to the outbox.
	id := startLocked(t, b, def, "the command to be held")

	in := b.waitTerminalWithin(t, id, 10*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"pick/forward"}, b.effects(t, id))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND headers ? $2", id, "sagaflow-held-id"),
		"the command was held once")
}

// startLocked starts a saga of def whose execution lock another transaction
// holds from before the start commits until the engine has deferred (or
// held) a command (what, for a failure), and returns its id.
func startLocked(t *testing.T, b *bundle, def *saga.Definition[order], what string) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	start, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = start.Rollback(ctx) }()
	st, err := saga.StartTx(ctx, b.engine, start, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	require.NoError(t, b.engine.LockSaga(ctx, holder, st.ID))
	require.NoError(t, start.Commit(ctx))
	waitFor(t, 20*time.Second, func() bool { return b.engine.Stats().Deferred > 0 }, what)
	require.NoError(t, holder.Commit(ctx))
	return st.ID
}

// In Kafka mode a step's retry is a relay row due after its backoff,
// written by the Kafka worker. An idle relay had looked ahead before it was
// written and published it at its next poll, a minute here. The engine now
// notifies the relays when the retry is due.
func TestAKafkaModeRetryIsPublishedAfterItsBackoff(t *testing.T) {
	t.Parallel()
	const name = "kretrywake"
	b, _ := kafkaModeWithSlowRelay(t, name)
	ctx := context.Background()
	var picks atomic.Int32
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 200 * time.Millisecond }},
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				if picks.Add(1) == 1 {
					return errors.New("the shelf is busy")
				}
				return recordEffect(ctx, run, b.schema)
			}})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	in := b.waitTerminalWithin(t, st.ID, 10*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"saga_started", "step_failed:pick", "step_completed:pick", "saga_completed"}, eventTypes(in))
	require.Equal(t, []string{"pick/forward"}, b.effects(t, st.ID))
}

// kafkaModeWithSlowRelay is an engine in Kafka mode with one worker and
// the relay that publishes its commands, which polls once a minute.
func kafkaModeWithSlowRelay(t *testing.T, name string) (*bundle, *relay.Relay) {
	t.Helper()
	k := setupKafkaRelayPoll(t, 1, &saga.Config{Workers: 1}, time.Minute, saga.CommandTopicDefault+"."+name)
	return k.bundle, k.r
}

// A command written for later by another process (here: moved by hand, as
// a retry an engine that has since died would write) comes due between an
// idle worker's claim and its look ahead. The look counted only commands
// due later, took this one for a command another worker held, and slept
// for PollInterval: a minute here. It now counts what came due since its
// claim began.
func TestACommandDueBetweenTheClaimAndTheLookRunsAtOnce(t *testing.T) {
	t.Parallel()
	b, def := pollingOnceAMinute(t, "duegap")
	ctx := context.Background()
	outbox := b.table("outbox")
	// The later saga's command waits an hour before the engine starts.
	later, err := saga.Start(ctx, b.engine, def, order{OrderID: "later"}, nil)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+outbox+" SET available_at = now() + interval '1 hour' WHERE saga_id = $1", later.ID)
	require.NoError(t, err)

	var due atomic.Int64 // when the later command is due (unix ns); 0: not armed
	var slowed atomic.Bool
	b.engine.SetIdle(func() {
		if at := due.Load(); at != 0 && slowed.CompareAndSwap(false, true) {
			// The look comes after the command is due, as on a loaded machine.
			time.Sleep(time.Until(time.Unix(0, at).Add(200 * time.Millisecond)))
		}
	})
	b.start(t)
	// The listener's connect wakes every worker: let it come first.
	waitFor(t, 10*time.Second, func() bool { return b.engine.Health(ctx).Ready }, "the engine to be ready")
	time.Sleep(200 * time.Millisecond)

	// Due in 300 ms; the idle worker slept for a minute before it existed.
	due.Store(time.Now().Add(300 * time.Millisecond).UnixNano())
	_, err = b.pool.Exec(ctx, "UPDATE "+outbox+" SET available_at = now() + interval '300 ms' WHERE saga_id = $1", later.ID)
	require.NoError(t, err)
	// Another saga wakes the worker, which claims before the command is due.
	now, err := saga.Start(ctx, b.engine, def, order{OrderID: "now"}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminalWithin(t, now.ID, 10*time.Second).Status)

	in := b.waitTerminalWithin(t, later.ID, 10*time.Second)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.True(t, slowed.Load(), "the worker's look was not slowed")
	require.Equal(t, []string{"pick/forward"}, b.effects(t, later.ID))
}

// pollingOnceAMinute is an engine with one worker that polls once a minute,
// not started, and a saga of one step, pick, registered as name.
func pollingOnceAMinute(t *testing.T, name string) (*bundle, *saga.Definition[order]) {
	t.Helper()
	b := setup(t, &saga.Config{Workers: 1, PollInterval: time.Minute})
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return recordEffect(ctx, run, b.schema)
		}})
	require.NoError(t, b.engine.Register(def))
	return b, def
}
