package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

func TestCheckSchemaNamesWhatIsMissing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	ms, err := migrations.All()
	require.NoError(t, err)
	latest := ms[len(ms)-1]

	// Never migrated: the schema exists, the version table does not.
	err = migrations.Check(ctx, pool, schema)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.ErrorContains(t, err, fmt.Sprintf(`schema %q is at migration version 0, and this sagaflow needs %d`, schema, latest.Version))
	require.ErrorContains(t, err, "run migrations.Migrate")
	// No schema at all.
	err = migrations.Check(ctx, pool, schema+"_absent")
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.ErrorContains(t, err, "at migration version 0")

	// Migrated, then the last migration's record lost: an older schema.
	_, err = migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	require.NoError(t, migrations.Check(ctx, pool, schema))
	versions := pgx.Identifier{schema}.Sanitize() + ".sagaflow_migrations"
	_, err = pool.Exec(ctx, "DELETE FROM "+versions+" WHERE version = $1", latest.Version)
	require.NoError(t, err)
	err = migrations.Check(ctx, pool, schema)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	// The version before the latest one, not latest-1: numbers need not be
	// consecutive (one may be taken by a migration still being written).
	require.ErrorContains(t, err, fmt.Sprintf("at migration version %d, and this sagaflow needs %d (missing %03d_%s)",
		ms[len(ms)-2].Version, latest.Version, latest.Version, latest.Name))

	// A schema a newer version migrated further passes.
	_, err = pool.Exec(ctx, "INSERT INTO "+versions+" (version, name) VALUES ($1, $2), (999, 'from_the_future')", latest.Version, latest.Name)
	require.NoError(t, err)
	require.NoError(t, migrations.Check(ctx, pool, schema))

	require.ErrorIs(t, migrations.Check(ctx, pool, "pg_catalog"), migrations.ErrInvalidSchema)
}

func TestCheckSchemaThatCannotAskIsNotAVerdict(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	err = migrations.Check(context.Background(), pool, "sagaflow")
	require.Error(t, err)
	require.NotErrorIs(t, err, migrations.ErrNotMigrated)
	require.True(t, strings.HasPrefix(err.Error(), "migrations: check schema sagaflow: read versions: "), err.Error())
}
