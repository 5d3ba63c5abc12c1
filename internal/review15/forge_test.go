package review15

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// forge copies the reply row of saga a's step key fromKey in the
// participant's outbox under a new id and message id, with a's saga id
// replaced by b's in the columns and headers named by what ("all": saga
// id, aggregate id, both headers and the step key; "saga": all but the
// step key, which still names a's step). The relay publishes it.
func (r *rig) forge(t *testing.T, a, b uuid.UUID, fromKey, what string) uuid.UUID {
	t.Helper()
	id := uuid.New()
	stepKey := "step_key"
	hdrKey := "headers->>'sagaflow-step-key'"
	if what == "all" {
		stepKey = "replace(step_key, $1, $2)"
		hdrKey = "replace(headers->>'sagaflow-step-key', $1, $2)"
	}
	tag, err := r.part.Pool.Exec(context.Background(), `INSERT INTO `+r.part.Table("outbox")+`
		(id, topic, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key)
		SELECT $4::uuid, topic, aggregatetype, $2, type, payload,
			headers || jsonb_build_object('sagaflow-saga-id', $2::text, 'sagaflow-message-id', $4::text,
				'sagaflow-step-key', `+hdrKey+`),
			$2::uuid, `+stepKey+`
		FROM `+r.part.Table("outbox")+` WHERE step_key = $3 AND saga_id = $1::uuid`,
		a.String(), b.String(), fromKey, id)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected())
	return id
}

// Replies that name saga B, made from saga A's (completed) replies, reach
// the engine while B waits for pay (the participant holds B's pay):
// "early": A's bill reply with every trace of A replaced by B: a bill reply
// for B arriving before B's pay reply; "mixed": A's pay reply with B's saga
// id but A's step key. Neither may move B (no reply_received, no bill sent,
// still running) nor touch A; when pay is let go, B completes with its own
// pay and bill, each once.
func TestForgedRepliesForAnotherSagaOrALaterStep(t *testing.T) {
	t.Parallel()
	for _, what := range []string{"early", "mixed"} {
		t.Run(what, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "forge"+what, nil)
			def := r.def(1)
			r.start(t, nil, def)
			ctx := context.Background()
			a, err := saga.Start(ctx, r.engine, def, ord{ID: "a"}, nil)
			require.NoError(t, err)
			inA := r.ended(t, a.ID)
			require.Equal(t, saga.StatusCompleted, inA.Status)

			gate := testkit.NewGate()
			r.payGate.Store(gate)
			b, err := saga.Start(ctx, r.engine, def, ord{ID: "b"}, nil)
			require.NoError(t, err)
			testkit.WaitFor(t, wait, "B's pay at the participant", func() bool { return gate.Entered() == 1 })
			var forged uuid.UUID
			if what == "early" {
				forged = r.forge(t, a.ID, b.ID, r.stepKey(t, a.ID, "bill"), "all")
			} else {
				forged = r.forge(t, a.ID, b.ID, r.stepKey(t, a.ID, "pay"), "saga")
			}
			testkit.WaitFor(t, wait, "the forged reply published", func() bool {
				return r.part.Count(t, "SELECT count(*) FROM "+r.part.Table("outbox")+
					" WHERE id = '"+forged.String()+"' AND status = 'published'") == 1
			})
			testkit.Hold(t, 1500*time.Millisecond, "B does not move on a forged reply", func() bool {
				in := r.get(t, b.ID)
				for _, e := range in.History {
					if e.Type == "reply_received" || e.Type == "step_completed" && e.Step != "pick" {
						return false
					}
				}
				return in.Status == saga.StatusRunning && r.sent(t, b.ID, "bill") == 0
			})
			gate.Open()
			inB := r.ended(t, b.ID)
			require.Equal(t, saga.StatusCompleted, inB.Status, "%v %+v", timeline(inB), inB.LastError)
			require.Equal(t, []string{"pay", "bill"}, r.calls(t, b.ID))
			require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, b.ID))
			require.Equal(t, 1, r.sent(t, b.ID, "bill"))
			require.Len(t, r.get(t, a.ID).History, len(inA.History), "A untouched")
			require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, a.ID))
		})
	}
}
