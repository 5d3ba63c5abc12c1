package review4_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// Guarantee 12: a signal is delivered whether it arrives before the saga
// reaches its await (kept; same-name signals in arrival order) or after; a
// signal sent while a step of the saga runs does not wait for that step.
func TestSignalKeptWhileStepRunsAndDeliveredInOrder(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	g := newGate()
	def := saga.Define("inorder",
		saga.Step[state]{Name: "gate", Action: func(ctx context.Context, _ *saga.StepRun, _ *state) error {
			return g.wait(ctx)
		}},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "c", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	g.started(t)
	// Two signals while the first step runs, the second one sent twice.
	for _, p := range []string{"1", "2", "2"} {
		_, err := sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "id-" + p, Payload: ev{V: p}})
		require.NoError(t, err, "a signal must be recorded while a step of the saga runs")
	}
	close(g.release)
	waitingFor(t, v.e, st.ID, "signal", "x")
	in := sagatest.Wait(t, v.e, st.ID, sagatest.Step("c"), wopts)
	require.Equal(t, saga.StatusRunning, in.Status)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "id-3", Payload: ev{V: "3"}})
	require.NoError(t, err)
	in = sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"1", "2", "3"}, s.Got)
	require.Equal(t, 3, count(in, "signal_received:a")+count(in, "signal_received:b")+count(in, "signal_received:c"),
		sagatest.Describe(in))
	for _, step := range []string{"a", "b", "c"} {
		require.Equal(t, 1, v.effects(t, st.ID, "sig:"+step))
	}
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 3, "the duplicate is recorded once")
	for i, s := range ss {
		require.Equal(t, "delivered", s.Status)
		require.Equal(t, []string{"a", "b", "c"}[i], s.Step)
		require.NotNil(t, s.DeliveredAt)
	}
}

// Signal.ID deduplicates per saga: a second signal with the same ID (before or
// after delivery, or many at once) is Duplicate and has no effect; the same
// ID to another saga is that saga's own signal.
func TestSignalDuplicateID(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("dup",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	one, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	two, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)

	r, err := sig(t, v.e, saga.Signal{SagaID: one.ID, Name: "x", ID: "same", Payload: ev{V: "first"}})
	require.NoError(t, err)
	require.False(t, r.Duplicate)
	require.Equal(t, one.ID, r.SagaID)
	sagatest.Wait(t, v.e, one.ID, sagatest.Event("signal_received:a"), wopts)
	r, err = sig(t, v.e, saga.Signal{SagaID: one.ID, Name: "x", ID: "same", Payload: ev{V: "again"}})
	require.NoError(t, err)
	require.True(t, r.Duplicate, "same id after delivery")

	// Same id to the other saga: its own signal.
	r, err = sig(t, v.e, saga.Signal{SagaID: two.ID, Name: "x", ID: "same", Payload: ev{V: "first"}})
	require.NoError(t, err)
	require.False(t, r.Duplicate)

	// Many senders of one new id at once: exactly one is recorded, none fails.
	var wg sync.WaitGroup
	var mu sync.Mutex
	fresh, errs := 0, []error{}
	for range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := v.e.Signal(ctx, saga.Signal{SagaID: one.ID, Name: "x", ID: "burst", Payload: ev{V: "burst"}})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			} else if !r.Duplicate {
				fresh++
			}
		}()
	}
	wg.Wait()
	require.Empty(t, errs, "concurrent duplicates must not fail")
	require.Equal(t, 1, fresh)

	in := sagatest.WaitEnded(t, v.e, one.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status)
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"first", "burst"}, s.Got)
	require.Len(t, signals(t, v.e, one.ID), 2)
	require.Equal(t, 1, v.effects(t, one.ID, "sig:a"))
	require.Equal(t, 1, v.effects(t, one.ID, "sig:b"))

	in = sagatest.Wait(t, v.e, two.ID, sagatest.Event("signal_received:a"), wopts)
	require.Equal(t, saga.StatusRunning, in.Status)
}

