package saga

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// The state machine's decisions about waits, without PostgreSQL.

// waitDef: reserve (compensates), picked (a signal with a one-hour limit),
// pack (a child), ship.
func waitDef(t *testing.T) *compiled {
	t.Helper()
	child := Define("packing", Step[noState]{Name: "box", Action: noop})
	c, err := Define("fulfil",
		Step[noState]{Name: "reserve", Action: noop, Compensate: noop, Timeout: 10 * time.Second},
		Step[noState]{Name: "picked", Timeout: 5 * time.Second,
			Wait: OnSignal("picked", func(context.Context, *StepRun, *noState, struct{}) error { return nil }).Timeout(time.Hour)},
		Step[noState]{Name: "pack", Timeout: 5 * time.Second, Wait: Child(child,
			func(context.Context, *StepRun, *noState) (noState, *StartOpts, error) { return noState{}, nil, nil }, nil)},
		Step[noState]{Name: "ship", Action: noop},
	).compile()
	require.NoError(t, err)
	return c
}

func waitingAt(def *compiled, step, kind, waitFor string, command uuid.UUID) *store.Saga {
	sg := at(def, step, steps.Forward, store.StatusRunning, 0)
	sg.WaitKind, sg.WaitFor, sg.CommandID = &kind, &waitFor, &command
	until := time.Unix(1_800_000_000, 0)
	sg.WaitUntil = &until
	return sg
}

func TestMachineParksASagaUntilItsWaitEnds(t *testing.T) {
	def := waitDef(t)
	sg := at(def, "picked", steps.Forward, store.StatusRunning, 0)
	d := testMachine.parked(sg, def, 1, store.WaitSignal, "picked", time.Hour, true)
	require.Equal(t, store.WaitSignal, d.tr.WaitKind)
	require.Equal(t, "picked", d.tr.WaitFor)
	require.True(t, d.tr.SetWaitUntil)
	require.Equal(t, time.Hour, d.tr.WaitDelay)
	require.Equal(t, next("picked", steps.Forward, 2, time.Hour), d.next, "its command is due at the wait's end")
	require.True(t, d.tr.ExactDeadline)
	require.Equal(t, time.Hour+5*time.Second+testSlack, d.tr.CheckAfter, "the rescuer waits until after the wait's end")
	require.Equal(t, []string{EventWaitStarted}, summary(d).Events)

	// Without a time limit: no command, no rescue deadline.
	d = testMachine.parked(sg, def, 1, store.WaitSignal, "picked", -1, true)
	require.Nil(t, d.next)
	require.Negative(t, d.tr.WaitDelay)

	// Re-armed (a command came again): no new history.
	d = testMachine.parked(sg, def, 1, store.WaitSignal, "picked", time.Minute, false)
	require.Empty(t, d.tr.History)
}

func TestMachineKeepsAWaitAcrossRetriesAndClearsItWhenTheSagaMovesOn(t *testing.T) {
	def := waitDef(t)
	cmd := uuid.New()
	sg := waitingAt(def, "picked", store.WaitSignal, "picked", cmd)
	retry := testMachine.failure(sg, def, 1, steps.Forward, 1, steps.WithCode("x", errors.New("handler")), 0)
	require.True(t, retry.retry)
	require.Equal(t, store.WaitSignal, retry.tr.WaitKind, "a retry waits on, until the same end")
	require.False(t, retry.tr.SetWaitUntil)

	done := testMachine.success(sg, def, 1, steps.Forward, nil, 0, "k")
	require.Empty(t, done.tr.WaitKind, "the next step does not wait")
	require.Equal(t, "pack", done.tr.StepName)
}

func TestMachineCancelOfAWaitingSaga(t *testing.T) {
	def := waitDef(t)
	cmd, child := uuid.New(), uuid.New()
	sg := waitingAt(def, "pack", store.WaitChild, child.String(), cmd)
	d := testMachine.cancel(sg, def, 2, "stop", CodeDeadline)
	require.Equal(t, []uuid.UUID{cmd}, d.tr.Supersede, "the wait's timer command goes")
	require.NotNil(t, d.tr.CancelChild)
	require.Equal(t, child, d.tr.CancelChild.ID)
	require.Equal(t, CodeDeadline, d.tr.CancelChild.Code)
	require.Equal(t, CodeDeadline, *d.tr.LastErrorCode)
	require.Empty(t, d.tr.WaitKind)
	require.Equal(t, "reserve", d.tr.StepName, "the steps before the child compensate")

	// A signal wait has no child to cancel.
	sig := waitingAt(def, "picked", store.WaitSignal, "picked", cmd)
	d = testMachine.cancel(sig, def, 1, "stop", "")
	require.Nil(t, d.tr.CancelChild)
	require.Equal(t, CodeCancelled, *d.tr.LastErrorCode)
}

func TestMachineWaitTimedOut(t *testing.T) {
	def := waitDef(t)
	cmd, child := uuid.New(), uuid.New()
	d := testMachine.waitTimedOut(waitingAt(def, "pack", store.WaitChild, child.String(), cmd), def, 2)
	require.Equal(t, store.StatusCompensating, d.tr.Status)
	require.Equal(t, CodeWaitTimeout, *d.tr.LastErrorCode)
	require.Equal(t, child, d.tr.CancelChild.ID)
	require.Empty(t, d.tr.Supersede, "the command that found the time up is the wait's own")
	require.Equal(t, EventWaitTimedOut, d.tr.History[0].Event)
}
