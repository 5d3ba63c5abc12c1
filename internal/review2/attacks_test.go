package review2_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// Consumer names are data, not patterns: DeleteProcessed of "p_y" or "%"
// deletes "this consumer's inbox keys" only.
func TestDeleteProcessedConsumerNameIsNotAPattern(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	names := []string{"pay", "p_y", "%", "pay\\", "PAY"}
	for _, n := range names {
		require.False(t, recorded(t, pool, schema, n, "old-"+n))
	}
	exec(t, pool, schema, "UPDATE %s.inbox SET processed_at = now() - interval '2 hours'")
	for i, n := range []string{"p_y", "%", "pay\\"} {
		in, err := inbox.New(pool, &inbox.Config{Consumer: n, Schema: schema})
		require.NoError(t, err)
		deleted, err := in.DeleteProcessed(ctx, time.Hour, 100)
		require.NoError(t, err)
		require.Equal(t, int64(1), deleted, "consumer %q", n)
		require.Equal(t, len(names)-i-1, count(t, pool, schema, "SELECT count(*) FROM %s.inbox"), "consumer %q deleted others' keys", n)
	}
	in, err := inbox.New(pool, &inbox.Config{Consumer: "pay", Schema: schema})
	require.NoError(t, err)
	_, err = in.DeleteProcessed(ctx, time.Hour, 0)
	require.Error(t, err, "batch 0")
}

// Docs (inbox.Config.Consumer): "Required."; New wraps "every configuration
// problem" in ErrInvalidConfig.
func TestInboxConsumerNameRequired(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	for _, bad := range []string{"", "a\x00b", "a\xffb"} {
		_, err := inbox.New(pool, &inbox.Config{Consumer: bad, Schema: schema})
		require.ErrorIs(t, err, inbox.ErrInvalidConfig, "consumer %q", bad)
	}
	_, err := inbox.New(pool, nil)
	require.ErrorIs(t, err, inbox.ErrInvalidConfig)
	_, err = inbox.New(pool, &inbox.Config{Consumer: "c", Schema: "bad schema"})
	require.ErrorIs(t, err, inbox.ErrInvalidConfig)
}

// Docs (Status): OldestPendingAge "is the age of the oldest pending one; 0
// when nothing is pending." A message held back by Delay is pending, and its
// age is never negative.
func TestStatusOldestPendingAgeWithDelay(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	st, err := ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Status{}, st)
	m := msg("orders", "k", "T")
	m.Delay = time.Hour
	insert(t, pool, schema, m)
	st, err = ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.Pending)
	require.GreaterOrEqual(t, st.OldestPendingAge, time.Duration(0))
	require.Less(t, st.OldestPendingAge, time.Minute)

	old := insert(t, pool, schema, msg("orders", "k", "T"))
	exec(t, pool, schema, "UPDATE %s.outbox SET created_at = now() - interval '2 hours', available_at = now() - interval '2 hours' WHERE id = $1", old)
	st, err = ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), st.Pending)
	require.InDelta(t, (2 * time.Hour).Seconds(), st.OldestPendingAge.Seconds(), 60)
}

// Docs (Replay): "the engine's own direct commands never are" replayed.
func TestReplayNeverSelectsDirectCommands(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	relayed := insert(t, pool, schema, msg("orders", "k", "T"))
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 1)
	direct := uuid.Must(uuid.NewV7())
	exec(t, pool, schema, `INSERT INTO %s.outbox (id, topic, delivery, aggregateid, type, payload, status, published_at)
		VALUES ($1, 'orders', 'direct', 'k', 'T', '\x00', 'published', now())`, direct)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	res, err := ob.Replay(ctx, outbox.ReplayOpts{RatePerSecond: 1000})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{relayed}, res.Matched)
}

