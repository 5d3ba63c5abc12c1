package main

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

func TestPauseAndUnpause(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	e, orderDef, _ := f.engine(t, false)
	st, err := saga.Start(ctx, e, orderDef, order{ID: "o-pause"}, nil)
	require.NoError(t, err)
	id := st.ID
	held := func() int {
		return f.Count(t, "SELECT count(*) FROM "+f.Table("outbox")+" WHERE saga_id = $1 AND available_at = 'infinity'", id)
	}

	out := f.cli(t, "pause", id.String(), "--reason", "incident 42").ok(t)
	require.Contains(t, out, "saga "+id.String()+" is paused")
	require.Equal(t, 1, held())
	show := f.cli(t, "show", id.String()).ok(t)
	require.Contains(t, show, "paused:")
	require.Contains(t, show, "incident 42")
	list := f.cli(t, "list", "--paused").ok(t)
	require.Contains(t, list, id.String())

	doc := decode[pauseResult](t, f.cli(t, "--json", "unpause", id.String()))
	require.Equal(t, "unpaused", doc.Result)
	require.Zero(t, held())
	msg := f.cli(t, "unpause", id.String()).failed(t, exitFailed)
	require.Contains(t, msg, "not paused")

	// A type.
	out = f.cli(t, "pause", "--type", orderDef.Name()).ok(t)
	require.Contains(t, out, "is paused")
	require.Equal(t, 1, held())
	doc = decode[pauseResult](t, f.cli(t, "--json", "pause", "--type", orderDef.Name()))
	require.Equal(t, "already_paused", doc.Result)
	doc = decode[pauseResult](t, f.cli(t, "--json", "unpause", "--type", orderDef.Name()))
	require.Equal(t, "unpaused", doc.Result)
	require.Zero(t, held())
	// A type that is not paused is refused as a saga that is not is.
	msg = f.cli(t, "unpause", "--type", orderDef.Name()).failed(t, exitFailed)
	require.Contains(t, msg, "not paused as a type")

	// The engine then runs the saga to its end; an ended saga cannot be paused.
	testkit.Start(t, e)
	testkit.WaitStatus(t, f.DB, id, saga.StatusCompleted)
	msg = f.cli(t, "pause", id.String()).failed(t, exitFailed)
	require.Contains(t, msg, "not running")
	msg = f.cli(t, "pause", uuid.NewString()).failed(t, exitNotFound)
	require.Contains(t, msg, "no such saga")
	f.cli(t, "pause", "--type", "bad\x00name").failed(t, exitUsage)
	f.cli(t, "pause", id.String(), "--type", "x").failed(t, exitUsage)
}

func TestVersions(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	e, orderDef, _ := f.engine(t, false)
	for range 2 {
		_, err := saga.Start(ctx, e, orderDef, order{ID: "o-" + uuid.NewString()}, nil)
		require.NoError(t, err)
	}
	out := f.cli(t, "versions").ok(t)
	require.Contains(t, out, "NAME")
	require.Regexp(t, orderDef.Name()+` +1 +2 +0 +0`, out)
	doc := decode[[]saga.VersionCount](t, f.cli(t, "--json", "versions"))
	require.Equal(t, []saga.VersionCount{{Name: orderDef.Name(), Version: 1, Running: 2}}, doc)
}
