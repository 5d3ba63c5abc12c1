package saga_test

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// retryTwice allows two attempts, 10 ms apart.
var retryTwice = &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}

// hasEvent reports whether in's history has an event of type typ.
func hasEvent(in *saga.Instance, typ string) bool {
	return slices.ContainsFunc(in.History, func(ev saga.Event) bool { return ev.Type == typ })
}

// pivotSaga is reserve (compensatable), charge (the pivot), ship
// (retriable, after the pivot): every step records its effect.
func pivotSaga(b *bundle, name string, charge, ship saga.StepFunc[order]) *saga.Definition[order] {
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	wrap := func(fn saga.StepFunc[order]) saga.StepFunc[order] {
		return func(ctx context.Context, run *saga.StepRun, o *order) error {
			if fn != nil {
				if err := fn(ctx, run, o); err != nil {
					return err
				}
			}
			return rec(ctx, run, o)
		}
	}
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: rec, Compensate: rec},
		saga.Step[order]{Name: "charge", Action: wrap(charge), Pivot: true, Retry: retryTwice},
		saga.Step[order]{Name: "ship", Action: wrap(ship), Retriable: true, Retry: retryTwice},
	)
}

func TestPivotRulesAreCheckedAtRegistration(t *testing.T) {
	t.Parallel()
	nop := func(context.Context, *saga.StepRun, *order) error { return nil }
	for _, tc := range []struct {
		name  string
		steps []saga.Step[order]
		want  string
	}{
		{"compensatable after the pivot", []saga.Step[order]{
			{Name: "charge", Action: nop, Pivot: true},
			{Name: "ship", Action: nop, Retriable: true, Compensate: nop},
		}, `step "ship": comes after the pivot "charge" and is compensatable`},
		{"not retriable after the pivot", []saga.Step[order]{
			{Name: "charge", Action: nop, Pivot: true},
			{Name: "notify", Action: nop},
		}, `step "notify": comes after the pivot "charge" and is not marked Retriable`},
		{"remote compensation after the pivot", []saga.Step[order]{
			{Name: "charge", Action: nop, Pivot: true},
			{Name: "ship", Retriable: true, Remote: &saga.Remote[order]{Topic: "t", Type: "x", CompensateType: "undo",
				Command: func(context.Context, *saga.StepRun, *order) (any, error) { return nil, nil }}},
		}, `step "ship": comes after the pivot "charge" and is compensatable`},
		{"two pivots", []saga.Step[order]{
			{Name: "charge", Action: nop, Pivot: true},
			{Name: "ship", Action: nop, Pivot: true},
		}, `step "ship": is a second pivot (step "charge" is the pivot)`},
		{"retriable before any pivot", []saga.Step[order]{
			{Name: "reserve", Action: nop, Retriable: true},
			{Name: "charge", Action: nop, Pivot: true},
		}, `step "reserve": is Retriable but comes before any pivot`},
		{"pivot with a compensation", []saga.Step[order]{
			{Name: "charge", Action: nop, Pivot: true, Compensate: nop},
		}, `step "charge": is the pivot and has a compensation`},
		{"a compensating wait timeout after the pivot", []saga.Step[order]{
			{Name: "charge", Action: nop, Pivot: true},
			{Name: "delivered", Retriable: true, Wait: saga.OnSignal("delivered",
				func(context.Context, *saga.StepRun, *order, struct{}) error { return nil }).Timeout(time.Hour)},
		}, `step "delivered": comes after the pivot "charge" and its wait's Timeout compensates`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := setup(t, nil).engine.Register(saga.Define("p", tc.steps...))
			require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			require.ErrorContains(t, err, tc.want)
		})
	}
	// The well-formed shape registers, waits that go on included.
	b := setup(t, nil)
	require.NoError(t, b.engine.Register(saga.Define("ok",
		saga.Step[order]{Name: "reserve", Action: nop, Compensate: nop},
		saga.Step[order]{Name: "charge", Action: nop, Pivot: true},
		saga.Step[order]{Name: "delivered", Retriable: true, Wait: saga.OnSignal("delivered",
			func(context.Context, *saga.StepRun, *order, struct{}) error { return nil }).TimeoutThen(time.Hour, nil)},
		saga.Step[order]{Name: "ship", Action: nop, Retriable: true},
	)))
}

