package saga_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

func checks(r health.Report) map[string]bool {
	out := map[string]bool{}
	for _, c := range r.Checks {
		out[c.Name] = c.OK
	}
	return out
}

func TestEngineHealth(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()

	r := b.engine.Health(ctx)
	require.Equal(t, "engine", r.Component)
	require.True(t, r.Live, "an engine never started has nothing to restart")
	require.False(t, r.Ready)
	require.Equal(t, map[string]bool{"schema": true, "workers": false, "claim": true, "listen": false}, checks(r))

	b.start(t)
	require.Eventually(t, func() bool {
		r = b.engine.Health(ctx)
		return r.Ready && strings.Contains(r.Checks[2].Detail, "last claim succeeded")
	}, 30*time.Second, 10*time.Millisecond, "a started engine gets ready and claims: %+v", r)
	require.True(t, r.Live)
	require.Equal(t, map[string]bool{"schema": true, "workers": true, "claim": true, "listen": true}, checks(r))
	require.Contains(t, r.Checks[1].Detail, fmt.Sprintf("%d of %d running", saga.WorkersDefault, saga.WorkersDefault))
	require.Contains(t, r.Checks[2].Detail, "last claim succeeded")

	// A schema that lacks this build's latest migration is not ready.
	_, err := b.pool.Exec(ctx, "DELETE FROM "+b.table("sagaflow_migrations")+" WHERE version = (SELECT max(version) FROM "+
		b.table("sagaflow_migrations")+")")
	require.NoError(t, err)
	r = b.engine.Health(ctx)
	require.False(t, r.Ready)
	require.False(t, checks(r)["schema"])
	require.Contains(t, r.Checks[0].Detail, "schema not migrated")

	var nilEngine *saga.Engine
	require.False(t, nilEngine.Health(ctx).Ready)
}

// Right after a database restart the pool still holds connections the
// restart broke, used too recently to be pinged: the schema check reads
// again on the next connection instead of reporting the broken one.
func TestEngineHealthAfterTheDatabaseBrokeThePoolsConnections(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	pool := pgtest.RecentPool(t, 3)
	e, err := saga.New(pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.Equal(t, 3, pgtest.BreakIdle(t, pool))
	r := e.Health(ctx)
	require.True(t, checks(r)["schema"], "%+v", r)
}
