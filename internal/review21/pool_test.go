package review21

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// The user's application shares the engine's pool (as StartTx invites).
// The engine runs on a pool of 4 connections; a batch of eight sagas' step
// b commands has its head held. Two sagas later in the batch get a cancel
// request row and one a pause row, with no notification; an operator tool
// on a pool of its own asks one to cancel and pauses one (notified). 300 ms
// later, in "held", the application takes every other connection of the
// engine's pool for 2 s, and the head is let go ("control" takes none).
// Guarantee 10: a batch that read the saga more than 100 ms before "reads
// its requests and pauses again, so a late notification does not let the
// step start"; docs/reliability.md: a lock from outside "holds up a
// worker" (nothing worse). Whatever the read again does without a free
// connection (wait, or fail), no step b of those five sagas may start: the
// cancelled end compensated with b never called, the paused complete once
// after Resume, the others complete once. "held" fails: F1.
func TestReadAgainWithThePoolHeld(t *testing.T) {
	t.Parallel()
	for _, hold := range []bool{false, true} {
		name := "control"
		if hold {
			name = "held"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			readAgainWithThePoolHeld(t, hold)
		})
	}
}

func readAgainWithThePoolHeld(t *testing.T, hold bool) {
	d := testkit.NewDB(t)
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	require.NoError(t, err)
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	small := &testkit.DB{Pool: pool, Schema: d.Schema}
	r := newRig(t, small, "r21pool", "b", nil)
	// An operator tool on a pool of its own (the original one).
	tool := testkit.NewEngine(t, d.Pool, &saga.Config{Schema: d.Schema, Logger: testkit.Discard})
	ids := r.startN(t, 9, nil)
	e, head, m := r.run(t, ids)
	cancelled, paused, untouched := m[:3], m[3:5], m[5:]
	r.sqlCancel(t, m[0], "review21: unheard of")
	r.sqlCancel(t, m[1], "review21: unheard of")
	require.NoError(t, r.act(t, tool, m[2], "request", "review21: notified"))
	r.sqlPause(t, &m[3], "review21: unheard of")
	require.NoError(t, r.act(t, tool, m[4], "pause", "review21: notified"))
	time.Sleep(aged)
	// Take every connection the pool will give within a moment.
	var held []*pgxpool.Conn
	for hold {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		c, err := pool.Acquire(ctx)
		cancel()
		if err != nil {
			break
		}
		held = append(held, c)
	}
	t.Logf("holding %d of the pool's %d connections", len(held), cfg.MaxConns)
	release := func() {
		for _, c := range held {
			c.Release()
		}
		held = nil
	}
	t.Cleanup(release)
	r.gate.Open()
	// Watch for 2 s; the verdict comes after the release, with the
	// timelines.
	ranWhileHeld := map[uuid.UUID]bool{}
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(testkit.Poll) {
		for _, id := range m[:5] {
			if r.callsOf(id, "b") > 0 {
				ranWhileHeld[id] = true
			}
		}
	}
	release()

	for _, id := range append([]uuid.UUID{head}, untouched...) {
		r.completedOnce(t, e, id)
	}
	t.Logf("stats %+v", e.Stats())
	for _, id := range cancelled {
		in := testkit.WaitEnded(t, e, id)
		t.Logf("cancelled %s: b ran while the pool was held: %v; b called %d times (%s); %v", id, ranWhileHeld[id], r.callsOf(id, "b"), r.explain(id, "b"), testkit.Timeline(in))
	}
	for _, id := range paused {
		t.Logf("paused %s: b ran while the pool was held: %v; b called %d times (%s); %v", id, ranWhileHeld[id], r.callsOf(id, "b"), r.explain(id, "b"), testkit.Timeline(get(t, e, id)))
	}
	for _, id := range cancelled {
		r.cancelledClean(t, e, id)
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called", id)
	}
	for _, id := range paused {
		r.heldPaused(t, e, id, 300*time.Millisecond)
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called while paused", id)
		require.NoError(t, tool.Resume(context.Background(), id, "review21: go on"))
	}
	for _, id := range paused {
		r.completedOnce(t, e, id)
	}
}
