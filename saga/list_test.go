package saga_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestListFiltersAndPages(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	a := threeSteps(b, "alpha", nil)
	z := threeSteps(b, "zeta", nil)
	require.NoError(t, b.engine.Register(a, z))
	ctx := context.Background()

	var alphas []uuid.UUID
	for i := range 7 {
		st, err := saga.Start(ctx, b.engine, a, order{}, &saga.StartOpts{BusinessKey: fmt.Sprintf("a-%d", i)})
		require.NoError(t, err)
		alphas = append(alphas, st.ID)
	}
	var mid time.Time
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT now()").Scan(&mid))
	zs, err := saga.Start(ctx, b.engine, z, order{}, &saga.StartOpts{BusinessKey: "z-0"})
	require.NoError(t, err)

	// Pages of 3, newest first, with no overlap and no gap.
	var got []uuid.UUID
	cursor := ""
	pages := 0
	for {
		res, err := b.engine.List(ctx, &saga.ListOpts{Name: "alpha", Limit: 3, Cursor: cursor})
		require.NoError(t, err)
		pages++
		for _, s := range res.Sagas {
			require.Equal(t, "alpha", s.Name)
			require.Empty(t, s.History)
			got = append(got, s.ID)
		}
		if res.NextCursor == "" {
			break
		}
		cursor = res.NextCursor
	}
	require.Equal(t, 3, pages)
	require.Len(t, got, 7)
	for i := range got {
		require.Equal(t, alphas[len(alphas)-1-i], got[i], "newest first")
	}

	res, err := b.engine.List(ctx, &saga.ListOpts{BusinessKey: "a-3"})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 1)
	require.Equal(t, alphas[3], res.Sagas[0].ID)

	res, err = b.engine.List(ctx, &saga.ListOpts{CreatedAfter: mid})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 1)
	require.Equal(t, zs.ID, res.Sagas[0].ID)
	res, err = b.engine.List(ctx, &saga.ListOpts{CreatedBefore: mid})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 7)

	res, err = b.engine.List(ctx, &saga.ListOpts{Statuses: []saga.Status{saga.StatusCompleted}})
	require.NoError(t, err)
	require.Empty(t, res.Sagas)
	res, err = b.engine.List(ctx, &saga.ListOpts{Statuses: []saga.Status{saga.StatusRunning}, Name: "zeta"})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 1)

	_, err = b.engine.List(ctx, &saga.ListOpts{Cursor: "not-a-cursor"})
	require.ErrorContains(t, err, "malformed cursor")
	_, err = b.engine.List(ctx, &saga.ListOpts{Limit: saga.ListLimitMax + 1})
	require.ErrorContains(t, err, "Limit 1001 is outside 0..1000")
}
