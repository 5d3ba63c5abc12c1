package review18

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// kmode is a schema whose sagas run in Kafka mode (KafkaConfig.AllSteps):
// a relay publishes their commands to saga.CommandTopicDefault+"."+name
// (partitions as asked), and engines consume them. The saga is
//
//	a (local, hook; compensation "a-undo") [-> w (OnSignal "go")] -> b (local) -> c (local)
//
// Every effect is a row of testkit.Effects written through run.Tx.
type kmode struct {
	name, topic string
	kc          *kafkatest.Cluster
	db          *testkit.DB
	fx          *testkit.Effects
	def         *saga.Definition[ord]
	client      *saga.Engine // never started: starts, reads, steers
	key         []byte       // the signing key, if any

	mu    sync.Mutex
	hook  func(ctx context.Context, run *saga.StepRun, o *ord) error
	calls map[string]int // saga/step -> Action calls
}

func newKmode(t *testing.T, name string, partitions int32, await bool, key []byte) *kmode {
	t.Helper()
	k := &kmode{name: name, topic: saga.CommandTopicDefault + "." + name, key: key, calls: map[string]int{}}
	k.kc = kafkatest.New(t, kafkatest.SeedTopics(partitions, k.topic, k.topic+".replies"))
	k.db = testkit.NewDB(t)
	k.fx = testkit.NewEffects(t, k.db)
	testkit.Relay(t, k.kc.Addrs(), k.db)
	step := func(n string, comp bool) saga.Step[ord] {
		// The timeout is longer than any of the tests' waits (wait): a
		// handler held at a gate while a loaded machine brings the other
		// sagas to theirs must not time out and run again before the
		// operator acts (a CI run's TestKafkaModeTwoEnginesOneGroup took
		// 23 s with a 20 s timeout here).
		s := saga.Step[ord]{Name: n, Retry: noBackoff(3), Timeout: 2 * time.Minute,
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				k.mu.Lock()
				k.calls[run.SagaID.String()+"/"+n]++
				hook := k.hook
				k.mu.Unlock()
				if hook != nil {
					if err := hook(ctx, run, o); err != nil {
						return err
					}
				}
				return k.fx.Record(ctx, run, n)
			}}
		if comp {
			s.Compensate = func(ctx context.Context, run *saga.StepRun, _ *ord) error { return k.fx.Record(ctx, run, n+"-undo") }
		}
		return s
	}
	list := []saga.Step[ord]{step("a", true)}
	if await {
		list = append(list, saga.Step[ord]{Name: "w", Wait: saga.OnSignal("go",
			func(ctx context.Context, run *saga.StepRun, _ *ord, _ json.RawMessage) error {
				return k.fx.Record(ctx, run, "go")
			})})
	}
	list = append(list, step("b", true), step("c", false))
	k.def = saga.Define(name, list...)
	k.client = testkit.NewEngine(t, k.db.Pool, k.config(1, 16), k.def)
	return k
}

func (k *kmode) config(workers, batch int) *saga.Config {
	cfg := k.db.Config()
	cfg.Workers = workers
	cfg.BatchSize = batch
	cfg.RescueInterval = time.Second
	cfg.Kafka = &saga.KafkaConfig{Brokers: k.kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second, SigningKey: k.key}
	return cfg
}

func (k *kmode) setHook(f func(ctx context.Context, run *saga.StepRun, o *ord) error) {
	k.mu.Lock()
	k.hook = f
	k.mu.Unlock()
}

func (k *kmode) callsOf(id uuid.UUID, step string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.calls[id.String()+"/"+step]
}

// backlog starts n sagas (ids prefix0..) with no engine running and returns
// them once their first commands are all on the topic.
func (k *kmode) backlog(t *testing.T, prefix string, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(context.Background(), k.client, k.def, ord{ID: fmt.Sprintf("%s%d", prefix, i)}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	k.waitOnTopic(t, ids...)
	return ids
}

// waitOnTopic waits until each saga has a command on the topic.
func (k *kmode) waitOnTopic(t *testing.T, ids ...uuid.UUID) {
	t.Helper()
	testkit.WaitFor(t, wait, "the commands on the topic", func() bool {
		msgs, err := k.kc.ReadAll(context.Background(), k.topic)
		require.NoError(t, err)
		seen := map[string]bool{}
		for _, m := range msgs {
			seen[string(m.Key)] = true
		}
		for _, id := range ids {
			if !seen[id.String()] {
				return false
			}
		}
		return true
	})
}

func (k *kmode) signal(t *testing.T, ctx context.Context, id uuid.UUID) {
	t.Helper()
	_, err := k.client.Signal(ctx, saga.Signal{SagaID: id, Name: "go", ID: "go-" + id.String()})
	require.NoError(t, err)
}

// completedOnce checks that saga id completed with every effect once and
// nothing undone.
func (k *kmode) completedOnce(t *testing.T, e *saga.Engine, id uuid.UUID, await bool) {
	t.Helper()
	in := testkit.WaitEnded(t, e, id)
	require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, timeline(in))
	want := map[string]int{"a": 1, "b": 1, "c": 1}
	if await {
		want["go"] = 1
	}
	require.Equal(t, want, k.fx.Counts(t, id), "%s: effects (%v)", id, timeline(in))
	require.Equal(t, 1, testkit.Events(in, "step_completed", "a"), "%s: %v", id, timeline(in))
}

// cancelledClean checks that saga id ended compensated by a cancel, with no
// step after a run and every run of a undone.
func (k *kmode) cancelledClean(t *testing.T, e *saga.Engine, id uuid.UUID) map[string]int {
	t.Helper()
	in := testkit.WaitEnded(t, e, id)
	require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v", id, timeline(in))
	require.Equal(t, 1, countType(in, "saga_cancelled"), "%s: %v", id, timeline(in))
	c := k.fx.Counts(t, id)
	require.LessOrEqual(t, c["a"], 1, "%s: %v", id, timeline(in))
	require.Equal(t, c["a"], c["a-undo"], "%s: every a undone (%v)", id, timeline(in))
	require.Zero(t, c["go"]+c["b"]+c["b-undo"]+c["c"], "%s: no step after the cancel (%v, %v)", id, c, timeline(in))
	return c
}

func (k *kmode) deadLetters(t *testing.T) []saga.DeadLetter {
	t.Helper()
	page, err := k.client.DeadLetters(context.Background(), &saga.DeadOpts{Topic: k.topic})
	require.NoError(t, err)
	return page.Letters
}

// countType counts the entries of a saga's history of type typ, at any step.
func countType(in *saga.Instance, typ string) int {
	n := 0
	for _, e := range in.History {
		if e.Type == typ {
			n++
		}
	}
	return n
}
