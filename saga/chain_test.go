package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/testkit"
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
	// ReplyStepLimit a minute: these tests run the step after a reply in
	// its transaction, and a loaded CI machine took the default 200 ms
	// (the limit is TestAStepPastReplyStepLimitIsHandedToAWorker's).
	return newChainRigWith(t, name, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{ReplyStepLimit: time.Minute}}, nil)
}

// newChainRigWith is newChainRig with the engine's configuration cfg and,
// when set, onReply as pay's OnReply.
func newChainRigWith(t *testing.T, name string, cfg *saga.Config,
	onReply func(context.Context, *saga.StepRun, *order, json.RawMessage) error) *chainRig {
	t.Helper()
	return newChainRigOf(t, name, cfg, func(remote string) []saga.Step[order] {
		return []saga.Step[order]{{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
			OnReply: onReply,
		}}}
	})
}

// newChainRigOf is a hybrid-mode saga of pick (local), the remote steps
// that middle gives for the participant's topic, and ship (local), with the
// test as the participant.
func newChainRigOf(t *testing.T, name string, cfg *saga.Config, middle func(remote string) []saga.Step[order]) *chainRig {
	t.Helper()
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, cfg, replies, remote)
	local := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }
	all := append([]saga.Step[order]{{Name: "pick", Action: local}}, middle(remote)...)
	def := saga.Define(name, append(all, saga.Step[order]{Name: "ship", Action: local})...)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	return &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}
}

// command waits for saga id's remote command on the participant's topic
// and returns its step key.
func (r *chainRig) command(t *testing.T, id uuid.UUID) string {
	t.Helper()
	return r.commandFor(t, id, "")
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
	require.Equal(t, int64(1), r.engine.Stats().Chained, "only pay's send was chained")
	r.shipHeldUntilResumed(t, st.ID)
}

// shipHeldUntilResumed checks that ship did not run for saga id, paused,
// and that its command is held; then resumes the saga and checks that it
// completes, ship run once.
func (r *chainRig) shipHeldUntilResumed(t *testing.T, id uuid.UUID) {
	t.Helper()
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, []string{"pick/forward"}, r.effects(t, id), "ship did not run while paused")
	require.Equal(t, 1, r.count(t, "SELECT count(*) FROM "+r.table("outbox")+
		" WHERE saga_id = $1 AND delivery = 'direct' AND paused_from IS NOT NULL", id), "ship's command is held")
	require.NoError(t, r.engine.Resume(context.Background(), id, "looked at"))
	in := r.waitTerminal(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, id))
}

// A local step followed by a remote one writes only the remote step's
// command, in one update of the saga's row: the command a worker would have
// claimed for the remote step is not written (and deleted again in the same
// transaction), and the saga goes from the local step to waiting for the
// reply at once. The reply and the local step after it are one update too,
// with no command written for that step. What the outbox was given and how
// the row moved are logged by triggers, so that what is undone before the
// commit is seen too.
func TestARemoteStepAfterALocalOneIsSentInTheSameUpdate(t *testing.T) {
	t.Parallel()
	r := newChainRig(t, "chainsend")
	ctx := context.Background()
	r.logWrites(t)

	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	key := r.command(t, st.ID)
	r.reply(t, st.ID, key)
	in := r.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))

	require.Equal(t, []string{"pick direct", "pay relay"}, r.logged(t, "outbox_log", st.ID),
		"the outbox rows written for the saga, in order: none for pay's send or for ship")
	require.Equal(t, []string{
		"pick -> pay awaiting", // pick's success and pay's send
		"pay -> ship",          // the reply, and ship, which ran with it and completed the saga
	}, r.logged(t, "update_log", st.ID), "the updates of the saga's row, in order")
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay", "reply_received:pay",
		"step_completed:pay", "step_completed:ship", "saga_completed"}, eventTypes(in), "the history, in order")
	require.Equal(t, int64(2), r.engine.Stats().Chained, "pay's send and ship ran chained")
}

