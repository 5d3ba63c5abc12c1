package saga_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

func TestStartRefusesAnUnmigratedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t) // created, never migrated
	e, err := saga.New(pool, &saga.Config{Schema: schema, Logger: testLogger(t)})
	require.NoError(t, err, "New stays cheap: it does not ask the database")
	ms, err := migrations.All()
	require.NoError(t, err)
	err = e.Start(ctx)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.ErrorContains(t, err, `schema "`+schema+`" is at migration version 0`)
	require.ErrorContains(t, err, fmt.Sprintf("this sagaflow needs %d", ms[len(ms)-1].Version))
	require.ErrorContains(t, err, "run migrations.Migrate")
	require.NoError(t, e.Stop(ctx), "the engine did not start")

	_, err = migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	require.NoError(t, e.Start(ctx))
	require.NoError(t, e.Stop(ctx))
}