// Signals race sagas to their await: many sagas, each signalled at a random
// moment around its first step; every signal is delivered exactly once.
func TestSignalRacesArrivalAtAwait(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("race",
		saga.Step[state]{Name: "work", Action: func(ctx context.Context, run *saga.StepRun, _ *state) error {
			time.Sleep(time.Duration(rand.IntN(15)) * time.Millisecond) // the work, not synchronisation
			return v.effect(ctx, run, "work")
		}},
		saga.Step[state]{Name: "await", Wait: saga.OnSignal("go", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	const n = 40
	ids := make([]uuid.UUID, n)
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("order-%d", i)
			st, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: key})
			if err != nil {
				errs <- err
				return
			}
			ids[i] = st.ID
			time.Sleep(time.Duration(rand.IntN(30)) * time.Millisecond) // a random moment
			// Half by id, half by name and business key.
			s := saga.Signal{Name: "go", ID: key, Payload: ev{V: key}}
			if i%2 == 0 {
				s.SagaID = st.ID
			} else {
				s.Saga, s.BusinessKey = "race", key
			}
			if _, err := v.e.Signal(ctx, s); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for i, id := range ids {
		in := sagatest.WaitEnded(t, v.e, id, wopts)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 1, count(in, "signal_received:await"))
		require.Equal(t, 1, v.effects(t, id, "sig:await"))
		var s state
		require.NoError(t, in.DecodeState(&s))
		require.Equal(t, []string{fmt.Sprintf("order-%d", i)}, s.Got)
	}
}

// Input PostgreSQL cannot store is refused with ErrInvalidInput and writes
// nothing; a large but valid payload is delivered intact.
func TestSignalBadInput(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("bad",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("u", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, &saga.StartOpts{BusinessKey: "bk"})
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")

	long := strings.Repeat("k", 10<<10)
	bads := []string{"a\x00b", "\xff\xfe", long}
	type tc struct {
		name string
		s    saga.Signal
		// rejectedOK: refusing it as "no saga can take it" is acceptable too.
		rejectedOK bool
	}
	var cases []tc
	for i, b := range bads {
		cases = append(cases,
			tc{name: fmt.Sprintf("Name%d", i), s: saga.Signal{SagaID: st.ID, Name: b, ID: "n"}},
			tc{name: fmt.Sprintf("ID%d", i), s: saga.Signal{SagaID: st.ID, Name: "x", ID: b}},
			tc{name: fmt.Sprintf("Saga%d", i), s: saga.Signal{Saga: b, BusinessKey: "bk", Name: "x"}, rejectedOK: i == 2},
			tc{name: fmt.Sprintf("BusinessKey%d", i), s: saga.Signal{Saga: "bad", BusinessKey: b, Name: "x"}},
		)
	}
	cases = append(cases,
		tc{name: "PayloadNotJSON", s: saga.Signal{SagaID: st.ID, Name: "x", Payload: json.RawMessage("{not json")}},
		tc{name: "NoName", s: saga.Signal{SagaID: st.ID}},
		tc{name: "NoAddress", s: saga.Signal{Name: "x"}},
	)
	for _, c := range cases {
		_, err := sig(t, v.e, c.s)
		require.Error(t, err, c.name)
		if c.rejectedOK && errors.Is(err, saga.ErrSignalRejected) {
			continue
		}
		require.ErrorIs(t, err, saga.ErrInvalidInput, c.name)
	}
	require.Empty(t, signals(t, v.e, st.ID), "refused signals write nothing")
	waitingFor(t, v.e, st.ID, "signal", "x")

	// A 10 kB payload is delivered as sent.
	payload := ev{V: long}
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "big", Payload: payload})
	require.NoError(t, err)
	sagatest.Wait(t, v.e, st.ID, sagatest.Step("b"), wopts)
	// Invalid UTF-8 inside a JSON string: refused, or delivered decoded (with
	// U+FFFD, as encoding/json decodes it); never a broken saga.
	want := "\ufffd"
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "u", ID: "utf8", Payload: []byte("{\"v\":\"\xff\"}")})
	if err != nil {
		require.ErrorIs(t, err, saga.ErrInvalidInput)
		_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "u", ID: "utf8-2", Payload: ev{V: want}})
		require.NoError(t, err)
	}
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{payload.V, want}, s.Got)
	t.Logf("payload with invalid UTF-8 accepted: %v", err == nil)
}

