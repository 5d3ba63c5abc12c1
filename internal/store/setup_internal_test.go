package store

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// migratedStore migrates a fresh schema and returns its pool, name and
// statements, for the tests that read the statements themselves.
func migratedStore(t *testing.T) (*pgxpool.Pool, string, *Store) {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	st, err := New(schema)
	require.NoError(t, err)
	return pool, schema, st
}
