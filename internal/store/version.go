package store

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// This file holds the statements of definition versions (migration 011).

// TryLockSaga tries saga id's execution lock without waiting, and holds it
// until tx ends. It reports false when a step of the saga runs right now.
func (s *Store) TryLockSaga(ctx context.Context, tx pgx.Tx, id uuid.UUID) (bool, error) {
	var ok bool
	if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtextextended($1::text, $2))`, id.String(), s.lockNS).Scan(&ok); err != nil {
		return false, fmt.Errorf("store: try the lock of saga %s: %w", id, err)
	}
	return ok, nil
}

// SagasAtVersion returns up to limit ids of sagas named name at version
// version that have not ended, oldest first.
func (s *Store) SagasAtVersion(ctx context.Context, db DBTX, name string, version, limit int) ([]uuid.UUID, error) {
	rows, err := db.Query(ctx, `SELECT id FROM `+quoteSchema(s.schema)+`.saga_instances
		WHERE saga_name = $1 AND def_version = $2 AND status IN ('running', 'compensating')
		ORDER BY created_at, id LIMIT $3`, name, int32(version), limit)
	if err != nil {
		return nil, fmt.Errorf("store: sagas of %s at version %d: %w", name, version, err)
	}
	ids, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (uuid.UUID, error) {
		var id [16]byte
		err := r.Scan(&id)
		return uuid.UUID(id), err
	})
	if err != nil {
		return nil, fmt.Errorf("store: sagas of %s at version %d: %w", name, version, err)
	}
	return ids, nil
}

// DeletePendingCommands deletes saga id's pending step commands and
// wake-ups: a migration writes the command of the saga's new position.
func (s *Store) DeletePendingCommands(ctx context.Context, tx pgx.Tx, id uuid.UUID) error {
	_, err := tx.Exec(ctx, `DELETE FROM `+quoteSchema(s.schema)+`.outbox o WHERE o.saga_id = $1 AND `+heldRows, pgID(id))
	if err != nil {
		return fmt.Errorf("store: delete pending commands of saga %s: %w", id, err)
	}
	return nil
}

// InboxHas reports whether the engine's inbox holds key (a step with that
// key has committed its effects).
func (s *Store) InboxHas(ctx context.Context, db DBTX, key string) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+quoteSchema(s.schema)+`.inbox WHERE consumer = $1 AND key = $2)`,
		InboxConsumerEngine, key).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("store: look up inbox key: %w", err)
	}
	return ok, nil
}

// VersionCount is how many sagas of a name run on a version, by status.
type VersionCount struct {
	Name    string
	Version int
	Status  string
	Count   int64
}

// CountVersions counts the sagas that have not ended, and the failed ones,
// by name, version and status.
func (s *Store) CountVersions(ctx context.Context, db DBTX) ([]VersionCount, error) {
	rows, err := db.Query(ctx, `SELECT saga_name, def_version, status, count(*) FROM `+quoteSchema(s.schema)+`.saga_instances
		WHERE status IN ('running', 'compensating', 'failed')
		GROUP BY saga_name, def_version, status ORDER BY saga_name, def_version, status`)
	if err != nil {
		return nil, fmt.Errorf("store: count versions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (VersionCount, error) {
		var c VersionCount
		err := r.Scan(&c.Name, &c.Version, &c.Status, &c.Count)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: count versions: %w", err)
	}
	return out, nil
}
