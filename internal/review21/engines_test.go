package review21

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Two engines share the work. Engine A's one worker holds a batch of step
// b commands (its head held); engine B, started after, knows the saga and
// runs too. B cancels three sagas later in A's batch, pauses one; a cancel
// row and a pause row are written for two more with no notification. The
// guarantees hold "for any number of engines sharing one database": none
// of those sagas' step b handler is called, the cancelled end compensated
// (each completed step undone once, whichever engine compensates), the
// paused complete once after Resume, the rest complete once.
func TestSecondEngineStopsSagasInFirstEnginesBatch(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21two", "b", nil)
	ids := r.startN(t, 12, nil)
	ea, head, m := r.run(t, ids)
	cfg := r.config()
	cfg.Workers, cfg.BatchSize = 2, 4
	eb, _ := testkit.StartEngine(t, r.db.Pool, cfg, r.def)
	for _, id := range m[:3] {
		require.NoError(t, r.act(t, eb, id, "cancel", "review21: engine B"))
	}
	require.NoError(t, r.act(t, eb, m[3], "pause", "review21: engine B"))
	r.sqlCancel(t, m[4], "review21: unheard of")
	r.sqlPause(t, &m[5], "review21: unheard of")
	r.openAged(t)

	for _, id := range append([]uuid.UUID{head}, m[6:]...) {
		r.completedOnce(t, ea, id)
	}
	r.sharedWithHead(t, m[6:])
	for _, id := range append(append([]uuid.UUID{}, m[:3]...), m[4]) {
		r.cancelledClean(t, ea, id)
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called", id)
		require.Equal(t, map[string]int{"a": 1, "a-undo": 1}, r.fx.Counts(t, id))
	}
	for _, id := range []uuid.UUID{m[3], m[5]} {
		r.heldPaused(t, ea, id, 300*time.Millisecond)
		require.NoError(t, r.ops.Resume(context.Background(), id, "review21: go on"))
	}
	for _, id := range []uuid.UUID{m[3], m[5]} {
		r.completedOnce(t, eb, id)
	}
}

// The worst user: the head's own step cancels two sagas later in its batch
// through its transaction (CancelTx on a client engine that knows the saga,
// RequestCancelTx on the operator tool). CancelTx: "The request counts
// from when tx commits: steps that run before then are not affected, and a
// saga that ends before then has the request refused"; guarantee 2 and 3:
// the head's step commits once, each effect once. Whatever the batch makes
// of requests written in its own transaction, the two sagas end
// compensated, cancelled once, with each completed step undone once and
// step c never run; everyone else completes once.
func TestHeadStepCancelsItsBatchMatesInItsTransaction(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21self", "b", nil)
	ids := r.startN(t, 8, nil)
	var targets []uuid.UUID
	hook := func(ctx context.Context, run *saga.StepRun) error {
		if err := r.client.CancelTx(ctx, run.Tx, targets[0], "review21: from the head's step"); err != nil {
			return err
		}
		return r.ops.RequestCancelTx(ctx, run.Tx, targets[1], "review21: from the head's step")
	}
	// The head is whichever saga's b runs first; its hook cancels the
	// last two of the others, set before the gate opens.
	r.onHead.Store(&hook)
	e, head, m := r.run(t, ids)
	targets = m[len(m)-2:]
	r.gate.Open()

	r.completedOnce(t, e, head)
	for _, id := range m[:len(m)-2] {
		r.completedOnce(t, e, id)
	}
	for _, id := range targets {
		in := testkit.WaitEnded(t, e, id)
		tl := testkit.Timeline(in)
		require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v", id, tl)
		require.Equal(t, 1, countType(in, "saga_cancelled"), "%s: %v", id, tl)
		c := r.fx.Counts(t, id)
		require.Equal(t, 1, c["a"], "%s: %v %v", id, c, tl)
		require.Equal(t, 1, c["a-undo"], "%s: %v %v", id, c, tl)
		require.Equal(t, c["b"], c["b-undo"], "%s: %v %v", id, c, tl)
		require.Zero(t, c["c"], "%s: %v %v", id, c, tl)
		require.LessOrEqual(t, r.callsOf(id, "b"), 1, "%s: %v", id, tl)
		t.Logf("%s: b called %d times: %v", id, r.callsOf(id, "b"), tl)
	}
	require.Equal(t, 1, r.callsOf(head, "b"), "the head's step ran once")
	t.Logf("stats %+v", e.Stats())
}

// A cancel request row and a pause row written, with no notification,
// before any engine claims the sagas' first commands: the batch reads its
// sagas after the rows committed. Guarantee 10: the request "goes ahead of
// the saga's next command, whatever that is"; "Pause": "an engine that
// claims one (a command that escaped the hold by racing the pause ...)
// writes it back held instead of running it". No handler of those sagas
// is called; the others complete once.
func TestQuietRowsBeforeTheClaim(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"postgres", "kafka"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			name := "r21before" + mode
			var kc *kafkatest.Cluster
			if mode == "kafka" {
				topic := saga.CommandTopicDefault + "." + name
				kc = kafkatest.New(t, kafkatest.SeedTopics(1, topic, topic+".replies"))
			}
			r := newRig(t, nil, name, "-", kc)
			ids := r.startN(t, 12, nil)
			var plain, cancelled, paused []uuid.UUID
			for i, id := range ids {
				switch i % 3 {
				case 0:
					plain = append(plain, id)
				case 1:
					cancelled = append(cancelled, id)
				default:
					paused = append(paused, id)
				}
			}
			for _, id := range cancelled {
				r.sqlCancel(t, id, "review21: before the claim")
			}
			for _, id := range paused {
				r.sqlPause(t, &id, "review21: before the claim")
			}
			e, _ := testkit.StartEngine(t, r.db.Pool, r.config(), r.def)
			for _, id := range plain {
				r.completedOnce(t, e, id)
			}
			for _, id := range cancelled {
				r.cancelledClean(t, e, id)
				require.Zero(t, r.callsOf(id, "a"), "%s: step a's handler was called", id)
			}
			for _, id := range paused {
				r.heldPaused(t, e, id, 300*time.Millisecond)
				require.NoError(t, r.ops.Resume(context.Background(), id, "review21: go on"))
			}
			for _, id := range paused {
				r.completedOnce(t, e, id)
			}
		})
	}
}
