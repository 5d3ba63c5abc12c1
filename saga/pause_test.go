package saga_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// gatedSaga is reserve, charge, ship, each recording its effect (and
// compensable); charge blocks until gate is closed when gate is not nil.
func gatedSaga(b *bundle, name string, entered chan<- struct{}, gate <-chan struct{}) *saga.Definition[order] {
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	charge := func(ctx context.Context, run *saga.StepRun, o *order) error {
		if gate != nil && run.Direction == steps.Forward {
			entered <- struct{}{}
			<-gate
		}
		return rec(ctx, run, o)
	}
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: rec, Compensate: rec},
		saga.Step[order]{Name: "charge", Action: charge, Compensate: rec},
		saga.Step[order]{Name: "ship", Action: rec, Compensate: rec},
	)
}

// heldCommands counts a saga's pending commands that a pause holds.
func (b *bundle) heldCommands(t *testing.T, id uuid.UUID) int {
	return b.count(t, "SELECT count(*) FROM "+b.table("outbox")+
		" WHERE saga_id = $1 AND status = 'pending' AND available_at = 'infinity' AND paused_from IS NOT NULL", id)
}

// stays checks, for a few poll intervals, that cond keeps holding.
func stays(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		require.True(t, cond(), what)
	}
}

// A pause taken while a step runs lets the step finish and starts nothing
// after it; Resume continues where the saga paused, and every step has run
// exactly once.
func TestPauseLetsTheRunningStepFinishAndStartsNothingNew(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered, gate := make(chan struct{}, 1), make(chan struct{})
	def := gatedSaga(b, "pause-running", entered, gate)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered // charge runs

	require.NoError(t, b.engine.Pause(ctx, st.ID, "card processor incident"))
	close(gate) // charge finishes after the pause committed
	waitFor(t, 10*time.Second, func() bool { return b.heldCommands(t, st.ID) == 1 }, "ship's command to be held")
	require.Equal(t, []string{"reserve/forward", "charge/forward"}, b.effects(t, st.ID))
	stays(t, 5*100*time.Millisecond, func() bool { return len(b.effects(t, st.ID)) == 2 }, "no step may start while paused")

	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.NotNil(t, in.Paused)
	require.Equal(t, saga.PauseCodeOperator, in.Paused.Code)
	require.Equal(t, "card processor incident", in.Paused.Reason)
	require.False(t, in.Paused.Type)
	require.True(t, hasEvent(in, saga.EventSagaPaused))
	list, err := b.engine.List(ctx, &saga.ListOpts{Paused: true, Name: "pause-running"})
	require.NoError(t, err)
	require.Len(t, list.Sagas, 1)
	require.NotNil(t, list.Sagas[0].Paused)

	// Pausing again changes nothing.
	require.NoError(t, b.engine.Pause(ctx, st.ID, "again"))
	in, err = b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, "card processor incident", in.Paused.Reason)

	require.NoError(t, b.engine.Resume(ctx, st.ID, "incident over"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Nil(t, in.Paused)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	require.True(t, hasEvent(in, saga.EventSagaUnpaused))
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_pauses")))
}

// A timer that falls due while its saga is paused fires once, after Resume,
// and the rescuer leaves the paused saga alone however overdue it looks.
func TestPausedTimerFiresAfterResumeAndIsNotRescued(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	def := saga.Define("pause-timer",
		saga.Step[order]{Name: "reserve", Action: rec},
		// Long enough that the test sees the saga asleep before the timer
		// fires on a loaded machine (300 ms was not, in a CI run).
		saga.Step[order]{Name: "cool-off", Wait: saga.Sleep[order](3 * time.Second)},
		saga.Step[order]{Name: "ship", Action: rec},
	)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	b.start(t)
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, 10*time.Second, func() bool {
		in, err := b.engine.Get(ctx, st.ID)
		return err == nil && in.Wait != nil
	}, "the saga to sleep")
	require.NoError(t, b.engine.Pause(ctx, st.ID, ""))
	require.Equal(t, 1, b.heldCommands(t, st.ID), "the timer is held")
	time.Sleep(3500 * time.Millisecond) // the timer's time passes
	b.overdue(t, st.ID)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{}, res, "a paused saga is not stuck")
	require.Equal(t, []string{"reserve/forward"}, b.effects(t, st.ID))

	require.NoError(t, b.engine.Resume(ctx, st.ID, ""))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "ship/forward"}, b.effects(t, st.ID))
	require.False(t, hasEvent(in, saga.EventSagaRescued))
}

