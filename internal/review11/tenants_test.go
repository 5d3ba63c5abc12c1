package review11_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Two tenants: two schemas whose names differ only in case, each with its
// engine, the same saga type and branch names, and a saga of the same id
// (StartOpts.ID, as a service deriving ids from its orders would set it).
// Tenant A's branch fan.b is lost; tenant B's fan.b runs right now. Each
// rescuer handles its own schema only: A's re-sends A's branch, and
// touches nothing of B (history, outbox, branch rows); B's finds nothing.
func TestTenantsLostBranch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	da, db := tenants(t)
	a, b := envOn(t, da), envOn(t, db)
	bhA, bhB := newBehave(), newBehave()
	defA := fanDef("tenant", a.fx, bhA, 3, "a", "b")
	defB := fanDef("tenant", b.fx, bhB, 3, "a", "b")
	id := uuid.New()
	a.loseBranch(t, "fan.b", 0)
	entered, release := bhB.block("fan.b")
	defer release()
	gA, _ := testkit.StartEngine(t, a.Pool, a.cfg(), defA)
	gB, _ := testkit.StartEngine(t, b.Pool, b.cfg(), defB)
	_, err := saga.Start(ctx, gA, defA, order{ID: "A"}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	_, err = saga.Start(ctx, gB, defB, order{ID: "B"}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	waitFor(t, "A's fan.a", func() bool { return a.fx.Count(t, id, "fan.a") == 1 })
	waitFor(t, "B's fan.a", func() bool { return b.fx.Count(t, id, "fan.a") == 1 })
	testkit.Recv(t, entered, wait, "B's fan.b running")
	require.Equal(t, 1, a.dropped(t, "%/fan.b/%"))
	require.True(t, a.age(t, id, 2*slack))
	require.True(t, b.age(t, id, 2*slack))

	beforeB := b.dump(t, id)
	histB := b.Count(t, `SELECT count(*) FROM `+b.Table("saga_history"))
	resA := rescue(t, gA)
	require.Equal(t, 1, resA.Redriven, "%+v", resA)
	require.Equal(t, beforeB, b.dump(t, id), "A's rescuer changed B's outbox or branches")
	require.Equal(t, histB, b.Count(t, `SELECT count(*) FROM `+b.Table("saga_history")), "A's rescuer wrote B's history")
	resB := rescue(t, gB)
	require.Zero(t, resB.Redriven+resB.FailedOver+resB.Woken, "B's branch runs right now: %+v\n%s", resB, b.dump(t, id))

	// A completes while B's branch is still held in its handler: one
	// tenant's running branch does not hold back the other's.
	inA := testkit.WaitEnded(t, gA, id)
	require.Equal(t, saga.StatusCompleted, inA.Status)
	release()
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, gB, id).Status)
	for _, x := range []*env{a, b} {
		require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, x.fx.Counts(t, id), x.Schema)
	}
	require.Equal(t, 1, a.events(t, id, saga.EventSagaRescued, "fan.b"))
	require.Equal(t, 0, b.events(t, id, saga.EventSagaRescued, ""))
	var stA, stB order
	inB, err := gB.Get(ctx, id)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(inA.State, &stA))
	require.NoError(t, json.Unmarshal(inB.State, &stB))
	require.Equal(t, "A", stA.ID)
	require.Equal(t, "B", stB.ID)
}

// The same for lost wake-ups: tenant A's saga waits for signal "go", which
// was sent and whose wake-up was lost; tenant B's saga of the same id waits
// for "go" too, with no signal. A's rescuer wakes A's saga only; B's wakes
// nothing, and B's saga keeps waiting.
func TestTenantsLostWakeUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	da, db := tenants(t)
	a, b := envOn(t, da), envOn(t, db)
	mk := func(fx *testkit.Effects) *saga.Definition[order] {
		return saga.Define("waiter",
			saga.Step[order]{Name: "await", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error {
				return fx.Record(ctx, run, "signalled")
			})},
		)
	}
	defA, defB := mk(a.fx), mk(b.fx)
	id := uuid.New()
	gA, _ := testkit.StartEngine(t, a.Pool, a.cfg(), defA)
	gB, _ := testkit.StartEngine(t, b.Pool, b.cfg(), defB)
	for _, x := range []struct {
		g   *saga.Engine
		def *saga.Definition[order]
		e   *env
	}{{gA, defA, a}, {gB, defB, b}} {
		_, err := saga.Start(ctx, x.g, x.def, order{ID: x.e.Schema}, &saga.StartOpts{ID: id})
		require.NoError(t, err)
		waitFor(t, "waiting", func() bool {
			in, err := x.g.Get(ctx, id)
			require.NoError(t, err)
			return in.Wait != nil
		})
	}
	a.lose(t, "%", "sagaflow.wake", "delete", 0, 1)
	_, err := gA.Signal(ctx, saga.Signal{SagaID: id, Name: "go", Payload: json.RawMessage(`{}`)})
	require.NoError(t, err)
	require.Equal(t, 1, a.dropped(t, "%"), "the wake-up was lost")
	testkit.Hold(t, 300*time.Millisecond, "A still waits", func() bool { return a.fx.Count(t, id, "signalled") == 0 })
	require.NoError(t, a.clk.Advance(ctx, 2*slack))
	require.NoError(t, b.clk.Advance(ctx, 2*slack))
	histB := b.Count(t, `SELECT count(*) FROM `+b.Table("saga_history"))
	resA := rescue(t, gA)
	require.Equal(t, 1, resA.Woken, "%+v", resA)
	resB := rescue(t, gB)
	require.Zero(t, resB.Woken, "B has no signal: %+v", resB)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, gA, id).Status)
	testkit.Hold(t, 300*time.Millisecond, "B still waits", func() bool { return b.fx.Count(t, id, "signalled") == 0 })
	require.Equal(t, histB, b.Count(t, `SELECT count(*) FROM `+b.Table("saga_history")))
	inB, err := gB.Get(ctx, id)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, inB.Status)
	require.NotNil(t, inB.Wait)
}
