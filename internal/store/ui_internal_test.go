package store

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// The UI's queries answer from a bounded read through an index, whatever
// the tables hold: on tables big enough for the planner to care, analyzed,
// no plan reads a whole table. They also count what they should.
func TestUIQueriesUseIndexes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema, st := migratedStore(t)
	q := quoteSchema(schema)
	// 60,000 sagas (a tenth failed at "charge" with card_declined, older
	// ones first), 120,000 history entries, an old one an hour and a half
	// ago, and dead rows of both kinds.
	_, err := pool.Exec(ctx, `INSERT INTO `+q+`.saga_instances
		(id, saga_name, business_key, status, step_index, step_name, direction, state, last_error, last_error_code, failed_step, created_at)
		SELECT gen_random_uuid(), CASE WHEN i % 2 = 0 THEN 'checkout' ELSE 'refund' END, 'k' || i,
			CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'completed' END, 1, 'charge', 'forward', '{}',
			CASE WHEN i % 10 = 0 THEN 'declined' END, CASE WHEN i % 10 = 0 THEN 'card_declined' END,
			CASE WHEN i % 10 = 0 THEN 'charge' END, now() - i * interval '1 second'
		FROM generate_series(1, 60000) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO `+q+`.saga_history (saga_id, event, step_name, direction, epoch, at)
		SELECT gen_random_uuid(), CASE WHEN i % 4 = 0 THEN 'step_failed' ELSE 'step_completed' END, 'charge', 'forward', 0,
			CASE WHEN i = 1 THEN now() - interval '90 minutes' ELSE now() - (i % 50) * interval '1 second' END
		FROM generate_series(1, 120000) i`)
	require.NoError(t, err)
	dead := uuid.New()
	_, err = pool.Exec(ctx, `INSERT INTO `+q+`.outbox (id, topic, aggregateid, type, payload, status)
		SELECT CASE WHEN i = 1 THEN $1 ELSE gen_random_uuid() END, 't', 'a', 'x', '\x00010203'::bytea,
			CASE WHEN i % 100 = 0 OR i = 1 THEN 'dead' ELSE 'published' END
		FROM generate_series(1, 20000) i`, dead)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO `+q+`.dead_letters (consumer, topic, msg_value, reason)
		SELECT 'c', 't', CASE WHEN i = 1 THEN NULL ELSE '\xfffe'::bytea END, 'r' FROM generate_series(1, 5000) i`)
	require.NoError(t, err)
	for _, tbl := range []string{"saga_instances", "saga_history", "outbox", "dead_letters"} {
		_, err = pool.Exec(ctx, "ANALYZE "+q+"."+tbl)
		require.NoError(t, err)
	}

	for _, tc := range []struct {
		name, sql string
		args      []any
		index     string // the index the plan reads through (one of them, separated by |)
	}{
		{"saga counts", sqlSagaCounts, []any{100_000}, "saga_instances_created"},
		{"top failures", sqlTopFailures, []any{"failed", 10_000, 10}, "saga_instances_status_created|saga_instances_created"},
		{"steps per minute", sqlStepsPerMinute, []any{100_000}, "saga_history_pkey"},
		{"dead payloads", sqlDeadPayloads, []any{[]uuid.UUID{dead}, 16}, "outbox_pkey"},
		{"dead letter values", sqlDeadLetterValues, []any{[]int64{1, 2}, 16}, "dead_letters_pkey"},
	} {
		rows, err := pool.Query(ctx, "EXPLAIN "+st.uiSQL(tc.sql), tc.args...)
		require.NoError(t, err, tc.name)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err, tc.name)
		plan := strings.Join(lines, "\n")
		require.NotContains(t, plan, "Seq Scan", "%s reads a whole table:\n%s", tc.name, plan)
		found := false
		for _, ix := range strings.Split(tc.index, "|") {
			found = found || strings.Contains(plan, " "+ix+" ")
		}
		require.True(t, found, "%s reads through none of %s:\n%s", tc.name, tc.index, plan)
	}

	counts, scanned, err := st.SagaCounts(ctx, pool, 100_000)
	require.NoError(t, err)
	require.Equal(t, int64(60000), scanned)
	require.Equal(t, []SagaCount{{"checkout", "completed", 24000}, {"checkout", "failed", 6000},
		{"refund", "completed", 30000}}, counts)
	_, scanned, err = st.SagaCounts(ctx, pool, 1000)
	require.NoError(t, err)
	require.Equal(t, int64(1000), scanned, "the scan is bounded")

	top, err := st.TopFailures(ctx, pool, "failed", 100_000, 10)
	require.NoError(t, err)
	require.Equal(t, []FailureCount{{Name: "checkout", Step: "charge", Code: "card_declined", Count: 6000}}, top)

	minutes, now, since, err := st.StepsPerMinute(ctx, pool, 200_000)
	require.NoError(t, err)
	require.False(t, now.IsZero())
	require.True(t, since.IsZero(), "the whole hour was read")
	var done, failed int64
	for _, m := range minutes {
		done += m.Completed
		failed += m.Failed
		require.False(t, m.Minute.Before(now.Add(-61*60e9)), "a minute outside the last hour")
	}
	require.Equal(t, int64(119999), done+failed, "every entry but the one 90 minutes old")
	require.Equal(t, int64(30000), failed)
	minutes, _, since, err = st.StepsPerMinute(ctx, pool, 100_000)
	require.NoError(t, err)
	require.False(t, since.IsZero(), "the bound cut the hour short, and says so")
	done = 0
	for _, m := range minutes {
		done += m.Completed + m.Failed
	}
	require.Equal(t, int64(100_000), done, "the scan is bounded")

	payloads, err := st.DeadPayloads(ctx, pool, []uuid.UUID{dead, uuid.New()}, 2)
	require.NoError(t, err)
	require.Equal(t, map[uuid.UUID][]byte{dead: {0, 1}}, payloads)
	values, err := st.DeadLetterValues(ctx, pool, []int64{1, 2}, 1)
	require.NoError(t, err)
	require.Equal(t, map[int64][]byte{1: {}, 2: {0xff}}, values)
	empty, err := st.DeadPayloads(ctx, pool, nil, 2)
	require.NoError(t, err)
	require.Empty(t, empty)
}
