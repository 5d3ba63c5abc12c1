package review14

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// The chained step is the saga's last: the saga ends in the wait's
// update. What a saga's end does must still happen there: its
// concurrency slot is released and the next queued saga admitted ("in the
// transaction that writes the saga's end").
func TestSagaEndingInTheWaitsUpdateReleasesItsSlot(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	def := chainDef(r, "slots", chainOpts{}).WithConcurrency(1)
	r.start(t, nil, def)
	ctx := context.Background()
	var ids []uuid.UUID
	for i := range 3 {
		st, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprint("o-", i)}, &saga.StartOpts{ConcurrencyKey: "k"})
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for i, id := range ids {
		r.waiting(t, id, "await")
		for _, later := range ids[i+1:] {
			in := r.get(t, later)
			require.NotNil(t, in.Concurrency, describe(in))
			require.True(t, in.Concurrency.Queued, "saga %d must wait for the slot while %d runs\n%s", later, i, describe(in))
		}
		r.signal(t, id, "go", "s", "p")
		in := r.ended(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	}
	for _, id := range ids {
		require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
	}
}

// A child saga that ends in its wait's update (signal -> last local step)
// wakes its parent, which goes on once ("every transition that ends a saga
// with a parent adds a wake-up for the parent").
func TestChildEndingInTheWaitsUpdateWakesItsParent(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	child := chainDef(r, "kidsig", chainOpts{})
	var dones tally
	parent := saga.Define("parentsig",
		saga.Step[ord]{Name: "kid", Wait: saga.Child(child,
			func(_ context.Context, _ *saga.StepRun, o *ord) (ord, *saga.StartOpts, error) {
				return ord{ID: "kid-of-" + o.ID}, nil, nil
			},
			func(ctx context.Context, run *saga.StepRun, o *ord, k ord) error {
				dones.add(o.ID)
				o.Got = k.Got
				return r.fx.Record(ctx, run, "done")
			})},
		saga.Step[ord]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			return r.fx.Record(ctx, run, "after:"+o.Got)
		}},
	)
	r.start(t, nil, parent, child)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, parent, ord{ID: "p"}, nil)
	require.NoError(t, err)
	in := r.waiting(t, st.ID, "kid")
	require.Equal(t, "child", in.Wait.Kind)
	childID, err := uuid.Parse(in.Wait.For)
	require.NoError(t, err)
	r.waiting(t, childID, "await")
	r.signal(t, childID, "go", "s", "from-signal")
	ch := r.ended(t, childID)
	require.Equal(t, saga.StatusCompleted, ch.Status, describe(ch))
	in = sagatest.WaitEnded(t, r.engine, st.ID, &sagatest.WaitOpts{Timeout: 10 * time.Second})
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"done", "after:from-signal"}, r.fx.List(t, st.ID))
	require.Equal(t, 1, dones.get("p"))
	require.Equal(t, 1, count(in, "child_ended:kid"), describe(in))
}

// The chained step changes the state and fails; on its retry it sees the
// state the wait's handler left, without its own failed change. A payload
// that does not decode fails the wait for good (signal_payload) and the
// step after it never runs.
func TestChainedStepStateAndUndecodablePayload(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var seen tally
	def := chainDef(r, "statechg", chainOpts{actRetry: noBackoff(3), awaitRetry: noBackoff(3),
		act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			seen.note(o.ID, o.Note+"|"+o.Got)
			if seen.add(o.ID) == 1 {
				o.Note = "dirty"
				o.Got = "dirty"
				return fmt.Errorf("fails after changing the state")
			}
			return r.fx.Record(ctx, run, "act")
		}})
	r.start(t, nil, def)
	ctx := context.Background()
	ok := r.startAt(t, def, "ok", "await")
	bad := r.startAt(t, def, "bad", "await")
	r.signal(t, ok, "go", "s", "payload")
	_, err := r.engine.Signal(ctx, saga.Signal{SagaID: bad, Name: "go", ID: "s", Payload: json.RawMessage(`{"not":"a string"}`)})
	require.NoError(t, err)

	in := r.ended(t, ok)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"|payload", "|payload"}, seen.notes("ok"))
	var st ord
	require.NoError(t, in.DecodeState(&st))
	require.Equal(t, ord{ID: "ok", Got: "payload"}, st)

	in = r.ended(t, bad)
	require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
	require.Equal(t, saga.CodeSignalPayload, in.LastError.Code, describe(in))
	require.Equal(t, "await", in.LastError.Step)
	require.Zero(t, seen.get("bad"))
	require.Equal(t, []string{"prep", "unprep"}, r.fx.List(t, bad))
	s := r.signals(t, bad)
	require.Len(t, s, 1)
	require.NotEqual(t, "delivered", s[0].Status, "%+v", s[0])
}

// A saga deadline passes while the step chained after its signal runs
// (honouring ctx): the rescuer's cancel interrupts the step, which is
// rolled back alone; the wait's end stays and is compensated, with code
// saga_deadline, and no later step runs.
func TestDeadlineDuringTheChainedStep(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var calls tally
	def := chainDef(r, "deadline", chainOpts{actTimeout: 20 * time.Second,
		act: func(ctx context.Context, run *saga.StepRun, _ *ord) error {
			calls.add("act")
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Second):
			}
			return r.fx.Record(ctx, run, "act")
		},
		tail: []saga.Step[ord]{{Name: "final", Action: rec(r, "final")}},
	})
	r.start(t, func(c *saga.Config) { c.RescueInterval = time.Second }, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "o-1"}, &saga.StartOpts{Deadline: 1500 * time.Millisecond})
	require.NoError(t, err)
	r.waiting(t, st.ID, "await")
	r.signal(t, st.ID, "go", "s", "p")
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
	require.Equal(t, saga.CodeDeadline, in.LastError.Code, describe(in))
	require.Equal(t, []string{"prep", "onsig", "unawait", "unprep"}, r.fx.List(t, st.ID), describe(in))
	require.Equal(t, 1, calls.get("act"))
	requireDelivered(t, r, st.ID, "await")
}
