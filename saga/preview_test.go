package saga_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// runText renders planned runs as "step/direction/epoch" plus "*" for a
// reused key, so a table row reads like the plan.
func runText(runs []saga.PlannedRun) string {
	var b []string
	for _, r := range runs {
		s := fmt.Sprintf("%s/%s/%d", r.Step, r.Direction, r.Key.Epoch)
		if r.Reused {
			s += "*"
		}
		b = append(b, s)
	}
	return strings.Join(b, " ")
}

func TestPlanFor(t *testing.T) {
	t.Parallel()
	id := uuid.New()
	def := []saga.StepInfo{
		{Name: "reserve", Compensable: true},
		{Name: "charge", Compensable: true},
		{Name: "notify"},
		{Name: "ship", Compensable: true},
	}
	ev := func(typ, step string, dir steps.Direction, epoch int) saga.Event {
		return saga.Event{Type: typ, Step: step, Direction: dir, Epoch: epoch}
	}
	// failedCompensating: ship failed for good, charge's compensation gave up.
	failedCompensating := saga.Instance{ID: id, Name: "checkout", Status: saga.StatusFailed, Step: "charge",
		Direction: steps.Compensate, Epoch: 0, Version: 9, History: []saga.Event{
			ev(saga.EventSagaStarted, "reserve", steps.Forward, 0),
			ev(saga.EventStepCompleted, "reserve", steps.Forward, 0),
			ev(saga.EventStepCompleted, "charge", steps.Forward, 0),
			ev(saga.EventStepCompleted, "notify", steps.Forward, 0),
			ev(saga.EventStepFailed, "ship", steps.Forward, 0),
			ev(saga.EventCompensationStarted, "charge", steps.Compensate, 0),
			ev(saga.EventStepFailed, "charge", steps.Compensate, 0),
			ev(saga.EventSagaFailed, "charge", steps.Compensate, 0),
		}}
	failedForward := saga.Instance{ID: id, Name: "checkout", Status: saga.StatusFailed, Step: "charge",
		Direction: steps.Forward, Epoch: 2, History: []saga.Event{
			ev(saga.EventStepCompleted, "reserve", steps.Forward, 2),
			ev(saga.EventStepFailed, "charge", steps.Forward, 2),
		}}
	compensated := saga.Instance{ID: id, Name: "checkout", Status: saga.StatusCompensated, Step: "reserve",
		Direction: steps.Compensate, Epoch: 1}
	completed := saga.Instance{ID: id, Name: "checkout", Status: saga.StatusCompleted, Step: "ship",
		Direction: steps.Forward, Epoch: 0}
	running := saga.Instance{ID: id, Name: "checkout", Status: saga.StatusRunning, Step: "notify",
		Direction: steps.Forward, Epoch: 0}
	awaiting := running
	awaiting.Step = "charge"
	awaiting.History = []saga.Event{ev(saga.EventStepCompleted, "reserve", steps.Forward, 0),
		ev(saga.EventCommandSent, "charge", steps.Forward, 0)}
	compensating := running
	compensating.Status = saga.StatusCompensating

	for _, tc := range []struct {
		name          string
		inst          saga.Instance
		action        saga.PlanAction
		from          string
		runs, comps   string
		kept          string
		epoch         int
		ends          saga.Status
		errIs         error
		errContaining string
	}{
		{name: "resume a failed compensation", inst: failedCompensating, action: saga.PlanResume,
			runs: "charge/compensate/0* reserve/compensate/0", ends: saga.StatusCompensated},
		{name: "resume forward", inst: failedForward, action: saga.PlanResume, epoch: 2,
			runs:  "charge/forward/2* notify/forward/2 ship/forward/2",
			comps: "ship/compensate/2 charge/compensate/2 reserve/compensate/2", kept: "reserve", ends: saga.StatusCompleted},
		{name: "resume a completed saga", inst: completed, action: saga.PlanResume, errIs: saga.ErrNotReplayable},
		{name: "resume a running saga", inst: running, action: saga.PlanResume, errIs: saga.ErrNotReplayable},
		{name: "rerun a completed saga from a middle step", inst: completed, action: saga.PlanRerun, from: "notify", epoch: 1,
			runs: "notify/forward/1 ship/forward/1", comps: "ship/compensate/1 charge/compensate/1 reserve/compensate/1",
			kept: "reserve charge", ends: saga.StatusCompleted},
		{name: "rerun a compensated saga from its first step", inst: compensated, action: saga.PlanRerun, from: "reserve", epoch: 2,
			runs:  "reserve/forward/2 charge/forward/2 notify/forward/2 ship/forward/2",
			comps: "ship/compensate/2 charge/compensate/2 reserve/compensate/2", ends: saga.StatusCompleted},
		{name: "rerun a compensated saga from a later step", inst: compensated, action: saga.PlanRerun, from: "charge",
			errIs: saga.ErrNotReplayable},
		{name: "rerun a failed compensation from its step", inst: failedCompensating, action: saga.PlanRerun, from: "charge",
			errIs: saga.ErrNotReplayable},
		{name: "rerun a failed compensation from a later step", inst: failedCompensating, action: saga.PlanRerun, from: "notify",
			epoch: 1, runs: "notify/forward/1 ship/forward/1", comps: "ship/compensate/1 charge/compensate/1 reserve/compensate/1",
			kept: "reserve charge", ends: saga.StatusCompleted},
		{name: "rerun from an unknown step", inst: completed, action: saga.PlanRerun, from: "<nope>", errContaining: `no step "<nope>"`},
		{name: "rerun a running saga", inst: running, action: saga.PlanRerun, from: "reserve", errIs: saga.ErrNotReplayable},
		{name: "resume with a from step", inst: failedForward, action: saga.PlanResume, from: "reserve", errContaining: "rerun only"},
		{name: "cancel a running saga", inst: running, action: saga.PlanCancel,
			comps: "charge/compensate/0 reserve/compensate/0", ends: saga.StatusCompensated},
		{name: "cancel a saga awaiting a reply compensates the step sent", inst: awaiting, action: saga.PlanCancel,
			comps: "charge/compensate/0 reserve/compensate/0", ends: saga.StatusCompensated},
		{name: "cancel a compensating saga", inst: compensating, action: saga.PlanCancel, errIs: saga.ErrNotRunning},
		{name: "cancel a completed saga", inst: completed, action: saga.PlanCancel, errIs: saga.ErrNotRunning},
		{name: "unknown action", inst: running, action: "explode", errContaining: "unknown action"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, err := saga.PlanFor(&tc.inst, def, false, tc.action, tc.from)
			if tc.errIs != nil || tc.errContaining != "" {
				require.Error(t, err)
				if tc.errIs != nil {
					require.ErrorIs(t, err, tc.errIs)
				}
				require.Contains(t, err.Error(), tc.errContaining)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.runs, runText(p.Runs), "runs")
			require.Equal(t, tc.comps, runText(p.Compensations), "compensations")
			require.Equal(t, tc.kept, strings.Join(p.Kept, " "), "kept")
			require.Equal(t, tc.epoch, p.Epoch)
			require.Equal(t, tc.ends, p.Ends)
			require.Equal(t, tc.inst.Version, p.Version)
			for _, r := range append(p.Runs, p.Compensations...) {
				require.Equal(t, id, r.Key.SagaID)
				require.Equal(t, fmt.Sprintf("%s/%s/%s/%d", id, r.Step, r.Direction, r.Key.Epoch), r.Key.String())
			}
		})
	}
}

