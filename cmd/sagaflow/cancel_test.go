package main

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
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
		return f.Count(t, "SELECT count(*) FROM "+f.Table("outbox")+" WHERE type = 'sagaflow.cancel' AND saga_id = $1", id)
	}

	out := f.cli(t, "cancel", id.String(), "--reason", "customer asked").ok(t)
	require.Equal(t, "cancel of saga "+id.String()+" requested: an engine that knows the saga compensates it, "+
		"or refuses the request if the saga is past its pivot or ends first (its timeline says which)\n", out)
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
	testkit.Start(t, e)
	testkit.WaitStatus(t, f.DB, id, saga.StatusCompensated)
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

// Issue #11, point 3: `sagaflow cancel` of an 8-step saga while its step 2
// runs compensates steps 1 and 2 and runs no step after the request. Step 2
// here ignores its context and completes; the request goes ahead of step 3.
func TestCancelWhileAStepRunsRunsNoLaterStep(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	var mu sync.Mutex
	var ran []string
	entered := make(chan struct{})
	release := make(chan struct{})
	var ss []saga.Step[order]
	for i := 1; i <= 8; i++ {
		name := fmt.Sprintf("s%d", i)
		fn := func(ctx context.Context, run *saga.StepRun, _ *order) error {
			mu.Lock()
			ran = append(ran, name+"/"+string(run.Direction))
			mu.Unlock()
			if name == "s2" && run.Direction == "forward" {
				close(entered)
				<-release
			}
			return nil
		}
		ss = append(ss, saga.Step[order]{Name: name, Action: fn, Compensate: fn})
	}
	def := saga.Define("eight", ss...)
	e, _ := testkit.StartEngine(t, f.Pool, f.Config(), def)
	st, err := saga.Start(ctx, e, def, order{ID: "o-eight"}, nil)
	require.NoError(t, err)
	<-entered

	f.cli(t, "cancel", st.ID.String(), "--reason", "changed my mind").ok(t)
	close(release)
	testkit.WaitStatus(t, f.DB, st.ID, saga.StatusCompensated)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"s1/forward", "s2/forward", "s2/compensate", "s1/compensate"}, ran)
	out := f.cli(t, "show", st.ID.String()).ok(t)
	require.Contains(t, out, "cancel_requested")
	require.Contains(t, out, "saga_cancelled")
}