// A retriable step is retried past its MaxAttempts until it succeeds, and
// nothing is compensated.
func TestRetriableStepRetriesUntilItSucceeds(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var tries atomic.Int32
	def := pivotSaga(b, "pivot-retry", nil, func(context.Context, *saga.StepRun, *order) error {
		if tries.Add(1) <= 5 {
			return errors.New("the carrier's API is down")
		}
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, int32(6), tries.Load(), "5 failures, then the success, with MaxAttempts 2")
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

// A retriable step that fails for good ends the saga failed, for an
// operator, without compensating; a resume runs the step again.
func TestRetriableStepFailingForGoodIsNotCompensated(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var fixed atomic.Bool
	def := pivotSaga(b, "pivot-permanent", nil, func(context.Context, *saga.StepRun, *order) error {
		if !fixed.Load() {
			return steps.Permanent(steps.WithCode("address_invalid", errors.New("the address does not exist")))
		}
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, "address_invalid", in.LastError.Code)
	require.Equal(t, []string{"reserve/forward", "charge/forward"}, b.effects(t, st.ID), "nothing compensated past the pivot")

	fixed.Store(true)
	require.NoError(t, b.engine.Resume(ctx, st.ID, "address corrected"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

// The pivot failing for good compensates the steps before it, as any step.
func TestPivotFailingCompensatesTheStepsBefore(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := pivotSaga(b, "pivot-fails", func(context.Context, *saga.StepRun, *order) error {
		return steps.Permanent(errors.New("card declined"))
	}, nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, []string{"reserve/forward", "reserve/compensate"}, b.effects(t, st.ID))
}

// An operator acting while a step after the pivot runs: Cancel is refused
// with ErrPastPivot, a request recorded by a tool without the definition
// is refused when an engine applies it, the running step is not
// interrupted, and the saga completes.
func TestCancelPastThePivotIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	def := saga.Define("pivot-cancel",
		saga.Step[order]{Name: "reserve", Action: rec, Compensate: rec},
		saga.Step[order]{Name: "charge", Action: rec, Pivot: true},
		saga.Step[order]{Name: "ship", Retriable: true, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			select {
			case entered <- struct{}{}:
			default:
			}
			select {
			case <-release:
				return rec(ctx, run, o)
			case <-ctx.Done():
				return ctx.Err()
			}
		}},
		saga.Step[order]{Name: "notify", Retriable: true, Action: rec},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered

	err = b.engine.Cancel(ctx, st.ID, "customer changed their mind")
	require.ErrorIs(t, err, saga.ErrPastPivot)
	require.ErrorContains(t, err, `pivot step "charge"`)

	// The CLI's way: a tool that does not know the saga records a request.
	cli, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, cli.RequestCancel(ctx, st.ID, "from the CLI"))
	// The running step is not interrupted by it: it finishes when released,
	// and the engine refuses the request at the next step.
	time.Sleep(200 * time.Millisecond) // several of the engine's cancel polls
	close(release)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward", "notify/forward"}, b.effects(t, st.ID))
	require.True(t, hasEvent(in, saga.EventCancelRefused), "the recorded request was refused, and says so: %v", eventTypes(in))
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_cancel_requests")+" WHERE saga_id = $1", st.ID))
}

// A cancel before the pivot has completed compensates as usual.
func TestCancelBeforeThePivotCompensates(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond})
	entered := make(chan struct{}, 1)
	def := pivotSaga(b, "pivot-early-cancel", func(ctx context.Context, _ *saga.StepRun, _ *order) error {
		entered <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}, nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	<-entered
	require.NoError(t, b.engine.Cancel(ctx, st.ID, "stop"))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "reserve/compensate"}, b.effects(t, st.ID))
}

// A saga that passes its deadline after its pivot is not cancelled: the
// deadline is cleared, with a history entry, and the saga completes.
//
// The deadline passes by sagatest.Clock once the pivot (charge) has
// committed, while ship waits for its retry: a deadline of 300 ms of real
// time passed, on a loaded CI machine, while charge still ran, and then
// landed, as it should, as a cancel request of the running pivot, which is
// not what this test is about. Ship waits between attempts, not in its
// handler, which would hold the saga's row and the clock's move with it.
func TestDeadlinePastThePivotIsCleared(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond, RescueInterval: time.Second})
	var released atomic.Bool
	def := pivotSaga(b, "pivot-deadline", nil, func(context.Context, *saga.StepRun, *order) error {
		if !released.Load() {
			return steps.RetryAfter(time.Hour, errors.New("not yet"))
		}
		return nil
	}).WithDeadline(time.Hour)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, sagatest.Event("step_completed:charge"), &sagatest.WaitOpts{Timeout: 10 * time.Second})
	clock := sagatest.NewClock(b.pool, b.schema, b.engine)
	require.NoError(t, clock.Advance(ctx, 2*time.Hour))
	sagatest.Wait(t, b.engine, st.ID, sagatest.Cond("have its deadline cleared", func(in *saga.Instance) bool {
		return hasEvent(in, saga.EventDeadlineCleared)
	}), &sagatest.WaitOpts{Timeout: 10 * time.Second})
	released.Store(true)
	require.NoError(t, clock.Advance(ctx, 2*time.Hour)) // ship's retry falls due
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.False(t, hasEvent(in, saga.EventSagaCancelled), "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

// A deadline that passes while the pivot itself runs lands as a cancel of
// the running pivot: the pivot's context is cancelled. A pivot that honours
// it is rolled back and the steps before it are compensated (as
// TestCancelBeforeThePivotCompensates shows for an operator's cancel); one
// that completes anyway (the charge went through) commits, and the saga
// goes forward: the request is refused at the next step, nothing is
// compensated.
func TestDeadlineWhileThePivotRunsGoesForwardIfThePivotCompletes(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: 20 * time.Millisecond, RescueInterval: time.Second})
	rec := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	interrupted := make(chan struct{})
	def := saga.Define("pivot-deadline-running",
		saga.Step[order]{Name: "reserve", Action: rec, Compensate: rec},
		saga.Step[order]{Name: "charge", Pivot: true, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			select {
			case <-ctx.Done():
				close(interrupted)
			case <-time.After(30 * time.Second):
				return errors.New("the deadline's cancel never reached the running pivot")
			}
			// The charge went through regardless: record it outside the
			// cancelled context, in the step's transaction.
			return rec(context.WithoutCancel(ctx), run, o)
		}},
		saga.Step[order]{Name: "ship", Retriable: true, Action: rec},
	).WithDeadline(300 * time.Millisecond)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	select {
	case <-interrupted:
	default:
		t.Fatalf("the pivot was not interrupted by the deadline; history: %v", eventTypes(in))
	}
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	require.True(t, hasEvent(in, saga.EventCancelRefused), "the deadline's request was refused past the pivot: %v", eventTypes(in))
	require.False(t, hasEvent(in, saga.EventSagaCancelled), "history: %v", eventTypes(in))
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_cancel_requests")+" WHERE saga_id = $1", st.ID))
}
