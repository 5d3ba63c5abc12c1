package store

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
)

// The operator UI's read-only queries. Each reads a bounded number of rows,
// through an index, whatever the size of the tables: the newest sagas by
// the created index, the newest history entries by their primary key.

// The UI's statements; {{schema}} stands for the quoted schema.
const (
	sqlSagaCounts = `SELECT saga_name, status, count(*) FROM (
			SELECT saga_name, status FROM {{schema}}.saga_instances
			ORDER BY created_at DESC, id DESC LIMIT $1) x
		GROUP BY saga_name, status ORDER BY saga_name, status`
	sqlTopFailures = `SELECT saga_name, coalesce(failed_step, ''), last_error_code, count(*) FROM (
			SELECT saga_name, failed_step, last_error_code FROM {{schema}}.saga_instances
			WHERE status = $1 ORDER BY created_at DESC, id DESC LIMIT $2) x
		WHERE last_error_code IS NOT NULL
		GROUP BY 1, 2, 3 ORDER BY 4 DESC, 1, 2, 3 LIMIT $3`
	sqlStepsPerMinute = `WITH h AS (SELECT at, event FROM {{schema}}.saga_history ORDER BY id DESC LIMIT $1),
		scan AS (SELECT count(*) AS n, min(at) AS oldest FROM h)
		SELECT m.minute, m.completed, m.failed, now(), scan.n, scan.oldest FROM scan LEFT JOIN (
			SELECT date_trunc('minute', at) AS minute,
				count(*) FILTER (WHERE event IN ('step_completed', 'compensation_completed')) AS completed,
				count(*) FILTER (WHERE event = 'step_failed') AS failed
			FROM h WHERE at >= now() - interval '1 hour'
				AND event IN ('step_completed', 'compensation_completed', 'step_failed')
			GROUP BY 1) m ON true
		ORDER BY m.minute`
	sqlDeadPayloads = `SELECT id, substring(payload FROM 1 FOR $2) FROM {{schema}}.outbox
		WHERE id = ANY($1) AND status = 'dead'`
	sqlDeadLetterValues = `SELECT id, coalesce(substring(msg_value FROM 1 FOR $2), ''::bytea) FROM {{schema}}.dead_letters
		WHERE id = ANY($1)`
)

// uiSQL returns one of the UI's statements for s's schema.
func (s *Store) uiSQL(q string) string {
	return strings.ReplaceAll(q, "{{schema}}", quoteSchema(s.schema))
}

// SagaCount is the number of sagas of one name in one status.
type SagaCount struct {
	Name   string
	Status string
	Count  int64
}

// SagaCounts counts the newest scan sagas by name and status. Scanned is
// how many sagas were counted: when it equals scan, older sagas were left
// out.
func (s *Store) SagaCounts(ctx context.Context, db DBTX, scan int) (counts []SagaCount, scanned int64, err error) {
	rows, err := db.Query(ctx, s.uiSQL(sqlSagaCounts), scan)
	if err != nil {
		return nil, 0, fmt.Errorf("store: count sagas: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var c SagaCount
		if err := rows.Scan(&c.Name, &c.Status, &c.Count); err != nil {
			return nil, 0, fmt.Errorf("store: count sagas: %w", err)
		}
		scanned += c.Count
		counts = append(counts, c)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("store: count sagas: %w", err)
	}
	return counts, scanned, nil
}

// FailureCount is the number of sagas whose last error came from one step
// with one code.
type FailureCount struct {
	Name  string
	Step  string // "" when the error names no step
	Code  string
	Count int64
}

// TopFailures groups the last errors of the newest scan sagas of status (by
// the status index) by saga name, failed step and code, most frequent
// first, at most limit groups.
func (s *Store) TopFailures(ctx context.Context, db DBTX, status string, scan, limit int) ([]FailureCount, error) {
	rows, err := db.Query(ctx, s.uiSQL(sqlTopFailures), status, scan, limit)
	if err != nil {
		return nil, fmt.Errorf("store: top failures: %w", err)
	}
	defer rows.Close()
	var out []FailureCount
	for rows.Next() {
		var f FailureCount
		if err := rows.Scan(&f.Name, &f.Step, &f.Code, &f.Count); err != nil {
			return nil, fmt.Errorf("store: top failures: %w", err)
		}
		out = append(out, f)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: top failures: %w", err)
	}
	return out, nil
}

// MinuteCount is the number of step executions that ended in one minute.
type MinuteCount struct {
	Minute    time.Time
	Completed int64 // actions and compensations that committed
	Failed    int64 // attempts that failed
}

// StepsPerMinute counts, per minute of the last hour in database time,
// the step executions among the newest scan history entries (by their
// primary key), oldest minute first; now is the database's clock. When the
// scan was cut short by its bound inside the hour, since is the time of the
// oldest entry read: the minutes before it are not counted. Otherwise since
// is zero.
func (s *Store) StepsPerMinute(ctx context.Context, db DBTX, scan int) (minutes []MinuteCount, now, since time.Time, err error) {
	rows, err := db.Query(ctx, s.uiSQL(sqlStepsPerMinute), scan)
	if err != nil {
		return nil, now, since, fmt.Errorf("store: steps per minute: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var minute, oldest *time.Time
		var completed, failed *int64
		var n int64
		if err := rows.Scan(&minute, &completed, &failed, &now, &n, &oldest); err != nil {
			return nil, now, since, fmt.Errorf("store: steps per minute: %w", err)
		}
		if n >= int64(scan) && oldest != nil && oldest.After(now.Add(-time.Hour)) {
			since = *oldest
		}
		if minute != nil {
			minutes = append(minutes, MinuteCount{Minute: *minute, Completed: *completed, Failed: *failed})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, now, since, fmt.Errorf("store: steps per minute: %w", err)
	}
	return minutes, now, since, nil
}

// DeadPayloads returns the first n bytes of the payloads of the dead
// outbox rows ids, by id (primary key); rows that are gone or not dead are
// missing.
func (s *Store) DeadPayloads(ctx context.Context, db DBTX, ids []uuid.UUID, n int) (map[uuid.UUID][]byte, error) {
	out := make(map[uuid.UUID][]byte, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := db.Query(ctx, s.uiSQL(sqlDeadPayloads), ids, n)
	if err != nil {
		return nil, fmt.Errorf("store: dead payloads: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id uuid.UUID
		var b []byte
		if err := rows.Scan(&id, &b); err != nil {
			return nil, fmt.Errorf("store: dead payloads: %w", err)
		}
		out[id] = b
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: dead payloads: %w", err)
	}
	return out, nil
}

// DeadLetterValues returns the first n bytes of the values of the dead
// letters ids, by id (primary key); a letter with no value has an empty
// one, a letter that is gone is missing.
func (s *Store) DeadLetterValues(ctx context.Context, db DBTX, ids []int64, n int) (map[int64][]byte, error) {
	out := make(map[int64][]byte, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := db.Query(ctx, s.uiSQL(sqlDeadLetterValues), ids, n)
	if err != nil {
		return nil, fmt.Errorf("store: dead letter values: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var b []byte
		if err := rows.Scan(&id, &b); err != nil {
			return nil, fmt.Errorf("store: dead letter values: %w", err)
		}
		out[id] = b
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: dead letter values: %w", err)
	}
	return out, nil
}
