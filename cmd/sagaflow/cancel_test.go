package main

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestCancel(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()

	// A running saga: started, but no engine runs its steps yet.
	e, orderDef, _ := f.engine(t, false)
	st, err := saga.Start(ctx, e, orderDef, order{ID: "o-cancel"}, nil)
	require.NoError(t, err)
	id := st.ID
	cancels := func() int {
		return f.count(t, "SELECT count(*) FROM "+f.table("outbox")+" WHERE type = 'sagaflow.cancel' AND saga_id = $1", id)
	}

	out := f.cli(t, "cancel", id.String(), "--reason", "customer asked").ok(t)
	require.Equal(t, "cancel of saga "+id.String()+" requested: an engine that knows the saga will compensate it\n", out)
	require.Equal(t, 1, cancels())
	require.Equal(t, saga.StatusRunning, f.status(t, id), "the CLI only records the request")

	doc := decode[struct {
		ID     uuid.UUID
		Result string
	}](t, f.cli(t, "--json", "cancel", id.String()))
	require.Equal(t, id, doc.ID)
	require.Equal(t, "requested", doc.Result)
	require.Equal(t, 2, cancels())

	// An engine that knows the saga carries the request out.
	start(t, e)
	f.waitStatus(t, id, saga.StatusCompensated)
	in, err := e.Get(ctx, id)
	require.NoError(t, err)
	require.Equal(t, saga.CodeCancelled, in.LastError.Code)

	// Ended: nothing to cancel.
	msg := f.cli(t, "cancel", id.String()).failed(t, exitFailed)
	require.Contains(t, msg, "cancel "+id.String())
	require.Contains(t, msg, "not running")

	msg = f.cli(t, "cancel", uuid.NewString()).failed(t, exitNotFound)
	require.Contains(t, msg, "no such saga")
	msg = f.cli(t, "cancel", "42").failed(t, exitUsage)
	require.Contains(t, msg, `"42" is not a UUID`)
}