// A payload whose JSON escapes a NUL ("\u0000") is accepted by Signal (the
// docs say a NUL byte is refused as input); the handler receives it, and a
// handler that keeps it in the saga's state makes the step fail for good
// with state_encode, so the saga compensates. Documented piecemeal
// (guarantee 8), but Signal's doc suggests NUL input never gets this far.
func TestSignalPayloadWithEscapedNUL(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("nul",
		saga.Step[state]{Name: "check", Wait: saga.OnSignal("n",
			func(ctx context.Context, run *saga.StepRun, s *state, p ev) error {
				if p.V != "a\x00b" {
					return steps.Permanent(fmt.Errorf("payload %q", p.V))
				}
				return v.effect(ctx, run, "nul-ok")
			})},
		saga.Step[state]{Name: "keep", Wait: saga.OnSignal("n", appendSig(v))},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	for _, id := range []string{"1", "2"} {
		_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "n", ID: id, Payload: ev{V: "a\x00b"}})
		if errors.Is(err, saga.ErrInvalidInput) {
			return // refused as the docs say: fine
		}
		require.NoError(t, err)
	}
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, 1, v.effects(t, st.ID, "nul-ok"), "the payload is delivered as sent")
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, "state_encode", in.LastError.Code)
	require.Equal(t, "keep", in.LastError.Step)
}

// A payload that does not decode into the handler's type fails the step for
// good with CodeSignalPayload, and the saga compensates.
func TestSignalPayloadDoesNotDecode(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("payload",
		saga.Step[state]{Name: "first", Action: act[state](v, "first"), Compensate: act[state](v, "undo-first")},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x",
			func(ctx context.Context, run *saga.StepRun, s *state, p struct{ N int }) error {
				return v.effect(ctx, run, "handled")
			})},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "s", Payload: map[string]string{"N": "abc"}})
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.NotNil(t, in.LastError)
	require.Equal(t, saga.CodeSignalPayload, in.LastError.Code)
	require.Equal(t, "a", in.LastError.Step)
	require.Equal(t, 0, v.effects(t, st.ID, "handled"))
	require.Equal(t, 1, v.effects(t, st.ID, "undo-first"))
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 1)
	if ss[0].Status == "pending" {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN: the saga has ended (compensated, code signal_payload) but the signal that ended it "+
			"is listed by Engine.Signals as %q, which SignalInfo documents as 'kept for a step that awaits it'; "+
			"it should be delivered or rejected with the decode error", ss[0].Status)
	}
}

// Two engines on two schemas (tenants) with the same saga name and business
// key: a signal sent through one never reaches the other's saga, by key or
// by id.
func TestSignalStaysInItsSchema(t *testing.T) {
	t.Parallel()
	a, b := newEnv(t), newEnv(t)
	mk := func(v *env) *saga.Definition[state] {
		return saga.Define("tenant", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))})
	}
	da, db := mk(a), mk(b)
	a.run(t, da)
	b.run(t, db)
	ctx := context.Background()
	sa, err := saga.Start(ctx, a.e, da, state{}, &saga.StartOpts{BusinessKey: "k"})
	require.NoError(t, err)
	sb, err := saga.Start(ctx, b.e, db, state{}, &saga.StartOpts{BusinessKey: "k"})
	require.NoError(t, err)
	waitingFor(t, b.e, sb.ID, "signal", "x")

	_, err = sig(t, a.e, saga.Signal{SagaID: sb.ID, Name: "x", ID: "cross"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotFound)
	r, err := sig(t, a.e, saga.Signal{Saga: "tenant", BusinessKey: "k", Name: "x", ID: "mine"})
	require.NoError(t, err)
	require.Equal(t, sa.ID, r.SagaID)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, a.e, sa.ID, wopts).Status)

	in := get(t, b.e, sb.ID)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.NotNil(t, in.Wait)
	require.Empty(t, signals(t, b.e, sb.ID))
}

// SignalTx counts from its commit: rolled back, it leaves nothing; a rejected
// signal is recorded only when the caller commits.
func TestSignalTxRollback(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("txsig", saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))})
	done := saga.Define("txdone", saga.Step[state]{Name: "a", Action: act[state](v, "a")})
	v.run(t, def, done)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")

	tx, err := v.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = v.e.SignalTx(ctx, tx, saga.Signal{SagaID: st.ID, Name: "x", ID: "rolled", Payload: ev{V: "rolled"}})
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	require.Empty(t, signals(t, v.e, st.ID))
	// The same id again, committed: not a duplicate of the rolled-back one.
	tx, err = v.pool.Begin(ctx)
	require.NoError(t, err)
	r, err := v.e.SignalTx(ctx, tx, saga.Signal{SagaID: st.ID, Name: "x", ID: "rolled", Payload: ev{V: "kept"}})
	require.NoError(t, err)
	require.False(t, r.Duplicate)
	require.NoError(t, tx.Commit(ctx))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	var s state
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"kept"}, s.Got)

	// Rejected inside tx: rolled back, nothing; committed, recorded.
	ended, err := saga.Start(ctx, v.e, done, state{}, nil)
	require.NoError(t, err)
	sagatest.WaitEnded(t, v.e, ended.ID, wopts)
	for _, commit := range []bool{false, true} {
		tx, err := v.pool.Begin(ctx)
		require.NoError(t, err)
		_, err = v.e.SignalTx(ctx, tx, saga.Signal{SagaID: ended.ID, Name: "x", ID: fmt.Sprint(commit)})
		require.ErrorIs(t, err, saga.ErrSignalRejected)
		require.ErrorIs(t, err, saga.ErrNotRunning)
		if commit {
			require.NoError(t, tx.Commit(ctx), "a rejected SignalTx leaves tx usable, to keep the record")
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
	}
	ss := signals(t, v.e, ended.ID)
	require.Len(t, ss, 1)
	require.Equal(t, "true", ss[0].ID)
	require.Equal(t, "rejected", ss[0].Status)
	require.NotEmpty(t, ss[0].Error)
}

