package migrations_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// newRole creates a login role, dropped when the test ends, and a pool that
// connects as it; the test is skipped where the server lets neither happen.
func newRole(t *testing.T, pool *pgxpool.Pool, role string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	id := pgx.Identifier{role}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE ROLE "+id+" LOGIN"); err != nil {
		t.Skipf("cannot create a role on this server (%v)", err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP OWNED BY "+id+"; DROP ROLE "+id) })
	cfg := pool.Config().Copy()
	cfg.ConnConfig.User = role
	cfg.ConnConfig.Password = ""
	rp, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(rp.Close)
	if err := rp.Ping(ctx); err != nil {
		t.Skipf("cannot log in as a new role on this server (%v)", err)
	}
	return rp
}

// The owner of an existing schema who may not create schemas in the
// database migrates it: Migrate does not ask for CREATE SCHEMA then, and
// neither do the exported scripts.
func TestSchemaOwnerWithoutCreateOnTheDatabaseMigrates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	for _, apply := range []string{"Migrate", "Script", "per-version Script"} {
		target := strings.ToLower(schema + "_" + strings.ReplaceAll(apply, " ", "_")[:3])
		role := "own_" + target
		rp := newRole(t, pool, role)
		var db string
		require.NoError(t, pool.QueryRow(ctx, "SELECT current_database()").Scan(&db))
		_, err := pool.Exec(ctx, "REVOKE CREATE ON DATABASE "+pgx.Identifier{db}.Sanitize()+" FROM PUBLIC")
		require.NoError(t, err)
		_, err = pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{target}.Sanitize()+" AUTHORIZATION "+pgx.Identifier{role}.Sanitize())
		require.NoError(t, err)
		t.Cleanup(func() {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{target}.Sanitize()+" CASCADE")
		})
		// The role can indeed not create a schema: the test would prove
		// nothing otherwise.
		_, err = rp.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{target}.Sanitize())
		require.ErrorContains(t, err, "permission denied", apply)

		switch apply {
		case "Migrate":
			res, err := migrations.Migrate(ctx, rp, target)
			require.NoError(t, err)
			require.NotEmpty(t, res.Applied)
		case "Script":
			sql, err := migrations.Script(target)
			require.NoError(t, err)
			_, err = rp.Exec(ctx, sql)
			require.NoError(t, err)
		default:
			ms, err := migrations.All()
			require.NoError(t, err)
			for _, m := range ms {
				sql, err := m.Script(target)
				require.NoError(t, err)
				_, err = rp.Exec(ctx, sql)
				require.NoError(t, err, m.FileName())
			}
		}
		require.NoError(t, migrations.Check(ctx, rp, target), apply)
		res, err := migrations.Migrate(ctx, rp, target)
		require.NoError(t, err, apply)
		require.Empty(t, res.Applied, "%s left nothing for Migrate to do", apply)
	}
}

// A tool that applies one version at a time sees the schema at each
// version in turn, and applying a version twice fails rather than doing it
// twice.
func TestPerVersionScriptsRecordTheirVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	ms, err := migrations.All()
	require.NoError(t, err)
	for i, m := range ms {
		sql, err := m.Script(schema)
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(sql, "-- sagaflow migration "+m.FileName()[:3]), sql[:60])
		_, err = pool.Exec(ctx, sql)
		require.NoError(t, err, m.FileName())
		err = migrations.Check(ctx, pool, schema)
		if i < len(ms)-1 {
			require.ErrorIs(t, err, migrations.ErrNotMigrated)
		} else {
			require.NoError(t, err)
		}
	}
	again, err := ms[0].Script(schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, again)
	require.Error(t, err, "a second run of a version is refused")
	_, err = ms[0].Script("bad name")
	require.ErrorIs(t, err, migrations.ErrInvalidSchema)
}

// Export writes one file per version, in order, and will not overwrite a
// file that says something else.
func TestExportWritesOneFilePerVersion(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "db", "migrations")
	paths, err := migrations.Export(dir, "shop")
	require.NoError(t, err)
	ms, err := migrations.All()
	require.NoError(t, err)
	require.Len(t, paths, len(ms))
	for i, m := range ms {
		require.Equal(t, filepath.Join(dir, m.FileName()), paths[i])
		body, err := os.ReadFile(paths[i])
		require.NoError(t, err)
		want, err := m.Script("shop")
		require.NoError(t, err)
		require.Equal(t, want, string(body))
		require.NotContains(t, string(body), "{{schema}}")
	}
	_, err = migrations.Export(dir, "shop")
	require.NoError(t, err, "exporting the same again is fine")
	require.NoError(t, os.WriteFile(paths[0], []byte("-- edited\n"), 0o644))
	_, err = migrations.Export(dir, "shop")
	require.ErrorContains(t, err, "exists with other content")
	_, err = migrations.Export(t.TempDir(), "pg_x")
	require.ErrorIs(t, err, migrations.ErrInvalidSchema)
}

// Exports running at once into one directory never see each other's half
// written files: identical content is not taken for a conflict.
func TestConcurrentExportsOfTheSameContentAgree(t *testing.T) {
	t.Parallel()
	for range 5 {
		dir := t.TempDir()
		errs := make(chan error, 8)
		for range 8 {
			go func() {
				_, err := migrations.Export(dir, "shop")
				errs <- err
			}()
		}
		for range 8 {
			require.NoError(t, <-errs)
		}
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		ms, err := migrations.All()
		require.NoError(t, err)
		require.Len(t, entries, len(ms), "no temporary file is left behind")
	}
}

// A version applied before an earlier one is named as out of order, not
// as an up-to-date schema that somehow lacks it.
func TestCheckNamesVersionsAppliedOutOfOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	ms, err := migrations.All()
	require.NoError(t, err)
	_, err = migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, "DELETE FROM "+pgx.Identifier{schema, "sagaflow_migrations"}.Sanitize()+" WHERE version = 1")
	require.NoError(t, err)
	err = migrations.Check(ctx, pool, schema)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.ErrorContains(t, err, fmt.Sprintf("has migration versions up to %d but lacks %s, applied out of order or skipped",
		ms[len(ms)-1].Version, ms[0].FileName()[:len(ms[0].FileName())-len(".up.sql")]))
}
