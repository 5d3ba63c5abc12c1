package store

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// TestWakeSweepReadsWhatCanBeReady: the rescuer's sweep for lost wake-ups
// runs at every rescue. With many sagas asleep on signals that have not
// come, it reads the pending signals and the parents waiting for children,
// not every saga that waits: before migration 014 it read each waiting
// saga (111,000 buffers for 100,000 sleepers). It still finds the one saga
// whose signal is pending.
func TestWakeSweepReadsWhatCanBeReady(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, st := migratedStore(t)
	sagas := pgx.Identifier{schema, "saga_instances"}.Sanitize()
	const sleeping = 5000
	_, err := pool.Exec(ctx, `INSERT INTO `+sagas+` (id, saga_name, status, step_index, step_name, direction, state, wait_kind, wait_for,
			created_at, updated_at)
		SELECT gen_random_uuid(), 'parcel', 'running', 1, 'await', 'forward', '{}', 'signal', 'go',
			now() - interval '1 hour', now() - interval '1 hour'
		FROM generate_series(1, $1)`, sleeping)
	require.NoError(t, err)
	var ready [16]byte
	require.NoError(t, pool.QueryRow(ctx, `SELECT id FROM `+sagas+` LIMIT 1`).Scan(&ready))
	_, err = pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "saga_signals"}.Sanitize()+
		` (saga_id, target, name, signal_id, payload, status, created_at) VALUES ($1, 'parcel', 'go', 'sig-1', '{}', 'pending', now() - interval '1 hour')`, ready)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, "ANALYZE "+sagas)
	require.NoError(t, err)

	after := int64(time.Second / time.Microsecond)
	var plan []map[string]any
	require.NoError(t, pool.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+st.ops.waitsReady, []string{"parcel"}, after, 100).Scan(&plan))
	top := plan[0]["Plan"].(map[string]any)
	read := top["Shared Hit Blocks"].(float64) + top["Shared Read Blocks"].(float64)
	require.Less(t, read, float64(100), "the sweep read %v buffers for %d sleepers", read, sleeping)

	found, err := st.WaitsReady(ctx, pool, []string{"parcel"}, time.Second, 100)
	require.NoError(t, err)
	require.Len(t, found, 1)
	require.Equal(t, ready, [16]byte(found[0].ID))
}