// A signal no saga can take (ended, compensating, missing) is recorded as
// rejected with an error wrapping ErrSignalRejected and the reason.
func TestSignalRejected(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	g := newGate()
	ended := saga.Define("ended", saga.Step[state]{Name: "a", Action: act[state](v, "a")})
	comp := saga.Define("comp",
		saga.Step[state]{Name: "a", Action: act[state](v, "a"), Compensate: func(ctx context.Context, _ *saga.StepRun, _ *state) error {
			return g.wait(ctx)
		}},
		saga.Step[state]{Name: "b", Action: func(context.Context, *saga.StepRun, *state) error {
			return steps.Permanent(errors.New("no"))
		}},
		saga.Step[state]{Name: "c", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, ended, comp)
	ctx := context.Background()

	e1, err := saga.Start(ctx, v.e, ended, state{}, &saga.StartOpts{BusinessKey: "e1"})
	require.NoError(t, err)
	sagatest.WaitEnded(t, v.e, e1.ID, wopts)
	for _, s := range []saga.Signal{
		{SagaID: e1.ID, Name: "x", ID: "by-id"},
		{Saga: "ended", BusinessKey: "e1", Name: "x", ID: "by-key"},
	} {
		r, err := sig(t, v.e, s)
		require.ErrorIs(t, err, saga.ErrSignalRejected)
		require.ErrorIs(t, err, saga.ErrNotRunning)
		require.Equal(t, e1.ID, r.SagaID)
	}
	ss := signals(t, v.e, e1.ID)
	require.Len(t, ss, 2)
	for _, s := range ss {
		require.Equal(t, "rejected", s.Status)
		require.NotEmpty(t, s.Error)
	}

	c1, err := saga.Start(ctx, v.e, comp, state{}, nil)
	require.NoError(t, err)
	g.started(t) // compensating "a"
	_, err = sig(t, v.e, saga.Signal{SagaID: c1.ID, Name: "x", ID: "late"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotRunning)
	close(g.release)
	require.Equal(t, saga.StatusCompensated, sagatest.WaitEnded(t, v.e, c1.ID, wopts).Status)

	missing := uuid.New()
	r, err := sig(t, v.e, saga.Signal{SagaID: missing, Name: "x", ID: "nobody"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotFound)
	require.Equal(t, uuid.Nil, r.SagaID)
	_, err = sig(t, v.e, saga.Signal{Saga: "ended", BusinessKey: "nobody", Name: "x", ID: "nobody"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotFound)
}

// A signal to a missing saga id is recorded as rejected, and Engine.Signals
// of that id lists it.
func TestSignalToMissingSagaIsVisible(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("m", saga.Step[state]{Name: "a", Action: act[state](v, "a")})
	v.run(t, def)
	missing := uuid.New()
	_, err := sig(t, v.e, saga.Signal{SagaID: missing, Name: "x", ID: "nobody"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	ss, err := v.e.Signals(context.Background(), missing)
	if err != nil || len(ss) != 1 {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN: a signal to a missing saga id is 'recorded as rejected' (ErrSignalRejected doc, "+
			"README), yet Engine.Signals(missingID) returns %d signals, err=%v: the record is not reachable "+
			"through the public API (signals by name and business key cannot be listed at all)", len(ss), err)
	}
	require.Equal(t, "rejected", ss[0].Status)
}

// A signal for a later await arrives while the saga sleeps: it is kept and
// delivered once the timer has fired.
func TestSignalKeptWhileSleeping(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("sleepsig",
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Hour)},
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	st, err := saga.Start(context.Background(), v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "timer", "")
	_, err = sig(t, v.e, saga.Signal{SagaID: st.ID, Name: "x", ID: "early", Payload: ev{V: "early"}})
	require.NoError(t, err)
	ss := signals(t, v.e, st.ID)
	require.Len(t, ss, 1)
	require.Equal(t, "pending", ss[0].Status)
	require.NoError(t, v.clock().Advance(context.Background(), time.Hour))
	in := sagatest.WaitEnded(t, v.e, st.ID, wopts)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, count(in, "timer_fired:nap"))
	require.Equal(t, 1, v.effects(t, st.ID, "sig:a"))
}

// A signal awaited with a time limit: either the signal or the timeout wins,
// never both, when the signal races the limit's passing.
func TestSignalRacesWaitTimeout(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("limit",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v)).TimeoutThen(time.Hour, nil)},
		saga.Step[state]{Name: "after", Action: act[state](v, "after")},
	)
	v.run(t, def)
	ctx := context.Background()
	const n = 20
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, v.e, def, state{}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	for _, id := range ids {
		waitingFor(t, v.e, id, "signal", "x")
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		assert := v.clock().Advance(ctx, time.Hour)
		if assert != nil {
			t.Error(assert)
		}
	}()
	for _, id := range ids {
		_, err := v.e.Signal(ctx, saga.Signal{SagaID: id, Name: "x", ID: "race", Payload: ev{V: "s"}})
		if err != nil {
			require.ErrorIs(t, err, saga.ErrSignalRejected) // the saga ended first
		}
	}
	wg.Wait()
	for _, id := range ids {
		in := sagatest.WaitEnded(t, v.e, id, wopts)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		got, timedOut := count(in, "signal_received:a"), count(in, "wait_timed_out:a")
		require.Equal(t, 1, got+timedOut, "exactly one of signal and timeout: %s", sagatest.Describe(in))
		require.Equal(t, got, v.effects(t, id, "sig:a"))
		require.Equal(t, 1, v.effects(t, id, "after"))
	}
}

// SignalResult.Seq: "signals of one name are delivered in this order". Two
// senders' transactions overlap: the first to take a sequence number commits
// last. Either the second waits for the first, or the await takes the
// committed one first, and then Seq order is not delivery order.
func TestSignalSeqOrderWithOverlappingTx(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("seq",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, v.e, def, state{}, nil)
	require.NoError(t, err)
	waitingFor(t, v.e, st.ID, "signal", "x")

	tx1, err := v.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx1.Rollback(ctx) //nolint:errcheck
	r1, err := v.e.SignalTx(ctx, tx1, saga.Signal{SagaID: st.ID, Name: "x", ID: "early", Payload: ev{V: "early"}})
	require.NoError(t, err)

	// The second sender, in its own transaction, with a bound on how long
	// it may be held back by the first.
	type res struct {
		r   saga.SignalResult
		err error
	}
	done := make(chan res, 1)
	go func() {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		tx2, err := v.pool.Begin(c)
		if err != nil {
			done <- res{err: err}
			return
		}
		defer tx2.Rollback(ctx) //nolint:errcheck
		r, err := v.e.SignalTx(c, tx2, saga.Signal{SagaID: st.ID, Name: "x", ID: "late", Payload: ev{V: "late"}})
		if err == nil {
			err = tx2.Commit(c)
		}
		done <- res{r, err}
	}()
	r2 := <-done
	if r2.err != nil {
		// Serialised behind the first sender: order is kept, at the cost
		// of blocking. Commit the first and we are done.
		require.NoError(t, tx1.Commit(ctx))
		t.Logf("second SignalTx was held back by the first open one: %v", r2.err)
		return
	}
	require.Greater(t, r2.r.Seq, r1.Seq)
	// The second is committed: the saga takes it at step a.
	sagatest.Wait(t, v.e, st.ID, sagatest.Event("signal_received:a"), wopts)
	require.NoError(t, tx1.Commit(ctx))
	in, ok := poll(t, v.e, st.ID, 20*time.Second, func(in *saga.Instance) bool {
		return in.Status.Terminal() || count(in, "step_completed:a") > 1
	})
	if !ok {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN (bug): the signal committed last is never delivered; see "+
			"TestSignalCommittedLateIsNotMissed:\n%s", sagatest.Describe(in))
	}
	if count(in, "step_completed:a") > 1 {
		t.Fatalf("FIXED FINDING, BROKEN AGAIN (bug): step a ran twice; see TestSignalCommittedLateIsNotMissed:\n%s", sagatest.Describe(in))
	}
	var s state
	require.NoError(t, in.DecodeState(&s))
	// Documented (SignalResult.Seq): an await takes the lowest Seq among the
	// signals committed when it looks, so the one committed first went first.
	require.Equal(t, []string{"late", "early"}, s.Got[:2])
}

