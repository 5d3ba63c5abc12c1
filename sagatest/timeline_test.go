package sagatest_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// A wrong timeline fails the test with a message a reader can act on: the
// difference line by line, the timeline to paste, and the saga's details.
func TestRequireTimelineFailsWithAReadableDiff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := twoSteps("declined", true)
	b.start(t, def)
	st, err := saga.Start(context.Background(), b.engine, def, order{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, b.engine, st.ID, nil)

	// The test expected the charge to go through.
	msg := failure(t, func(tb testing.TB) {
		sagatest.RequireTimeline(tb, in, "saga_started", "step_completed:reserve", "step_completed:charge", "saga_completed")
		tb.Errorf("RequireTimeline returned")
	})
	require.Equal(t, "sagatest: timeline of saga "+st.ID.String()+" (declined) is not the one wanted (- want, + got):\n"+
		"    saga_started\n"+
		"    step_completed:reserve\n"+
		"  - step_completed:charge\n"+
		"  - saga_completed\n"+
		"  + step_failed:charge\n"+
		"  + compensation_started:reserve\n"+
		"  + compensation_completed:reserve\n"+
		"  + saga_compensated\n"+
		"got, as Go:\n"+
		`  []string{"saga_started", "step_completed:reserve", "step_failed:charge", "compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"}`+"\n"+
		sagatest.Describe(in), msg)
	require.Contains(t, msg, "step_failed:charge (forward, attempt 1) error [card_declined] the card was declined")

	// The right one passes, and so the literal it printed is right.
	require.Empty(t, failure(t, func(tb testing.TB) {
		sagatest.RequireTimeline(tb, in, "saga_started", "step_completed:reserve", "step_failed:charge",
			"compensation_started:reserve", "compensation_completed:reserve", "saga_compensated")
	}))
}

func TestTimelineNamesTheStepOfStepEventsOnly(t *testing.T) {
	t.Parallel()
	in := &saga.Instance{History: []saga.Event{
		{Type: saga.EventSagaStarted, Step: "reserve", Direction: "forward"},
		{Type: saga.EventStepCompleted, Step: "reserve", Direction: "forward"},
		{Type: saga.EventSagaCompleted},
	}}
	require.Equal(t, []string{"saga_started", "step_completed:reserve", "saga_completed"}, sagatest.Timeline(in))
	require.Nil(t, sagatest.Timeline(nil))
}