// logWrites makes triggers log every row written to the schema's outbox
// (its step, or its type when it names no step) and every update of a
// saga's row, in order (see [bundle.logged]).
func (r *bundle) logWrites(t *testing.T) {
	t.Helper()
	_, err := r.pool.Exec(context.Background(), `
		CREATE TABLE `+r.table("outbox_log")+` (n bigserial, saga_id uuid, what text);
		CREATE TABLE `+r.table("update_log")+` (n bigserial, saga_id uuid, what text);
		CREATE FUNCTION `+r.table("log_outbox")+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO `+r.table("outbox_log")+` (saga_id, what) VALUES (NEW.saga_id, coalesce(split_part(NEW.step_key, '/', 2), NEW.type) || ' ' || NEW.delivery);
			RETURN NEW;
		END $$;
		CREATE FUNCTION `+r.table("log_update")+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO `+r.table("update_log")+` (saga_id, what) VALUES (NEW.id,
				OLD.step_name || ' -> ' || NEW.step_name || CASE WHEN NEW.awaiting_reply THEN ' awaiting' ELSE '' END);
			RETURN NEW;
		END $$;
		CREATE TRIGGER log_outbox AFTER INSERT ON `+r.table("outbox")+` FOR EACH ROW EXECUTE FUNCTION `+r.table("log_outbox")+`();
		CREATE TRIGGER log_update AFTER UPDATE ON `+r.table("saga_instances")+` FOR EACH ROW EXECUTE FUNCTION `+r.table("log_update")+`()`)
	require.NoError(t, err)
}

// logged returns what the trigger of table logged for saga id, in order.
func (r *bundle) logged(t *testing.T, table string, id uuid.UUID) []string {
	t.Helper()
	rows, err := r.pool.Query(context.Background(), `SELECT what FROM `+r.table(table)+` WHERE saga_id = $1 ORDER BY n`, id)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// A remote step's command that cannot be built right after the local step
// before it is that step's failure, as when a worker claimed it: retried
// when the error is retryable (the command is then built again, and sent),
// and otherwise failed for good, with the local step compensated. The
// local step ran once either way.
func TestARemoteCommandThatCannotBeBuiltAfterALocalStepFailsItsStep(t *testing.T) {
	t.Parallel()
	const name = "chainbuild"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}}, replies, remote)
	local := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }
	pick := func(ctx context.Context, run *saga.StepRun, o *order) error {
		if o.OrderID == "aborted" {
			_, _ = run.Tx.Exec(ctx, "SELECT 1/0") // leaves the transaction aborted
			return nil
		}
		return recordEffect(ctx, run, k.schema)
	}
	var builds sync.Map // order id → *atomic.Int32
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: pick, Compensate: local, Retry: &saga.RetryPolicy{MaxAttempts: 1}},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second,
			Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
			Remote: &saga.Remote[order]{
				Topic: remote, Type: name + ".pay",
				Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
					n, _ := builds.LoadOrStore(o.OrderID, new(atomic.Int32))
					switch c := n.(*atomic.Int32).Add(1); {
					case o.OrderID == "bad":
						return nil, steps.Permanent(errors.New("no card on file"))
					case o.OrderID == "flaky" && c == 1:
						return nil, errors.New("card vault unavailable")
					}
					return o, nil
				},
			}},
		saga.Step[order]{Name: "ship", Action: local},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}
	ctx := context.Background()

	bad, err := saga.Start(ctx, k.engine, def, order{OrderID: "bad"}, nil)
	require.NoError(t, err)
	in := r.waitTerminal(t, bad.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick/forward", "pick/compensate"}, r.effects(t, bad.ID))
	require.NotNil(t, in.LastError)
	require.Contains(t, in.LastError.Message, "no card on file")

	flaky, err := saga.Start(ctx, k.engine, def, order{OrderID: "flaky"}, nil)
	require.NoError(t, err)
	r.reply(t, flaky.ID, r.command(t, flaky.ID))
	in = r.waitTerminal(t, flaky.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, flaky.ID))
	n, _ := builds.Load("flaky")
	require.Equal(t, int32(2), n.(*atomic.Int32).Load(), "the command was built again for the retry")
	require.Zero(t, r.directCommands(t, bad.ID)+r.directCommands(t, flaky.ID), "no command left behind")
	// Both first builds ran right after pick, in its transaction, and ship
	// ran in the reply's: a batch's counters are added just after its commit.
	waitFor(t, 5*time.Second, func() bool { return k.engine.Stats().Chained >= 3 }, "three chained steps")
	require.Equal(t, int64(3), k.engine.Stats().Chained)

	// The local step left the transaction aborted: the update that carries
	// its success and the send fails, and the local step's failure is
	// written instead, with nothing sent.
	aborted, err := saga.Start(ctx, k.engine, def, order{OrderID: "aborted"}, nil)
	require.NoError(t, err)
	in = r.waitTerminal(t, aborted.ID)
	require.NotEqual(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, saga.CodeTxAborted, in.LastError.Code, "history: %v", eventTypes(in))
	require.Equal(t, "pick", in.LastError.Step)
	require.NotContains(t, eventTypes(in), "command_sent:pay")
	require.Zero(t, r.count(t, "SELECT count(*) FROM "+r.table("outbox")+" WHERE saga_id = $1 AND delivery = 'relay'", aborted.ID),
		"pay's command was not written")
}

