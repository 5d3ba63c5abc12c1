package review14

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// twoAwaitsDef: prep -> await1 (OnSignal "go", records "onsig1:<payload>")
// -> act (held by actGate when set) -> await2 (OnSignal "go", records
// "onsig2:<payload>") -> act2.
func twoAwaitsDef(r *rig, name string, actGate *testkit.Gate) *saga.Definition[ord] {
	return twoAwaitsDefGated(r, name, nil, actGate)
}

// twoAwaitsDefGated is twoAwaitsDef with await1's handler held by
// handlerGate too, when set.
func twoAwaitsDefGated(r *rig, name string, handlerGate, actGate *testkit.Gate) *saga.Definition[ord] {
	on := func(tag string) *saga.Wait[ord] {
		return saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, _ *ord, p string) error {
			if tag == "onsig1" && handlerGate != nil {
				if err := handlerGate.Pass(ctx); err != nil {
					return err
				}
			}
			return r.fx.Record(ctx, run, tag+":"+p)
		})
	}
	return saga.Define(name,
		saga.Step[ord]{Name: "prep", Action: rec(r, "prep")},
		saga.Step[ord]{Name: "await1", Wait: on("onsig1")},
		saga.Step[ord]{Name: "act", Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			if actGate != nil {
				if err := actGate.Pass(ctx); err != nil {
					return err
				}
			}
			return r.fx.Record(ctx, run, "act")
		}},
		saga.Step[ord]{Name: "await2", Wait: on("onsig2")},
		saga.Step[ord]{Name: "act2", Action: rec(r, "act2")},
	)
}

// A second signal with the same ID is recorded once and delivered once:
// it does not end the second wait of the same name.
func TestDuplicateSignalEndsOneWait(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	def := twoAwaitsDef(r, "dupsig", nil)
	r.start(t, nil, def)
	id := r.startAt(t, def, "o-1", "await1")
	first := r.signal(t, id, "go", "A", "A")
	again := r.signal(t, id, "go", "A", "A-again")
	require.False(t, first.Duplicate)
	require.True(t, again.Duplicate)
	r.waiting(t, id, "await2")
	testkit.Hold(t, 500*time.Millisecond, "the duplicate does not end await2", func() bool {
		in := r.get(t, id)
		return in.Step == "await2" && in.Wait != nil && r.fx.Count(t, id, "act2") == 0
	})
	r.signal(t, id, "go", "B", "B")
	in := r.ended(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"prep", "onsig1:A", "act", "onsig2:B", "act2"}, r.fx.List(t, id))
	sigs := r.signals(t, id)
	require.Len(t, sigs, 2, "%+v", sigs)
	require.Equal(t, []string{"A", "B"}, []string{sigs[0].ID, sigs[1].ID})
	require.Equal(t, []string{"await1", "await2"}, []string{sigs[0].Step, sigs[1].Step})
	require.Equal(t, 1, count(in, "signal_received:await1"))
	require.Equal(t, 1, count(in, "signal_received:await2"))
}

// Eight senders race with one ID while the saga waits: one signal is
// recorded. Then, while the first wait's handler or the step chained
// after it runs (held at a gate), two
// signals of the same name arrive at once: when the saga reaches the
// second wait it takes one of them at once, the other stays pending, and
// every step ran once.
func TestSignalBurstsAroundAChainedStep(t *testing.T) {
	t.Parallel()
	for _, where := range []string{inAct, inHandler} {
		t.Run(where, func(t *testing.T) {
			t.Parallel()
			signalBursts(t, where)
		})
	}
}

