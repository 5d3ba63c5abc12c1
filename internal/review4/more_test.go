package review4_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// A signal wait without a time limit has no deadline: the rescuer leaves it
// alone however much time passes, and the signal still completes it.
func TestUnlimitedSignalWaitOutlivesTime(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("forever", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))})
	ctl := v.controlDef()
	v.run(t, def, ctl)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	in := waitingFor(t, v.e, st.ID, "signal", "x")
	require.Nil(t, in.Wait.Until)
	c, err := saga.Start(ctx, v.e, ctl, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, c.ID, "timer", "")
	require.NoError(t, v.clock().Advance(ctx, 1000*time.Hour))
	sagatest.WaitEnded(t, v.e, c.ID, wopts)
	r, err := v.e.RescueNow(ctx)
	require.NoError(t, err)
	in = get(t, v.e, st.ID)
	require.Equal(t, saga.StatusRunning, in.Status, sagatest.Describe(in))
	require.NotNil(t, in.Wait)
	require.Equal(t, 0, r.FailedOver)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1"})
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, v.e, st.ID, wopts).Status)
}

// A handler that fails leaves its signal undelivered for the next attempt;
// it is delivered once, on the attempt that commits.
func TestSignalHandlerRetried(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	fails := make(chan struct{}, 1)
	fails <- struct{}{}
	def := saga.Define("retry", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x",
		func(ctx context.Context, run *saga.StepRun, s *state, p ev) error {
			if err := v.effect(ctx, run, "tried"); err != nil { // rolled back on failure
				return err
			}
			select {
			case <-fails:
				return errors.New("flaky")
			default:
			}
			s.Got = append(s.Got, p.V)
			return nil
		}), Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return time.Hour }}})
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1", Payload: ev{V: "one"}})
	require.NoError(t, err)
	sagatest.Wait(t, v.e, st.ID, sagatest.Event("step_failed:a"), wopts)
	ss := signals(t, v.e, st.ID)
	require.Equal(t, "pending", ss[0].Status, "a failed attempt leaves the signal undelivered")
	require.NoError(t, v.clock().Advance(ctx, time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"one"}, s.Got)
	require.Equal(t, 1, v.effects(t, st.ID, "tried"))
	require.Equal(t, 1, count(in, "signal_received:a"))
	require.Equal(t, "delivered", signals(t, v.e, st.ID)[0].Status)
}

// Signal.SagaID wins over Saga and BusinessKey ("when SagaID is not set").
func TestSignalAddressedTwice(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("addr", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))})
	v.run(t, def)
	ctx := context.Background()
	a, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "a"})
	require.NoError(t, err)
	b, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "b"})
	require.NoError(t, err)
	r, err := sig(t, v.e, saga.Signal{SagaID: a.ID, Saga: "addr", BusinessKey: "b", Name: "x", ID: "1"})
	require.NoError(t, err)
	require.Equal(t, a.ID, r.SagaID)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, v.e, a.ID, wopts).Status)
	require.Empty(t, signals(t, v.e, b.ID))
}

// TimeoutThen with a handler: it runs in the step's transaction when nothing
// came in time, and the saga goes on.
func TestTimeoutThenHandler(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("then",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v)).TimeoutThen(time.Hour, act[state](v, "fallback"))},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")
	require.NoError(t, v.clock().Advance(ctx, time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.effects(t, st.ID, "fallback"))
	require.Equal(t, 1, v.effects(t, st.ID, "after"))
	require.Equal(t, 0, v.effects(t, st.ID, "sig:a"))
	require.Equal(t, 1, count(in, "wait_timed_out:a"))
}

// Cancelled while signals wait for it: the saga compensates; signals sent
// afterwards are rejected.
func TestCancelWithPendingSignals(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("cancelsig",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("y", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "y", ID: "early"})
	require.NoError(t, err)
	require.NoError(t, v.e.Cancel(ctx, st.ID, "stop"))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "late"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 2)
	require.Equal(t, "rejected", ss[1].Status)
	// Documented (SignalInfo.Status): a signal no step took stays pending
	// when its saga ends first.
	require.Equal(t, "pending", ss[0].Status)
}

