package review6_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// A timer that falls due during a pause, with sagatest's clock: Resume
// makes "each held command ... due when it was due before, or at once when
// that time has passed", and Clock.Advance moves "every time sagaflow
// stored in the schema" d into the past. An hour's sleep, paused, two hours
// advanced, then resumed, fires at once.
func TestPauseTimerWithClockAdvance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	d := saga.Define("p-clock",
		saga.Step[st]{Name: "nap", Wait: saga.Sleep[st](time.Hour)},
		saga.Step[st]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "after")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, e, s.ID, sagatest.Cond("wait on its timer", func(in *saga.Instance) bool {
		return in.Wait != nil
	}), nil)
	require.NoError(t, e.Pause(ctx, s.ID, "hold"))
	clock := sagatest.NewClock(v.Pool, v.Schema, e)
	require.NoError(t, clock.Advance(ctx, 2*time.Hour))
	testkit.Hold(t, time.Second, "the due timer does not fire while paused", func() bool {
		return v.fx.Count(t, s.ID, "after") == 0
	})
	require.NoError(t, e.Resume(ctx, s.ID, "go"))
	if w := get(t, e, s.ID).Wait; w != nil && w.Until != nil {
		t.Logf("after resume: wait until %s, now %s", w.Until, time.Now())
	}
	in := sagatest.WaitEnded(t, e, s.ID, &sagatest.WaitOpts{Timeout: 10 * time.Second})
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, events(in, "timer_fired:nap"))
}

// doc.go "Versions": "(after Config.UnknownSagaGrace with no such engine,
// the commands are parked as for any saga no engine knows)"; guarantee 8:
// "Bad input is parked, never dropped"; RequeueDead: "A dead outbox row
// becomes pending again". sagatest.Clock.Advance makes the grace pass:
// "the age of a Postgres-only command for a saga or step no engine here
// knows (Config.UnknownSagaGrace)".
func TestFindingRequeueReparkedByEngineWithoutVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1 := orderV1(v)
	client := v.engine(t, false, v1)
	old, err := saga.Start(ctx, client, v1, st{}, nil)
	require.NoError(t, err)
	cfg := v.config()
	cfg.UnknownSagaGrace = time.Minute
	onlyV2 := v.engineWith(t, cfg, true, orderV2(v))
	require.NoError(t, sagatest.NewClock(v.Pool, v.Schema, onlyV2).Advance(ctx, 2*time.Minute))
	var dead *saga.DeadMessagePage
	testkit.WaitFor(t, 15*time.Second, "the v1 command is parked after the grace", func() bool {
		dead, err = client.DeadMessages(ctx, nil)
		require.NoError(t, err)
		return len(dead.Messages) > 0
	})
	require.Len(t, dead.Messages, 1)
	require.NotNil(t, dead.Messages[0].SagaID)
	require.Equal(t, old.ID, *dead.Messages[0].SagaID)
	require.NotEmpty(t, dead.Messages[0].LastError)
	require.Empty(t, v.fx.Counts(t, old.ID))

	withV1 := v.engine(t, true, orderV1(v))
	rq, err := withV1.RequeueDead(ctx, &saga.RequeueOpts{MessageIDs: []uuid.UUID{dead.Messages[0].ID}})
	require.NoError(t, err)
	require.Len(t, rq.Messages, 1)
	in := testkit.WaitEnded(t, withV1, old.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, v.fx.Counts(t, old.ID))
}
