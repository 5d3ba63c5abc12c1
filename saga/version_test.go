package saga_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// orderV2 is the state of version 2 of the versioned saga: the order, and
// the parcel it packed.
type orderV2 struct {
	OrderID string `json:"order_id"`
	Parcel  string `json:"parcel"`
}

// versioned returns version 1 (reserve, paid, ship) and version 2 (reserve,
// paid, pack, ship) of one saga; "paid" awaits a signal. Every step records
// its effect.
func versioned(b *bundle, name string) (*saga.Definition[order], *saga.Definition[orderV2]) {
	rec1 := func(ctx context.Context, run *saga.StepRun, _ *order) error { return recordEffect(ctx, run, b.schema) }
	rec2 := func(ctx context.Context, run *saga.StepRun, _ *orderV2) error {
		return recordEffect(ctx, run, b.schema)
	}
	v1 := saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: rec1, Compensate: rec1},
		saga.Step[order]{Name: "paid", Wait: saga.OnSignal("paid", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
		saga.Step[order]{Name: "ship", Action: rec1},
	)
	v2 := saga.Define(name,
		saga.Step[orderV2]{Name: "reserve", Action: rec2, Compensate: rec2},
		saga.Step[orderV2]{Name: "paid", Wait: saga.OnSignal("paid", func(context.Context, *saga.StepRun, *orderV2, struct{}) error { return nil })},
		saga.Step[orderV2]{Name: "pack", Action: func(ctx context.Context, run *saga.StepRun, o *orderV2) error {
			o.Parcel = "parcel-" + o.OrderID
			return recordEffect(ctx, run, b.schema)
		}},
		saga.Step[orderV2]{Name: "ship", Action: rec2},
	).WithVersion(2)
	return v1, v2
}

// waitingFor waits until saga id waits at step.
func (b *bundle) waitingAt(t *testing.T, id uuid.UUID, step string) {
	t.Helper()
	waitFor(t, 10*time.Second, func() bool {
		in, err := b.engine.Get(context.Background(), id)
		return err == nil && in.Wait != nil && in.Step == step
	}, "saga %s to wait at %s", id, step)
}

func (b *bundle) pay(t *testing.T, id uuid.UUID) {
	t.Helper()
	_, err := b.engine.Signal(context.Background(), saga.Signal{SagaID: id, Name: "paid", ID: "pay-" + id.String()})
	require.NoError(t, err)
}

// Sagas of version 1 and 2 in flight together each finish on their own
// version's steps, on one engine that registered both.
func TestVersionsRunSideBySide(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v1, v2 := versioned(b, "versioned")
	require.NoError(t, b.engine.Register(v1, v2))
	ctx := context.Background()
	old, err := saga.Start(ctx, b.engine, v1, order{OrderID: "o1"}, nil)
	require.NoError(t, err)
	cur, err := saga.Start(ctx, b.engine, v2, orderV2{OrderID: "o2"}, nil)
	require.NoError(t, err)
	counts, err := b.engine.Versions(ctx)
	require.NoError(t, err)
	require.Equal(t, []saga.VersionCount{{Name: "versioned", Version: 1, Running: 1}, {Name: "versioned", Version: 2, Running: 1}}, counts)

	b.start(t)
	b.waitingAt(t, old.ID, "paid")
	b.waitingAt(t, cur.ID, "paid")
	b.pay(t, old.ID)
	b.pay(t, cur.ID)
	in := b.waitTerminal(t, old.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, in.DefinitionVersion)
	require.Equal(t, []string{"reserve/forward", "ship/forward"}, b.effects(t, old.ID))
	in = b.waitTerminal(t, cur.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 2, in.DefinitionVersion)
	require.Equal(t, []string{"reserve/forward", "pack/forward", "ship/forward"}, b.effects(t, cur.ID))
}