// The span of a remote step's send, run right after the local step before
// it, links to that step's attempt (as a claimed command's attempt links to
// the attempt that wrote it), and the command it sends carries the send's
// span, which the participant continues. The local step run with the reply
// links to the reply's span.
func TestARemoteStepSentAfterALocalOneLinksToIt(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	r := newChainRigWith(t, "chaintrace", &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}, TracerProvider: tp}, nil)
	ctx, caller := tp.Tracer("test").Start(context.Background(), "POST /orders")
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	caller.End()
	r.command(t, st.ID)

	span := func(name string) sdktrace.ReadOnlySpan {
		var found sdktrace.ReadOnlySpan
		waitFor(t, 10*time.Second, func() bool {
			for _, sp := range rec.Ended() {
				if sp.SpanContext().TraceID() == caller.SpanContext().TraceID() && sp.Name() == name {
					found = sp
				}
			}
			return found != nil
		}, "span %q", name)
		return found
	}
	pick, pay := span("step chaintrace/pick"), span("step chaintrace/pay")
	require.Equal(t, saga.OutcomeSent, attr(pay, "sagaflow.step.outcome").AsString())
	require.Len(t, pay.Links(), 1, "pay's send links to the attempt that moved the saga to it")
	require.Equal(t, pick.SpanContext().SpanID(), pay.Links()[0].SpanContext.SpanID())

	msgs, err := r.kc.ReadAll(context.Background(), r.remote)
	require.NoError(t, err)
	var parent string
	for _, m := range msgs {
		for _, h := range m.Headers {
			if string(m.Key) == st.ID.String() && h.Key == "traceparent" {
				parent = string(h.Value)
			}
		}
	}
	require.Contains(t, parent, pay.SpanContext().SpanID().String(), "the command carries the send's span")

	// ship, run in the reply's update, links to the reply's span.
	r.reply(t, st.ID, r.command(t, st.ID))
	require.Equal(t, saga.StatusCompleted, r.waitTerminal(t, st.ID).Status)
	reply, ship := span("reply chaintrace/pay"), span("step chaintrace/ship")
	require.Equal(t, saga.OutcomeCompleted, attr(reply, "sagaflow.step.outcome").AsString())
	require.Equal(t, saga.OutcomeCompleted, attr(ship, "sagaflow.step.outcome").AsString())
	require.Len(t, ship.Links(), 1, "ship links to the reply it ran with")
	require.Equal(t, reply.SpanContext().SpanID(), ship.Links()[0].SpanContext.SpanID())
}

// A pause that commits while a reply is being applied (after the claim, so
// the claim did not see it) stops the step after the reply from running in
// the reply's transaction: the pause's trigger holds the command the reply
// wrote for it, and the engine asks, in the round trip that writes the
// reply, whether it was held. It runs once after the resume.
func TestChainedStepWaitsForAPauseTakenWhileTheReplyIsApplied(t *testing.T) {
	t.Parallel()
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	r := newChainRigWith(t, "chainpausing", &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}},
		func(ctx context.Context, _ *saga.StepRun, _ *order, _ json.RawMessage) error { return gate.Pass(ctx) })
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-3"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	waitFor(t, 15*time.Second, func() bool { return gate.Entered() == 1 }, "the reply to be applied")
	require.NoError(t, r.engine.Pause(ctx, st.ID, "operator looks at it"))
	gate.Open()

	waitFor(t, 15*time.Second, func() bool {
		in, err := r.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		return in.Step == "ship"
	}, "the reply to be written")
	r.shipHeldUntilResumed(t, st.ID)
}

