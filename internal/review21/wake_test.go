package review21

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// Wake-ups later in a held batch. Sagas "r21sig" (z, compensation z-undo,
// then a wait for the signal "go", then d) wait at their signal; with the
// engine stopped, a saga of the gated type starts and every waiting saga is
// signalled, so the next engine's first batch is the gated step a at its
// head and the signals' wake-ups after it. A wake-up ends the wait and runs
// the next local step at once ("Sagas that wait"): a saga "asked to
// cancel, takes the usual way: the step's command waits". Cancel rows and
// pause rows are written with no notification while the head is held: no
// OnSignal handler nor step d of those sagas is called; the cancelled end
// compensated (z undone once), the paused complete once after Resume, the
// others complete once.
func TestWakeUpsLaterInAHeldBatch(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21head", "a", nil)
	rec := func(n string) func(ctx context.Context, run *saga.StepRun, _ *ord) error {
		return func(ctx context.Context, run *saga.StepRun, _ *ord) error {
			var tx string
			if err := run.Tx.QueryRow(ctx, "SELECT pg_current_xact_id()::text").Scan(&tx); err != nil {
				return err
			}
			r.count(run.SagaID, n, tx)
			return r.fx.Record(ctx, run, n)
		}
	}
	sig := saga.Define("r21sig",
		saga.Step[ord]{Name: "z", Action: rec("z"), Compensate: rec("z-undo")},
		saga.Step[ord]{Name: "w", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, o *ord, _ json.RawMessage) error {
			return rec("go")(ctx, run, o)
		})},
		saga.Step[ord]{Name: "d", Action: rec("d")},
	)
	require.NoError(t, r.client.Register(sig))
	ctx := context.Background()
	ys := make([]uuid.UUID, 10)
	for i := range ys {
		st, err := saga.Start(ctx, r.client, sig, ord{ID: "y"}, nil)
		require.NoError(t, err)
		ys[i] = st.ID
	}
	e1, stop1 := testkit.StartEngine(t, r.db.Pool, r.config(), r.def, sig)
	for _, id := range ys {
		sagatest.Wait(t, e1, id, sagatest.Cond("the signal wait", func(in *saga.Instance) bool { return in.Wait != nil }), &sagatest.WaitOpts{Timeout: within})
	}
	stop1()

	heads := r.startN(t, 1, nil)
	for _, id := range ys {
		_, err := r.ops.Signal(ctx, saga.Signal{SagaID: id, Name: "go", ID: "go-" + id.String()})
		require.NoError(t, err)
	}
	e, _ := testkit.StartEngine(t, r.db.Pool, r.config(), r.def, sig)
	t.Cleanup(r.gate.Open)
	testkit.WaitFor(t, within, "the head at the gate", func() bool { return r.gate.Entered() == 1 })
	require.Equal(t, heads[0], *r.head.Load())
	var later []uuid.UUID
	for _, id := range ys {
		if r.callsOf(id, "go") == 0 {
			later = append(later, id)
		}
	}
	t.Logf("%d of %d wake-ups not yet run at the head's turn", len(later), len(ys))
	require.GreaterOrEqual(t, len(later), 8, "the wake-ups ran ahead of the head: not the batch the test meant")
	cancelled, paused := later[:3], later[3:6]
	for _, id := range cancelled {
		r.sqlCancel(t, id, "review21: lost notification")
	}
	for _, id := range paused {
		r.sqlPause(t, &id, "review21: lost notification")
	}
	r.openAged(t)

	r.completedOnce(t, e, heads[0])
	done := func(id uuid.UUID) {
		t.Helper()
		in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: within})
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, testkit.Timeline(in))
		require.Equal(t, map[string]int{"z": 1, "go": 1, "d": 1}, r.fx.Counts(t, id), "%s: %v", id, testkit.Timeline(in))
		require.Equal(t, 1, r.callsOf(id, "d"), "%s", id)
	}
	for _, id := range ys {
		if contains(cancelled, id) || contains(paused, id) {
			continue
		}
		done(id)
	}
	shared := 0
	for _, id := range later[6:] {
		if r.sameTx(id, "go") {
			shared++
		}
	}
	require.NotZero(t, shared, "no untouched wake-up ran in the head's transaction: the batch was not what the test meant")
	for _, id := range cancelled {
		in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: within})
		require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v", id, testkit.Timeline(in))
		require.Zero(t, r.callsOf(id, "go")+r.callsOf(id, "d"), "%s: a handler ran after the cancel (%v)", id, testkit.Timeline(in))
		require.Equal(t, map[string]int{"z": 1, "z-undo": 1}, r.fx.Counts(t, id), "%s: %v", id, testkit.Timeline(in))
	}
	for _, id := range paused {
		testkit.Hold(t, 300*time.Millisecond, "the paused saga starts nothing", func() bool {
			in := get(t, e, id)
			return in.Paused != nil && r.callsOf(id, "go")+r.callsOf(id, "d") == 0
		})
		require.NoError(t, r.ops.Resume(ctx, id, "review21: go on"))
	}
	for _, id := range paused {
		done(id)
	}
}

