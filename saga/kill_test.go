package saga_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

const childEnv = "SAGAFLOW_CHILD_WORKER"

// TestWorkerKilledMidStep runs an engine in a real child process. Its
// "charge" step writes its effect in the step's transaction, says (in a
// row of its own, committed) that it has started, and hangs. The parent
// kills the child with SIGKILL, then its own engine finishes the saga: the
// charge effect exists once, because the killed transaction never committed.
func TestWorkerKilledMidStep(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, "CREATE TABLE "+b.table("entered")+" (pid int, step text)")
	require.NoError(t, err)
	def := threeSteps(b, "killable", nil)
	require.NoError(t, b.engine.Register(def))
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-kill"}, nil)
	require.NoError(t, err)

	var out bytes.Buffer
	child := exec.Command(os.Args[0], "-test.run=^TestChildWorkerProcess$", "-test.v")
	child.Env = append(os.Environ(), childEnv+"=1", "SAGAFLOW_CHILD_SCHEMA="+b.schema, "SAGAFLOW_CHILD_DSN="+pgtest.ConnString(t))
	child.Stdout, child.Stderr = &out, &out
	require.NoError(t, child.Start())
	waitFor(t, 30*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("entered")+" WHERE step = 'charge'") == 1
	}, "the child to enter the charge step")
	// The child is in the middle of "charge", its effect written but not
	// committed. Kill it.
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	err = child.Wait()
	require.Error(t, err, "the child was killed, it did not exit: %s", out.String())
	require.Equal(t, []string{"reserve/forward"}, b.effects(t, st.ID), "only the step the child committed")

	b.start(t)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	var childPID int
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT pid FROM "+b.table("entered")).Scan(&childPID))
	require.Equal(t, child.Process.Pid, childPID, "the step the parent finished is the one the child was killed in")
}

// TestChildWorkerProcess is the child of TestWorkerKilledMidStep.
func TestChildWorkerProcess(t *testing.T) {
	if os.Getenv(childEnv) == "" {
		t.Skip("runs only as the child process of TestWorkerKilledMidStep")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("SAGAFLOW_CHILD_DSN"))
	require.NoError(t, err)
	b := &bundle{pool: pool, schema: os.Getenv("SAGAFLOW_CHILD_SCHEMA")}
	def := threeSteps(b, "killable", map[string]saga.StepFunc[order]{
		"charge/forward": func(ctx context.Context, run *saga.StepRun, _ *order) error {
			// The effect is written (by threeSteps) in the step's
			// transaction; announce the step outside it, then hang.
			if _, err := pool.Exec(ctx, "INSERT INTO "+b.table("entered")+" VALUES ($1, 'charge')", os.Getpid()); err != nil {
				return err
			}
			select {}
		},
	})
	e, err := saga.New(pool, &saga.Config{Schema: b.schema, BatchSize: 1, PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, e.Register(def))
	require.NoError(t, e.Start(ctx))
	select {} // until killed
}