// An engine that registered only version 2 leaves version 1's sagas to an
// engine that has it: it neither runs nor parks them, and its own sagas are
// not held back. The engine with version 1 then finishes them.
func TestAnEngineWithoutAVersionLeavesItsSagasAlone(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v1, v2 := versioned(b, "deploy")
	require.NoError(t, b.engine.Register(v2)) // the new deploy
	oldEngine, err := saga.New(b.pool, &saga.Config{Schema: b.schema, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	v1b, _ := versioned(b, "deploy")
	require.NoError(t, oldEngine.Register(v1b)) // the old deploy, not yet running
	ctx := context.Background()
	var olds []uuid.UUID
	for range 5 {
		st, err := saga.Start(ctx, oldEngine, v1b, order{OrderID: "old"}, nil)
		require.NoError(t, err)
		olds = append(olds, st.ID)
	}
	_ = v1
	b.start(t)
	var news []uuid.UUID
	for range 5 {
		st, err := saga.Start(ctx, b.engine, v2, orderV2{OrderID: "new"}, nil)
		require.NoError(t, err)
		news = append(news, st.ID)
	}
	for _, id := range news {
		b.waitingAt(t, id, "paid")
		b.pay(t, id)
	}
	for _, id := range news {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, id).Status, "version 2 is not held back")
	}
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("effects")+" WHERE saga_id = ANY($1)", olds), "version 1 did not run here")
	require.Equal(t, 5, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = ANY($1) AND status = 'pending'", olds),
		"version 1's commands wait, neither run nor parked")
	require.Zero(t, b.engine.Stats().Parked)

	require.NoError(t, oldEngine.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, oldEngine.Stop(ctx))
	})
	for _, id := range olds {
		sagatest.Wait(t, oldEngine, id, sagatest.Cond("a wait", func(in *saga.Instance) bool { return in.Wait != nil }), nil)
		_, err := oldEngine.Signal(ctx, saga.Signal{SagaID: id, Name: "paid"})
		require.NoError(t, err)
	}
	for _, id := range olds {
		in := sagatest.WaitEnded(t, oldEngine, id, nil)
		require.Equal(t, saga.StatusCompleted, in.Status)
		require.Equal(t, []string{"reserve/forward", "ship/forward"}, b.effects(t, id))
	}
}

