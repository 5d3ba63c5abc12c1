package saga_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// kafkaBundle is an engine in Kafka mode, the relay that publishes its
// commands, and the in-process cluster between them.
type kafkaBundle struct {
	*bundle
	kc *kafkatest.Cluster
	r  *relay.Relay
}

func setupKafka(t *testing.T, partitions int, sagaNames ...string) *kafkaBundle {
	t.Helper()
	var topics []string
	for _, n := range sagaNames {
		topics = append(topics, saga.CommandTopicDefault+"."+n)
	}
	kc := kafkatest.New(t, kafkatest.SeedTopics(int32(partitions), topics...))
	b := setup(t, &saga.Config{Workers: 2, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true}})
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(b.pool, w, &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
		require.NoError(t, w.Close())
	})
	return &kafkaBundle{bundle: b, kc: kc, r: r}
}

func TestKafkaModeRunsSagasThroughTheRelay(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 3, "kcheckout")
	def := threeSteps(k.bundle, "kcheckout", nil)
	require.NoError(t, k.engine.Register(def))
	require.Equal(t, []string{"sagaflow.commands.kcheckout"}, k.engine.CommandTopics())
	k.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{OrderID: "k-1"}, nil)
	require.NoError(t, err)
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID))
	// Every command went through the outbox and the relay to Kafka.
	require.Equal(t, 3, k.count(t, "SELECT count(*) FROM "+k.table("outbox")+" WHERE saga_id = $1 AND delivery = 'relay' AND status = 'published'", st.ID))
	msgs, err := k.kc.ReadAll(ctx, "sagaflow.commands.kcheckout")
	require.NoError(t, err)
	require.Len(t, msgs, 3)
	for _, m := range msgs {
		require.Equal(t, st.ID.String(), string(m.Key), "partitioned by saga id")
	}
}

func TestKafkaModeDuplicateDeliveryHasOneEffect(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 3, "kdup")
	def := threeSteps(k.bundle, "kdup", nil)
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	// The relay publishes the first command; a second copy reaches the
	// topic too (a relay crash after the broker's acknowledgement).
	topic := "sagaflow.commands.kdup"
	var first []kafka.Message
	waitFor(t, 10*time.Second, func() bool {
		first, err = k.kc.ReadAll(ctx, topic)
		require.NoError(t, err)
		return len(first) == 1
	}, "the relay to publish the first command")
	w := relay.NewKafkaWriter(k.kc.Addrs(), nil)
	dup := first[0]
	dup.Topic, dup.Partition, dup.Offset = topic, 0, 0
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Topic: dup.Topic, Key: dup.Key, Value: dup.Value, Headers: dup.Headers}))
	require.NoError(t, w.Close())

	k.start(t)
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID))
	waitFor(t, 10*time.Second, func() bool { return k.engine.Stats().StaleDiscarded >= 1 }, "the duplicate to be discarded")
}

func TestKafkaModeCommitsOffsetsOnlyAfterTheStep(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	k := setupKafka(t, 3, "kcrash")
	def := threeSteps(k.bundle, "kcrash", nil)
	require.NoError(t, k.engine.Register(def))
	crashes := 0
	k.engine.SetBeforeCommit(func(ctx context.Context, tx pgx.Tx) error {
		if crashes < 2 {
			crashes++
			return context.DeadlineExceeded // the step's transaction never commits
		}
		return nil
	})
	k.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 2, crashes)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID))
}

func TestKafkaModeTwoEnginesShareTheWork(t *testing.T) {
	t.Parallel()
	const sagas = 120
	k := setupKafka(t, 12, "kload")
	def := threeSteps(k.bundle, "kload", map[string]saga.StepFunc[order]{"ship/forward": func(_ context.Context, _ *saga.StepRun, s *order) error {
		if s.OrderID[len(s.OrderID)-1] == '7' {
			return errPermanentDecline
		}
		return nil
	}})
	require.NoError(t, k.engine.Register(def))
	second, err := saga.New(k.pool, &saga.Config{Schema: k.schema, Workers: 2, Logger: testLogger(t),
		Kafka: &saga.KafkaConfig{Brokers: k.kc.Addrs(), AllSteps: true}})
	require.NoError(t, err)
	require.NoError(t, second.Register(def))
	k.start(t)
	(&bundle{pool: k.pool, schema: k.schema, engine: second}).start(t)
	ctx := context.Background()
	// Keep starting sagas until both engines have run steps: the group
	// rebalances as members join, and then the partitions are shared.
	started := 0
	waitFor(t, 60*time.Second, func() bool {
		for range 10 {
			_, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-" + strconv.Itoa(started)}, nil)
			require.NoError(t, err)
			started++
		}
		return k.engine.Stats().StepsSucceeded > 0 && second.Stats().StepsSucceeded > 0
	}, "both engines to run steps")
	for ; started < sagas; started++ {
		_, err := saga.Start(ctx, k.engine, def, order{OrderID: "o-" + strconv.Itoa(started)}, nil)
		require.NoError(t, err)
	}
	waitFor(t, 90*time.Second, func() bool {
		return k.count(t, "SELECT count(*) FROM "+k.table("saga_instances")+" WHERE status NOT IN ('completed', 'compensated')") == 0
	}, "all sagas to end")
	require.Equal(t, started, k.count(t, "SELECT count(*) FROM "+k.table("saga_instances")))
	require.Equal(t, started/10, k.count(t, "SELECT count(*) FROM "+k.table("saga_instances")+" WHERE status = 'compensated'"))
	require.Equal(t, 0, k.count(t, "SELECT count(*) FROM (SELECT 1 FROM "+k.table("effects")+
		" GROUP BY saga_id, step, direction HAVING count(*) <> 1) d"), "every effect exactly once")
	t.Logf("engine 1: %+v", k.engine.Stats())
	t.Logf("engine 2: %+v", second.Stats())
}