// Guarantee 12, "none is missed", under the pattern that once lost a signal
// in TestSignalSeqOrderWithOverlappingTx: a SignalTx that stays open while
// the saga takes a later signal at its first await, and commits once the
// saga waits at its second. Many sagas at once.
func TestSignalCommittedLateIsNotMissed(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("late",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	const n = 24
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, v.e, def, state{}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 2) // each sender holds two connections: leave the engine some
	for _, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			err := func() error {
				tx, err := v.pool.Begin(ctx)
				if err != nil {
					return err
				}
				defer tx.Rollback(ctx) //nolint:errcheck
				if _, err := v.e.SignalTx(ctx, tx, saga.Signal{SagaID: id, Name: "x", ID: "early", Payload: ev{V: "early"}}); err != nil {
					return err
				}
				if _, err := v.e.Signal(ctx, saga.Signal{SagaID: id, Name: "x", ID: "late", Payload: ev{V: "late"}}); err != nil {
					return err
				}
				// Commit at a random moment around the saga's move to its second await.
				time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
				return tx.Commit(ctx)
			}()
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, id := range ids {
		in, ok := poll(t, v.e, id, 20*time.Second, func(in *saga.Instance) bool {
			return in.Status.Terminal() || count(in, "step_completed:a") > 1
		})
		if !ok {
			t.Fatalf("FIXED FINDING, BROKEN AGAIN (bug, guarantee 12 'none is missed'): saga %s waits forever at step b although "+
				"both its signals were committed; Engine.Signals: %+v\n%s", id, signals(t, v.e, id), sagatest.Describe(in))
		}
		if n := count(in, "step_completed:a"); n > 1 {
			t.Fatalf("FIXED FINDING, BROKEN AGAIN (bug, guarantees 3 and 12): the await step a of saga %s completed %d times, its "+
				"handler's run.Tx effect is there %d times, and the second signal was consumed by the second "+
				"run, so step b waits forever for a signal already delivered (missed):\n%s",
				id, n, v.effects(t, id, "sig:a"), sagatest.Describe(in))
		}
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 1, v.effects(t, id, "sig:a"))
		require.Equal(t, 1, v.effects(t, id, "sig:b"))
	}
}