// A remote step's Command that uses the step's transaction, right after a
// local step: the local step is then written on its own before the
// Command's first statement (which sees the local step's writes), and the
// send follows in an update of its own. What the Command wrote commits with
// the send, and is rolled back with a failure.
func TestARemoteCommandThatUsesTheTransactionAfterALocalStep(t *testing.T) {
	t.Parallel()
	const name = "chaintx"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}}, replies, remote)
	ctx := context.Background()
	_, err := k.pool.Exec(ctx, `CREATE TABLE `+k.table("marks")+` (order_id text, picked int)`)
	require.NoError(t, err)
	local := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }
	pick := func(ctx context.Context, run *saga.StepRun, o *order) error {
		if o.OrderID == "aborted" {
			// A statement that fails, its error dropped: the transaction is
			// left aborted, which the step's write finds.
			_, _ = run.Tx.Exec(ctx, "SELECT 1/0")
			return nil
		}
		return recordEffect(ctx, run, k.schema)
	}
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: pick, Compensate: local, Retry: &saga.RetryPolicy{MaxAttempts: 1}},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Retry: &saga.RetryPolicy{MaxAttempts: 1},
			Remote: &saga.Remote[order]{
				Topic: remote, Type: name + ".pay",
				Command: func(ctx context.Context, run *saga.StepRun, o *order) (any, error) {
					// The local step's effect is there to read, in the same transaction.
					_, err := run.Tx.Exec(ctx, `INSERT INTO `+k.table("marks")+` SELECT $1, count(*) FROM `+k.table("effects")+
						` WHERE saga_id = $2 AND step = 'pick'`, o.OrderID, run.SagaID)
					if err != nil {
						return nil, err
					}
					if o.OrderID == "bad" {
						return nil, steps.Permanent(errors.New("no card on file"))
					}
					return o, nil
				},
			}},
		saga.Step[order]{Name: "ship", Action: local},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}
	r.logWrites(t)
	marks := func(id string) []int {
		rows, err := k.pool.Query(ctx, `SELECT picked FROM `+k.table("marks")+` WHERE order_id = $1`, id)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[int])
		require.NoError(t, err)
		return out
	}

	good, err := saga.Start(ctx, k.engine, def, order{OrderID: "good"}, nil)
	require.NoError(t, err)
	r.reply(t, good.ID, r.command(t, good.ID))
	in := r.waitTerminal(t, good.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []int{1}, marks("good"), "the Command saw pick's effect, and its write committed with the send")
	require.Equal(t, []string{"pick -> pay", "pay -> pay awaiting", "pay -> ship"}, r.logged(t, "update_log", good.ID))
	require.Equal(t, []string{"pick direct", "pay relay"}, r.logged(t, "outbox_log", good.ID))

	bad, err := saga.Start(ctx, k.engine, def, order{OrderID: "bad"}, nil)
	require.NoError(t, err)
	in = r.waitTerminal(t, bad.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Empty(t, marks("bad"), "the failed Command's write was rolled back")
	require.Equal(t, []string{"pick/forward", "pick/compensate"}, r.effects(t, bad.ID), "pick's effect was kept, then compensated")
	require.Contains(t, in.LastError.Message, "no card on file")

	// The local step left the transaction aborted: its write fails when the
	// Command's first statement sends it, and the step's failure is recorded
	// instead. Nothing is sent, and the Command's statement never ran.
	aborted, err := saga.Start(ctx, k.engine, def, order{OrderID: "aborted"}, nil)
	require.NoError(t, err)
	in = r.waitTerminal(t, aborted.ID)
	require.NotEqual(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.NotNil(t, in.LastError)
	require.Equal(t, saga.CodeTxAborted, in.LastError.Code, "history: %v", eventTypes(in))
	require.Equal(t, "pick", in.LastError.Step)
	require.Empty(t, marks("aborted"))
	require.Equal(t, []string{"pick direct"}, r.logged(t, "outbox_log", aborted.ID), "pay's command was not written")
}

// The local step run in a reply's update, when it does not succeed: its
// failure (retried), a transaction it left aborted, and a cancel that
// interrupts it. Each time the reply stays applied (its history, and what
// OnReply wrote in the transaction), only the step's own writes are undone,
// and the saga goes on from there. ReplyStepLimit is a minute: the cancelled
// step is held until the cancel interrupts it, and on a loaded machine that
// took longer than the default limit, which then cut the step and its
// reply's transaction (another test's subject) before the cancel came.
func TestTheStepRunWithAReplyFailsAlone(t *testing.T) {
	t.Parallel()
	const name = "chainfail"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{ReplyStepLimit: time.Minute}}, replies, remote)
	ctx := context.Background()
	_, err := k.pool.Exec(ctx, `CREATE TABLE `+k.table("marks")+` (order_id text)`)
	require.NoError(t, err)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	var ships sync.Map // order id → *atomic.Int32
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
			OnReply: func(ctx context.Context, run *saga.StepRun, o *order, _ json.RawMessage) error {
				_, err := run.Tx.Exec(ctx, `INSERT INTO `+k.table("marks")+` VALUES ($1)`, o.OrderID)
				return err
			},
		}},
		saga.Step[order]{Name: "ship", Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
			Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
				if err := recordEffect(ctx, run, k.schema); err != nil {
					return err
				}
				n, _ := ships.LoadOrStore(o.OrderID, new(atomic.Int32))
				if n.(*atomic.Int32).Add(1) > 1 {
					return nil
				}
				switch o.OrderID {
				case "flaky":
					return errors.New("the carrier is busy")
				case "aborted":
					_, _ = run.Tx.Exec(ctx, "SELECT 1/0") // leaves the transaction aborted
					return nil
				case "cancelled":
					_ = gate.Pass(ctx) // until the cancel interrupts it
					return ctx.Err()
				}
				return nil
			}},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}
	marks := func(id string) int {
		return r.count(t, `SELECT count(*) FROM `+k.table("marks")+` WHERE order_id = $1`, id)
	}
	run := func(id string) uuid.UUID {
		st, err := saga.Start(ctx, k.engine, def, order{OrderID: id}, nil)
		require.NoError(t, err)
		r.reply(t, st.ID, r.command(t, st.ID))
		return st.ID
	}

	for _, id := range []string{"flaky", "aborted"} {
		sid := run(id)
		in := r.waitTerminal(t, sid)
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: history: %v", id, eventTypes(in))
		require.Equal(t, 1, marks(id), "%s: OnReply's write was kept", id)
		require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, sid), "%s: the failed attempt's write was undone", id)
		h := eventTypes(in)
		require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay", "reply_received:pay", "step_completed:pay",
			"step_failed:ship", "step_completed:ship", "saga_completed"}, h, id)
	}
	sid := run("cancelled")
	waitFor(t, 15*time.Second, func() bool { return gate.Entered() == 1 }, "ship to run")
	require.NoError(t, k.engine.Cancel(ctx, sid, "the customer called"))
	in := r.waitTerminal(t, sid)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, 1, marks("cancelled"), "OnReply's write was kept")
	require.Contains(t, eventTypes(in), "reply_received:pay")
	require.NotContains(t, r.effects(t, sid), "ship/forward", "ship's write was undone")
}