// The parent passes its deadline while it waits for its child: the child is
// cancelled too.
func TestParentDeadlineCancelsChild(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	f := newFamily(v, "pdeadline", 0)
	f.parent.WithDeadline(time.Hour)
	v.run(t, f.parent, f.childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, f.parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	waitingFor(t, v.e, child.ID, "signal", "go")
	require.NoError(t, v.clock().Advance(ctx, 2*time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeDeadline, in.LastError.Code)
	c := sagatest.WaitEnded(t, v.e, child.ID, wopts)
	require.Equal(t, saga.StatusCompensated, c.Status, sagatest.Describe(c))
	require.Equal(t, 1, v.effects(t, child.ID, "child-undo"))
}

// A child whose step fails with a retryable error and then exhausts its
// attempts: the parent is woken (child_ended) and compensates.
func TestChildExhaustsRetries(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	childDef := saga.Define("flaky-child", saga.Step[kid]{Name: "work",
		Action: func(context.Context, *saga.StepRun, *kid) error {
			return steps.RetryAfter(time.Minute, errors.New("busy"))
		},
		Retry: &saga.RetryPolicy{MaxAttempts: 2}})
	parent := saga.Define("flaky-parent",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "spawn", Wait: saga.Child(childDef,
			func(context.Context, *saga.StepRun, *state) (kid, *saga.StartOpts, error) { return kid{}, nil, nil },
			func(context.Context, *saga.StepRun, *state, kid) error { return nil })},
	)
	v.run(t, parent, childDef)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, parent, state{}, nil)
	require.NoError(t, err)
	child := childOf(t, v.e, st.ID)
	sagatest.Wait(t, v.e, child.ID, sagatest.Event("step_failed:work"), wopts)
	require.NoError(t, v.clock().Advance(ctx, time.Minute))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeChildFailed, in.LastError.Code)
	require.Equal(t, 1, count(in, "child_ended:spawn"))
}

// SignalOn's handler, called as an inbox consumer would (in the inbox's
// transaction): the message id is the signal id, so a redelivery has no
// second effect. A message id the inbox accepts (it hashes ids that are too
// long or hold NUL bytes, "so any id deduplicates") should not make the
// signal unstorable.
func TestSignalOnMessageIDs(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("onmsg",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("picked", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("picked", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "o-1"})
	require.NoError(t, err)
	h := saga.SignalOn(v.e, "picked", func(msg inbox.Message, e struct{ OrderID, V string }) (saga.Signal, error) {
		return saga.Signal{Saga: "onmsg", BusinessKey: e.OrderID, Payload: ev{V: e.V}}, nil
	})
	deliver := func(id string, val string) error {
		tx, err := v.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		if err := h(ctx, tx, inbox.Message{ID: id, Topic: "warehouse", Value: []byte(`{"OrderID":"o-1","V":"` + val + `"}`)}); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	require.NoError(t, deliver("m-1", "one"))
	require.NoError(t, deliver("m-1", "one-again"), "a redelivered message is no error")
	sagatest.Wait(t, v.e, st.ID, sagatest.Step("b"), wopts)
	require.Len(t, signals(t, v.e, st.ID), 1)

	var refused []string
	for _, id := range []string{strings.Repeat("m", 600), "m\x00nul", "m\xffbad"} {
		if err := deliver(id, "odd-id"); err != nil {
			refused = append(refused, err.Error())
		}
		if len(refused) == 0 {
			break // delivered: the saga has ended
		}
	}
	if len(refused) > 0 {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN: SignalOn turns a message whose id is over 512 bytes, or holds a NUL or invalid "+
			"UTF-8 (ids the inbox accepts and deduplicates by their SHA-256), into a signal that cannot be "+
			"stored, so the consumer dead-letters a valid message: %s", strings.Join(refused, "; "))
	}
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status)
}

// A saga started and signalled in one transaction (by id and by business
// key): the signal is kept and delivered once the saga reaches its await.
func TestStartAndSignalInOneTx(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("onetx",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	tx, err := v.pool.Begin(ctx)
	require.NoError(t, err)
	st, err := saga.StartTx(ctx, v.e, tx, def, state{}, &saga.StartOpts{BusinessKey: "k"})
	require.NoError(t, err)
	r, err := v.e.SignalTx(ctx, tx, saga.Signal{SagaID: st.ID, Name: "x", ID: "1", Payload: ev{V: "by-id"}})
	require.NoError(t, err)
	require.Equal(t, st.ID, r.SagaID)
	r, err = v.e.SignalTx(ctx, tx, saga.Signal{Saga: "onetx", BusinessKey: "k", Name: "x", ID: "2", Payload: ev{V: "by-key"}})
	require.NoError(t, err)
	require.Equal(t, st.ID, r.SagaID)
	require.NoError(t, tx.Commit(ctx))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"by-id", "by-key"}, s.Got)
}

