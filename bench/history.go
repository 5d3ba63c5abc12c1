package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sagaflow/sagaflow/migrations"
)

// historyShape is what [prefillHistory] writes beside the sagas; the zero
// value is the engine's tables in Postgres-only mode with retention
// running.
type historyShape struct {
	// Age is how long ago the sagas were written.
	Age time.Duration
	// Outbox is the number of published messages per saga, at most 3 (one
	// per step).
	Outbox int
}

// prefillHistory creates and migrates schema and writes n finished sagas
// into it, shaped as the engine leaves the benchmark's saga when it
// completes: a saga row (completed, state with the three steps, version 4),
// five history rows (saga_started, three step_completed, saga_completed)
// and, for the sagas of the last 14 days (the inbox retention), the three
// step keys in the inbox. Ids are UUIDv7 of their creation time; the sagas
// ended over the last 20 days, inside the 30-day saga retention, so the
// engine's retention leaves them. Then ANALYZE, as autovacuum would.
//
// shape.Age moves all of it back in time: the tables as the engine, with
// retention running, left them Age ago, and no retention since; an Age
// beyond the windows makes every row a backlog for retention.
// shape.Outbox adds that many published messages per saga (relay delivery,
// as the commands of Kafka mode), for the sagas of the 7 days before Age
// (the outbox retention).
func prefillHistory(ctx context.Context, pool *pgxpool.Pool, schema string, n int, shape historyShape) (time.Duration, error) {
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
	SELECT i, now() - $4 * interval '1 microsecond' - interval '20 days' + (interval '20 days' * i / $1::int) AS t
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
), ob AS (
	INSERT INTO ` + s + `.outbox (id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id,
		step_key, status, attempts, available_at, created_at, published_at)
	SELECT (lpad(to_hex((extract(epoch FROM ins.created_at + k.after) * 1000)::bigint), 12, '0') || '7' ||
			substr(md5(ins.id::text || k.ord), 1, 3) || '8' || substr(md5(ins.id::text || k.ord), 4, 15))::uuid,
		'sagaflow.commands.bench', 'relay', 'saga.bench', ins.id::text, 'sagaflow.step',
		convert_to('{"saga_id":"' || ins.id || '","saga":"bench","step":"' || k.step || '","direction":"forward","epoch":0,"version":' || k.ord || '}', 'UTF8'),
		'{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}', ins.id,
		ins.id::text || '/' || k.step || '/forward/0', 'published', 1,
		ins.created_at + k.after, ins.created_at + k.after, ins.created_at + k.after + interval '5 ms'
	FROM ins, (VALUES (1, 'a', interval '1 ms'), (2, 'b', interval '30 ms'), (3, 'c', interval '60 ms')) AS k(ord, step, after)
	WHERE k.ord <= $6 AND ins.created_at > now() - interval '7 days' - $4 * interval '1 microsecond'
)
INSERT INTO ` + s + `.inbox (consumer, key, processed_at)
SELECT 'sagaflow.engine', ins.id::text || '/' || k.step || '/forward/0', ins.created_at + k.after
FROM ins, (VALUES ('a', interval '30 ms'), ('b', interval '60 ms'), ('c', interval '99 ms')) AS k(step, after)
WHERE ins.created_at > now() - interval '14 days' - $5 * interval '1 microsecond'`
		age := shape.Age.Microseconds()
		if _, err := pool.Exec(ctx, sql, n, from, to, age, age, shape.Outbox); err != nil {
			return 0, fmt.Errorf("prefill %s rows %d-%d: %w", schema, from, to, err)
		}
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+s+".saga_instances; ANALYZE "+s+".saga_history; ANALYZE "+s+".inbox; ANALYZE "+s+".outbox"); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}
