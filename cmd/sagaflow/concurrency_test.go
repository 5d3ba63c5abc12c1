package main

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// TestConcurrencyKeyShown: list --queued shows the sagas waiting for a
// slot, with their key and position; show prints the key's line; a key
// PostgreSQL cannot store is refused naming the flag's field.
func TestConcurrencyKeyShown(t *testing.T) {
	t.Parallel()
	f := setup(t)
	def := definePing().WithConcurrency(1)
	e := testkit.NewEngine(t, f.Pool, f.Config(), def)
	ctx := context.Background()
	var ids []uuid.UUID
	for range 2 {
		st, err := saga.Start(ctx, e, def, order{}, &saga.StartOpts{ConcurrencyKey: "cust-7"})
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	out := f.cli(t, "list", "--queued").ok(t)
	require.Contains(t, out, ids[1].String())
	require.NotContains(t, out, ids[0].String())
	require.Contains(t, out, "queued:cust-7 #1")

	doc := decode[listDoc](t, f.cli(t, "list", "--concurrency-key", "cust-7", "--json"))
	require.ElementsMatch(t, ids, []uuid.UUID{doc.Sagas[0].ID, doc.Sagas[1].ID})

	out = f.cli(t, "show", ids[1].String()).ok(t)
	require.Contains(t, out, "concurrency key:")
	require.Contains(t, out, "cust-7: waiting, position 1 (1/1 running)")
	out = f.cli(t, "show", ids[0].String()).ok(t)
	require.Contains(t, out, "cust-7 (1/1 running)")

	out = f.cli(t, "list", "--concurrency-key", "bad\xff").failed(t, 2)
	require.True(t, strings.Contains(out, "--concurrency-key is not valid UTF-8"), out)
}
