package saga

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

func TestCompensationCause(t *testing.T) {
	t.Parallel()
	fwd, comp := string(steps.Forward), string(steps.Compensate)
	entry := func(event, step, dir string, epoch int, code string) store.History {
		h := store.History{Event: event, StepName: &step, Direction: &dir, Epoch: &epoch}
		if code != "" {
			msg := code + " happened"
			h.Error, h.ErrorCode = &msg, &code
		}
		return h
	}
	for _, tc := range []struct {
		name  string
		hist  []store.History
		epoch int
		want  string // the cause's event:step:code, "" for none
	}{
		{"a step's final failure", []store.History{
			entry(EventStepCompleted, "reserve", fwd, 0, ""),
			entry(EventStepFailed, "charge", fwd, 0, "declined"), // retried
			entry(EventStepFailed, "charge", fwd, 0, "no_funds"), // final
			entry(EventCompensationStarted, "reserve", comp, 0, ""),
			entry(EventStepFailed, "reserve", comp, 0, "stock_locked"),
			entry(EventSagaFailed, "reserve", comp, 0, "stock_locked"),
		}, 0, "step_failed:charge:no_funds"},
		{"a cancel after a retried failure", []store.History{
			entry(EventStepFailed, "charge", fwd, 0, "declined"),
			entry(EventSagaCancelled, "charge", fwd, 0, "cancelled"),
			entry(EventSagaFailed, "reserve", comp, 0, "stock_locked"),
		}, 0, "saga_cancelled:charge:cancelled"},
		{"an earlier resume is not a cause", []store.History{
			entry(EventStepFailed, "ship", fwd, 0, "no_carrier"),
			entry(EventSagaFailed, "charge", comp, 0, "refund_rejected"),
			entry(EventSagaResumed, "charge", comp, 0, "refund_rejected"),
			entry(EventSagaFailed, "charge", comp, 0, "refund_rejected"),
		}, 0, "step_failed:ship:no_carrier"},
		{"only the saga's current epoch", []store.History{
			entry(EventStepFailed, "ship", fwd, 0, "no_carrier"),
			entry(EventSagaRerun, "charge", fwd, 1, ""),
			entry(EventSagaFailed, "charge", comp, 1, "refund_rejected"),
		}, 1, ""},
		{"no history", nil, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := compensationCause(tc.hist, tc.epoch)
			if tc.want == "" {
				require.Nil(t, got)
				return
			}
			require.NotNil(t, got)
			require.Equal(t, tc.want, got.Event+":"+*got.StepName+":"+*got.ErrorCode)
		})
	}
}