func TestKafkaModeDeadLettersMalformedCommands(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 1, "kpoison")
	def := threeSteps(k.bundle, "kpoison", nil)
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()
	// Garbage ahead of a real saga's commands on the only partition.
	w := relay.NewKafkaWriter(k.kc.Addrs(), nil)
	require.NoError(t, w.WriteMessages(ctx,
		kafka.Message{Topic: "sagaflow.commands.kpoison", Key: []byte("x"), Value: []byte("{not json")},
		kafka.Message{Topic: "sagaflow.commands.kpoison", Key: []byte("y"), Value: []byte(`{}`),
			Headers: []kafka.Header{{Key: "sagaflow-type", Value: []byte("sagaflow.step")}}}))
	require.NoError(t, w.Close())
	k.start(t)
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, k.waitTerminal(t, st.ID).Status, "the partition kept moving")
	rows, err := k.pool.Query(ctx, "SELECT consumer, reason, msg_value FROM "+k.table("dead_letters")+" ORDER BY id")
	require.NoError(t, err)
	type dead struct {
		Consumer, Reason string
		Value            []byte
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[dead])
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, "sagaflow.engine", got[0].Consumer)
	require.Contains(t, got[0].Reason, `malformed command: message type "" is not`)
	require.Equal(t, []byte("{not json"), got[0].Value, "the original bytes")
	require.Contains(t, got[1].Reason, "malformed command: saga_id is missing")
}

func TestKafkaModeRescuerWaitsForALaggingConsumer(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 1, "klag")
	def := threeSteps(k.bundle, "klag", nil)
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	// The relay published the command; no engine consumes yet (lag), and
	// the deadline passes: the saga waits, no attempt spent.
	waitFor(t, 10*time.Second, func() bool {
		return k.count(t, "SELECT count(*) FROM "+k.table("outbox")+" WHERE saga_id = $1 AND status = 'published'", st.ID) == 1
	}, "the relay to publish")
	k.overdue(t, st.ID)
	res, err := k.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Waiting: 1}, res)
	// Published long ago and still no progress: lost. Re-driven.
	_, err = k.pool.Exec(ctx, "UPDATE "+k.table("outbox")+" SET published_at = now() - interval '1 hour' WHERE saga_id = $1", st.ID)
	require.NoError(t, err)
	k.overdue(t, st.ID)
	res, err = k.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Redriven: 1}, res)
	k.start(t)
	require.Equal(t, saga.StatusCompleted, k.waitTerminal(t, st.ID).Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID), "the first copy was stale")
}

// TestKafkaModeCarriesOutToolRequests: the operator CLI has no definitions
// and no Kafka: its cancel requests and replays are direct commands, which a
// Kafka-mode engine carries out too.
func TestKafkaModeCarriesOutToolRequests(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 1, "ktool")
	var fixed atomic.Bool
	def := threeSteps(k.bundle, "ktool", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			if !fixed.Load() {
				return steps.Permanent(errors.New("no carrier"))
			}
			return nil
		},
		"charge/compensate": func(context.Context, *saga.StepRun, *order) error {
			if !fixed.Load() {
				return steps.Permanent(errors.New("refunds down"))
			}
			return nil
		},
	})
	require.NoError(t, k.engine.Register(def))
	k.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, k.waitTerminal(t, st.ID).Status)

	tool, err := saga.New(k.pool, &saga.Config{Schema: k.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	fixed.Store(true)
	require.NoError(t, tool.Resume(ctx, st.ID, "refunds work again"))
	require.Equal(t, saga.StatusCompensated, k.waitTerminal(t, st.ID).Status)

}

// countingReader is a KafkaConfig.NewReader seam over the real kafka-go
// reader: it counts what the worker fetched and committed.
type countingReader struct {
	*kafka.Reader
	fetched, committed *atomic.Int64
}

func (r countingReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	m, err := r.Reader.FetchMessage(ctx)
	if err == nil {
		r.fetched.Add(1)
	}
	return m, err
}

func (r countingReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	err := r.Reader.CommitMessages(ctx, msgs...)
	if err == nil {
		r.committed.Add(int64(len(msgs)))
	}
	return err
}

// The reader seam: an engine given KafkaConfig.NewReader consumes through
// it, with the group and topics it would have used, and commits every
// command it ran.
func TestKafkaModeConsumesThroughTheReaderSeam(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, saga.CommandTopicDefault+".kseam"))
	var fetched, committed atomic.Int64
	var gotGroup string
	var gotTopics []string
	var mu sync.Mutex
	newReader := func(group string, topics []string) saga.KafkaReader {
		mu.Lock()
		gotGroup, gotTopics = group, topics
		mu.Unlock()
		return countingReader{Reader: kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: group, GroupTopics: topics,
			StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond}),
			fetched: &fetched, committed: &committed}
	}
	b := setup(t, &saga.Config{Workers: 1, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), NewReader: newReader, AllSteps: true}})
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(b.pool, w, &relay.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		require.NoError(t, r.Stop(context.Background()))
		require.NoError(t, w.Close())
	})
	def := threeSteps(b, "kseam", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{OrderID: "seam-1"}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	waitFor(t, 10*time.Second, func() bool { return committed.Load() == 3 }, "three commits")
	require.Equal(t, int64(3), fetched.Load())
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, "sagaflow-engine-"+b.schema, gotGroup)
	require.Equal(t, []string{saga.CommandTopicDefault + ".kseam"}, gotTopics)
}
