package store

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// TestNextDirectDueReadsOneEntry: with many sleeping sagas' commands in the
// outbox and statistics that do not know them yet (no ANALYZE, as after a
// burst of timers), the workers' next-due look-up reads the first index
// entry, not every future command; and it still finds the nearest one of
// the engine's own sagas, ignoring due and other definitions' commands.
func TestNextDirectDueReadsOneEntry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, st := migratedStore(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()

	const sleeping = 5000
	_, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (id, topic, delivery, aggregatetype, aggregateid, type, payload, available_at)
		SELECT gen_random_uuid(), 'cmds', 'direct', 'saga.mine', i::text, 'sagaflow.step', '{}', now() + interval '1 hour' + i * interval '1 s'
		FROM generate_series(1, $1) AS i`, sleeping)
	require.NoError(t, err)
	// Due already, and nearer but of a definition this engine does not know:
	// neither counts.
	_, err = pool.Exec(ctx, `INSERT INTO `+outbox+` (id, topic, delivery, aggregatetype, aggregateid, type, payload, available_at)
		VALUES (gen_random_uuid(), 'cmds', 'direct', 'saga.mine', 'due', 'sagaflow.step', '{}', now() - interval '1 s'),
			(gen_random_uuid(), 'cmds', 'direct', 'saga.other', 'other', 'sagaflow.step', '{}', now() + interval '1 minute')`)
	require.NoError(t, err)

	known := []string{"saga.mine"}
	grace := 5 * time.Minute
	d, ok, err := st.NextDirectDue(ctx, pool, "cmds", known, grace, 0)
	require.NoError(t, err)
	require.True(t, ok)
	require.InDelta(t, (time.Hour + time.Second).Seconds(), d.Seconds(), 30, "the nearest of the engine's own future commands")

	var plan []struct {
		Plan json.RawMessage `json:"Plan"`
	}
	require.NoError(t, pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+st.q.nextDue, "cmds", known, micros(grace), int64(0)).Scan(&plan))
	require.Len(t, plan, 1)
	var worst float64
	var walk func(raw json.RawMessage)
	walk = func(raw json.RawMessage) {
		var n struct {
			Relation string            `json:"Relation Name"`
			Rows     float64           `json:"Actual Rows"`
			Plans    []json.RawMessage `json:"Plans"`
		}
		require.NoError(t, json.Unmarshal(raw, &n))
		if n.Relation == "outbox" {
			worst = max(worst, n.Rows)
		}
		for _, p := range n.Plans {
			walk(p)
		}
	}
	walk(plan[0].Plan)
	require.LessOrEqual(t, worst, 1.0, "rows the look-up read from the outbox, of %d sleeping commands: %s", sleeping, plan[0].Plan)

	_, err = pool.Exec(ctx, `DELETE FROM `+outbox+` WHERE aggregatetype = 'saga.mine' AND available_at > now()`)
	require.NoError(t, err)
	_, ok, err = st.NextDirectDue(ctx, pool, "cmds", known, grace, 0)
	require.NoError(t, err)
	require.False(t, ok, "no future command of the engine's own")
}

// TestNextDirectDueCountsCommandsDueSinceTheClaim: a command that came due
// after the caller's claim began (which could not take it) counts, due now,
// however late the look; one due before that claim (another worker's) does
// not, nor one written due at once (its writer announced it).
func TestNextDirectDueCountsCommandsDueSinceTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, st := migratedStore(t)
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	insert := func(id string, createdAgo, dueAgo time.Duration) {
		t.Helper()
		_, err := pool.Exec(ctx, `INSERT INTO `+outbox+` (id, topic, delivery, aggregatetype, aggregateid, type, payload, created_at, available_at)
			VALUES (gen_random_uuid(), 'cmds', 'direct', 'saga.mine', $1, 'sagaflow.step', '{}',
				now() - $2 * interval '1 microsecond', now() - $3 * interval '1 microsecond')`, id, micros(createdAgo), micros(dueAgo))
		require.NoError(t, err)
	}
	known, grace := []string{"saga.mine"}, 5*time.Minute
	look := func(since time.Duration) (time.Duration, bool) {
		t.Helper()
		d, ok, err := st.NextDirectDue(ctx, pool, "cmds", known, grace, since)
		require.NoError(t, err)
		return d, ok
	}
	// Written 10 s ago due 3 s ago (a retry, a timer): due since a claim that
	// began 5 s ago, not since one that began 1 s ago.
	insert("late", 10*time.Second, 3*time.Second)
	// Written due at once 2 s ago: announced, so never counted.
	insert("now", 2*time.Second, 2*time.Second)
	_, ok := look(time.Second)
	require.False(t, ok, "due before the claim began: another worker's")
	d, ok := look(5 * time.Second)
	require.True(t, ok, "came due since the claim began")
	require.InDelta(t, -3, d.Seconds(), 1, "due already")
	insert("later", 10*time.Second, -time.Hour)
	d, ok = look(5 * time.Second)
	require.True(t, ok)
	require.Less(t, d, time.Duration(0), "the one due since the claim comes before the one due in an hour")
	d, ok = look(time.Second)
	require.True(t, ok)
	require.InDelta(t, time.Hour.Seconds(), d.Seconds(), 30)
}
