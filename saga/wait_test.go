package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// fulfil is the state of the waiting test sagas.
type fulfil struct {
	OrderID string   `json:"order_id"`
	Got     []string `json:"got,omitempty"`
	Child   string   `json:"child,omitempty"`
}

type picked struct {
	Bin string `json:"bin"`
}

// act is a step action that records its effect and appends its name.
func act(schema, name string) saga.StepFunc[fulfil] {
	return func(ctx context.Context, run *saga.StepRun, s *fulfil) error {
		s.Got = append(s.Got, name)
		return recordEffect(ctx, run, schema)
	}
}

func waiting(kind string) sagatest.Until {
	return sagatest.Cond("waiting for a "+kind, func(in *saga.Instance) bool {
		return in.Wait != nil && in.Wait.Kind == kind
	})
}

// waitingAt is a saga that waits at step.
func waitingAt(step string) sagatest.Until {
	return sagatest.Cond("waiting at "+step, func(in *saga.Instance) bool { return in.Step == step && in.Wait != nil })
}

// startWaiting registers def, starts the engine and a saga of def, and
// returns once the saga waits for a signal.
func (b *bundle) startWaiting(t *testing.T, def *saga.Definition[fulfil]) (context.Context, saga.Started) {
	t.Helper()
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
	return ctx, st
}

func waitOpts() *sagatest.WaitOpts { return &sagatest.WaitOpts{Timeout: 20 * time.Second} }

func countEvents(in *saga.Instance, typ string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Type == typ {
			n++
		}
	}
	return n
}

