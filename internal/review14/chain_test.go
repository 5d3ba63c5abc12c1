package review14

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// chainOpts shape chainDef.
type chainOpts struct {
	// handler runs in the OnSignal handler before it records "onsig";
	// an error from it fails the await step.
	handler func(ctx context.Context, run *saga.StepRun, o *ord, p string) error
	// gotOf, when set, gives what the handler stores in Got instead of
	// the payload.
	gotOf      func(o *ord, p string) string
	awaitRetry *saga.RetryPolicy
	act        saga.StepFunc[ord]
	actRetry   *saga.RetryPolicy
	actTimeout time.Duration
	tail       []saga.Step[ord]
}

// chainDef: prep (local, compensated by unprep) -> await (OnSignal "go":
// the handler sets Got to the payload and records "onsig"; compensated by
// unawait) -> act (local, compensated by unact) -> tail.
func chainDef(r *rig, name string, o chainOpts) *saga.Definition[ord] {
	if o.act == nil {
		o.act = rec(r, "act")
	}
	s := []saga.Step[ord]{
		{Name: "prep", Action: rec(r, "prep"), Compensate: rec(r, "unprep")},
		{Name: "await", Retry: o.awaitRetry, Compensate: rec(r, "unawait"),
			Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
				if o.handler != nil {
					if err := o.handler(ctx, run, s, p); err != nil {
						return err
					}
				}
				s.Got = p
				if o.gotOf != nil {
					s.Got = o.gotOf(s, p)
				}
				return r.fx.Record(context.WithoutCancel(ctx), run, "onsig")
			})},
		{Name: "act", Action: o.act, Retry: o.actRetry, Timeout: o.actTimeout, Compensate: rec(r, "unact")},
	}
	return saga.Define(name, append(s, o.tail...)...)
}

// startAt starts a saga of def and waits until it waits at step.
func (r *rig) startAt(t *testing.T, def *saga.Definition[ord], id, step string) uuid.UUID {
	t.Helper()
	st, err := saga.Start(context.Background(), r.engine, def, ord{ID: id}, nil)
	require.NoError(t, err)
	r.waiting(t, st.ID, step)
	return st.ID
}

// sameTx says whether the effects whats of saga id were committed by one
// transaction (the effects table records the writer's txid).
func (r *rig) txids(t *testing.T, id uuid.UUID, whats ...string) int {
	t.Helper()
	return r.db.Count(t, "SELECT count(DISTINCT txid) FROM "+r.fx.Table()+" WHERE saga_id = $1 AND what = ANY($2)", id, whats)
}

func requireDelivered(t *testing.T, r *rig, id uuid.UUID, step string) saga.SignalInfo {
	t.Helper()
	sigs := r.signals(t, id)
	require.Len(t, sigs, 1, "%+v", sigs)
	require.Equal(t, "delivered", sigs[0].Status, "%+v", sigs[0])
	require.Equal(t, step, sigs[0].Step)
	return sigs[0]
}

// The step after a signal runs at once, in the wait's transaction, under
// its own key, with no command written for it; the handler's state change
// reaches it.
func TestSignalThenLocalStepIsOneTransaction(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var acts tally
	def := chainDef(r, "sigok", chainOpts{act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
		acts.add(o.ID)
		acts.note("key", run.Key.String())
		acts.note("attempt", fmt.Sprint(run.Attempt))
		acts.note("got", o.Got)
		o.Note = "acted"
		return r.fx.Record(ctx, run, "act")
	}})
	r.start(t, nil, def)
	id := r.startAt(t, def, "o-1", "await")
	chained := r.engine.Stats().Chained
	res := r.signal(t, id, "go", "sig-1", "hello")
	require.False(t, res.Duplicate)
	in := r.ended(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
	require.Equal(t, 1, r.txids(t, id, "onsig", "act"), "the handler's and the step's writes commit together")
	require.Equal(t, []string{id.String() + "/act/forward/0"}, acts.notes("key"))
	require.Equal(t, []string{"1"}, acts.notes("attempt"))
	require.Equal(t, []string{"hello"}, acts.notes("got"))
	var st ord
	require.NoError(t, in.DecodeState(&st))
	require.Equal(t, ord{ID: "o-1", Note: "acted", Got: "hello"}, st)
	before(t, in, "saga_started", "step_completed:prep", "signal_received:await", "step_completed:await",
		"step_completed:act", "saga_completed")
	require.Equal(t, 1, count(in, "signal_received:await"))
	requireDelivered(t, r, id, "await")
	require.Zero(t, r.commandsFor(t, id, "act"), "no command is written for the step after the wait")
	require.Greater(t, r.engine.Stats().Chained, chained)
}

