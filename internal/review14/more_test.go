package review14

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// CancelTx "holds the saga until it ends, so that no step starts
// meanwhile". A signal sent while such a transaction is open must not
// run the wait's handler or the step after it before the transaction
// ends: committed, the cancel wins (nothing after prep ran, prep is
// compensated, the signal is not delivered); rolled back, the signal is
// delivered once and the step after it runs once.
func TestCancelTxOpenWhenTheSignalArrives(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		name := map[bool]string{true: "commit", false: "rollback"}[commit]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			var calls tally
			def := chainDef(r, "ctx"+name, chainOpts{
				handler: func(context.Context, *saga.StepRun, *ord, string) error { calls.add("handler"); return nil },
				act: func(ctx context.Context, run *saga.StepRun, _ *ord) error {
					calls.add("act")
					return r.fx.Record(ctx, run, "act")
				}})
			r.start(t, nil, def)
			ctx := context.Background()
			id := r.startAt(t, def, "o-1", "await")
			tx, err := r.db.Pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			require.NoError(t, r.engine.CancelTx(ctx, tx, id, "held"))
			// The signal may wait for the held saga: send it aside.
			sent := make(chan error, 1)
			go func() {
				_, err := r.engine.Signal(ctx, saga.Signal{SagaID: id, Name: "go", ID: "sig-1", Payload: "p"})
				sent <- err
			}()
			testkit.Hold(t, 700*time.Millisecond, "no step runs while CancelTx's transaction is open", func() bool {
				return calls.get("handler") == 0 && calls.get("act") == 0
			})
			if commit {
				require.NoError(t, tx.Commit(ctx))
			} else {
				require.NoError(t, tx.Rollback(ctx))
			}
			err = testkit.Recv(t, sent, wait, "the signal's answer")
			if commit && err != nil {
				require.ErrorIs(t, err, saga.ErrSignalRejected)
			} else {
				require.NoError(t, err)
			}
			in := r.ended(t, id)
			if commit {
				require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
				require.Equal(t, []string{"prep", "unprep"}, r.fx.List(t, id))
				require.Zero(t, calls.get("act"))
				s := r.signals(t, id)
				require.Len(t, s, 1)
				require.NotEqual(t, "delivered", s[0].Status, "%+v", s[0])
				return
			}
			require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
			require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
			require.Equal(t, 1, calls.get("act"))
			requireDelivered(t, r, id, "await")
		})
	}
}

// A chained step with PauseWhenExhausted and one attempt fails: the saga
// pauses at it with the wait's end kept; Resume runs the step again (not
// the wait's handler), once.
func TestChainedStepPausesWhenExhausted(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var calls tally
	def := saga.Define("exhaust",
		saga.Step[ord]{Name: "prep", Action: rec(r, "prep")},
		saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
			calls.add("handler")
			s.Got = p
			return r.fx.Record(ctx, run, "onsig")
		})},
		saga.Step[ord]{Name: "act", Retry: noBackoff(1), PauseWhenExhausted: true,
			Action: func(ctx context.Context, run *saga.StepRun, s *ord) error {
				if calls.add("act") == 1 {
					return errors.New("provider down")
				}
				return r.fx.Record(ctx, run, "act:"+s.Got)
			}},
	)
	r.start(t, nil, def)
	id := r.startAt(t, def, "o-1", "await")
	r.signal(t, id, "go", "sig-1", "p")
	in := sagatest.Wait(t, r.engine, id, sagatest.Cond("pause", func(in *saga.Instance) bool { return in.Paused != nil }),
		&sagatest.WaitOpts{Timeout: wait})
	require.Equal(t, saga.PauseCodeExhausted, in.Paused.Code, describe(in))
	require.Equal(t, "act", in.Step)
	require.Equal(t, []string{"prep", "onsig"}, r.fx.List(t, id))
	requireDelivered(t, r, id, "await")
	require.NoError(t, r.engine.Resume(context.Background(), id, "fixed"))
	in = r.ended(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"prep", "onsig", "act:p"}, r.fx.List(t, id))
	require.Equal(t, 1, calls.get("handler"))
	require.Equal(t, 2, calls.get("act"))
}

