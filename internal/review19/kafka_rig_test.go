package review19_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// kmode is a schema whose sagas run in Kafka mode (KafkaConfig.AllSteps),
// with a relay and engines that poll once a minute. The saga is
//
//	a (compensation "a-undo") [-> w (OnSignal "go")] -> b -> c
//
// every effect a row of testkit.Effects written through run.Tx; every call
// of an action is counted, with its transaction id.
type kmode struct {
	name, topic string
	kc          *kafkatest.Cluster
	db          *testkit.DB
	fx          *testkit.Effects
	def         *saga.Definition[ord]
	client      *saga.Engine
	key         []byte
	calls       calls

	mu   sync.Mutex
	hook func(ctx context.Context, run *saga.StepRun, o *ord) error
}

func newKmode(t *testing.T, name string, await bool, key []byte) *kmode {
	t.Helper()
	k := &kmode{name: name, topic: saga.CommandTopicDefault + "." + name, key: key}
	k.kc = kafkatest.New(t, kafkatest.SeedTopics(1, k.topic, k.topic+".replies"))
	k.db = testkit.NewDB(t)
	k.fx = testkit.NewEffects(t, k.db)
	longRelay(t, k.kc.Addrs(), k.db)
	step := func(n string, comp bool) saga.Step[ord] {
		s := saga.Step[ord]{Name: n, Retry: backoff(3, 200*time.Millisecond), Timeout: 20 * time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				tx, err := txid(ctx, run)
				if err != nil {
					return err
				}
				k.calls.add(o.ID+"/"+n, tx)
				k.mu.Lock()
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

// longRelay starts a relay on d's schema with a one-minute poll, until the
// test ends.
func longRelay(t *testing.T, brokers []string, d *testkit.DB) {
	t.Helper()
	testkit.RelayPolling(t, brokers, d, poll)
}

func (k *kmode) config(workers, batch int) *saga.Config {
	cfg := config(k.db, workers, batch)
	cfg.Kafka = &saga.KafkaConfig{Brokers: k.kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second, SigningKey: k.key}
	return cfg
}

func (k *kmode) setHook(f func(ctx context.Context, run *saga.StepRun, o *ord) error) {
	k.mu.Lock()
	k.hook = f
	k.mu.Unlock()
}

// backlog starts n sagas (ids prefix0..) and returns once their first
// commands are all on the topic.
func (k *kmode) backlog(t *testing.T, prefix string, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(context.Background(), k.client, k.def, ord{ID: fmt.Sprintf("%s%d", prefix, i)}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	testkit.WaitFor(t, wait, "the commands on the topic", func() bool {
		seen := k.onTopic(t)
		for _, id := range ids {
			if _, ok := seen[id.String()]; !ok {
				return false
			}
		}
		return true
	})
	return ids
}

// onTopic maps each key on the topic to its last message.
func (k *kmode) onTopic(t *testing.T) map[string]kafka.Message {
	t.Helper()
	msgs, err := k.kc.ReadAll(context.Background(), k.topic)
	require.NoError(t, err)
	out := map[string]kafka.Message{}
	for _, m := range msgs {
		out[string(m.Key)] = m
	}
	return out
}

func (k *kmode) signal(t *testing.T, id uuid.UUID) {
	t.Helper()
	_, err := k.client.Signal(context.Background(), saga.Signal{SagaID: id, Name: "go", ID: "go-" + id.String()})
	require.NoError(t, err)
}

// completedOnce checks that saga id completed with every effect once.
func (k *kmode) completedOnce(t *testing.T, e *saga.Engine, id uuid.UUID, await bool, d time.Duration) {
	t.Helper()
	in := endedWithin(t, e, id, d)
	require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, testkit.Timeline(in))
	want := map[string]int{"a": 1, "b": 1, "c": 1}
	if await {
		want["go"] = 1
	}
	require.Equal(t, want, k.fx.Counts(t, id), "%s: effects (%v)", id, testkit.Timeline(in))
}

// deadByOffset maps each dead-lettered offset of the command topic to its
// reasons.
func (k *kmode) deadByOffset(t *testing.T) map[int64][]string {
	t.Helper()
	page, err := k.client.DeadLetters(context.Background(), &saga.DeadOpts{Topic: k.topic, Limit: 500})
	require.NoError(t, err)
	out := map[int64][]string{}
	for _, l := range page.Letters {
		require.NotNil(t, l.Offset, "a dead letter of the command topic without its offset: %+v", l)
		out[*l.Offset] = append(out[*l.Offset], l.Reason)
	}
	return out
}

func rec(topic string, m kafka.Message) *kgo.Record {
	r := &kgo.Record{Topic: topic, Partition: 0, Key: m.Key, Value: m.Value}
	for _, h := range m.Headers {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
	}
	return r
}

func setHeader(r *kgo.Record, name string, value []byte) {
	for i := range r.Headers {
		if r.Headers[i].Key == name {
			r.Headers[i].Value = value
			return
		}
	}
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: name, Value: value})
}

// produce writes recs to partition 0 in order and returns their offsets.
func produce(t *testing.T, kc *kafkatest.Cluster, recs ...*kgo.Record) []int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	out := make([]int64, len(recs))
	for i, r := range recs {
		out[i] = r.Offset
	}
	return out
}

// twice lists the keys whose handler ran more than once.
func (c *calls) twice() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for k, n := range c.n {
		if n > 1 {
			out = append(out, fmt.Sprintf("%s×%d", k, n))
		}
	}
	return out
}

func short(s string) string {
	if len(s) > 60 {
		return s[:60] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}
