package saga_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// strayHeld starts a saga of def (the engine not started) and leaves its
// first command held with no pause, as a release lost to a race leaves it:
// paused, then the pause's row deleted behind the engine's back.
func (b *bundle) strayHeld(t *testing.T, def *saga.Definition[order]) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, b.engine.Pause(ctx, st.ID, "lost release"))
	b.unpauseBehindTheEngine(t, st.ID)
	require.Equal(t, 1, b.heldCommands(t, st.ID))
	return st.ID
}

// unpauseBehindTheEngine deletes saga id's own pause row, leaving what it
// held held.
func (b *bundle) unpauseBehindTheEngine(t *testing.T, id uuid.UUID) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), "DELETE FROM "+b.table("saga_pauses")+" WHERE kind = 'saga' AND saga_id = $1", id)
	require.NoError(t, err)
}

// A command held for a pause that no longer exists is released by one run
// of the rescuer, and its saga completes.
func TestRescuerReleasesACommandNoPauseHolds(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := gatedSaga(b, "stray-held", nil, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	id := b.strayHeld(t, def)

	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Released: 1}, res)
	require.Zero(t, b.heldCommands(t, id))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+
		" WHERE saga_id = $1 AND status = 'pending' AND paused_from IS NULL AND available_at <= now()", id), "due again")
	require.Equal(t, int64(1), b.engine.Stats().Released)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{}, res, "nothing left to release")

	b.start(t)
	in := b.waitTerminal(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, id))
}

// A command held for a pause that still exists, the saga's own or its
// type's, stays held; one whose pause is gone, in the same run, does not.
func TestRescuerLeavesCommandsOfPausedSagasHeld(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	paused := gatedSaga(b, "held-paused", nil, nil)
	free := gatedSaga(b, "held-free", nil, nil)
	require.NoError(t, b.engine.Register(paused, free))
	ctx := context.Background()
	own, err := saga.Start(ctx, b.engine, paused, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, b.engine.Pause(ctx, own.ID, "own pause"))
	// Held by its own pause, which is lifted behind the engine's back,
	// while its type's pause holds it still.
	byType, err := saga.Start(ctx, b.engine, paused, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, b.engine.Pause(ctx, byType.ID, "own pause, lost"))
	ok, err := b.engine.PauseType(ctx, "held-paused", "type pause")
	require.NoError(t, err)
	require.True(t, ok)
	b.unpauseBehindTheEngine(t, byType.ID)
	stray := b.strayHeld(t, free)

	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Released: 1}, res)
	require.Zero(t, b.heldCommands(t, stray))
	require.Equal(t, 1, b.heldCommands(t, own.ID), "its own pause holds it")
	require.Equal(t, 1, b.heldCommands(t, byType.ID), "its type's pause holds it")

	// The type's pause alone still holds both.
	ok, err = b.engine.PauseType(ctx, "held-paused", "")
	require.NoError(t, err)
	require.False(t, ok)
	b.unpauseBehindTheEngine(t, own.ID)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{}, res)
	require.Equal(t, 1, b.heldCommands(t, own.ID))
	require.Equal(t, 1, b.heldCommands(t, byType.ID))
}

// The release is the engine's schema's business only: another schema's held
// commands wait for its own rescuer.
func TestRescuerReleasesOnlyItsSchemasCommands(t *testing.T) {
	t.Parallel()
	b1, b2 := setup(t, nil), setup(t, nil)
	def1, def2 := gatedSaga(b1, "stray-tenant", nil, nil), gatedSaga(b2, "stray-tenant", nil, nil)
	require.NoError(t, b1.engine.Register(def1))
	require.NoError(t, b2.engine.Register(def2))
	ctx := context.Background()
	id1, id2 := b1.strayHeld(t, def1), b2.strayHeld(t, def2)

	res, err := b1.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Released: 1}, res)
	require.Zero(t, b1.heldCommands(t, id1))
	require.Equal(t, 1, b2.heldCommands(t, id2), "the other schema's command is not touched")

	res, err = b2.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Released: 1}, res)
	require.Zero(t, b2.heldCommands(t, id2))
}

// A pause written and not yet committed when the rescuer runs: the rescuer
// must not release what the pause will hold once it commits. (Pausing holds
// the commands that are due, not those at 'infinity', so nothing would hold
// it again.)
func TestRescuerDoesNotReleaseWhatAPauseInFlightCovers(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := gatedSaga(b, "stray-inflight", nil, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	id := b.strayHeld(t, def)

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	// What Engine.Pause writes, up to its commit.
	_, err = tx.Exec(ctx, "INSERT INTO "+b.table("saga_pauses")+
		" (kind, saga_id, saga_name, code, reason) VALUES ('saga', $1, 'stray-inflight', 'operator', 'in flight')", id)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "UPDATE "+b.table("outbox")+" SET paused_from = available_at, available_at = 'infinity'"+
		" WHERE saga_id = $1 AND status = 'pending' AND available_at <> 'infinity'", id)
	require.NoError(t, err)

	started := time.Now()
	res, err := b.engine.RescueNow(ctx) // waits for the pause, gives up, tries again next run
	require.NoError(t, err)
	require.Less(t, time.Since(started), 5*time.Second)
	require.Zero(t, res.Released)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, b.heldCommands(t, id), "the pause that committed holds the command")
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Released)
	require.Equal(t, 1, b.heldCommands(t, id))
}

// Pause and the rescuer's release, at once, many times: a command is never
// left released while a pause of its saga exists.
func TestRescuerReleaseRacingPause(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := gatedSaga(b, "stray-race", nil, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	const sagas, rounds = 4, 30
	ids := make([]uuid.UUID, sagas)
	for i := range ids {
		ids[i] = b.strayHeld(t, def)
	}
	released := 0
	for range rounds {
		var wg sync.WaitGroup
		for _, id := range ids {
			wg.Go(func() { require.NoError(t, b.engine.Pause(ctx, id, "race")) })
		}
		wg.Go(func() {
			res, err := b.engine.RescueNow(ctx)
			require.NoError(t, err)
			released += res.Released
		})
		wg.Wait()
		for _, id := range ids {
			require.Equal(t, 1, b.heldCommands(t, id), "saga %s is paused: its command must be held", id)
			b.unpauseBehindTheEngine(t, id)
		}
	}
	t.Logf("released %d of %d commands before their pause", released, sagas*rounds)
}