// A signal wait with a time limit, then a local step: the limit passes
// (TimeoutThen's function runs, then the step after it, once), or the
// signal comes just at the limit: exactly one of the two ends the wait,
// the step after it runs once, and a late signal is not delivered. The
// limit leaves the test time to see every saga waiting (it looks at them in
// turn): with 300 ms a loaded CI run found one already past its wait.
func TestSignalWaitTimeoutThenLocalStep(t *testing.T) {
	t.Parallel()
	const n = 6
	r := newRig(t)
	var calls tally
	def := saga.Define("limit",
		saga.Step[ord]{Name: "prep", Action: rec(r, "prep")},
		saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
			s.Got = p
			return r.fx.Record(ctx, run, "onsig")
		}).TimeoutThen(1500*time.Millisecond, func(ctx context.Context, run *saga.StepRun, s *ord) error {
			s.Got = "timeout"
			return r.fx.Record(ctx, run, "timedout")
		})},
		saga.Step[ord]{Name: "act", Action: func(ctx context.Context, run *saga.StepRun, s *ord) error {
			calls.add(s.ID)
			return r.fx.Record(ctx, run, "act:"+s.Got)
		}},
	)
	r.start(t, nil, def)
	ctx := context.Background()
	ids := make([]uuid.UUID, n)
	var wg sync.WaitGroup
	for i := range n {
		st, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprint("o-", i)}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	for i := range n {
		in := r.waiting(t, ids[i], "await")
		if i == 0 {
			continue // no signal: the limit passes
		}
		// The others get their signal close to the limit, some before,
		// some after.
		wg.Add(1)
		go func() {
			defer wg.Done()
			if in.Wait.Until != nil {
				var now time.Time
				if err := r.db.Pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
					t.Error(err)
					return
				}
				time.Sleep(in.Wait.Until.Sub(now) + time.Duration(i-3)*20*time.Millisecond)
			}
			_, err := r.engine.Signal(ctx, saga.Signal{SagaID: ids[i], Name: "go", ID: "s", Payload: "sig"})
			if err != nil && !errors.Is(err, saga.ErrSignalRejected) {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	for i, id := range ids {
		in := r.ended(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
		fx := r.fx.List(t, id)
		require.Contains(t, [][]string{{"prep", "onsig", "act:sig"}, {"prep", "timedout", "act:timeout"}}, fx, describe(in))
		require.Equal(t, 1, calls.get(fmt.Sprint("o-", i)))
		require.Equal(t, 1, count(in, "step_completed:await"), describe(in))
		sigs := r.signals(t, id)
		if fx[1] == "onsig" {
			require.Equal(t, 1, count(in, "signal_received:await"), describe(in))
			requireDelivered(t, r, id, "await")
		} else {
			require.Zero(t, count(in, "signal_received:await"), describe(in))
			for _, s := range sigs {
				require.NotEqual(t, "delivered", s.Status, "%+v", s)
			}
		}
		if i == 0 {
			require.Equal(t, []string{"prep", "timedout", "act:timeout"}, fx)
		}
		t.Logf("saga %d: %v", i, fx[1])
	}
}

// Two engines on one schema, 60 sagas waiting, their signals sent in
// transactions of ten (SignalTx): each wait ends once and each chained
// step runs once, whichever engine takes the wake-up.
func TestTwoEnginesManySignals(t *testing.T) {
	t.Parallel()
	const n = 60
	r := newRig(t)
	var acts tally
	def := chainDef(r, "twoeng", chainOpts{act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
		acts.add(o.ID)
		return r.fx.Record(ctx, run, "act")
	}})
	r.start(t, func(c *saga.Config) { c.Workers = 1 }, def)
	other, _ := testkit.StartEngine(t, r.db.Pool, func() *saga.Config { c := r.db.Config(); c.Workers = 1; return c }(), def)
	ctx := context.Background()
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprint("o-", i)}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	for _, id := range ids {
		r.waiting(t, id, "await")
	}
	for g := 0; g < n; g += 10 {
		tx, err := r.db.Pool.Begin(ctx)
		require.NoError(t, err)
		for _, id := range ids[g : g+10] {
			e := r.engine
			if g%20 == 10 {
				e = other
			}
			_, err := e.SignalTx(ctx, tx, saga.Signal{SagaID: id, Name: "go", ID: "s", Payload: "p"})
			require.NoError(t, err)
		}
		require.NoError(t, tx.Commit(ctx))
	}
	for i, id := range ids {
		in := r.ended(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
		require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
		require.Equal(t, 1, acts.get(fmt.Sprint("o-", i)))
		require.Equal(t, 1, count(in, "signal_received:await"))
	}
	require.Zero(t, r.db.Count(t, "SELECT count(*) FROM "+r.db.Table("outlog")+" WHERE step_key LIKE '%/act/forward/%'"))
	t.Logf("chained: this engine %d, the other %d", r.engine.Stats().Chained, other.Stats().Chained)
}
