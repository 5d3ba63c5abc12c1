package store_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// newStore migrates a fresh schema and returns its pool, a store on it and
// its name.
func newStore(t *testing.T) (*pgxpool.Pool, *store.Store, string) {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	st, err := store.New(schema)
	require.NoError(t, err)
	return pool, st, schema
}

func tables(t *testing.T, ctx context.Context, db store.DBTX, schema string) []string {
	t.Helper()
	rows, err := db.Query(ctx, "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1", schema)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

func TestMigrateIsIdempotentAndConcurrencySafe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	// The schema need not exist beforehand: migrate into a new one.
	target := schema + "_m"
	t.Cleanup(func() { _, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+target+" CASCADE") })

	var wg sync.WaitGroup
	results := make([]*migrations.Result, 4)
	for i := range results {
		wg.Go(func() {
			res, err := migrations.Migrate(ctx, pool, target)
			require.NoError(t, err)
			results[i] = res
		})
	}
	wg.Wait()
	ms, err := migrations.All()
	require.NoError(t, err)
	require.NotEmpty(t, ms)
	applied := 0
	for _, r := range results {
		applied += len(r.Applied)
		require.Equal(t, ms[len(ms)-1].Version, r.Version)
	}
	require.Equal(t, len(ms), applied, "each migration applied exactly once across concurrent callers")
	require.Equal(t, []string{"dead_letters", "idempotency_keys", "inbox", "outbox", "saga_branches", "saga_cancel_requests", "saga_concurrency_keys", "saga_concurrency_queue", "saga_history", "saga_instances", "saga_pauses", "saga_signals", "sagaflow_migrations"}, tables(t, ctx, pool, target), "tables after all migrations")

	again, err := migrations.Migrate(ctx, pool, target)
	require.NoError(t, err)
	require.Empty(t, again.Applied)
}

func TestMigrateRefusesBadSchemaNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewSchema(t)
	for _, bad := range []string{
		"", `x"; DROP TABLE users; --`, "has space", "1starts_with_digit", "pg_toast", "dash-ed",
		strings.Repeat("a", 49), "ünïcode",
	} {
		_, err := migrations.Migrate(ctx, pool, bad)
		require.ErrorIs(t, err, store.ErrInvalidSchema, "schema %q", bad)
		_, err = migrations.Script(bad)
		require.ErrorIs(t, err, store.ErrInvalidSchema, "schema %q", bad)
		_, err = store.New(bad)
		require.ErrorIs(t, err, store.ErrInvalidSchema, "schema %q", bad)
	}
	for _, good := range []string{"sagaflow", "Orders_2", "_x", strings.Repeat("a", 48)} {
		require.NoError(t, store.ValidateSchema(good), good)
	}
}

func TestMigrationSQLAppliesWithAnotherTool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	script, err := migrations.Script(schema)
	require.NoError(t, err)
	require.NotContains(t, script, "{{schema}}")
	require.Contains(t, script, `CREATE TABLE "`+schema+`".saga_instances`)

	// Apply it as a migration tool would: the whole script, as is.
	_, err = pool.Exec(ctx, script)
	require.NoError(t, err)
	require.Contains(t, tables(t, ctx, pool, schema), "outbox")
	// The migrator then sees the schema as up to date.
	res, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
}
