package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// This file holds the statements of concurrency keys (migration 009). The
// release of a slot is not here: a trigger on saga_instances does it in the
// transaction that ends the saga (see 010_concurrency_keys.up.sql).

// LockConcurrencyKey locks the counter row of (name, key) in db's
// transaction, creating it when missing with the limit max, and returns how
// many sagas hold one of its slots and how many wait. The lock is held until
// the transaction ends, so nothing else admits or queues a saga of this key
// meanwhile.
func (s *Store) LockConcurrencyKey(ctx context.Context, db DBTX, name, key string, max int) (running, waiting int, err error) {
	q := quoteSchema(s.schema)
	err = db.QueryRow(ctx, `WITH k AS (
			INSERT INTO `+q+`.saga_concurrency_keys AS k (saga_name, ckey, max_slots, running)
			VALUES ($1, $2, $3, 0)
			ON CONFLICT (saga_name, ckey) DO UPDATE SET max_slots = EXCLUDED.max_slots
			RETURNING k.running)
		SELECT k.running, (SELECT count(*) FROM `+q+`.saga_concurrency_queue w WHERE w.saga_name = $1 AND w.ckey = $2) FROM k`,
		name, key, int32(max)).Scan(&running, &waiting)
	if err != nil {
		return 0, 0, fmt.Errorf("store: lock concurrency key %q of %s: %w", key, name, err)
	}
	return running, waiting, nil
}

// admitSQL calls the function of migration 009 that admits or queues a saga
// just inserted with a key.
func (s *Store) admitSQL() string {
	return `SELECT pos, running FROM ` + quoteSchema(s.schema) + `.saga_concurrency_admit($1, $2, $3, $4, $5, $6)`
}

// Admission is what became of a saga started with a concurrency key.
type Admission struct {
	// Position is 0 when the saga took a slot, its place in the key's queue
	// when it waits (1 for the next), -1 when the start inserted no saga
	// (one existed).
	Position int
	// Running is how many sagas hold a slot of the key.
	Running int
}

// AdmitStarted admits or queues saga id of name, just inserted in db's
// transaction with its first command commandID, under key with limit max:
// it takes a slot when the key is under its limit and nobody waits, else it
// waits in the key's queue, its command held (due at 'infinity') and with
// no rescue deadline until admitted; then its deadline is checkAfter from
// the admission.
func (s *Store) AdmitStarted(ctx context.Context, db DBTX, id uuid.UUID, name, key string, max int, commandID uuid.UUID, checkAfter time.Duration) (Admission, error) {
	var a Admission
	err := db.QueryRow(ctx, s.admitSQL(), s.admitArgs(id, name, key, max, commandID, checkAfter)...).Scan(&a.Position, &a.Running)
	if err != nil {
		return a, fmt.Errorf("store: admit saga %s with concurrency key %q: %w", id, key, err)
	}
	return a, nil
}

// QueueAdmitStarted queues [Store.AdmitStarted] in batch b; a is set when
// the batch's results are read.
func (s *Store) QueueAdmitStarted(b *pgx.Batch, a *Admission, id uuid.UUID, name, key string, max int, commandID uuid.UUID, checkAfter time.Duration) {
	b.Queue(s.admitSQL(), s.admitArgs(id, name, key, max, commandID, checkAfter)...).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(&a.Position, &a.Running); err != nil {
			return fmt.Errorf("store: admit saga %s with concurrency key %q: %w", id, key, err)
		}
		return nil
	})
}

func (s *Store) admitArgs(id uuid.UUID, name, key string, max int, commandID uuid.UUID, checkAfter time.Duration) []any {
	return []any{pgID(id), name, key, int32(max), pgID(commandID), micros(checkAfter)}
}

// Concurrency is a saga's place under its concurrency key.
type Concurrency struct {
	Key string
	// Position is the saga's place in its key's queue, 1 for the next to
	// be admitted; 0 when it is not waiting.
	Position int
	// Holding says the saga holds one of the key's slots: it has not ended
	// and does not wait.
	Holding bool
	// Running and Max are the key's slots in use and its limit.
	Running, Max int
}

// SagaConcurrency returns the concurrency key of each saga of ids that has
// one, with its place.
func (s *Store) SagaConcurrency(ctx context.Context, db DBTX, ids []uuid.UUID) (map[uuid.UUID]Concurrency, error) {
	q := quoteSchema(s.schema)
	pg := make([][16]byte, len(ids))
	for i, id := range ids {
		pg[i] = id
	}
	rows, err := db.Query(ctx, `SELECT s.id, s.concurrency_key,
			coalesce((SELECT count(*) FROM `+q+`.saga_concurrency_queue o
				WHERE o.saga_name = w.saga_name AND o.ckey = w.ckey AND o.seq <= w.seq), 0),
			w.saga_id IS NULL AND s.status IN ('running', 'compensating'),
			coalesce(k.running, 0), coalesce(k.max_slots, 0)
		FROM `+q+`.saga_instances s
		LEFT JOIN `+q+`.saga_concurrency_queue w ON w.saga_id = s.id
		LEFT JOIN `+q+`.saga_concurrency_keys k ON k.saga_name = s.saga_name AND k.ckey = s.concurrency_key
		WHERE s.id = ANY($1) AND s.concurrency_key IS NOT NULL`, pg)
	if err != nil {
		return nil, fmt.Errorf("store: read concurrency keys: %w", err)
	}
	defer rows.Close()
	out := map[uuid.UUID]Concurrency{}
	for rows.Next() {
		var id [16]byte
		var c Concurrency
		var pos int64
		if err := rows.Scan(&id, &c.Key, &pos, &c.Holding, &c.Running, &c.Max); err != nil {
			return nil, fmt.Errorf("store: read concurrency keys: %w", err)
		}
		c.Position = int(pos)
		out[uuid.UUID(id)] = c
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: read concurrency keys: %w", err)
	}
	return out, nil
}

// concurrencyFilter adds the concurrency key filters of f to where.
func (s *Store) concurrencyFilter(where []string, f ListFilter, arg func(any) string) []string {
	if f.ConcurrencyKey != "" {
		where = append(where, "concurrency_key = "+arg(f.ConcurrencyKey))
	}
	if f.Queued {
		where = append(where, "id IN (SELECT saga_id FROM "+quoteSchema(s.schema)+".saga_concurrency_queue)")
	}
	return where
}
