package sagatest_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// hourly is a saga whose charge step fails once and is retried an hour
// later.
func hourly(name string) *saga.Definition[order] {
	var calls atomic.Int32
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: nop, Compensate: nop},
		saga.Step[order]{Name: "charge",
			Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return time.Hour }},
			Action: func(_ context.Context, _ *saga.StepRun, o *order) error {
				if calls.Add(1) == 1 {
					return errors.New("the provider is down")
				}
				o.Charged = true
				return nil
			}},
	)
}

// An hour of backoff passes in milliseconds, in both modes: the retry's
// command comes due, the engine is woken and runs it.
func TestAdvancePassesAnHourOfRetryBackoff(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"postgres", "kafka"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			var b *bundle
			if mode == "kafka" {
				b = setup(t, saga.CommandTopicDefault+".hourly")
			} else {
				b = setup(t)
			}
			def := hourly("hourly")
			b.start(t, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, b.engine, def, order{ID: "o-1"}, nil)
			require.NoError(t, err)

			in := sagatest.Wait(t, b.engine, st.ID, sagatest.Event("step_failed:charge"), nil)
			require.Equal(t, saga.StatusRunning, in.Status)
			// The retry waits an hour: still running well after the engine
			// would have picked it up had it been due.
			require.Never(t, func() bool {
				in, err := b.engine.Get(ctx, st.ID)
				return err != nil || in.Status != saga.StatusRunning
			}, 300*time.Millisecond, 20*time.Millisecond)

			clock := sagatest.NewClock(b.pool, b.schema, b.engine)
			begun := time.Now()
			require.NoError(t, clock.Advance(ctx, time.Hour))
			in = sagatest.WaitEnded(t, b.engine, st.ID, &sagatest.WaitOpts{Timeout: 10 * time.Second})
			t.Logf("an hour of backoff took %s", time.Since(begun))
			require.Less(t, time.Since(begun), 5*time.Second)
			require.Equal(t, saga.StatusCompleted, in.Status)
			sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve", "step_failed:charge",
				"step_completed:charge", "saga_completed")
			// The timeline moved back with everything else: the retry came
			// an hour (of database time) after the failure.
			require.GreaterOrEqual(t, in.History[3].At.Sub(in.History[2].At), time.Hour)
		})
	}
}

// Advance moves only rows that exist: advancing before the retry is
// written does not make the retry due.
func TestAdvanceMovesOnlyWhatIsWritten(t *testing.T) {
	t.Parallel()
	b := setup(t)
	def := hourly("hourly")
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	clock := sagatest.NewClock(b.pool, b.schema, b.engine)
	st, err := saga.Start(ctx, b.engine, def, order{ID: "o-2"}, nil)
	require.NoError(t, err)
	require.NoError(t, clock.Advance(ctx, time.Hour)) // before the step failed
	created := func() time.Time {
		var at time.Time
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT created_at FROM "+b.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&at))
		return at
	}
	var now time.Time
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT now()").Scan(&now))
	require.WithinDuration(t, now.Add(-time.Hour), created(), time.Minute, "the saga's own times moved back")

	require.NoError(t, b.engine.Start(ctx))
	t.Cleanup(func() { require.NoError(t, b.engine.Stop(context.Background())) })
	sagatest.Wait(t, b.engine, st.ID, sagatest.Event("step_failed:charge"), nil)
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+
		" WHERE saga_id = $1 AND status = 'pending' AND available_at > now() + interval '59 minutes'", st.ID),
		"the retry written after the advance waits its full hour")

	require.ErrorContains(t, clock.Advance(ctx, 0), "d must be positive")
}

// A remote step's reply timeout is a deadline in the database: Advance
// makes it pass, and the rescuer it runs fails the step and compensates.
func TestAdvancePassesAReplyTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t, saga.CommandTopicDefault+".remote", saga.CommandTopicDefault+".remote.replies", "inventory.commands")
	def := saga.Define("remote",
		saga.Step[order]{Name: "reserve", Timeout: time.Hour, Remote: &saga.Remote[order]{
			Topic: "inventory.commands", Type: "inventory.reserve", CompensateType: "inventory.release",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		}},
		saga.Step[order]{Name: "charge", Action: nop},
	)
	pool, schema := migrated(t)
	inventory := sagatest.NewParticipant(t, sagatest.ParticipantConfig{
		Brokers: b.kc.Addrs(), Topic: "inventory.commands", Pool: pool, Schema: schema,
		Answers: map[string]sagatest.Answer{
			"inventory.reserve": sagatest.NoReply(), // lost, as far as the saga can tell
			"inventory.release": sagatest.Reply(nil),
		},
	})
	b.start(t, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{ID: "o-3"}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, sagatest.Cond("reach the participant", func(*saga.Instance) bool {
		return len(inventory.Calls()) == 1
	}), nil)

	require.NoError(t, sagatest.NewClock(b.pool, b.schema, b.engine).Advance(ctx, time.Hour+2*saga.RescueSlackDefault))
	in := sagatest.WaitEnded(t, b.engine, st.ID, &sagatest.WaitOpts{Timeout: 20 * time.Second})
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeReplyTimeout, in.LastError.Code)
	sagatest.RequireTimeline(t, in, "saga_started", "command_sent:reserve", "step_failed:reserve",
		"compensation_started:reserve", "command_sent:reserve", "reply_received:reserve", "compensation_completed:reserve",
		"saga_compensated")
	calls := inventory.Calls()
	require.Len(t, calls, 2)
	require.Equal(t, sagatest.Call{Type: "inventory.reserve", Key: steps.Key{SagaID: st.ID, Step: "reserve", Direction: steps.Forward},
		Direction: steps.Forward, Command: calls[0].Command}, calls[0], "NoReply records the call, unanswered")
	require.JSONEq(t, `{"id": "o-3"}`, string(calls[0].Command))
	require.Equal(t, "inventory.release", calls[1].Type)
	require.True(t, calls[1].Answered)
}

// A command for a saga no engine here knows waits UnknownSagaGrace (ten
// minutes by default) for one that does: Advance makes the grace pass.
func TestAdvancePassesTheUnknownSagaGrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	known := twoSteps("known", false)
	b.start(t, known)
	// Another service's engine (a client here) starts a saga this engine
	// does not know.
	other, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	foreign := twoSteps("foreign", false)
	require.NoError(t, other.Register(foreign))
	ctx := context.Background()
	st, err := saga.Start(ctx, other, foreign, order{ID: "o-4"}, nil)
	require.NoError(t, err)
	require.Never(t, func() bool { return b.engine.Stats().Parked > 0 }, 300*time.Millisecond, 20*time.Millisecond,
		"held within the grace")

	require.NoError(t, sagatest.NewClock(b.pool, b.schema).Advance(ctx, saga.UnknownSagaGraceDefault+time.Minute))
	var dead *saga.DeadMessagePage
	require.Eventually(t, func() bool {
		dead, err = b.engine.DeadMessages(ctx, nil)
		return err == nil && len(dead.Messages) > 0
	}, 10*time.Second, 10*time.Millisecond)
	require.Len(t, dead.Messages, 1)
	require.Equal(t, &st.ID, dead.Messages[0].SagaID)
	require.Contains(t, dead.Messages[0].LastError, "UnknownSagaGrace")
}