// The engine's NewReader seam (saga.KafkaConfig): "It gets the group and the
// topics (Engine.CommandTopics) and must commit only the offsets it is asked
// to, synchronously. Defaults to a kafka-go reader in the consumer group";
// GroupID "Defaults to "sagaflow-engine-" + Schema". A saga's command must go
// through the reader it returns.
func TestEngineNewReaderSeam(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.GroupMinSessionTimeout(time.Second))

	type call struct {
		group  string
		topics []string
	}
	var mu sync.Mutex
	var calls []call
	var readers []*seamReader
	def := saga.Define("review2",
		saga.Step[struct{}]{Name: "only", Action: func(context.Context, *saga.StepRun, *struct{}) error { return nil }},
	)
	e, err := saga.New(pool, &saga.Config{
		Schema:  schema,
		Workers: 1,
		Kafka: &saga.KafkaConfig{
			Brokers: kc.Addrs(), AllSteps: true,
			NewReader: func(group string, topics []string) saga.KafkaReader {
				mu.Lock()
				defer mu.Unlock()
				calls = append(calls, call{group, slices.Clone(topics)})
				r := &seamReader{Reader: kafka.NewReader(kafka.ReaderConfig{
					Brokers: kc.Addrs(), GroupID: group, GroupTopics: topics, StartOffset: kafka.FirstOffset,
					MaxWait: 50 * time.Millisecond, HeartbeatInterval: 300 * time.Millisecond,
					JoinGroupBackoff: 200 * time.Millisecond, ReadBackoffMin: 20 * time.Millisecond,
					ReadBackoffMax: 200 * time.Millisecond,
				})}
				readers = append(readers, r)
				return r
			},
		},
	})
	require.NoError(t, err)
	require.NoError(t, e.Register(def))
	topics := e.CommandTopics()
	require.NotEmpty(t, topics)
	for _, tp := range topics {
		require.NoError(t, kc.CreateTopic(tp, 1))
	}
	r := newRelay(t, pool, schema, kc, relay.Config{PollInterval: 50 * time.Millisecond})
	require.NoError(t, r.Start(ctx))
	require.NoError(t, e.Start(ctx))
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = e.Stop(stopCtx)
		}
	})

	started, err := saga.Start(ctx, e, def, struct{}{}, nil)
	require.NoError(t, err)
	eventually(t, 30*time.Second, func() bool {
		inst, err := e.Get(ctx, started.ID)
		require.NoError(t, err)
		return inst.Status == saga.StatusCompleted
	}, "the saga did not complete through the seam's reader")
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, e.Stop(stopCtx))
	stopped = true
	require.NoError(t, r.Stop(stopCtx))

	mu.Lock()
	defer mu.Unlock()
	require.NotEmpty(t, calls)
	var fetched, committed int
	for i, c := range calls {
		require.Equal(t, "sagaflow-engine-"+schema, c.group, "call %d", i)
		require.ElementsMatch(t, topics, c.topics, "call %d", i)
		f, cm, closed := readers[i].stats()
		fetched += f
		committed += cm
		if !closed {
			_ = readers[i].Reader.Close()
			t.Errorf("the engine did not close reader %d that NewReader made (the docs do not say who closes it)", i)
		}
	}
	require.NotZero(t, fetched, "no command came through the seam's reader")
	require.NotZero(t, committed)
	require.LessOrEqual(t, committed, fetched, "committed an offset it never fetched")
}

type seamReader struct {
	*kafka.Reader
	mu                 sync.Mutex
	fetched, committed int
	closed             bool
}

func (r *seamReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	m, err := r.Reader.FetchMessage(ctx)
	if err == nil {
		r.mu.Lock()
		r.fetched++
		r.mu.Unlock()
	}
	return m, err
}

func (r *seamReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	err := r.Reader.CommitMessages(ctx, msgs...)
	if err == nil {
		r.mu.Lock()
		r.committed += len(msgs)
		r.mu.Unlock()
	}
	return err
}

func (r *seamReader) Close() error {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	return r.Reader.Close()
}