// Pausing a type holds its running sagas and the ones started during the
// pause, leaves other types running, and ResumeType lets them all finish.
func TestPauseTypeHoldsItsSagasOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	paused := gatedSaga(b, "pause-type", nil, nil)
	other := gatedSaga(b, "pause-other", nil, nil)
	require.NoError(t, b.engine.Register(paused, other))
	ctx := context.Background()
	ok, err := b.engine.PauseType(ctx, "pause-type", "deploying a fix")
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = b.engine.PauseType(ctx, "pause-type", "twice")
	require.NoError(t, err)
	require.False(t, ok, "already paused")
	types, err := b.engine.PausedTypes(ctx)
	require.NoError(t, err)
	require.Equal(t, "deploying a fix", types["pause-type"].Reason)

	b.start(t)
	var held, free []uuid.UUID
	for range 5 {
		st, err := saga.Start(ctx, b.engine, paused, order{}, nil)
		require.NoError(t, err)
		held = append(held, st.ID)
		st, err = saga.Start(ctx, b.engine, other, order{}, nil)
		require.NoError(t, err)
		free = append(free, st.ID)
	}
	for _, id := range free {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, id).Status, "another type is not held back")
	}
	stays(t, 300*time.Millisecond, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("effects")+" WHERE saga_id = ANY($1)", held) == 0
	}, "no step of a paused type may start")
	in, err := b.engine.Get(ctx, held[0])
	require.NoError(t, err)
	require.NotNil(t, in.Paused)
	require.True(t, in.Paused.Type)

	// Resume of a saga that only its type's pause holds says what lifts it,
	// and changes nothing.
	err = b.engine.Resume(ctx, held[1], "try")
	require.ErrorIs(t, err, saga.ErrNotReplayable)
	require.ErrorContains(t, err, "ResumeType")
	require.Empty(t, b.effects(t, held[1]))

	// One saga is also paused on its own: it stays paused after the type's
	// pause is lifted.
	require.NoError(t, b.engine.Pause(ctx, held[0], "look at this one"))
	ok, err = b.engine.ResumeType(ctx, "pause-type")
	require.NoError(t, err)
	require.True(t, ok)
	for _, id := range held[1:] {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, id).Status)
		require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, id))
	}
	require.Empty(t, b.effects(t, held[0]))
	require.NoError(t, b.engine.Resume(ctx, held[0], ""))
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, held[0]).Status)
	ok, err = b.engine.ResumeType(ctx, "pause-type")
	require.NoError(t, err)
	require.False(t, ok, "not paused any more")
}