// A migration moves in-flight sagas of version 1 to version 2: the dry run
// shows exactly what the real run then does, and the moved sagas finish on
// version 2's steps. Sagas Map refuses, or sends nowhere, are skipped with
// the reason and keep running on version 1.
func TestMigrateSagasDryRunAndRealRunAgree(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v1, v2 := versioned(b, "migrating")
	require.NoError(t, b.engine.Register(v1, v2))
	b.start(t)
	ctx := context.Background()
	var ids []uuid.UUID
	for _, o := range []string{"a", "b", "refused", "nowhere"} {
		st, err := saga.Start(ctx, b.engine, v1, order{OrderID: o}, nil)
		require.NoError(t, err)
		b.waitingAt(t, st.ID, "paid")
		ids = append(ids, st.ID)
	}
	m := saga.Migration[order, orderV2]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, o *order, at saga.Position) (*orderV2, saga.Position, error) {
			switch o.OrderID {
			case "refused":
				return nil, saga.Position{}, errors.New("order refused\x00 by Map")
			case "nowhere":
				return &orderV2{OrderID: o.OrderID}, saga.Position{Step: "gift-wrap", Direction: steps.Forward}, nil
			}
			return &orderV2{OrderID: o.OrderID + "-v2"}, at, nil
		}}

	dry, err := saga.MigrateSagas(ctx, b.engine, m, &saga.MigrateOpts{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 2, dry.Moved)
	require.Equal(t, 2, dry.Skipped)
	counts, err := b.engine.Versions(ctx)
	require.NoError(t, err)
	require.Equal(t, []saga.VersionCount{{Name: "migrating", Version: 1, Running: 4}}, counts, "a dry run changes nothing")

	real, err := saga.MigrateSagas(ctx, b.engine, m, nil)
	require.NoError(t, err)
	require.Len(t, real.Moves, len(dry.Moves))
	for i := range dry.Moves {
		d, r := dry.Moves[i], real.Moves[i]
		require.False(t, d.Applied)
		require.Equal(t, d.Skipped == "", r.Applied, "move %d", i)
		d.Applied = r.Applied
		require.Equal(t, d, r, "the dry run and the real run agree")
	}
	byID := map[uuid.UUID]saga.SagaMove{}
	for _, mv := range real.Moves {
		byID[mv.ID] = mv
	}
	require.Equal(t, saga.Position{Step: "paid", Direction: steps.Forward}, byID[ids[0]].To)
	require.JSONEq(t, `{"order_id":"a-v2","parcel":""}`, string(byID[ids[0]].State))
	require.False(t, byID[ids[0]].KeyReused)
	require.Contains(t, byID[ids[2]].Skipped, "order refused")
	require.NotContains(t, byID[ids[2]].Skipped, "\x00")
	require.Contains(t, byID[ids[3]].Skipped, `step "gift-wrap"`)

	counts, err = b.engine.Versions(ctx)
	require.NoError(t, err)
	require.Equal(t, []saga.VersionCount{{Name: "migrating", Version: 1, Running: 2}, {Name: "migrating", Version: 2, Running: 2}}, counts)

	for _, id := range ids {
		b.waitingAt(t, id, "paid")
		b.pay(t, id)
	}
	for i, id := range ids {
		in := b.waitTerminal(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
		if i < 2 {
			require.Equal(t, 2, in.DefinitionVersion)
			require.True(t, hasEvent(in, saga.EventSagaMigrated))
			require.Equal(t, []string{"reserve/forward", "pack/forward", "ship/forward"}, b.effects(t, id))
			var st orderV2
			require.NoError(t, in.DecodeState(&st))
			require.Equal(t, "parcel-"+st.OrderID, st.Parcel)
		} else {
			require.Equal(t, 1, in.DefinitionVersion)
			require.Equal(t, []string{"reserve/forward", "ship/forward"}, b.effects(t, id))
		}
	}
	// Nothing is left to move.
	again, err := saga.MigrateSagas(ctx, b.engine, m, nil)
	require.NoError(t, err)
	require.Empty(t, again.Moves)
}

func TestVersionRegistrationAndMigrationRefusals(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v1, v2 := versioned(b, "vreg")
	require.NoError(t, b.engine.Register(v1, v2))
	dup, _ := versioned(b, "vreg")
	err := b.engine.Register(dup)
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)
	require.ErrorContains(t, err, `a saga named "vreg" is already registered at version 1`)
	bad, _ := versioned(b, "vbad")
	require.ErrorIs(t, b.engine.Register(bad.WithVersion(-1)), saga.ErrInvalidDefinition)

	ctx := context.Background()
	other, _ := versioned(b, "other")
	_, err = saga.MigrateSagas(ctx, b.engine, saga.Migration[order, order]{From: v1, To: other,
		Map: func(context.Context, uuid.UUID, *order, saga.Position) (*order, saga.Position, error) {
			return nil, saga.Position{}, nil
		}}, nil)
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	require.True(t, strings.Contains(err.Error(), "two versions of one saga"), err.Error())
	_, err = saga.MigrateSagas(ctx, b.engine, saga.Migration[order, orderV2]{From: v1, To: v2}, nil)
	require.ErrorIs(t, err, saga.ErrInvalidInput)
}

// A type's pause covers every version of it: a saga of version 2 (whose
// commands name the version) is held as one of version 1 is.
func TestPauseTypeCoversEveryVersion(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v1, v2 := versioned(b, "vpause")
	require.NoError(t, b.engine.Register(v1, v2))
	ctx := context.Background()
	_, err := b.engine.PauseType(ctx, "vpause", "")
	require.NoError(t, err)
	b.start(t)
	old, err := saga.Start(ctx, b.engine, v1, order{OrderID: "a"}, nil)
	require.NoError(t, err)
	cur, err := saga.Start(ctx, b.engine, v2, orderV2{OrderID: "b"}, nil)
	require.NoError(t, err)
	stays(t, 400*time.Millisecond, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("effects")+" WHERE saga_id = ANY($1)", []uuid.UUID{old.ID, cur.ID}) == 0
	}, "no saga of a paused type may start, whatever its version")
	require.Equal(t, 1, b.heldCommands(t, cur.ID))
	_, err = b.engine.ResumeType(ctx, "vpause")
	require.NoError(t, err)
	b.waitingAt(t, old.ID, "paid")
	b.waitingAt(t, cur.ID, "paid")
	b.pay(t, old.ID)
	b.pay(t, cur.ID)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, old.ID).Status)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, cur.ID).Status)
}