func TestPlanForNilSaga(t *testing.T) {
	t.Parallel()
	_, err := saga.PlanFor(nil, nil, false, saga.PlanResume, "")
	require.Error(t, err)
}

func TestHistorySteps(t *testing.T) {
	t.Parallel()
	inst := &saga.Instance{Step: "ship", History: []saga.Event{
		{Type: saga.EventSagaStarted, Step: "reserve", Direction: steps.Forward},
		{Type: saga.EventStepCompleted, Step: "reserve", Direction: steps.Forward},
		{Type: saga.EventCommandSent, Step: "charge", Direction: steps.Forward},
		{Type: saga.EventStepFailed, Step: "charge", Direction: steps.Forward},
		{Type: saga.EventSagaCompensated},
		{Type: saga.EventCompensationCompleted, Step: "reserve", Direction: steps.Compensate},
	}}
	require.Equal(t, []saga.StepInfo{
		{Name: "reserve", Compensable: true},
		{Name: "charge", Remote: true},
		{Name: "ship"},
	}, saga.HistorySteps(inst))
	require.Nil(t, saga.HistorySteps(nil))
}

func TestDefinitionSteps(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	type S struct{}
	nop := func(_ context.Context, _ *saga.StepRun, _ *S) error { return nil }
	def := saga.Define("preview", saga.Step[S]{Name: "a", Action: nop, Compensate: nop}, saga.Step[S]{Name: "b", Action: nop})
	require.NoError(t, b.engine.Register(def))
	got, ok := b.engine.DefinitionSteps("preview")
	require.True(t, ok)
	require.Equal(t, []saga.StepInfo{{Name: "a", Compensable: true}, {Name: "b"}}, got)
	_, ok = b.engine.DefinitionSteps("other")
	require.False(t, ok)
	var nilEngine *saga.Engine
	_, ok = nilEngine.DefinitionSteps("preview")
	require.False(t, ok)
}