// A step that asks to pause when its retries run out pauses the saga
// instead of compensating; after the operator fixes the cause, Resume runs
// the step again with a fresh count of attempts and the saga completes. A
// permanent error still compensates.
func TestPauseWhenExhausted(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var down atomic.Bool
	down.Store(true)
	var tries atomic.Int32
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	charge := func(ctx context.Context, run *saga.StepRun, o *order) error {
		tries.Add(1)
		if o.OrderID == "declined" {
			return steps.Permanent(errors.New("card declined"))
		}
		if down.Load() {
			return errors.New("payment gateway timeout")
		}
		return rec(ctx, run, o)
	}
	def := saga.Define("pause-exhausted",
		saga.Step[order]{Name: "reserve", Action: rec, Compensate: rec},
		saga.Step[order]{Name: "charge", Action: charge, Retry: retryTwice, PauseWhenExhausted: true},
		saga.Step[order]{Name: "ship", Action: rec},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	var in *saga.Instance
	waitFor(t, 10*time.Second, func() bool {
		in, err = b.engine.Get(ctx, st.ID)
		return err == nil && in.Paused != nil
	}, "the saga to pause")
	// One Get: the pause and the row it shows are of one snapshot.
	require.Equal(t, saga.StatusRunning, in.Status)
	require.Equal(t, saga.PauseCodeExhausted, in.Paused.Code)
	require.Equal(t, "charge", in.Paused.Step)
	require.Contains(t, in.Paused.Reason, "payment gateway timeout")
	require.NotNil(t, in.LastError)
	require.Equal(t, "payment gateway timeout", in.LastError.Message)
	require.Equal(t, 0, in.Attempt, "attempts start afresh on resume")
	stays(t, 300*time.Millisecond, func() bool { return tries.Load() == 2 }, "no attempt while paused")
	require.Equal(t, []string{"reserve/forward"}, b.effects(t, st.ID), "nothing compensated")

	down.Store(false) // the operator fixed the gateway
	require.NoError(t, b.engine.Resume(ctx, st.ID, "gateway back"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, int32(3), tries.Load())
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))

	// A permanent error is not "retries spent": it compensates.
	st, err = saga.Start(ctx, b.engine, def, order{OrderID: "declined"}, nil)
	require.NoError(t, err)
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Nil(t, in.Paused)
}

// A cancel of a paused saga is recorded at once; its compensations wait for
// Resume, then run exactly once.
func TestCancelOfAPausedSagaCompensatesAfterResume(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	entered, gate := make(chan struct{}, 1), make(chan struct{})
	def := gatedSaga(b, "pause-cancel", entered, gate)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered
	require.NoError(t, b.engine.Pause(ctx, st.ID, ""))
	close(gate)
	waitFor(t, 10*time.Second, func() bool { return b.heldCommands(t, st.ID) == 1 }, "ship's command to be held")

	require.NoError(t, b.engine.Cancel(ctx, st.ID, "customer cancelled"))
	waitFor(t, 10*time.Second, func() bool {
		in, err := b.engine.Get(ctx, st.ID)
		return err == nil && in.Status == saga.StatusCompensating
	}, "the cancel to be applied")
	stays(t, 300*time.Millisecond, func() bool { return len(b.effects(t, st.ID)) == 2 }, "no compensation while paused")

	require.NoError(t, b.engine.Resume(ctx, st.ID, ""))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "charge/compensate", "reserve/compensate"}, b.effects(t, st.ID))
}