// The local step run in a reply's update ignores its timeout past the
// engine's HandlerGrace: its worker abandons it, and the transaction goes
// with the reply in it (only the attempt's history entry is recorded). The
// reply's message runs again at once, and the reply is then written on its
// own, with the step's command for a worker, which runs the step: the saga
// is not moved on without the reply's effects, and does not wait for the
// reply's timeout either.
func TestTheStepRunWithAReplyAbandonedRunsAgainOnItsOwn(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t) // the abandonment is logged as an error
	const name = "chainabandon"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	// No ReplyStepLimit: the step is waited for up to its Timeout and
	// HandlerGrace (the limit is TestAStepPastReplyStepLimitIsHandedToAWorker's).
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, HandlerGrace: 100 * time.Millisecond, Kafka: &saga.KafkaConfig{ReplyStepLimit: -1}}, replies, remote)
	ctx := context.Background()
	var ships atomic.Int32
	returned := make(chan struct{}) // the abandoned handler returned
	def := saga.Define(name,
		saga.Step[order]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
		saga.Step[order]{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
			Topic: remote, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		}},
		saga.Step[order]{Name: "ship", Timeout: 200 * time.Millisecond,
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				if ships.Add(1) == 1 {
					time.Sleep(time.Second) // ignores its context
					close(returned)
					return nil
				}
				return recordEffect(ctx, run, k.schema)
			}},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}
	r.logWrites(t)

	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.command(t, st.ID))
	in := r.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay",
		"step_failed:ship", // run at once with the reply, abandoned: the reply went with it
		"reply_received:pay", "step_completed:pay", "step_completed:ship", "saga_completed"}, eventTypes(in))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
	require.Equal(t, int32(2), ships.Load())
	require.Equal(t, []string{"pick direct", "pay relay", "ship direct"}, r.logged(t, "outbox_log", st.ID),
		"the reply sent again was written with ship's command, for a worker")
	<-returned
}

