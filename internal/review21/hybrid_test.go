package review21

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// The hybrid mode's reply batch with notifications lost. Sagas
//
//	pick (unpick) -> pay (remote, refund; OnReply counted) -> ship (unship) -> done
//
// wait for pay's reply while no engine runs, and the replies pile up on
// the reply topic. The next engine reads them several to a transaction;
// the first OnReply of the second batch (the head) is held while cancel
// request rows and pause rows are written, with no notification, for
// sagas whose reply has not been applied yet. ship runs at once after a
// reply, but "A saga that is paused (also by a pause that committed while
// the reply was applied), or asked to cancel, takes the usual way instead:
// the next step's command waits" (saga/doc.go); guarantee 10: no step
// after the request runs. ship is never called for those sagas (until
// Resume, for the paused); the cancelled compensate (unpick, refund), the
// others complete once.
func TestHybridReplyBatchWithLostNotifications(t *testing.T) {
	t.Parallel()
	const name = "r21hy"
	h := testkit.NewHybrid(t, name, "", nil)
	r := newRig(t, h.Orders, name, "-", nil)
	payGate := testkit.NewGate()
	t.Cleanup(payGate.Open)
	for _, kind := range []string{"pay", "refund"} {
		require.NoError(t, participant.Handle(h.Participant, name+"."+kind, func(ctx context.Context, tx pgx.Tx, c participant.Call[ord]) (map[string]string, error) {
			if kind == "pay" {
				if err := payGate.Pass(ctx); err != nil {
					return nil, err
				}
			}
			return map[string]string{"ref": kind}, h.Record(ctx, tx, c.SagaID, kind, c.Command.ID, 0, c.Key.String())
		}))
	}
	h.Serve(t)
	gate1, gate2 := testkit.NewGate(), testkit.NewGate()
	t.Cleanup(gate1.Open)
	t.Cleanup(gate2.Open)
	var replies atomic.Int32
	rec := func(n string) func(ctx context.Context, run *saga.StepRun, _ *ord) error {
		return func(ctx context.Context, run *saga.StepRun, _ *ord) error {
			r.count(run.SagaID, n, "")
			return r.fx.Record(ctx, run, n)
		}
	}
	def := saga.Define(name,
		saga.Step[ord]{Name: "pick", Action: rec("pick"), Compensate: rec("unpick")},
		saga.Step[ord]{Name: "pay", Timeout: 2 * time.Minute, Remote: &saga.Remote[ord]{Topic: h.Topic, Type: name + ".pay", CompensateType: name + ".refund",
			Command: func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) { return ord{ID: o.ID}, nil },
			OnReply: func(ctx context.Context, run *saga.StepRun, _ *ord, _ json.RawMessage) error {
				r.count(run.SagaID, "paid", "")
				switch replies.Add(1) {
				case 1:
					if err := gate1.Pass(ctx); err != nil {
						return err
					}
				case 2:
					id := run.SagaID
					r.head.Store(&id)
					if err := gate2.Pass(ctx); err != nil {
						return err
					}
				}
				return r.fx.Record(ctx, run, "paid")
			}}},
		saga.Step[ord]{Name: "ship", Action: rec("ship"), Compensate: rec("unship"), Timeout: 2 * time.Minute},
		saga.Step[ord]{Name: "done", Action: rec("done")},
	)
	cfg := func() *saga.Config {
		c := h.Config()
		c.PollInterval, c.RescueInterval, c.BatchSize = time.Minute, time.Hour, 16
		c.Kafka.SessionTimeout = 6 * time.Second
		c.Kafka.ReplyStepLimit = -1
		return c
	}
	e1, stop1 := testkit.StartEngine(t, h.Orders.Pool, cfg(), def)
	const n = 10
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(context.Background(), e1, def, ord{ID: fmt.Sprint(i)}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	testkit.WaitFor(t, within, "every saga waiting for pay's reply", func() bool {
		for _, id := range ids {
			if in := get(t, e1, id); in.Step != "pay" || in.Status != saga.StatusRunning {
				return false
			}
		}
		return payGate.Entered() >= 1
	})
	stop1()
	payGate.Open()
	testkit.WaitFor(t, within, "every reply published", func() bool {
		return h.Part.Count(t, "SELECT count(*) FROM "+h.Part.Table("outbox")+" WHERE type = 'sagaflow.reply' AND status = 'published'") == n
	})
	e2, _ := testkit.StartEngine(t, h.Orders.Pool, cfg(), def)
	testkit.WaitFor(t, within, "the first OnReply at its gate", func() bool { return gate1.Entered() == 1 })
	time.Sleep(300 * time.Millisecond) // the reader has the backlog ready
	gate1.Open()
	testkit.WaitFor(t, within, "the next batch's first OnReply at its gate", func() bool { return gate2.Entered() == 1 })
	head := *r.head.Load()
	var later []uuid.UUID
	for _, id := range ids {
		if id != head && r.callsOf(id, "paid") == 0 {
			later = append(later, id)
		}
	}
	t.Logf("%d sagas' replies not yet applied at the head's", len(later))
	require.GreaterOrEqual(t, len(later), 4, "too few replies behind the head")
	cancelled, paused := later[:2], later[2:4]
	for _, id := range cancelled {
		r.sqlCancel(t, id, "review21: unheard of")
	}
	for _, id := range paused {
		r.sqlPause(t, &id, "review21: unheard of")
	}
	time.Sleep(aged)
	require.Zero(t, gate2.Left())
	gate2.Open()

	for _, id := range ids {
		if contains(cancelled, id) || contains(paused, id) {
			continue
		}
		in := sagatest.WaitEnded(t, e2, id, &sagatest.WaitOpts{Timeout: within})
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, testkit.Timeline(in))
		require.Equal(t, map[string]int{"pick": 1, "paid": 1, "ship": 1, "done": 1}, r.fx.Counts(t, id), "%s: %v", id, testkit.Timeline(in))
	}
	for _, id := range cancelled {
		in := sagatest.WaitEnded(t, e2, id, &sagatest.WaitOpts{Timeout: within})
		tl := testkit.Timeline(in)
		require.Zero(t, r.callsOf(id, "ship"), "%s: ship's handler was called after the cancel committed (%v)", id, tl)
		require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v", id, tl)
		c := r.fx.Counts(t, id)
		require.Equal(t, 1, c["unpick"], "%s: %v %v", id, c, tl)
		require.Equal(t, []string{"pay", "refund"}, h.Calls(t, id), "%s: %v", id, tl)
	}
	for _, id := range paused {
		testkit.Hold(t, 300*time.Millisecond, "the paused saga runs no step after its reply", func() bool {
			return get(t, e2, id).Paused != nil && r.callsOf(id, "ship") == 0
		})
		require.NoError(t, r.ops.Resume(context.Background(), id, "review21: go on"))
	}
	for _, id := range paused {
		in := sagatest.WaitEnded(t, e2, id, &sagatest.WaitOpts{Timeout: within})
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, testkit.Timeline(in))
		require.Equal(t, map[string]int{"pick": 1, "paid": 1, "ship": 1, "done": 1}, r.fx.Counts(t, id), "%s: %v", id, testkit.Timeline(in))
		require.Equal(t, 1, r.callsOf(id, "ship"))
	}
	t.Logf("engine 2: %+v", e2.Stats())
}
