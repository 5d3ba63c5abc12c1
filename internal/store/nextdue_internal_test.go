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
	d, ok, err := st.NextDirectDue(ctx, pool, "cmds", known, grace)
	require.NoError(t, err)
	require.True(t, ok)
	require.InDelta(t, (time.Hour + time.Second).Seconds(), d.Seconds(), 30, "the nearest of the engine's own future commands")

	var plan []struct {
		Plan json.RawMessage `json:"Plan"`
	}
	require.NoError(t, pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+st.q.nextDue, "cmds", known, micros(grace)).Scan(&plan))
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
	_, ok, err = st.NextDirectDue(ctx, pool, "cmds", known, grace)
	require.NoError(t, err)
	require.False(t, ok, "no future command of the engine's own")
}
