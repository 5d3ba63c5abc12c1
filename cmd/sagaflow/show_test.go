package main

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestShow(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.populate(t)

	t.Run("human", func(t *testing.T) {
		out := f.cli(t, "show", s.failed1.String()).ok(t)
		requireInOrder(t, out,
			"id:", s.failed1.String(),
			"name:", "order",
			"business key:", "o-stuck-1",
			"status:", "failed",
			"step:", "reserve (compensate, epoch 0, attempt 1)",
			"last error:", "stock service refused the release (release_broken) at step reserve",
			"timeline (6 events):",
			"+0s", "saga_started",
			"step_completed", "reserve", "forward", "attempt 1",
			"step_failed", "charge", "forward", "attempt 1", "card declined (card_declined)",
			"compensation_started", "reserve", "compensate",
			"step_failed", "reserve", "compensate", "attempt 1", "stock service refused the release (release_broken)",
			"saga_failed",
			"state:", `"id": "o-stuck-1"`,
		)
		require.Regexp(t, `\+[0-9.]+(µs|ms|s)\s+step_completed`, out)
	})

	t.Run("json", func(t *testing.T) {
		in := decode[saga.Instance](t, f.cli(t, "show", s.failed1.String(), "--json"))
		require.Equal(t, s.failed1, in.ID)
		require.Equal(t, saga.StatusFailed, in.Status)
		var types []string
		for _, ev := range in.History {
			types = append(types, ev.Type)
		}
		require.Equal(t, []string{saga.EventSagaStarted, saga.EventStepCompleted, saga.EventStepFailed,
			saga.EventCompensationStarted, saga.EventStepFailed, saga.EventSagaFailed}, types)
		var o order
		require.NoError(t, in.DecodeState(&o))
		require.Equal(t, order{ID: "o-stuck-1", Decline: true, BreakRelease: true}, o)
	})

	t.Run("not found", func(t *testing.T) {
		id := uuid.New()
		msg := f.cli(t, "show", id.String()).failed(t, exitNotFound)
		require.Equal(t, "sagaflow: show "+id.String()+`: no such saga in schema "`+f.Schema+`"`+"\n", msg)

		r := f.cli(t, "--json", "show", id.String())
		require.Equal(t, exitNotFound, r.code)
		e := decode[jsonError](t, r)
		require.Equal(t, exitNotFound, e.Code)
		require.Contains(t, e.Error, id.String())
	})

	t.Run("bad id", func(t *testing.T) {
		msg := f.cli(t, "show", "order-42").failed(t, exitUsage)
		require.Contains(t, msg, `saga id "order-42" is not a UUID`)
		msg = f.cli(t, "show").failed(t, exitUsage)
		require.Contains(t, msg, "missing saga id")
		msg = f.cli(t, "show", s.ping.String(), s.completed.String()).failed(t, exitUsage)
		require.Contains(t, msg, "unexpected argument")
	})
}