// Two engines on one schema: every timer fires once and every signal is
// delivered once, whichever engine takes it.
func TestTwoEnginesOneSchema(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	mk := func() *saga.Definition[state] {
		return saga.Define("shared",
			saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Hour)},
			saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
			saga.Step[state]{Name: "after", Action: act[state](v, "after")},
		)
	}
	def := mk()
	v.run(t, def)
	e2 := newEngine(t, v.pool, v.schema)
	startEngine(t, e2, mk())
	ctx := context.Background()
	const n = 30
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, v.e, def, state{}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
		// Half signalled before they sleep is over, by the other engine.
		if i%2 == 0 {
			_, err = sig(t, e2, saga.Signal{SagaID: st.ID, Name: "x", ID: "s"})
			require.NoError(t, err)
		}
	}
	for _, id := range ids {
		waitingFor(t, v.e, id, "timer", "")
	}
	require.NoError(t, sagatest.NewClock(v.pool, v.schema, v.e, e2).Advance(ctx, time.Hour))
	for i, id := range ids {
		if i%2 == 1 {
			waitingFor(t, v.e, id, "signal", "x")
			_, err := sig(t, v.e, saga.Signal{SagaID: id, Name: "x", ID: "s"})
			require.NoError(t, err)
		}
	}
	for _, id := range ids {
		in := sagatest.WaitEnded(t, e2, id, wopts)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 1, count(in, "timer_fired:nap"), sagatest.Describe(in))
		require.Equal(t, 1, count(in, "signal_received:a"))
		require.Equal(t, 1, v.effects(t, id, "sig:a"))
		require.Equal(t, 1, v.effects(t, id, "after"))
	}
}

// Rerun from an await: the step waits again (its signal was delivered under
// the old epoch) and takes a new signal.
func TestRerunFromAwait(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("rerun",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1", Payload: ev{V: "one"}})
	require.NoError(t, err)
	sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.NoError(t, v.e.Rerun(ctx, st.ID, "a", "again"))
	in := waitingFor(t, v.e, st.ID, "signal", "x")
	require.Equal(t, 1, in.Epoch)
	r, err := sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "1", Payload: ev{V: "dup"}})
	require.NoError(t, err)
	require.True(t, r.Duplicate, "ids deduplicate per saga, across epochs")
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "2", Payload: ev{V: "two"}})
	require.NoError(t, err)
	in = sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"one", "two"}, s.Got)
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 2)
	require.Equal(t, 1, ss[1].Epoch)
}

// An engine that is never started and registers nothing is a client: it can
// signal sagas that other engines run, by id and by name and business key.
func TestSignalFromClientEngine(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("client",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	client := newEngine(t, v.pool, v.schema)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "k"})
	require.NoError(t, err)
	_, err = sig(t, client, saga.Signal{SagaID: st.ID, Name: "x", ID: "1", Payload: ev{V: "id"}})
	require.NoError(t, err)
	_, err = sig(t, client, saga.Signal{Saga: "client", BusinessKey: "k", Name: "x", ID: "2", Payload: ev{V: "key"}})
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
}

// Cancel and signal race on many sagas: each ends, the signal takes effect at
// most once, and each call fails only with the documented errors.
func TestCancelRacesSignal(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("cancelrace",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v)), Compensate: act[state](v, "undo-a")},
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Hour)},
	)
	v.run(t, def)
	ctx := context.Background()
	const n = 30
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, v.e, def, state{}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for i, id := range ids {
		wg.Add(2)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond) // a random moment
			if err := v.e.Cancel(ctx, id, "race"); err != nil && !errors.Is(err, saga.ErrNotRunning) {
				errs <- fmt.Errorf("cancel %d: %w", i, err)
			}
		}()
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			if _, err := v.e.Signal(ctx, saga.Signal{SagaID: id, Name: "x", ID: "s"}); err != nil &&
				!errors.Is(err, saga.ErrSignalRejected) {
				errs <- fmt.Errorf("signal %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, id := range ids {
		in := sagatest.WaitEnded(t, v.e, id, wopts)
		require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
		got := count(in, "signal_received:a")
		require.LessOrEqual(t, got, 1)
		require.Equal(t, got, v.effects(t, id, "sig:a"))
		require.Equal(t, got, v.effects(t, id, "undo-a"), "a delivered await is compensated, once")
		require.Equal(t, v.effects(t, id, "first"), v.effects(t, id, "undo-first"), "a cancel may land before it ran")
		for _, s := range signals(t, v.e, id) {
			require.Equal(t, got == 1, s.Status == "delivered", "signal %+v vs timeline %s", s, sagatest.Describe(in))
		}
	}
}