// The chained step fails: retried (its writes rolled back, the handler's
// kept once), failed for good or out of attempts (compensations in
// reverse, the handler's write compensated), or panics. The signal is
// delivered once in every case.
func TestSignalThenFailingStep(t *testing.T) {
	t.Parallel()
	type outcome struct {
		status   saga.Status
		fx       []string
		attempts []string
		failed   int // step_failed:act entries
		cmds     int // commands written for act (retries only)
	}
	for _, c := range []struct {
		name  string
		retry *saga.RetryPolicy
		fail  func(n int) error // the error of act's nth attempt, nil to succeed
		want  outcome
	}{
		{"retry", noBackoff(3), func(n int) error {
			if n == 1 {
				return errors.New("provider down")
			}
			return nil
		}, outcome{saga.StatusCompleted, []string{"prep", "onsig", "act"}, []string{"1", "2"}, 1, 1}},
		{"retryafter", noBackoff(3), func(n int) error {
			if n == 1 {
				return steps.RetryAfter(50*time.Millisecond, errors.New("429"))
			}
			return nil
		}, outcome{saga.StatusCompleted, []string{"prep", "onsig", "act"}, []string{"1", "2"}, 1, 1}},
		{"permanent", noBackoff(3), func(int) error { return steps.Permanent(errors.New("card declined")) },
			outcome{saga.StatusCompensated, []string{"prep", "onsig", "unawait", "unprep"}, []string{"1"}, 1, 0}},
		{"exhausted", noBackoff(2), func(int) error { return errors.New("still down") },
			outcome{saga.StatusCompensated, []string{"prep", "onsig", "unawait", "unprep"}, []string{"1", "2"}, 2, 1}},
		{"panic", noBackoff(3), func(n int) error {
			if n == 1 {
				panic("chained step panics")
			}
			return nil
		}, outcome{saga.StatusCompleted, []string{"prep", "onsig", "act"}, []string{"1", "2"}, 1, 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			var acts tally
			def := chainDef(r, "sig"+c.name, chainOpts{actRetry: c.retry,
				act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
					n := acts.add(o.ID)
					acts.note("attempt", fmt.Sprint(run.Attempt))
					acts.note("got", o.Got)
					if err := r.fx.Record(ctx, run, "act-try"); err != nil {
						return err
					}
					if err := c.fail(n); err != nil {
						return err
					}
					_, err := run.Tx.Exec(ctx, "DELETE FROM "+r.fx.Table()+" WHERE saga_id = $1 AND what = 'act-try'", run.SagaID)
					if err != nil {
						return err
					}
					return r.fx.Record(ctx, run, "act")
				}})
			r.start(t, nil, def)
			id := r.startAt(t, def, "o-1", "await")
			r.signal(t, id, "go", "sig-1", "hello")
			in := r.ended(t, id)
			require.Equal(t, c.want.status, in.Status, describe(in))
			require.Equal(t, c.want.fx, r.fx.List(t, id), describe(in))
			require.Equal(t, c.want.attempts, acts.notes("attempt"))
			for _, g := range acts.notes("got") {
				require.Equal(t, "hello", g, "every attempt sees the handler's state")
			}
			require.Equal(t, c.want.failed, count(in, "step_failed:act"), describe(in))
			require.Equal(t, 1, count(in, "signal_received:await"), describe(in))
			require.Equal(t, 1, count(in, "step_completed:await"), describe(in))
			requireDelivered(t, r, id, "await")
			require.Equal(t, c.want.cmds, r.commandsFor(t, id, "act"), "commands written for act")
			if c.want.status == saga.StatusCompensated {
				require.Equal(t, "act", in.LastError.Step, describe(in))
				before(t, in, "step_completed:await", "step_failed:act", "compensation_completed:await",
					"compensation_completed:prep", "saga_compensated")
				require.Zero(t, count(in, "step_completed:act"))
			} else {
				before(t, in, "signal_received:await", "step_completed:await", "step_failed:act",
					"step_completed:act", "saga_completed")
			}
			if c.name == "panic" {
				for _, e := range in.History {
					if e.Type == saga.EventStepFailed && e.Step == "act" {
						require.Equal(t, saga.CodePanic, e.ErrorCode)
					}
				}
			}
		})
	}
}

// The wait handler fails twice before it takes the signal; the step after
// it then gets its own attempts, counted from 1 (not the handler's), and
// its MaxAttempts of 2 is enough for one failure.
func TestAttemptsOfTheChainedStepAreItsOwn(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var handler, acts tally
	def := chainDef(r, "attempts", chainOpts{
		awaitRetry: noBackoff(5),
		handler: func(_ context.Context, run *saga.StepRun, o *ord, _ string) error {
			handler.note("attempt", fmt.Sprint(run.Attempt))
			if handler.add(o.ID) <= 2 {
				return errors.New("handler not ready")
			}
			return nil
		},
		actRetry: noBackoff(2),
		act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			acts.note("attempt", fmt.Sprint(run.Attempt))
			if acts.add(o.ID) == 1 {
				return errors.New("first try fails")
			}
			return r.fx.Record(ctx, run, "act")
		}})
	r.start(t, nil, def)
	id := r.startAt(t, def, "o-1", "await")
	r.signal(t, id, "go", "sig-1", "p")
	in := r.ended(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"1", "2", "3"}, handler.notes("attempt"))
	require.Equal(t, []string{"1", "2"}, acts.notes("attempt"), describe(in))
	require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
	require.Equal(t, 2, count(in, "step_failed:await"))
	require.Equal(t, 1, count(in, "signal_received:await"), describe(in))
	requireDelivered(t, r, id, "await")
}
