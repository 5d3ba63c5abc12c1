package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// This file holds the statements of concurrency keys (migration 010). The
// release of a slot is not here: a trigger on saga_instances does it in the
// transaction that ends the saga (see 010_concurrency_keys.up.sql).

// LockConcurrencyKey locks the counter row of (name, key) in db's
// transaction, creating it when missing and setting its limit to max, and
// returns how many sagas hold one of its slots. The lock is held until the
// transaction ends, so the caller's decision to admit or queue a saga is the
// only one for this key meanwhile.
func (s *Store) LockConcurrencyKey(ctx context.Context, db DBTX, name, key string, max int) (int, error) {
	var running int
	err := db.QueryRow(ctx, `INSERT INTO `+quoteSchema(s.schema)+`.saga_concurrency_keys AS k (saga_name, ckey, max_slots, running)
		VALUES ($1, $2, $3, 0)
		ON CONFLICT (saga_name, ckey) DO UPDATE SET max_slots = EXCLUDED.max_slots
		RETURNING k.running`, name, key, int32(max)).Scan(&running)
	if err != nil {
		return 0, fmt.Errorf("store: lock concurrency key %q of %s: %w", key, name, err)
	}
	return running, nil
}

// AdmitConcurrent records that the just started saga id of name holds a
// slot of key. The caller holds the key's lock ([Store.LockConcurrencyKey]).
func (s *Store) AdmitConcurrent(ctx context.Context, db DBTX, id uuid.UUID, name, key string) error {
	q := quoteSchema(s.schema)
	_, err := db.Exec(ctx, `WITH k AS (
			UPDATE `+q+`.saga_concurrency_keys SET running = running + 1 WHERE saga_name = $2 AND ckey = $3
		), h AS (
			INSERT INTO `+q+`.saga_concurrency_holders (saga_id, saga_name, ckey) VALUES ($1, $2, $3)
		)
		UPDATE `+q+`.saga_instances SET concurrency_key = $3 WHERE id = $1`, pgID(id), name, key)
	if err != nil {
		return fmt.Errorf("store: admit saga %s with concurrency key %q: %w", id, key, err)
	}
	return nil
}

// QueueConcurrent puts the just started saga id of name in key's queue: its
// first command (the outbox row commandID) is held, due at 'infinity', and
// it has no rescue deadline until it is admitted; then its deadline is
// checkAfter from the admission. The caller holds the key's lock. It
// returns the saga's position in the queue, 1 for the first.
func (s *Store) QueueConcurrent(ctx context.Context, db DBTX, id uuid.UUID, name, key string, commandID uuid.UUID, checkAfter time.Duration) (int, error) {
	q := quoteSchema(s.schema)
	var pos int
	err := db.QueryRow(ctx, `WITH qu AS (
			INSERT INTO `+q+`.saga_concurrency_queue (saga_id, saga_name, ckey, command_id, check_us) VALUES ($1, $2, $3, $4, $5)
		), o AS (
			UPDATE `+q+`.outbox SET available_at = 'infinity' WHERE id = $4
		), sg AS (
			UPDATE `+q+`.saga_instances SET concurrency_key = $3, next_check_at = NULL WHERE id = $1
		)
		SELECT count(*) + 1 FROM `+q+`.saga_concurrency_queue WHERE saga_name = $2 AND ckey = $3`,
		pgID(id), name, key, pgID(commandID), micros(checkAfter)).Scan(&pos)
	if err != nil {
		return 0, fmt.Errorf("store: queue saga %s with concurrency key %q: %w", id, key, err)
	}
	return pos, nil
}

// Concurrency is a saga's place under its concurrency key.
type Concurrency struct {
	Key string
	// Position is the saga's place in its key's queue, 1 for the next to
	// be admitted; 0 when it is not waiting.
	Position int
	// Holding says the saga holds one of the key's slots.
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
			EXISTS (SELECT 1 FROM `+q+`.saga_concurrency_holders h WHERE h.saga_id = s.id),
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
