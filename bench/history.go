package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sagaflow/sagaflow/migrations"
)

// prefillHistory creates and migrates schema and writes n finished sagas
// into it, shaped as the engine leaves the benchmark's saga when it
// completes: a saga row (completed, state with the three steps, version 4),
// five history rows (saga_started, three step_completed, saga_completed)
// and, for the sagas of the last 14 days (the inbox retention), the three
// step keys in the inbox. Ids are UUIDv7 of their creation time; the sagas
// ended over the last 20 days, inside the 30-day saga retention, so the
// engine's retention leaves them. Then ANALYZE, as autovacuum would.
func prefillHistory(ctx context.Context, pool *pgxpool.Pool, schema string, n int) (time.Duration, error) {
	start := time.Now()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		return 0, fmt.Errorf("migrate %s: %w", schema, err)
	}
	s := pgx.Identifier{schema}.Sanitize()
	// One chunk per statement keeps each transaction and its WAL modest.
	const chunk = 100_000
	for from := 0; from < n; from += chunk {
		to := min(from+chunk, n) - 1
		sql := `
WITH g AS (
	SELECT i, now() - interval '20 days' + (interval '20 days' * i / $1::int) AS t
	FROM generate_series($2::int, $3::int) AS i
), s AS (
	SELECT i, t, (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7' ||
		substr(md5(i::text), 1, 3) || '8' || substr(md5(i::text), 4, 15))::uuid AS id
	FROM g
), ins AS (
	INSERT INTO ` + s + `.saga_instances (id, saga_name, status, step_index, step_name, direction, epoch, attempt,
		state, version, created_at, updated_at, ended_at)
	SELECT id, 'bench', 'completed', 2, 'c', 'forward', 0, 0,
		'{"done": ["a", "b", "c"], "order_id": "x"}', 4, t, t + interval '100 ms', t + interval '100 ms'
	FROM s
	RETURNING id, created_at
), hist AS (
	INSERT INTO ` + s + `.saga_history (saga_id, event, step_name, direction, epoch, attempt, detail, at)
	SELECT ins.id, e.event, e.step_name, e.direction, 0, e.attempt, e.detail::jsonb, ins.created_at + e.after
	FROM ins, (VALUES
		(1, 'saga_started', 'a', 'forward', 0, NULL, interval '1 ms'),
		(2, 'step_completed', 'a', 'forward', 1, '{"duration_ms": 0.1}', interval '30 ms'),
		(3, 'step_completed', 'b', 'forward', 1, '{"duration_ms": 0.1}', interval '60 ms'),
		(4, 'step_completed', 'c', 'forward', 1, '{"duration_ms": 0.1}', interval '99 ms'),
		(5, 'saga_completed', NULL, NULL, 0, NULL, interval '100 ms')
	) AS e(ord, event, step_name, direction, attempt, detail, after)
	ORDER BY ins.created_at, e.ord
)
INSERT INTO ` + s + `.inbox (consumer, key, processed_at)
SELECT 'sagaflow.engine', ins.id::text || '/' || k.step || '/forward/0', ins.created_at + k.after
FROM ins, (VALUES ('a', interval '30 ms'), ('b', interval '60 ms'), ('c', interval '99 ms')) AS k(step, after)
WHERE ins.created_at > now() - interval '14 days'`
		if _, err := pool.Exec(ctx, sql, n, from, to); err != nil {
			return 0, fmt.Errorf("prefill %s rows %d-%d: %w", schema, from, to, err)
		}
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+s+".saga_instances; ANALYZE "+s+".saga_history; ANALYZE "+s+".inbox"); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}