// A remote step's Command runs as a handler also when its command is
// claimed (here the saga's first step, with no local step before it): one
// that ignores its context past its Timeout and HandlerGrace is abandoned,
// the attempt recorded as the step's and retried; one that a cancel
// interrupts has the cancel applied in its place, with nothing sent.
func TestAClaimedRemoteCommandRunsAsAHandler(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t) // the abandonment is logged as an error
	const name = "claimedcmd"
	replies := saga.CommandTopicDefault + "." + name + ".replies"
	remote := name + ".participant"
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1, HandlerGrace: 100 * time.Millisecond, Kafka: &saga.KafkaConfig{}}, replies, remote)
	ctx := context.Background()
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	returned := make(chan struct{})
	var builds sync.Map // order id → *atomic.Int32
	def := saga.Define(name,
		saga.Step[order]{Name: "pay", Timeout: 2 * time.Second, Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
			Remote: &saga.Remote[order]{
				Topic: remote, Type: name + ".pay",
				Command: func(ctx context.Context, _ *saga.StepRun, o *order) (any, error) {
					n, _ := builds.LoadOrStore(o.OrderID, new(atomic.Int32))
					if n.(*atomic.Int32).Add(1) == 1 {
						switch o.OrderID {
						case "deaf":
							time.Sleep(3 * time.Second) // ignores its context
							close(returned)
						case "cancelled":
							_ = gate.Pass(ctx) // until the cancel interrupts it
							return nil, ctx.Err()
						}
					}
					return o, nil
				},
			}},
		saga.Step[order]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, k.schema) }},
	)
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	r := &chainRig{kafkaBundle: k, def: def, replies: replies, remote: remote, cl: rawProducer(t, k.kc)}

	deaf, err := saga.Start(ctx, k.engine, def, order{OrderID: "deaf"}, nil)
	require.NoError(t, err)
	r.reply(t, deaf.ID, r.command(t, deaf.ID))
	in := r.waitTerminal(t, deaf.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, int64(1), k.engine.Stats().HandlersAbandoned)
	var overran []string
	for _, h := range in.History {
		if h.ErrorCode == saga.CodeAbandonedRunOn {
			overran = append(overran, h.Step)
		}
	}
	require.Equal(t, []string{"pay"}, overran, "history: %v", eventTypes(in))
	require.Equal(t, []string{"ship/forward"}, r.effects(t, deaf.ID))

	cancelled, err := saga.Start(ctx, k.engine, def, order{OrderID: "cancelled"}, nil)
	require.NoError(t, err)
	waitFor(t, 15*time.Second, func() bool { return gate.Entered() == 1 }, "the Command to run")
	require.NoError(t, k.engine.Cancel(ctx, cancelled.ID, "the customer called"))
	in = r.waitTerminal(t, cancelled.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.NotContains(t, eventTypes(in), "command_sent:pay")
	require.Zero(t, r.count(t, "SELECT count(*) FROM "+r.table("outbox")+" WHERE saga_id = $1 AND delivery = 'relay'", cancelled.ID),
		"nothing was written for the participant")
	<-returned
}

// commandFor waits for saga id's remote command of step (any step when
// "") on the participant's topic and returns its step key: the last one.
func (r *chainRig) commandFor(t *testing.T, id uuid.UUID, step string) string {
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
				if h.Key == store.HeaderStepKey && (step == "" || strings.HasPrefix(string(h.Value), id.String()+"/"+step+"/")) {
					key = string(h.Value)
				}
			}
		}
		return key != ""
	}, "the %q command of saga %s", step, id)
	return key
}

// newTwoRemoteRig is a hybrid-mode saga pick (local), pay and bill (remote,
// one after the other, on one participant topic), ship (local), with the
// test as the participant; billCommand is bill's Command, and billTimeout
// its Timeout.
func newTwoRemoteRig(t *testing.T, name string, cfg *saga.Config, billTimeout time.Duration,
	billCommand func(context.Context, *saga.StepRun, *order) (any, error)) *chainRig {
	t.Helper()
	return newChainRigOf(t, name, cfg, func(remote string) []saga.Step[order] {
		return []saga.Step[order]{
			{Name: "pay", Timeout: 30 * time.Second, Remote: &saga.Remote[order]{
				Topic: remote, Type: name + ".pay",
				Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
			}},
			{Name: "bill", Timeout: billTimeout, Remote: &saga.Remote[order]{Topic: remote, Type: name + ".bill", Command: billCommand}},
		}
	})
}