func TestTimerSleepsWithoutWorkersAndFiresOnce(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("sleeper",
		saga.Step[fulfil]{Name: "pay", Action: act(b.schema, "pay")},
		saga.Step[fulfil]{Name: "escalate", Wait: saga.Sleep[fulfil](48 * time.Hour)},
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{OrderID: "o1"}, nil)
	require.NoError(t, err)

	in := sagatest.Wait(t, b.engine, st.ID, waiting("timer"), waitOpts())
	require.Equal(t, "escalate", in.Step)
	require.NotNil(t, in.Wait.Until)
	require.NotNil(t, in.NextCheckAt, "a timed wait keeps a rescue deadline")
	require.True(t, in.NextCheckAt.After(*in.Wait.Until), "the rescuer leaves it alone until after the wait's end")
	// Its command waits in the outbox, due at the wait's end, in database time.
	var due time.Time
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT available_at FROM `+b.table("outbox")+` WHERE saga_id = $1 AND status = 'pending'`,
		st.ID).Scan(&due))
	require.WithinDuration(t, *in.Wait.Until, due, time.Second)

	// The rescuer sees a healthy saga: nothing re-driven an hour in.
	clock := sagatest.NewClock(b.pool, b.schema, b.engine)
	require.NoError(t, clock.Advance(ctx, time.Hour))
	in, err = b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, "timer", in.Wait.Kind)
	require.Zero(t, countEvents(in, saga.EventSagaRescued))

	start := time.Now()
	require.NoError(t, clock.Advance(ctx, 47*time.Hour))
	in = b.waitTerminal(t, st.ID)
	t.Logf("48 hours passed in %s", time.Since(start))
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, countEvents(in, saga.EventTimerFired))
	require.Equal(t, []string{"pay/forward", "ship/forward"}, b.effects(t, st.ID))
	require.Nil(t, in.Wait)
}

func TestTimerSurvivesARestart(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("sleeper",
		saga.Step[fulfil]{Name: "escalate", Wait: saga.SleepFor(func(s *fulfil) time.Duration { return 2 * time.Hour })},
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
	)
	require.NoError(t, b.engine.Register(def))
	require.NoError(t, b.engine.Start(context.Background()))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, waiting("timer"), waitOpts())
	require.NoError(t, b.engine.Stop(ctx))

	second, err := saga.New(b.pool, &saga.Config{Schema: b.schema, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, second.Register(def))
	require.NoError(t, sagatest.NewClock(b.pool, b.schema).Advance(ctx, 2*time.Hour))
	require.NoError(t, second.Start(ctx))
	t.Cleanup(func() { _ = second.Stop(context.Background()) })
	in := sagatest.WaitEnded(t, second, st.ID, waitOpts())
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"ship/forward"}, b.effects(t, st.ID))
}

func TestSleepUntilAPastTimeDoesNotWait(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("late",
		saga.Step[fulfil]{Name: "window", Wait: saga.SleepUntil(func(*fulfil) time.Time { return time.Now().Add(-time.Hour) })},
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Zero(t, countEvents(in, saga.EventWaitStarted))
}

// signalDef waits for "picked" twice, appending each payload's bin.
func signalDef(schema string, timeout func(*saga.Wait[fulfil]) *saga.Wait[fulfil]) *saga.Definition[fulfil] {
	onPicked := func(ctx context.Context, run *saga.StepRun, s *fulfil, p picked) error {
		s.Got = append(s.Got, p.Bin)
		return recordEffect(ctx, run, schema)
	}
	w := saga.OnSignal("picked", onPicked)
	if timeout != nil {
		w = timeout(w)
	}
	return saga.Define("fulfil",
		saga.Step[fulfil]{Name: "reserve", Action: act(schema, "reserve"), Compensate: act(schema, "release")},
		saga.Step[fulfil]{Name: "first", Wait: w},
		saga.Step[fulfil]{Name: "second", Wait: saga.OnSignal("picked", onPicked)},
	)
}

func TestSignalsSentBeforeTheAwaitAreDeliveredInOrder(t *testing.T) {
	b := setup(t, nil)
	release := make(chan struct{})
	def := saga.Define("fulfil",
		saga.Step[fulfil]{Name: "gate", Action: func(ctx context.Context, run *saga.StepRun, s *fulfil) error {
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}},
		saga.Step[fulfil]{Name: "first", Wait: saga.OnSignal("picked", func(_ context.Context, _ *saga.StepRun, s *fulfil, p picked) error {
			s.Got = append(s.Got, p.Bin)
			return nil
		})},
		saga.Step[fulfil]{Name: "second", Wait: saga.OnSignal("picked", func(_ context.Context, _ *saga.StepRun, s *fulfil, p picked) error {
			s.Got = append(s.Got, p.Bin)
			return nil
		})},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, &saga.StartOpts{BusinessKey: "order-7"})
	require.NoError(t, err)
	// Both signals arrive while the saga is still at its first step.
	for _, bin := range []string{"A1", "B2"} {
		res, err := b.engine.Signal(ctx, saga.Signal{Saga: "fulfil", BusinessKey: "order-7", Name: "picked", ID: "wh-" + bin,
			Payload: picked{Bin: bin}})
		require.NoError(t, err)
		require.Equal(t, st.ID, res.SagaID)
		require.False(t, res.Duplicate)
	}
	close(release)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	var s fulfil
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"A1", "B2"}, s.Got)
	require.Equal(t, 2, countEvents(in, saga.EventSignalReceived))
	sigs, err := b.engine.Signals(ctx, st.ID)
	require.NoError(t, err)
	require.Len(t, sigs, 2)
	for _, g := range sigs {
		require.Equal(t, "delivered", g.Status)
		require.NotNil(t, g.DeliveredAt)
	}
	require.Equal(t, []string{"first", "second"}, []string{sigs[0].Step, sigs[1].Step})
}

func TestADuplicateSignalHasOneEffect(t *testing.T) {
	b := setup(t, nil)
	def := signalDef(b.schema, nil)
	ctx, st := b.startWaiting(t, def)

	sig := saga.Signal{SagaID: st.ID, Name: "picked", ID: "event-1", Payload: picked{Bin: "A1"}}
	first, err := b.engine.Signal(ctx, sig)
	require.NoError(t, err)
	require.False(t, first.Duplicate)
	sagatest.Wait(t, b.engine, st.ID, waitingAt("second"), waitOpts())
	again, err := b.engine.Signal(ctx, sig)
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, first.Seq, again.Seq)

	// The duplicate satisfied nothing: the saga still waits at its second
	// await, and a new signal is what completes it.
	require.Never(t, func() bool {
		in, err := b.engine.Get(ctx, st.ID)
		return err != nil || in.Status != saga.StatusRunning
	}, 500*time.Millisecond, 50*time.Millisecond)
	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked", ID: "event-2", Payload: picked{Bin: "B2"}})
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "first/forward", "second/forward"}, b.effects(t, st.ID))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")+` WHERE saga_id = $1`, st.ID))
}

func TestAnAwaitThatTimesOut(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout func(*saga.Wait[fulfil]) *saga.Wait[fulfil]
		status  saga.Status
		code    string
		effects []string
	}{
		{"compensates", func(w *saga.Wait[fulfil]) *saga.Wait[fulfil] { return w.Timeout(time.Hour) },
			saga.StatusCompensated, saga.CodeWaitTimeout, []string{"reserve/forward", "reserve/compensate"}},
		{"goes on", func(w *saga.Wait[fulfil]) *saga.Wait[fulfil] { return w.TimeoutThen(time.Hour, nil) },
			saga.StatusRunning, "", []string{"reserve/forward"}},
		{"runs its handler", func(w *saga.Wait[fulfil]) *saga.Wait[fulfil] {
			return w.TimeoutThen(time.Hour, func(ctx context.Context, run *saga.StepRun, s *fulfil) error {
				s.Got = append(s.Got, "timed-out")
				return steps.Permanent(steps.WithCode("no_pick", errors.New("the warehouse never picked")))
			})
		}, saga.StatusCompensated, "no_pick", []string{"reserve/forward", "reserve/compensate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, nil)
			def := signalDef(b.schema, tc.timeout)
			require.NoError(t, b.engine.Register(def))
			b.start(t)
			ctx := context.Background()
			st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
			require.NoError(t, err)
			in := sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
			require.NotNil(t, in.Wait.Until)
			require.NoError(t, sagatest.NewClock(b.pool, b.schema, b.engine).Advance(ctx, time.Hour))
			if tc.status == saga.StatusRunning {
				in = sagatest.Wait(t, b.engine, st.ID, waitingAt("second"), waitOpts())
				require.Nil(t, in.Wait.Until, "the second await has no time limit")
				require.Nil(t, in.NextCheckAt, "a wait without a time limit has no rescue deadline")
				require.Equal(t, 1, countEvents(in, saga.EventWaitTimedOut))
			} else {
				in = b.waitTerminal(t, st.ID)
				require.Equal(t, tc.status, in.Status)
				require.Equal(t, tc.code, in.LastError.Code)
			}
			require.Equal(t, tc.effects, b.effects(t, st.ID))
		})
	}
}

func TestASignalToAnEndedOrMissingSagaIsRecordedAndRefused(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("quick", saga.Step[fulfil]{Name: "only", Action: act(b.schema, "only")})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, &saga.StartOpts{BusinessKey: "k1"})
	require.NoError(t, err)
	b.waitTerminal(t, st.ID)

	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked", ID: "late-1"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotRunning)
	require.Contains(t, err.Error(), "completed")
	sigs, err := b.engine.Signals(ctx, st.ID)
	require.NoError(t, err)
	require.Len(t, sigs, 1)
	require.Equal(t, "rejected", sigs[0].Status)
	require.Contains(t, sigs[0].Error, "completed")
	// The same signal again: still refused, still one record.
	res, err := b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked", ID: "late-1"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotRunning)
	require.True(t, res.Duplicate)

	_, err = b.engine.Signal(ctx, saga.Signal{Saga: "quick", BusinessKey: "nobody", Name: "picked", ID: "x"})
	require.ErrorIs(t, err, saga.ErrSignalRejected)
	require.ErrorIs(t, err, saga.ErrNotFound)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")+
		` WHERE saga_id IS NULL AND target = 'quick/nobody' AND status = 'rejected'`))
	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: uuid.New(), Name: "picked"})
	require.ErrorIs(t, err, saga.ErrNotFound)
}

func TestSignalInputPostgreSQLRefusesIsAClearError(t *testing.T) {
	b := setup(t, nil)
	def := signalDef(b.schema, nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	long := strings.Repeat("k", 10_000)
	for _, tc := range []struct {
		name string
		sig  saga.Signal
		want string
	}{
		{"NUL in the name", saga.Signal{SagaID: st.ID, Name: "pick\x00ed"}, "Name"},
		{"invalid UTF-8 id", saga.Signal{SagaID: st.ID, Name: "picked", ID: "\xff\xfe"}, "Signal.ID"},
		{"10 kB business key", saga.Signal{Saga: "fulfil", BusinessKey: long, Name: "picked"}, "Signal.BusinessKey"},
		{"10 kB name", saga.Signal{SagaID: st.ID, Name: long}, "Name"},
		{"payload not JSON", saga.Signal{SagaID: st.ID, Name: "picked", Payload: json.RawMessage("{nope")}, "Payload"},
		{"no address", saga.Signal{Name: "picked"}, "SagaID"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := b.engine.Signal(ctx, tc.sig)
			require.ErrorIs(t, err, saga.ErrInvalidInput)
			require.Contains(t, err.Error(), tc.want)
		})
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")))
	// A payload with a NUL (valid JSON) is kept as bytes, and a handler
	// that cannot take it fails the step with a clear code.
	sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked", Payload: json.RawMessage(`{"bin": 7}`)})
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeSignalPayload, in.LastError.Code)
}

func TestSignalTxCountsWithTheCallersCommit(t *testing.T) {
	b := setup(t, nil)
	def := signalDef(b.schema, nil)
	ctx, st := b.startWaiting(t, def)

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.engine.SignalTx(ctx, tx, saga.Signal{SagaID: st.ID, Name: "picked", ID: "rolled-back", Payload: picked{Bin: "X"}})
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")))

	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := b.engine.SignalTx(ctx, tx, saga.Signal{SagaID: st.ID, Name: "picked", ID: "kept", Payload: picked{Bin: "Y"}})
		return err
	}))
	sagatest.Wait(t, b.engine, st.ID, sagatest.Step("second"), waitOpts())
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	var s fulfil
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, []string{"reserve", "Y"}, s.Got)
}

// childDefs is a parent whose second step runs a child saga.
func childDefs(schema string, childFails bool, childSleeps time.Duration) (*saga.Definition[fulfil], *saga.Definition[fulfil]) {
	childSteps := []saga.Step[fulfil]{
		{Name: "pack", Action: act(schema, "pack"), Compensate: act(schema, "unpack")},
	}
	if childSleeps > 0 {
		childSteps = append(childSteps, saga.Step[fulfil]{Name: "nap", Wait: saga.Sleep[fulfil](childSleeps)})
	}
	childSteps = append(childSteps, saga.Step[fulfil]{Name: "label", Action: func(ctx context.Context, run *saga.StepRun, s *fulfil) error {
		if childFails {
			return steps.Permanent(steps.WithCode("no_label", errors.New("printer on fire")))
		}
		s.Got = append(s.Got, "labelled")
		return recordEffect(ctx, run, schema)
	}})
	child := saga.Define("packing", childSteps...)
	parent := saga.Define("order",
		saga.Step[fulfil]{Name: "charge", Action: act(schema, "charge"), Compensate: act(schema, "refund")},
		saga.Step[fulfil]{Name: "pack", Wait: saga.Child(child,
			func(_ context.Context, run *saga.StepRun, s *fulfil) (fulfil, *saga.StartOpts, error) {
				return fulfil{OrderID: s.OrderID}, nil, nil
			},
			func(_ context.Context, _ *saga.StepRun, s *fulfil, c fulfil) error {
				s.Child = strings.Join(c.Got, ",")
				return nil
			})},
		saga.Step[fulfil]{Name: "notify", Action: act(schema, "notify")},
	)
	return parent, child
}

func TestAChildSagasResultIsTyped(t *testing.T) {
	b := setup(t, nil)
	parent, child := childDefs(b.schema, false, 0)
	require.NoError(t, b.engine.Register(parent, child))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, parent, fulfil{OrderID: "o9"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s fulfil
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, "pack,labelled", s.Child)
	// One child, with the id derived from the step's key, naming its parent.
	rows, err := b.pool.Query(ctx, `SELECT id FROM `+b.table("saga_instances")+` WHERE parent_id = $1`, st.ID)
	require.NoError(t, err)
	kids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	require.Len(t, kids, 1)
	kid, err := b.engine.Get(ctx, kids[0])
	require.NoError(t, err)
	require.Equal(t, st.ID, *kid.ParentID)
	require.Equal(t, saga.StatusCompleted, kid.Status)
	require.Equal(t, 1, countEvents(in, saga.EventChildStarted))
	require.Equal(t, 1, countEvents(in, saga.EventChildEnded))
}

func TestAFailedChildMakesTheParentCompensate(t *testing.T) {
	b := setup(t, nil)
	parent, child := childDefs(b.schema, true, 0)
	require.NoError(t, b.engine.Register(parent, child))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, parent, fulfil{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, saga.CodeChildFailed, in.LastError.Code)
	require.Contains(t, in.LastError.Message, "no_label")
	require.Equal(t, []string{"charge/forward", "pack/forward", "pack/compensate", "charge/compensate"}, b.effectsAll(t))
}

func TestCancellingAParentCancelsItsChild(t *testing.T) {
	b := setup(t, nil)
	parent, child := childDefs(b.schema, false, 24*time.Hour)
	require.NoError(t, b.engine.Register(parent, child))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, parent, fulfil{}, nil)
	require.NoError(t, err)
	in := sagatest.Wait(t, b.engine, st.ID, waiting("child"), waitOpts())
	kidID := uuid.MustParse(in.Wait.For)
	sagatest.Wait(t, b.engine, kidID, waiting("timer"), waitOpts())

	require.NoError(t, b.engine.Cancel(ctx, st.ID, "customer changed their mind"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	kid := b.waitTerminal(t, kidID)
	require.Equal(t, saga.StatusCompensated, kid.Status, sagatest.Describe(kid))
	require.Equal(t, saga.CodeCancelled, kid.LastError.Code)
	require.Contains(t, kid.LastError.Message, "customer changed their mind")
	require.ElementsMatch(t, []string{"charge/forward", "pack/forward", "pack/compensate", "charge/compensate"}, b.effectsAll(t))
	// The timers of both are gone, not left to fire.
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.table("outbox")+` WHERE status = 'pending' AND available_at > now()`))
}

func TestADeadlineCompensatesASagaThatWaitsTooLong(t *testing.T) {
	b := setup(t, nil)
	def := signalDef(b.schema, nil).WithDeadline(30 * time.Minute)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	in := sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
	require.NotNil(t, in.Deadline)
	require.NoError(t, sagatest.NewClock(b.pool, b.schema, b.engine).Advance(ctx, 31*time.Minute))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeDeadline, in.LastError.Code)
	require.Equal(t, []string{"reserve/forward", "reserve/compensate"}, b.effects(t, st.ID))

	// A per-saga deadline overrides the definition's.
	st2, err := saga.Start(ctx, b.engine, def, fulfil{}, &saga.StartOpts{Deadline: 2 * time.Hour})
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st2.ID, waiting("signal"), waitOpts())
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Deadlines)
	in, err = b.engine.Get(ctx, st2.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status)
}

func TestListFiltersWaitingSagas(t *testing.T) {
	b := setup(t, nil)
	def := signalDef(b.schema, nil)
	quick := saga.Define("quick", saga.Step[fulfil]{Name: "only", Action: act(b.schema, "only")})
	require.NoError(t, b.engine.Register(def, quick))
	b.start(t)
	ctx := context.Background()
	w, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	q, err := saga.Start(ctx, b.engine, quick, fulfil{}, nil)
	require.NoError(t, err)
	b.waitTerminal(t, q.ID)
	sagatest.Wait(t, b.engine, w.ID, waiting("signal"), waitOpts())
	res, err := b.engine.List(ctx, &saga.ListOpts{Waiting: true})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 1)
	require.Equal(t, w.ID, res.Sagas[0].ID)
	require.Equal(t, "picked", res.Sagas[0].Wait.For)
}

func TestWaitDefinitionsAreChecked(t *testing.T) {
	e, err := saga.New(dummyPool(t), &saga.Config{Schema: "x"})
	require.NoError(t, err)
	noop := func(context.Context, *saga.StepRun, *fulfil) error { return nil }
	for _, tc := range []struct {
		name string
		step saga.Step[fulfil]
		want string
	}{
		{"wait and action", saga.Step[fulfil]{Name: "s", Wait: saga.Sleep[fulfil](time.Second), Action: noop}, "a step waits, or acts"},
		{"bad signal name", saga.Step[fulfil]{Name: "s", Wait: saga.OnSignal[fulfil, picked]("bad\x00", nil)}, "signal name"},
		{"no handler", saga.Step[fulfil]{Name: "s", Wait: saga.OnSignal[fulfil, picked]("picked", nil)}, "needs a handler"},
		{"timer with timeout", saga.Step[fulfil]{Name: "s", Wait: saga.Sleep[fulfil](time.Second).Timeout(time.Minute)}, "a timer has no timeout"},
		{"zero timeout", saga.Step[fulfil]{Name: "s", Wait: saga.OnSignal("p", func(context.Context, *saga.StepRun, *fulfil, picked) error { return nil }).Timeout(0)}, "must be positive"},
		{"child without definition", saga.Step[fulfil]{Name: "s", Wait: saga.Child[fulfil, fulfil](nil, nil, nil)}, "Child needs"},
		{"empty wait", saga.Step[fulfil]{Name: "s", Wait: &saga.Wait[fulfil]{}}, "was not made by"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := e.Register(saga.Define("d", tc.step))
			require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

// effectsAll returns "step/direction" of every effect row, of every saga,
// in commit order.
func (b *bundle) effectsAll(t *testing.T) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), "SELECT step || '/' || direction FROM "+b.table("effects")+" ORDER BY seq")
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// TestKafkaModeWaits: Kafka cannot delay a message, so a timer's command
// waits in the outbox and the relay publishes it when it is due; a signal's
// wake-up and a child's end travel through Kafka like any command.
func TestKafkaModeWaits(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 2, "ksleeper", "order", "packing")
	sleeper := saga.Define("ksleeper",
		saga.Step[fulfil]{Name: "nap", Wait: saga.Sleep[fulfil](6 * time.Hour)},
		saga.Step[fulfil]{Name: "picked", Wait: saga.OnSignal("picked", func(_ context.Context, _ *saga.StepRun, s *fulfil, p picked) error {
			s.Got = append(s.Got, p.Bin)
			return nil
		})},
		saga.Step[fulfil]{Name: "ship", Action: act(k.schema, "ship")},
	)
	parent, child := childDefs(k.schema, false, 0)
	require.NoError(t, k.engine.Register(sleeper, parent, child))
	k.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, sleeper, fulfil{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, k.engine, st.ID, waiting("timer"), waitOpts())
	// The timer's command is a relay row, not published: it is not due.
	require.Equal(t, 1, k.count(t, `SELECT count(*) FROM `+k.table("outbox")+
		` WHERE saga_id = $1 AND delivery = 'relay' AND status = 'pending' AND available_at > now() + interval '5 hours'`, st.ID))
	require.NoError(t, sagatest.NewClock(k.pool, k.schema, k.engine).Advance(ctx, 6*time.Hour))
	sagatest.Wait(t, k.engine, st.ID, waiting("signal"), waitOpts())
	_, err = k.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked", ID: "p1", Payload: picked{Bin: "K9"}})
	require.NoError(t, err)
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, countEvents(in, saga.EventTimerFired))

	ps, err := saga.Start(ctx, k.engine, parent, fulfil{}, nil)
	require.NoError(t, err)
	in = k.waitTerminal(t, ps.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var s fulfil
	require.NoError(t, in.DecodeState(&s))
	require.Equal(t, "pack,labelled", s.Child)
}

// TestATimersCommandThatComesEarlyDoesNotEndTheWait: the wait ends by the
// database's clock against the stored end, not because its command ran (a
// command made due by hand, or delivered early, waits on).
func TestATimersCommandThatComesEarlyDoesNotEndTheWait(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("sleeper",
		saga.Step[fulfil]{Name: "nap", Wait: saga.Sleep[fulfil](3 * time.Hour)},
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	first := sagatest.Wait(t, b.engine, st.ID, waiting("timer"), waitOpts())
	_, err = b.pool.Exec(ctx, `UPDATE `+b.table("outbox")+` SET available_at = now() WHERE saga_id = $1 AND status = 'pending'`, st.ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `SELECT pg_notify($1, 'x')`, b.schema+"_sagaflow")
	require.NoError(t, err)
	// The command ran (the saga's version moved) and the saga waits on,
	// until the same end, with its command due then again.
	in := sagatest.Wait(t, b.engine, st.ID, sagatest.Cond("the early command ran", func(in *saga.Instance) bool {
		return in.Version > first.Version
	}), waitOpts())
	require.Equal(t, saga.StatusRunning, in.Status)
	require.Equal(t, "nap", in.Step)
	require.NotNil(t, in.Wait)
	require.WithinDuration(t, *first.Wait.Until, *in.Wait.Until, time.Second)
	require.Zero(t, countEvents(in, saga.EventTimerFired))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("outbox")+
		` WHERE saga_id = $1 AND status = 'pending' AND available_at > now() + interval '2 hours'`, st.ID))
}

// TestTheStepAfterAWaitRunsInTheSameTransaction: when a signal ends a wait
// and the next step is a local action, that step runs at once, in the
// transaction that delivered the signal (one claim and commit fewer),
// exactly once, and in the same update of the saga's row: no command is
// written for it.
func TestTheStepAfterAWaitRunsInTheSameTransaction(t *testing.T) {
	b := setup(t, nil)
	b.logWrites(t)
	xid := func(ctx context.Context, run *saga.StepRun, s *fulfil) error {
		var x string
		if err := run.Tx.QueryRow(ctx, "SELECT txid_current()::text").Scan(&x); err != nil {
			return err
		}
		s.Got = append(s.Got, run.Step+":"+x)
		return recordEffect(ctx, run, b.schema)
	}
	def := saga.Define("inline",
		saga.Step[fulfil]{Name: "picked", Wait: saga.OnSignal("picked", func(ctx context.Context, run *saga.StepRun, s *fulfil, _ picked) error {
			return xid(ctx, run, s)
		})},
		saga.Step[fulfil]{Name: "ship", Action: xid},
		saga.Step[fulfil]{Name: "bill", Action: act(b.schema, "bill")},
	)
	ctx, st := b.startWaiting(t, def)
	_, err := b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked"})
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"picked/forward", "ship/forward", "bill/forward"}, b.effects(t, st.ID))
	var s fulfil
	require.NoError(t, in.DecodeState(&s))
	require.Len(t, s.Got, 3)
	picked, ship := strings.TrimPrefix(s.Got[0], "picked:"), strings.TrimPrefix(s.Got[1], "ship:")
	require.Equal(t, picked, ship, "the signal's delivery and the next step ran in one transaction")
	require.Equal(t, []string{
		"picked -> picked", // the wait starts
		"picked -> bill",   // the signal, and ship, which ran with it
		"bill -> bill",     // bill completes the saga
	}, b.logged(t, "update_log", st.ID), "the updates of the saga's row, in order")
	require.Equal(t, []string{"picked direct", "sagaflow.wake direct", "bill direct"}, b.logged(t, "outbox_log", st.ID),
		"the outbox rows written for the saga, in order (the start's command, the signal's wake-up, bill's): none for ship")
	require.Equal(t, []string{"saga_started", "wait_started:picked", "signal_received:picked", "step_completed:picked",
		"step_completed:ship", "step_completed:bill", "saga_completed"}, eventTypes(in), "the history, in order")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")+` WHERE saga_id = $1 AND status = 'delivered'`, st.ID),
		"the signal is recorded as delivered")
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.table("outbox")+` WHERE saga_id = $1 AND status = 'pending'`, st.ID))
}

// TestTheStepAfterATimerRunsInTheSameUpdate: a timer's end and the local
// step after it are one update of the saga's row, in the batch that claimed
// the timer's command, with no command written for the step; the step runs
// once.
func TestTheStepAfterATimerRunsInTheSameUpdate(t *testing.T) {
	b := setup(t, nil)
	b.logWrites(t)
	def := saga.Define("nap",
		saga.Step[fulfil]{Name: "nap", Wait: saga.Sleep[fulfil](300 * time.Millisecond)},
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, fulfil{OrderID: "o1"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, []string{"ship/forward"}, b.effects(t, st.ID))
	require.Equal(t, []string{"nap -> nap", "nap -> ship"}, b.logged(t, "update_log", st.ID),
		"the wait's start, then its end with ship, which completed the saga")
	require.Equal(t, []string{"nap direct", "nap direct"}, b.logged(t, "outbox_log", st.ID),
		"the start's command and the timer's: none for ship")
	require.Equal(t, []string{"saga_started", "wait_started:nap", "timer_fired:nap", "step_completed:nap",
		"step_completed:ship", "saga_completed"}, eventTypes(in), "the history, in order")
	require.Equal(t, int64(1), b.engine.Stats().Chained)
}

// TestTheStepAfterAWaitFailsOrStopsAlone: the local step run in the update
// that ends a wait has a savepoint of its own. Its failure is written with
// the wait's end (the signal taken once, the handler's write kept) and the
// step retried; a cancel that interrupts it undoes only its writes; and a
// pause committed while the signal's handler runs keeps it from running:
// the wait's end is written with its command, held until the resume.
func TestTheStepAfterAWaitFailsOrStopsAlone(t *testing.T) {
	b := setup(t, nil)
	signalGate, shipGate := testkit.NewGate(), testkit.NewGate()
	t.Cleanup(signalGate.Open)
	t.Cleanup(shipGate.Open)
	var ships sync.Map // order id → *atomic.Int32
	def := saga.Define("alone",
		saga.Step[fulfil]{Name: "picked", Wait: saga.OnSignal("picked", func(ctx context.Context, run *saga.StepRun, s *fulfil, _ picked) error {
			if s.OrderID == "paused" {
				if err := signalGate.Pass(ctx); err != nil {
					return err
				}
			}
			return recordEffect(ctx, run, b.schema)
		})},
		saga.Step[fulfil]{Name: "ship", Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
			Action: func(ctx context.Context, run *saga.StepRun, s *fulfil) error {
				if err := recordEffect(ctx, run, b.schema); err != nil {
					return err
				}
				n, _ := ships.LoadOrStore(s.OrderID, new(atomic.Int32))
				if n.(*atomic.Int32).Add(1) > 1 {
					return nil
				}
				switch s.OrderID {
				case "flaky":
					return errors.New("the carrier is busy")
				case "cancelled":
					_ = shipGate.Pass(ctx) // until the cancel interrupts it
					return ctx.Err()
				}
				return nil
			}},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	signalled := func(id string) uuid.UUID {
		st, err := saga.Start(ctx, b.engine, def, fulfil{OrderID: id}, nil)
		require.NoError(t, err)
		sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
		_, err = b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked"})
		require.NoError(t, err)
		return st.ID
	}
	delivered := func(id uuid.UUID) int {
		return b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")+` WHERE saga_id = $1 AND status = 'delivered'`, id)
	}

	flaky := signalled("flaky")
	in := b.waitTerminal(t, flaky)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, []string{"saga_started", "wait_started:picked", "signal_received:picked", "step_completed:picked",
		"step_failed:ship", "step_completed:ship", "saga_completed"}, eventTypes(in))
	require.Equal(t, []string{"picked/forward", "ship/forward"}, b.effects(t, flaky), "the failed attempt's write was undone, the handler's kept")
	require.Equal(t, 1, delivered(flaky))

	cancelled := signalled("cancelled")
	waitFor(t, 15*time.Second, func() bool { return shipGate.Entered() == 1 }, "ship to run")
	require.NoError(t, b.engine.Cancel(ctx, cancelled, "the customer called"))
	in = b.waitTerminal(t, cancelled)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Contains(t, eventTypes(in), "signal_received:picked")
	require.Equal(t, []string{"picked/forward"}, b.effects(t, cancelled), "ship's write was undone, the handler's kept")
	require.Equal(t, 1, delivered(cancelled))

	paused := signalled("paused")
	waitFor(t, 15*time.Second, func() bool { return signalGate.Entered() == 1 }, "the signal to be taken")
	require.NoError(t, b.engine.Pause(ctx, paused, "operator looks at it"))
	signalGate.Open()
	waitFor(t, 15*time.Second, func() bool {
		in, err := b.engine.Get(ctx, paused)
		require.NoError(t, err)
		return in.Step == "ship"
	}, "the wait's end to be written")
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, []string{"picked/forward"}, b.effects(t, paused), "ship did not run while paused")
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+
		" WHERE saga_id = $1 AND delivery = 'direct' AND paused_from IS NOT NULL", paused), "ship's command is held")
	require.Equal(t, 1, delivered(paused))
	require.NoError(t, b.engine.Resume(ctx, paused, "looked at"))
	in = b.waitTerminal(t, paused)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, []string{"picked/forward", "ship/forward"}, b.effects(t, paused))
}

// TestADeafStepAfterAWaitCountsItsAttempts: a step run at once after a
// wait's end that ignores its context past its Timeout and HandlerGrace is
// abandoned, and the wait's end is lost with the transaction (only the
// attempt's history entry is recorded). The wait's end comes again (the
// timer's command, the signal's wake-up) and is then written on its own,
// with the step's command: the step is claimed on its own, its abandoned
// attempts count, and the saga fails the step for good and compensates
// once they are spent. Before, the step ran at once every time, was
// abandoned every time, and its saga never moved.
func TestADeafStepAfterAWaitCountsItsAttempts(t *testing.T) {
	allowErrorLogs(t) // each abandonment is logged as an error
	b := setup(t, &saga.Config{Workers: 1, HandlerGrace: 100 * time.Millisecond})
	var deaf atomic.Int32 // abandoned handlers still running
	t.Cleanup(func() {
		for deadline := time.Now().Add(5 * time.Second); deaf.Load() > 0 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
	})
	ship := saga.Step[fulfil]{Name: "ship", Timeout: 100 * time.Millisecond,
		Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
		Action: func(context.Context, *saga.StepRun, *fulfil) error {
			deaf.Add(1)
			defer deaf.Add(-1)
			time.Sleep(400 * time.Millisecond) // ignores its context
			return nil
		}}
	nap := saga.Define("deafnap", saga.Step[fulfil]{Name: "nap", Wait: saga.Sleep[fulfil](50 * time.Millisecond)}, ship)
	signalled := saga.Define("deafsignal", saga.Step[fulfil]{Name: "picked", Wait: saga.OnSignal("picked",
		func(ctx context.Context, run *saga.StepRun, _ *fulfil, _ picked) error {
			return recordEffect(ctx, run, b.schema)
		})}, ship)
	require.NoError(t, b.engine.Register(nap, signalled))
	b.start(t)
	ctx := context.Background()

	st, err := saga.Start(ctx, b.engine, nap, fulfil{OrderID: "o1"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, []string{"saga_started", "wait_started:nap",
		"step_failed:ship", // run at once after the timer, abandoned: the timer's end went with it
		"timer_fired:nap", "step_completed:nap",
		"step_failed:ship", "step_failed:ship", // claimed on its own: both attempts count
		"saga_compensated"}, eventTypes(in))

	st, err = saga.Start(ctx, b.engine, signalled, fulfil{OrderID: "o2"}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
	_, err = b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked"})
	require.NoError(t, err)
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, []string{"saga_started", "wait_started:picked", "step_failed:ship",
		"signal_received:picked", "step_completed:picked", "step_failed:ship", "step_failed:ship", "saga_compensated"}, eventTypes(in))
	require.Equal(t, []string{"picked/forward"}, b.effects(t, st.ID), "the signal took effect once")
}

// TestAForgedWakeUpDoesNothing: a sagaflow.wake carries no authority. One
// that names a step the saga is not at, or a saga with no signal pending,
// leaves the saga waiting and runs nothing; one for a saga that does not
// exist is parked, not dropped.
func TestAForgedWakeUpDoesNothing(t *testing.T) {
	b := setup(t, nil)
	def := signalDef(b.schema, nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{}, nil)
	require.NoError(t, err)
	before := sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())
	forge := func(sagaID uuid.UUID, step string) uuid.UUID {
		t.Helper()
		id := uuid.Must(uuid.NewV7())
		payload := wire.EncodeCommand(wire.Command{SagaID: wire.UUID(sagaID), Saga: "fulfil", Step: step,
			Direction: wire.Direction("forward"), Epoch: 0, Version: 99})
		_, err := b.pool.Exec(ctx, `INSERT INTO `+b.table("outbox")+` (id, topic, delivery, aggregatetype, aggregateid, type, payload, saga_id)
			VALUES ($1, $2, 'direct', 'saga.fulfil', $3, $4, $5, $6)`, id, saga.CommandTopicDefault, sagaID.String(), wire.TypeWake, payload, sagaID)
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, b.schema+"_sagaflow", saga.CommandTopicDefault)
		require.NoError(t, err)
		return id
	}
	first, second := forge(st.ID, "second"), forge(st.ID, "first")
	ghost := uuid.Must(uuid.NewV7())
	forged := forge(ghost, "first")
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.table("outbox")+` WHERE id = ANY($1) AND status = 'pending'`,
			[]uuid.UUID{first, second, forged}) == 0
	}, "the forged wake-ups to be consumed")
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, before.Version, in.Version, "nothing ran")
	require.Equal(t, "first", in.Step)
	require.NotNil(t, in.Wait)
	require.Equal(t, []string{"reserve/forward"}, b.effects(t, st.ID))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("outbox")+` WHERE id = $1 AND status = 'dead'`, forged),
		"a wake-up for a saga that does not exist is parked")
}

// TestTheStepAfterAWaitDoesNotRunOverAFailedEnd: a signal handler that
// leaves its transaction aborted (and returns nil) has its attempt
// recorded as failed; the step after the wait must not run in its batch on
// top of that failure, and runs once, after the retry that succeeds.
func TestTheStepAfterAWaitDoesNotRunOverAFailedEnd(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("abort",
		saga.Step[fulfil]{Name: "picked", Retry: fastRetry, Wait: saga.OnSignal("picked",
			func(ctx context.Context, run *saga.StepRun, _ *fulfil, _ picked) error {
				if run.Attempt == 1 {
					_, _ = run.Tx.Exec(ctx, "SELECT 1/0") // ignored: the transaction is aborted
				}
				return nil
			})},
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
	)
	ctx, st := b.startWaiting(t, def)
	_, err := b.engine.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "picked"})
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, []string{"ship/forward"}, b.effects(t, st.ID), "ship ran once")
	require.Contains(t, eventTypes(in), "step_failed:picked")
	require.Equal(t, 1, countEvents(in, saga.EventSignalReceived), "the signal took effect once")
}

// TestAChildInputPostgreSQLRefusesFailsTheStep: a Child input whose
// business key or state PostgreSQL cannot store fails the step for good
// with a clear code (child_start), and the parent compensates; nothing is
// half-started.
func TestAChildInputPostgreSQLRefusesFailsTheStep(t *testing.T) {
	for _, tc := range []struct {
		name  string
		key   string
		state string
		want  string
	}{
		{"NUL in the business key", "order\x00", "", "BusinessKey"},
		{"invalid UTF-8 in the business key", "order\xff", "", "BusinessKey"},
		{"10 kB business key", strings.Repeat("k", 10_000), "", "BusinessKey"},
		{"NUL in the state", "", "a\x00b", "NUL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, nil)
			child := saga.Define("kid", saga.Step[fulfil]{Name: "one", Action: act(b.schema, "kid")})
			parent := saga.Define("parent",
				saga.Step[fulfil]{Name: "charge", Action: act(b.schema, "charge"), Compensate: act(b.schema, "refund")},
				saga.Step[fulfil]{Name: "kid", Wait: saga.Child(child,
					func(context.Context, *saga.StepRun, *fulfil) (fulfil, *saga.StartOpts, error) {
						return fulfil{OrderID: tc.state}, &saga.StartOpts{BusinessKey: tc.key}, nil
					}, nil)},
			)
			require.NoError(t, b.engine.Register(parent, child))
			b.start(t)
			st, err := saga.Start(context.Background(), b.engine, parent, fulfil{}, nil)
			require.NoError(t, err)
			in := b.waitTerminal(t, st.ID)
			require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
			require.Equal(t, saga.CodeChildStart, in.LastError.Code)
			require.Contains(t, in.LastError.Message, tc.want)
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.table("saga_instances")+` WHERE saga_name = 'kid'`))
			require.Equal(t, []string{"charge/forward", "charge/compensate"}, b.effects(t, st.ID))
		})
	}
}