func contains(ids []uuid.UUID, id uuid.UUID) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// The step run at once after a wait's end, when the wait's handler is
// slow. Three sagas wait for "go" (z, the wait, d) and are signalled with
// no engine running; the next engine's batch holds their wake-ups, and the
// first OnSignal handler called (the head) is held. While it is held, a
// cancel request row, or a pause row, is written for the head's saga with
// no notification, and kept unheard of for 300 ms. "Sagas that wait": a
// saga "paused meanwhile, or asked to cancel, takes the usual way: the
// step's command waits"; guarantee 10: a request "goes ahead of the
// saga's next command, whatever that is, so no step after it runs", and a
// batch that read the saga more than 100 ms before reads its requests and
// pauses again, "so a late notification does not let the step start".
// Step d of the head's saga must not be called (until Resume, for the
// pause); the other two complete once.
func TestStepAfterASlowWaitEnd(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"cancel", "pause"} {
		t.Run(op, func(t *testing.T) { stepAfterASlowWaitEnd(t, op) })
	}
}

func stepAfterASlowWaitEnd(t *testing.T, op string) {
	t.Parallel()
	r := newRig(t, nil, "r21slowwait"+op, "-", nil)
	rec := func(n string) func(ctx context.Context, run *saga.StepRun, _ *ord) error {
		return func(ctx context.Context, run *saga.StepRun, _ *ord) error {
			r.count(run.SagaID, n, "")
			return r.fx.Record(ctx, run, n)
		}
	}
	name := "r21sw" + op
	sig := saga.Define(name,
		saga.Step[ord]{Name: "z", Action: rec("z"), Compensate: rec("z-undo")},
		saga.Step[ord]{Name: "w", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, o *ord, _ json.RawMessage) error {
			r.count(run.SagaID, "go", "")
			id := run.SagaID
			if r.head.CompareAndSwap(nil, &id) {
				if err := r.gate.Pass(ctx); err != nil {
					return err
				}
			}
			return r.fx.Record(ctx, run, "go")
		}), Timeout: 2 * time.Minute},
		saga.Step[ord]{Name: "d", Action: rec("d"), Timeout: 2 * time.Minute},
	)
	r.name = name // sqlPause's saga_name
	require.NoError(t, r.client.Register(sig))
	ctx := context.Background()
	ys := make([]uuid.UUID, 3)
	for i := range ys {
		st, err := saga.Start(ctx, r.client, sig, ord{ID: "y"}, nil)
		require.NoError(t, err)
		ys[i] = st.ID
	}
	e1, stop1 := testkit.StartEngine(t, r.db.Pool, r.config(), sig)
	for _, id := range ys {
		sagatest.Wait(t, e1, id, sagatest.Cond("the signal wait", func(in *saga.Instance) bool { return in.Wait != nil }), &sagatest.WaitOpts{Timeout: within})
	}
	stop1()
	for _, id := range ys {
		_, err := r.ops.Signal(ctx, saga.Signal{SagaID: id, Name: "go", ID: "go-" + id.String()})
		require.NoError(t, err)
	}
	e, _ := testkit.StartEngine(t, r.db.Pool, r.config(), sig)
	t.Cleanup(r.gate.Open)
	testkit.WaitFor(t, within, "the head's wait handler at the gate", func() bool { return r.gate.Entered() == 1 })
	head := *r.head.Load()
	if op == "cancel" {
		r.sqlCancel(t, head, "review21: unheard of")
	} else {
		r.sqlPause(t, &head, "review21: unheard of")
	}
	r.openAged(t)

	for _, id := range ys {
		if id == head {
			continue
		}
		in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: within})
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, testkit.Timeline(in))
		require.Equal(t, map[string]int{"z": 1, "go": 1, "d": 1}, r.fx.Counts(t, id))
	}
	if op == "cancel" {
		in := sagatest.WaitEnded(t, e, head, &sagatest.WaitOpts{Timeout: within})
		tl := testkit.Timeline(in)
		require.Zero(t, r.callsOf(head, "d"), "step d's handler was called after the cancel committed, unheard of, >100 ms after the batch read the saga (%v)", tl)
		require.Equal(t, saga.StatusCompensated, in.Status, "%v", tl)
		require.Equal(t, 1, r.fx.Count(t, head, "z-undo"), "%v", tl)
		return
	}
	testkit.Hold(t, 500*time.Millisecond, "the paused saga starts no step", func() bool {
		return get(t, e, head).Paused != nil && r.callsOf(head, "d") == 0
	})
	require.Zero(t, r.callsOf(head, "d"), "step d's handler was called after the pause committed")
	require.NoError(t, r.ops.Resume(ctx, head, "review21: go on"))
	in := sagatest.WaitEnded(t, e, head, &sagatest.WaitOpts{Timeout: within})
	require.Equal(t, saga.StatusCompleted, in.Status, "%v", testkit.Timeline(in))
	require.Equal(t, map[string]int{"z": 1, "go": 1, "d": 1}, r.fx.Counts(t, head))
}