// What an operator gets wrong gets a clear error, and odd bytes in a reason
// are stored safely.
func TestPauseRefusals(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := gatedSaga(b, "pause-refusals", nil, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	require.ErrorIs(t, b.engine.Pause(ctx, uuid.New(), ""), saga.ErrNotFound)

	b.start(t)
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	require.ErrorIs(t, b.engine.Pause(ctx, st.ID, ""), saga.ErrNotRunning)
	require.ErrorIs(t, b.engine.Resume(ctx, st.ID, ""), saga.ErrNotReplayable, "a completed saga neither paused nor failed")

	_, err = b.engine.PauseType(ctx, "bad\x00name", "")
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	_, err = b.engine.PauseType(ctx, "", "")
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	_, err = b.engine.ResumeType(ctx, "bad\xffname")
	require.ErrorIs(t, err, saga.ErrInvalidInput)

	// A reason with NUL, invalid UTF-8 and 10 kB is stored, cleaned and cut.
	_, err = b.engine.PauseType(ctx, "pause-refusals", "a\x00b\xff"+strings.Repeat("x", 10_000))
	require.NoError(t, err)
	types, err := b.engine.PausedTypes(ctx)
	require.NoError(t, err)
	r := types["pause-refusals"].Reason
	require.NotContains(t, r, "\x00")
	require.Less(t, len(r), 2100)
}

// A command that escaped the pause's hold (written by a transaction that
// began before the pause and committed after its sweep) is held by the
// engine that claims it: the engine, not only the outbox trigger, keeps a
// paused saga from starting a step.
func TestEngineHoldsAPausedSagasCommandItClaims(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := gatedSaga(b, "pause-escaped", nil, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, b.engine.Pause(ctx, st.ID, ""))
	require.Equal(t, 1, b.heldCommands(t, st.ID))
	// The race, made by hand: the command is due again, the trigger off.
	_, err = b.pool.Exec(ctx, "ALTER TABLE "+b.table("outbox")+" DISABLE TRIGGER saga_hold_paused")
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("outbox")+" SET available_at = now(), paused_from = NULL WHERE saga_id = $1", st.ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "ALTER TABLE "+b.table("outbox")+" ENABLE TRIGGER saga_hold_paused")
	require.NoError(t, err)
	require.Zero(t, b.heldCommands(t, st.ID))

	b.start(t)
	waitFor(t, 10*time.Second, func() bool { return b.heldCommands(t, st.ID) == 1 }, "the engine to hold the command")
	stays(t, 300*time.Millisecond, func() bool { return len(b.effects(t, st.ID)) == 0 }, "no step of a paused saga may run")
	require.NoError(t, b.engine.Resume(ctx, st.ID, ""))
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

// In Kafka mode, a command already on Kafka when its saga was paused is
// written back to the outbox, held, by the engine that consumes it, and runs
// once after Resume.
func TestKafkaModePauseHoldsAPublishedCommand(t *testing.T) {
	t.Parallel()
	k := setupKafka(t, 1, "kpause")
	def := threeSteps(k.bundle, "kpause", nil)
	require.NoError(t, k.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, k.engine, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, 10*time.Second, func() bool {
		msgs, err := k.kc.ReadAll(ctx, "sagaflow.commands.kpause")
		require.NoError(t, err)
		return len(msgs) == 1
	}, "the relay to publish the first command")
	require.NoError(t, k.engine.Pause(ctx, st.ID, "on Kafka already"))
	require.Zero(t, k.heldCommands(t, st.ID), "a published command is not in the outbox to hold")

	k.start(t)
	waitFor(t, 10*time.Second, func() bool { return k.heldCommands(t, st.ID) == 1 }, "the engine to hold the consumed command")
	stays(t, 300*time.Millisecond, func() bool { return len(k.effects(t, st.ID)) == 0 }, "no step of a paused saga may run")

	require.NoError(t, k.engine.Resume(ctx, st.ID, ""))
	in := k.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, k.effects(t, st.ID))
}

// A saga deadline that passes during a pause is not applied during it (no
// cancel, the saga stays running and paused); it is applied after Resume.
func TestSagaDeadlineWaitsForTheResume(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := saga.Define("pause-deadline",
		saga.Step[order]{Name: "paid", Wait: saga.OnSignal("paid", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
	).WithDeadline(300 * time.Millisecond)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, b.engine.Pause(ctx, st.ID, "hold it"))
	time.Sleep(600 * time.Millisecond) // the deadline passes
	_, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	stays(t, 400*time.Millisecond, func() bool {
		in, err := b.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		return in.Status == saga.StatusRunning && in.Paused != nil && !hasEvent(in, saga.EventSagaCancelled)
	}, "a paused saga's deadline may not fire")
	require.NoError(t, b.engine.Resume(ctx, st.ID, ""))
	_, err = b.engine.RescueNow(ctx) // the deadline's pass, now that the pause is lifted
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, saga.CodeDeadline, in.LastError.Code)
}