func (r *seamReader) stats() (fetched, committed int, closed bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fetched, r.committed, r.closed
}

// Docs (Outbox.InsertTx): it "wakes the relay when tx commits" — and only
// then: a rolled-back transaction leaves nothing to publish.
func TestInsertTxRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, ob.InsertTx(ctx, tx, msg("orders", "k", "T")))
	require.NoError(t, tx.Rollback(ctx))
	st, err := ob.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Status{}, st)
	require.Equal(t, 0, count(t, pool, schema, "SELECT count(*) FROM %s.outbox"))
}

// Docs (Message.Key): "Key is the partition key: messages with the same key
// are published in the order they were committed." Check accepts an empty
// Key; messages sharing it must then share a partition too, or their order
// is lost.
func TestEmptyKeyKeepsOrder(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, "nokey"))
	m := msg("nokey", "", "T")
	require.NoError(t, m.Check(), "an empty Key is accepted")
	var ids []string
	for range 9 {
		ids = append(ids, insert(t, pool, schema, msg("nokey", "", "T")).String())
	}
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 9)
	got, err := kc.ReadAll(ctx, "nokey")
	require.NoError(t, err)
	require.Len(t, got, 9)
	partitions := map[int]int{}
	for _, g := range got {
		partitions[g.Partition]++
	}
	if len(partitions) > 1 {
		t.Logf("9 messages with Key \"\" went to partitions %v", partitions)
		t.Skip("FINDING: messages with the same (empty) Key are spread over partitions, so their order is lost; " +
			"Check accepts an empty Key and the docs say messages with the same key are published in order")
	}
	var order []string
	for _, g := range got {
		v, _ := header(g, "sagaflow-message-id")
		order = append(order, v)
	}
	require.Equal(t, ids, order)
}

// A replay interrupted by its ctx (an operator's Ctrl-C) must tell what it
// already did: the docs do not say; a result that hides rows already made
// pending would have the operator replay them twice.
func TestReplayInterrupted(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	for _, k := range []string{"a", "b", "c", "d", "e", "f"} {
		insert(t, pool, schema, msg("orders", k, "T"))
	}
	publishAll(t, newRelay(t, pool, schema, kc, relay.Config{}), 6)
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	res, err := ob.Replay(ctx, outbox.ReplayOpts{RatePerSecond: 4})
	st, stErr := ob.Status(context.Background())
	require.NoError(t, stErr)
	t.Logf("interrupted replay: err %v, result %+v, pending now %d", err, res, st.Pending)
	require.Error(t, err, "a replay cut short reported success")
	require.Less(t, st.Pending, int64(6), "the rate limit did not hold")
	if res == nil || res.Republished != st.Pending {
		t.Skip("FINDING: an interrupted Replay returns an error without saying how many messages it already made pending " +
			"(result nil or wrong); the operator cannot tell what a retry would publish twice")
	}
}

// Relay Start twice with retention on, Stop once: no goroutine left behind
// (pgtest.Main checks leaks), Health says not running.
func TestRelayStartTwiceWithRetention(t *testing.T) {
	t.Parallel()
	pool, schema := migrated(t)
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	r := newRelay(t, pool, schema, kc, relay.Config{Retention: time.Hour, RetentionInterval: 10 * time.Millisecond})
	require.NoError(t, r.Start(ctx))
	require.NoError(t, r.Start(ctx))
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, r.Stop(ctx))
	h, err := r.Health(ctx)
	require.NoError(t, err)
	require.False(t, h.Running)
}

// Docs (Consumer.Start): "Cancelling ctx stops the consumer hard." A ctx
// already cancelled: Start must not leave a goroutine running, and Stop
// returns.
func TestConsumerStartWithCancelledCtx(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	c := r.consumer(r.charge)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := c.Start(ctx)
	t.Logf("Start with a cancelled ctx: %v", err)
	stopCtx, cancelStop := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelStop()
	err = c.Stop(stopCtx)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "Stop hung")
}