func signalBursts(t *testing.T, where string) {
	r := newRig(t)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	def := twoAwaitsDefGated(r, "burst", nil, gate)
	if where == inHandler {
		def = twoAwaitsDefGated(r, "burst", gate, nil)
	}
	r.start(t, nil, def)
	ctx := context.Background()
	id := r.startAt(t, def, "o-1", "await1")

	var wg sync.WaitGroup
	var mu sync.Mutex
	fresh := 0
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := r.engine.Signal(ctx, saga.Signal{SagaID: id, Name: "go", ID: "dup", Payload: "dup"})
			if err != nil {
				t.Error(err)
				return
			}
			if !res.Duplicate {
				mu.Lock()
				fresh++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 1, fresh, "one of eight identical signals is recorded")

	testkit.WaitFor(t, wait, where+" to run", func() bool { return gate.Entered() == 1 })
	for _, sid := range []string{"X", "Y"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := r.engine.Signal(ctx, saga.Signal{SagaID: id, Name: "go", ID: sid, Payload: sid}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	gate.Open()
	in := r.ended(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	fx := r.fx.List(t, id)
	require.Len(t, fx, 5, "%v", fx)
	require.Equal(t, []string{"prep", "onsig1:dup", "act"}, fx[:3])
	require.Contains(t, []string{"onsig2:X", "onsig2:Y"}, fx[3])
	require.Equal(t, "act2", fx[4])
	byStatus := map[string][]string{}
	for _, s := range r.signals(t, id) {
		byStatus[s.Status] = append(byStatus[s.Status], s.ID+"@"+s.Step)
	}
	require.Len(t, byStatus["delivered"], 2, "%v", byStatus)
	require.Len(t, byStatus["pending"], 1, "%v", byStatus)
	require.Equal(t, "dup@await1", byStatus["delivered"][0])
	require.Equal(t, 1, count(in, "signal_received:await2"), describe(in))
}

// A signal sent before the saga reaches its wait is kept; the wait ends as
// it starts, and the step after it runs once.
func TestSignalBeforeTheWait(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	def := saga.Define("early",
		saga.Step[ord]{Name: "prep", Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error {
			if err := gate.Pass(ctx); err != nil {
				return err
			}
			return r.fx.Record(ctx, run, "prep")
		}},
		saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
			s.Got = p
			return r.fx.Record(ctx, run, "onsig")
		})},
		saga.Step[ord]{Name: "act", Action: func(ctx context.Context, run *saga.StepRun, s *ord) error {
			return r.fx.Record(ctx, run, "act:"+s.Got)
		}},
	)
	r.start(t, nil, def)
	st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o-1"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, wait, "prep to run", func() bool { return gate.Entered() == 1 })
	r.signal(t, st.ID, "go", "early-1", "early")
	gate.Open()
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"prep", "onsig", "act:early"}, r.fx.List(t, st.ID))
	requireDelivered(t, r, st.ID, "await")
	require.Equal(t, 1, count(in, "signal_received:await"))
	require.Zero(t, r.commandsFor(t, st.ID, "act"), "no command for the step after a wait that ended as it started")
	require.Equal(t, 1, r.txids(t, st.ID, "onsig", "act:early"))
}

// Two tenants (schemas, engines) run the same saga type with the same
// business key and get signals of the same name and ID: each signal
// reaches its own tenant's saga only, and the ID deduplicates per tenant.
func TestTwoTenantsSameSignal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var ids [2]uuid.UUID
	var rigs [2]*rig
	for i := range rigs {
		r := newRig(t)
		def := chainDef(r, "shop", chainOpts{})
		r.start(t, nil, def)
		st, err := saga.Start(ctx, r.engine, def, ord{ID: "bk-1"}, &saga.StartOpts{BusinessKey: "bk-1"})
		require.NoError(t, err)
		r.waiting(t, st.ID, "await")
		rigs[i], ids[i] = r, st.ID
	}
	a, b := rigs[0], rigs[1]
	res, err := a.engine.Signal(ctx, saga.Signal{Saga: "shop", BusinessKey: "bk-1", Name: "go", ID: "S1", Payload: "to-a"})
	require.NoError(t, err)
	require.Equal(t, ids[0], res.SagaID)
	require.False(t, res.Duplicate)
	in := a.ended(t, ids[0])
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))

	// B's saga id sent through A's engine matches no saga of A.
	_, err = a.engine.Signal(ctx, saga.Signal{SagaID: ids[1], Name: "go", ID: "S1", Payload: "wrong"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotFound)
	testkit.Hold(t, 500*time.Millisecond, "tenant B's saga still waits", func() bool {
		in := b.get(t, ids[1])
		return in.Wait != nil && b.fx.Count(t, ids[1], "onsig") == 0
	})

	res, err = b.engine.Signal(ctx, saga.Signal{Saga: "shop", BusinessKey: "bk-1", Name: "go", ID: "S1", Payload: "to-b"})
	require.NoError(t, err)
	require.False(t, res.Duplicate, "an ID is deduplicated per tenant")
	in = b.ended(t, ids[1])
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	for i, r := range rigs {
		require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, ids[i]))
		var st ord
		require.NoError(t, r.get(t, ids[i]).DecodeState(&st))
		require.Equal(t, []string{"to-a", "to-b"}[i], st.Got)
		requireDelivered(t, r, ids[i], "await")
	}
	// A signal after the end is rejected and changes nothing.
	_, err = a.engine.Signal(ctx, saga.Signal{SagaID: ids[0], Name: "go", ID: "S2", Payload: "late"})
	require.True(t, errors.Is(err, saga.ErrSignalRejected), "%v", err)
	require.Equal(t, []string{"prep", "onsig", "act"}, a.fx.List(t, ids[0]))
}
