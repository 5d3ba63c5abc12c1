package review21

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/saga"
)

// Kafka mode (KafkaConfig.AllSteps), one partition, one worker, BatchSize
// 16: a backlog of twelve sagas' step a messages, whose first is held. The
// batch's sagas "are read and locked together before the first runs", so
// every later saga was read long before its turn. Meanwhile cancel request
// rows and pause rows are written with no notification, and an operator
// tool asks two more to cancel (RequestCancel, notified). Guarantee 10 and
// "Pause": no handler of those is called; the cancelled end compensated,
// the paused complete once after Resume; the rest complete once.
func TestKafkaModeBatchMatesWithLostNotifications(t *testing.T) {
	t.Parallel()
	const name = "r21kafka"
	topic := saga.CommandTopicDefault + "." + name
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic, topic+".replies"))
	r := newRig(t, nil, name, "a", kc)
	ids := r.startN(t, 12, nil)
	e, head, m := r.run(t, ids)
	quiet, paused, asked, untouched := m[:3], m[3:6], m[6:8], m[8:]
	for _, id := range quiet {
		r.sqlCancel(t, id, "review21: lost notification")
	}
	for _, id := range paused {
		r.sqlPause(t, &id, "review21: lost notification")
	}
	for _, id := range asked {
		require.NoError(t, r.act(t, r.ops, id, "request", "review21: tool request"))
	}
	r.openAged(t)

	for _, id := range append([]uuid.UUID{head}, untouched...) {
		r.completedOnce(t, e, id)
	}
	for _, id := range append(append([]uuid.UUID{}, quiet...), asked...) {
		r.cancelledClean(t, e, id)
		require.Zero(t, r.callsOf(id, "a"), "%s: step a's handler was called", id)
		require.Empty(t, r.fx.Counts(t, id))
	}
	for _, id := range paused {
		r.heldPaused(t, e, id, 300*time.Millisecond)
		require.Zero(t, r.callsOf(id, "a"), "%s: step a's handler was called", id)
		require.NoError(t, r.ops.Resume(context.Background(), id, "review21: go on"))
	}
	for _, id := range paused {
		r.completedOnce(t, e, id)
	}
	st := e.Stats()
	t.Logf("batched %d, reruns %d, cancels %d", st.BusBatched, st.BusBatchesRerun, st.CancelsApplied)
	require.NotZero(t, st.BusBatched, "no message ran batched: the test did not make a batch")
	page, err := r.ops.DeadLetters(context.Background(), &saga.DeadOpts{Topic: topic})
	require.NoError(t, err)
	require.Empty(t, page.Letters)
}
