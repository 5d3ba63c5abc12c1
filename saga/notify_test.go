package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// TestWakeUpsReachIdleEnginesElsewhere: the workers of an engine that polls
// only once a minute are idle; another engine on the schema (a process that
// only starts sagas, say) starts one with Start, whose statement commits on
// its own and is announced after its commit, and then one with StartTx, whose
// notification goes with the caller's commit. Both sagas run to the end in
// seconds: the notifications reach the idle workers, and each step's batch
// announces the next.
func TestWakeUpsReachIdleEnginesElsewhere(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 2, PollInterval: time.Minute})
	def := threeSteps(b, "wakeups", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	client, err := saga.New(b.pool, &saga.Config{Schema: b.schema, PollInterval: time.Minute, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, client.Register(def))
	ctx := context.Background()
	time.Sleep(300 * time.Millisecond) // the workers have polled once and wait

	started := time.Now()
	st, err := saga.Start(ctx, client, def, order{OrderID: "o-wake-1"}, nil)
	require.NoError(t, err)
	// The saga started with Start completes without waiting for a poll.
	sagatest.Wait(t, b.engine, st.ID, sagatest.Status(saga.StatusCompleted), &sagatest.WaitOpts{Timeout: 10 * time.Second})
	t.Logf("Start: completed in %s", time.Since(started).Round(time.Millisecond))

	started = time.Now()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	st, err = saga.StartTx(ctx, client, tx, def, order{OrderID: "o-wake-2"}, nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	// The saga started with StartTx completes without waiting for a poll.
	sagatest.Wait(t, b.engine, st.ID, sagatest.Status(saga.StatusCompleted), &sagatest.WaitOpts{Timeout: 10 * time.Second})
	t.Logf("StartTx: completed in %s", time.Since(started).Round(time.Millisecond))
}

// TestKafkaModeStepsWakeTheRelay: in Kafka mode a step's next command is a
// relay row, and only the notification after the batch's commit tells a
// relay that polls once a minute to publish it. A 3-step saga ends in
// seconds.
func TestKafkaModeStepsWakeTheRelay(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, saga.CommandTopicDefault+".kwake"))
	b := setup(t, &saga.Config{Workers: 1, PollInterval: time.Minute, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true}})
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(b.pool, w, &relay.Config{Schema: b.schema, PollInterval: time.Minute, Logger: testLogger(t)})
	require.NoError(t, err)
	def := threeSteps(b, "kwake", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() {
		require.NoError(t, r.Stop(context.Background()))
		require.NoError(t, w.Close())
	})
	time.Sleep(300 * time.Millisecond) // the relay has polled once and waits
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "k-wake"}, nil)
	require.NoError(t, err)
	// Every step's command reaches the relay through the notification after
	// its commit.
	sagatest.Wait(t, b.engine, st.ID, sagatest.Status(saga.StatusCompleted), &sagatest.WaitOpts{Timeout: 20 * time.Second})
}