// A reply followed by a remote step is one update: the reply's history,
// state and inbox key, the next step's command for the participant and the
// saga waiting for its reply. No command is written for a worker to claim
// the next step. A copy of the first reply that comes after is stale.
func TestARemoteStepAfterAReplyIsSentInTheSameUpdate(t *testing.T) {
	t.Parallel()
	var bills atomic.Int32
	r := newTwoRemoteRig(t, "chainremote", &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{}}, 30*time.Second,
		func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { bills.Add(1); return o, nil })
	r.logWrites(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	pay := r.commandFor(t, st.ID, "pay")
	r.reply(t, st.ID, pay)
	bill := r.commandFor(t, st.ID, "bill")
	r.reply(t, st.ID, pay) // a copy of pay's reply, after bill was sent
	r.reply(t, st.ID, bill)
	in := r.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"pick direct", "pay relay", "bill relay"}, r.logged(t, "outbox_log", st.ID),
		"the outbox rows written for the saga, in order: none for a worker to claim bill or ship")
	require.Equal(t, []string{
		"pick -> pay awaiting", // pick's success and pay's send
		"pay -> bill awaiting", // pay's reply and bill's send
		"bill -> ship",         // bill's reply, and ship, which completed the saga
	}, r.logged(t, "update_log", st.ID), "the updates of the saga's row, in order")
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay", "reply_received:pay", "step_completed:pay",
		"command_sent:bill", "reply_received:bill", "step_completed:bill", "step_completed:ship", "saga_completed"}, eventTypes(in))
	require.Equal(t, []string{"pick/forward", "ship/forward"}, r.effects(t, st.ID))
	require.Equal(t, int32(1), bills.Load(), "bill's command was built once")
	require.Equal(t, int64(3), r.engine.Stats().Chained, "pay's send, bill's send and ship ran at once")
}

// The remote step's Command run at once after a reply, ignoring its context
// past its Timeout and HandlerGrace, is abandoned: the reply goes with the
// transaction (only the attempt's history entry is recorded). The reply's
// message runs again at once, and the reply is then written on its own,
// with the next step's command, which a worker claims: the Command runs
// there.
func TestARemoteCommandAbandonedAfterAReplyIsSentOnItsOwn(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t) // the abandonment is logged as an error
	var bills atomic.Int32
	returned := make(chan struct{}) // the abandoned Command returned
	t.Cleanup(func() { <-returned })
	// No ReplyStepLimit: the Command is waited for up to its Timeout and
	// HandlerGrace (the limit is TestAStepPastReplyStepLimitIsHandedToAWorker's).
	r := newTwoRemoteRig(t, "chainremotedeaf", &saga.Config{Workers: 1, HandlerGrace: 100 * time.Millisecond, Kafka: &saga.KafkaConfig{ReplyStepLimit: -1}},
		time.Second, func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
			if bills.Add(1) == 1 {
				time.Sleep(3 * time.Second) // ignores its context
				close(returned)
			}
			return o, nil
		})
	r.logWrites(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, r.def, order{OrderID: "o-1"}, nil)
	require.NoError(t, err)
	r.reply(t, st.ID, r.commandFor(t, st.ID, "pay"))
	history := func() []string {
		in, err := r.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		return eventTypes(in)
	}
	waitFor(t, 15*time.Second, func() bool { return slices.Contains(history(), "command_sent:bill") }, "bill's command to be sent")
	require.Equal(t, []string{"saga_started", "step_completed:pick", "command_sent:pay",
		"step_failed:bill", // run at once with the reply, abandoned: the reply went with it
		"reply_received:pay", "step_completed:pay", "command_sent:bill"}, history())
	require.Equal(t, int32(2), bills.Load(), "bill's Command ran again, once")
	require.Equal(t, []string{"pick direct", "pay relay", "bill direct", "bill relay"}, r.logged(t, "outbox_log", st.ID),
		"the reply was written with bill's command for a worker, which sent it")
	require.Equal(t, []string{"pick -> pay awaiting", "pay -> bill", "bill -> bill awaiting"}, r.logged(t, "update_log", st.ID))
}