// Two plain Engine.Signal calls at once to a saga waiting at the first of two
// awaits (no caller transaction held open): each await takes one, once.
func TestTwoSignalsAtOnce(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	def := saga.Define("twice",
		saga.Step[state]{Name: "a", Wait: saga.OnSignal("x", appendSig(v))},
		saga.Step[state]{Name: "b", Wait: saga.OnSignal("x", appendSig(v))},
	)
	v.run(t, def)
	ctx := context.Background()
	const n = 24
	ids := make([]uuid.UUID, n)
	for i := range n {
		st, err := saga.Start(ctx, v.e, def, state{}, nil)
		require.NoError(t, err)
		ids[i] = st.ID
	}
	for _, id := range ids {
		waitingFor(t, v.e, id, "signal", "x")
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	sem := make(chan struct{}, 4)
	for _, id := range ids {
		for _, sid := range []string{"one", "two"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				if _, err := v.e.Signal(ctx, saga.Signal{SagaID: id, Name: "x", ID: sid, Payload: ev{V: sid}}); err != nil {
					errs <- err
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, id := range ids {
		in, ok := poll(t, v.e, id, 20*time.Second, func(in *saga.Instance) bool {
			return in.Status.Terminal() || count(in, "step_completed:a") > 1
		})
		if !ok || count(in, "step_completed:a") > 1 {
			t.Fatalf("FIXED FINDING, BROKEN AGAIN (bug): two signals sent at once with Engine.Signal: step a completed %d times "+
				"(effect %d times), saga stuck=%v:\n%s", count(in, "step_completed:a"), v.effects(t, id, "sig:a"),
				!ok, sagatest.Describe(in))
		}
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 1, v.effects(t, id, "sig:a"))
		require.Equal(t, 1, v.effects(t, id, "sig:b"))
	}
}
