package sagatest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type order struct {
	ID      string `json:"id"`
	Charged bool   `json:"charged,omitempty"`
}

func nop(context.Context, *saga.StepRun, *order) error { return nil }

// twoSteps is reserve (compensable) then charge, which fails for good when
// decline is set.
func twoSteps(name string, decline bool) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: nop, Compensate: nop},
		saga.Step[order]{Name: "charge", Action: func(context.Context, *saga.StepRun, *order) error {
			if decline {
				return steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
			}
			return nil
		}},
	)
}

func TestWaitEndedReturnsTheSagaAsItEnded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ok, declined := twoSteps("ok", false), twoSteps("declined", true)
	b.start(t, ok, declined)
	ctx := context.Background()

	st, err := saga.Start(ctx, b.engine, ok, order{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompleted, in.Status)
	sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve", "step_completed:charge", "saga_completed")

	st, err = saga.Start(ctx, b.engine, declined, order{ID: "o-2"}, nil)
	require.NoError(t, err)
	in = sagatest.Wait(t, b.engine, st.ID, sagatest.Status(saga.StatusCompensated), nil)
	require.Equal(t, "card_declined", in.LastError.Code)
	sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve", "step_failed:charge",
		"compensation_started:reserve", "compensation_completed:reserve", "saga_compensated")
}

// A saga no engine runs never ends: the wait fails at its timeout, and says
// where the saga is, with its timeline.
func TestWaitFailsAtItsTimeoutWithTheTimeline(t *testing.T) {
	t.Parallel()
	b := setup(t) // the engine is never started: a client
	def := twoSteps("idle", false)
	require.NoError(t, b.engine.Register(def))
	st, err := saga.Start(context.Background(), b.engine, def, order{ID: "o-3"}, nil)
	require.NoError(t, err)

	// 2 s, not less: the wait's first read must come back within it (a
	// loaded CI machine took longer than 300 ms once).
	begun := time.Now()
	msg := failure(t, func(tb testing.TB) {
		sagatest.WaitEnded(tb, b.engine, st.ID, &sagatest.WaitOpts{Timeout: 2 * time.Second})
		tb.Errorf("WaitEnded returned") // not reached: the wait fails the test
	})
	require.Less(t, time.Since(begun), 10*time.Second)
	require.Contains(t, msg, "sagatest: saga "+st.ID.String()+" did not end within 2s:")
	require.Contains(t, msg, "(idle) is running at step reserve (forward")
	require.Contains(t, msg, "timeline:")
	require.Contains(t, msg, "saga_started")
	require.NotContains(t, msg, "WaitEnded returned")
}

// A saga that ended otherwise fails the wait at once: it would not change.
func TestWaitFailsAtOnceWhenTheSagaEndedOtherwise(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := twoSteps("declined", true)
	b.start(t, def)
	st, err := saga.Start(context.Background(), b.engine, def, order{ID: "o-4"}, nil)
	require.NoError(t, err)
	sagatest.WaitEnded(t, b.engine, st.ID, nil)

	for _, c := range []struct {
		until sagatest.Until
		want  string
	}{
		{sagatest.Status(saga.StatusCompleted), "ended compensated and will not be completed"},
		{sagatest.Step("charge"), "ended compensated and will not reach step charge"},
		{sagatest.Event("step_completed:charge"), "ended compensated and will not record step_completed:charge"},
		{sagatest.Cond("ship the order", func(*saga.Instance) bool { return false }), "will not ship the order"},
	} {
		begun := time.Now()
		msg := failure(t, func(tb testing.TB) { sagatest.Wait(tb, b.engine, st.ID, c.until, nil) })
		require.Contains(t, msg, c.want)
		require.Contains(t, msg, "last error: [card_declined] the card was declined (step charge)")
		require.Less(t, time.Since(begun), 5*time.Second, "not the 30 s timeout")
	}
	// What did hold is returned at once.
	in := sagatest.Wait(t, b.engine, st.ID, sagatest.Event("step_failed:charge"), nil)
	require.Equal(t, saga.StatusCompensated, in.Status)
}

func TestWaitFailsForASagaThatDoesNotExist(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := [16]byte{1}
	msg := failure(t, func(tb testing.TB) { sagatest.WaitEnded(tb, b.engine, id, nil) })
	require.Contains(t, msg, "sagatest: wait for saga 01000000-0000-0000-0000-000000000000 to end:")
	require.Contains(t, msg, saga.ErrNotFound.Error())
}
