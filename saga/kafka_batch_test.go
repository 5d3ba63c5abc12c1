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
)

// A backlog on a Kafka-mode topic is run several messages to a transaction:
// every saga completes with each effect once, a copy of a command in the
// same batch as the original has no second effect, and a poison message in
// a batch sends that batch the one-at-a-time way, where it is dead-lettered
// and the others run.
func TestKafkaModeRunsABacklogInBatches(t *testing.T) {
	t.Parallel()
	const name = "kbatch"
	topic := saga.CommandTopicDefault + "." + name
	k := setupKafkaWith(t, 1, &saga.Config{Workers: 1}, topic)
	def := threeSteps(k.bundle, name, nil)
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()

	// The backlog: the first commands of 40 sagas, published by the relay
	// before any engine consumes them.
	var ids []uuid.UUID
	for range 40 {
		st, err := saga.Start(ctx, k.engine, def, order{OrderID: "b"}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	var first []kgo.RecordHeader
	var firstValue []byte
	waitFor(t, 15*time.Second, func() bool {
		msgs, err := k.kc.ReadAll(ctx, topic)
		require.NoError(t, err)
		if len(msgs) > 0 && first == nil {
			for _, h := range msgs[0].Headers {
				first = append(first, kgo.RecordHeader{Key: h.Key, Value: h.Value})
			}
			firstValue = msgs[0].Value
		}
		return len(msgs) == len(ids)
	}, "the backlog on the topic")
	cl := rawProducer(t, k.kc)
	// A copy of the first command, and a poison command, among the backlog.
	produce(t, cl, &kgo.Record{Topic: topic, Partition: 0, Key: []byte(ids[0].String()), Value: firstValue, Headers: first})
	poison := commandRecord(topic, ids[1], name, "reserve", 1)
	poison.Value = []byte("{not json")
	poisonOffset := produce(t, cl, poison)

	k.start(t)
	for _, id := range ids {
		in := k.waitTerminal(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
		require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, id), "saga %s", id)
	}
	waitFor(t, 15*time.Second, func() bool {
		_, _, _, _, ok := k.deadLetterAt(t, topic, poisonOffset)
		return ok
	}, "the poison command to be dead-lettered")
	st := k.engine.Stats()
	require.Positive(t, st.BusBatched, "some messages ran several to a transaction")
	require.Zero(t, k.count(t, "SELECT count(*) FROM "+k.table("dead_letters")+" WHERE kafka_offset <> $1 AND consumer = $2",
		poisonOffset, store.InboxConsumerEngine), "nothing else was dead-lettered")
	t.Logf("batched %d messages; stale %d", st.BusBatched, st.StaleDiscarded)
}
