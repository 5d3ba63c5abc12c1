package review20_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// balanced checks a cancelled chain saga's effects: c never ran, and each
// of a and b either did not commit or was undone exactly once.
func balanced(t *testing.T, fx map[string]int, what string) {
	t.Helper()
	require.Zero(t, fx["c"], "%s: c ran after the cancel: %v", what, fx)
	require.Equal(t, 1, fx["a"], "%s: %v", what, fx)
	for _, s := range []string{"a", "b"} {
		require.LessOrEqual(t, fx[s], 1, "%s: %v", what, fx)
		require.Equal(t, fx[s], fx[s+"-undo"], "%s: %s not undone exactly as often as it committed: %v", what, s, fx)
	}
}

// Postgres-only and Kafka mode (1 partition), 1 worker, BatchSize 16, a
// backlog of 16 sagas: their steps b run in batches, in one of which s0's b
// is held at a gate (in Kafka mode the batch's sagas "count as running on
// this engine from then on, so that a cancel asked meanwhile reaches
// them"). While it is held, an operator cancels s1..s4 and pauses s5..s8
// (Engine.Cancel: "the
// request is applied in that step's transaction instead of its outcome";
// doc.go "Pause": a batch "looks at the pauses again before each step it has
// yet to run", "a step that runs when the pause commits finishes and
// records its outcome; the command it writes next waits"). Then the gate
// opens and the batch ends with its tail and COMMIT in one round trip.
//
// The untouched sagas complete, effects once; the cancelled ones end
// compensated with c never run and a and b each undone exactly as often as
// committed; the paused ones do not run c while paused (held for a second
// after every other saga ended) and complete with effects once after
// Resume.
func TestOperatorsWhileABatchRuns(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"postgres", "kafka"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			operatorsWhileABatchRuns(t, mode)
		})
	}
}

func operatorsWhileABatchRuns(t *testing.T, mode string) {
	var c *chain
	var client *saga.Engine
	cfg := func() *saga.Config { return patient(c.db, 1, 16) }
	if mode == "postgres" {
		d := testkit.NewDB(t)
		c = newChain(t, d, "r20ops")
		client = testkit.NewEngine(t, d.Pool, cfg(), c.def)
	} else {
		k := newKchain(t, "r20kops", 1)
		c, client = k.chain, k.client
		cfg = func() *saga.Config { return kafkaMode(k.db, k.kc, 1, 16) }
	}
	d := c.db
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	c.setHook("s0", "b", func(ctx context.Context, _ *saga.StepRun, _ *st) error { return gate.Pass(ctx) })
	ctx := context.Background()
	ids := make([]uuid.UUID, 16)
	for i := range ids {
		s, err := saga.Start(ctx, client, c.def, st{ID: fmt.Sprint("s", i)}, nil)
		require.NoError(t, err)
		ids[i] = s.ID
	}
	e, _ := testkit.StartEngine(t, d.Pool, cfg(), c.def)
	testkit.WaitFor(t, wait, "s0's b to be held at the gate", func() bool { return gate.Entered() >= 1 })
	// The operators act from a goroutine: should Cancel or Pause wait for
	// the held batch, the gate is opened after 10 s and that is logged.
	ops := make(chan error, 1)
	go func() {
		for _, id := range ids[1:5] {
			if err := e.Cancel(ctx, id, "review20: stop it"); err != nil {
				ops <- err
				return
			}
		}
		for _, id := range ids[5:9] {
			if err := e.Pause(ctx, id, "review20: look at it"); err != nil {
				ops <- err
				return
			}
		}
		ops <- nil
	}()
	bRan := map[int]int32{}
	select {
	case err := <-ops:
		require.NoError(t, err)
		// Let the notifications of the pauses reach the engine before the
		// batch's remaining steps start (doc.go: only a step that starts in
		// that moment runs); this is not an assertion of speed.
		time.Sleep(300 * time.Millisecond)
		for i := 1; i < 9; i++ {
			bRan[i] = c.calls.Get(fmt.Sprintf("s%d/b", i))
		}
		gate.Open()
	case <-time.After(10 * time.Second):
		t.Logf("Cancel/Pause had not returned 10 s into the held batch; opening the gate")
		gate.Open()
		require.NoError(t, <-ops)
	}
	for i, id := range ids {
		if i >= 1 && i < 9 {
			continue
		}
		in := endedWithin(t, e, id, wait)
		require.Equal(t, saga.StatusCompleted, in.Status, "s%d: %v", i, testkit.Timeline(in))
		require.Equal(t, completed, c.effects(t, id), "s%d", i)
	}
	for i, id := range ids[1:5] {
		in := endedWithin(t, e, id, within)
		require.Equal(t, saga.StatusCompensated, in.Status, "s%d: %v", i+1, testkit.Timeline(in))
		balanced(t, c.effects(t, id), fmt.Sprintf("s%d (%v)", i+1, testkit.Timeline(in)))
	}
	testkit.Hold(t, time.Second, "paused sagas run no step after b", func() bool {
		for _, id := range ids[5:9] {
			if c.effects(t, id)["c"] != 0 {
				return false
			}
		}
		return true
	})
	for i, id := range ids[5:9] {
		in := get(t, e, id)
		require.NotNil(t, in.Paused, "s%d: %v", i+5, testkit.Timeline(in))
		require.False(t, in.Status.Terminal(), "s%d", i+5)
		require.NoError(t, e.Resume(ctx, id, "review20: go on"))
	}
	for i, id := range ids[5:9] {
		in := endedWithin(t, e, id, within)
		require.Equal(t, saga.StatusCompleted, in.Status, "s%d: %v", i+5, testkit.Timeline(in))
		require.Equal(t, completed, c.effects(t, id), "s%d: %v", i+5, testkit.Timeline(in))
	}
	require.Empty(t, doubles(t, c.fx, d))
	t.Logf("%s: b runs of s1..s8 while s0 was held: %v; stats %+v", mode, bRan, e.Stats())
}

// Postgres-only, 1 worker, BatchSize 16, a backlog of 16 sagas whose step
// b is, in turn: heavy (300 statements on run.Tx: inserts into a table of
// the test's, reads of it, a SET LOCAL), one that leaves the transaction
// aborted on its first attempt and returns nil, one that leaves it aborted
// and returns an error, and a plain one. The statements of a step go out
// after the earlier steps' queued writes ("the transaction a step sees
// sends it before the step's first statement"), and the batch's tail and
// COMMIT go in one round trip. Every saga completes; each effect once; the
// heavy steps' 300 rows exactly once (and none of an aborted attempt's);
// the aborted steps have exactly one failed attempt, the others none.
func TestHeavyAndAbortedStepsInOneBatch(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	c := newChain(t, d, "r20heavy")
	_, err := d.Pool.Exec(context.Background(), "CREATE TABLE "+d.Table("scratch")+" (saga_id uuid, n int, attempt int)")
	require.NoError(t, err)
	const heavy = 300
	ids := make([]uuid.UUID, 16)
	for i := range ids {
		id := fmt.Sprint("s", i)
		switch i % 4 {
		case 0:
			c.setHook(id, "b", func(ctx context.Context, run *saga.StepRun, _ *st) error {
				if _, err := run.Tx.Exec(ctx, "SET LOCAL statement_timeout = '20s'"); err != nil {
					return err
				}
				for n := range heavy {
					if _, err := run.Tx.Exec(ctx, "INSERT INTO "+d.Table("scratch")+" VALUES ($1, $2, $3)", run.SagaID, n, run.Attempt); err != nil {
						return err
					}
					if n%50 == 49 {
						var got int
						if err := run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+d.Table("scratch")+" WHERE saga_id = $1", run.SagaID).Scan(&got); err != nil {
							return err
						}
						if got != n+1 {
							return fmt.Errorf("review20: read %d rows of my own after writing %d", got, n+1)
						}
					}
				}
				return nil
			})
		case 1, 2:
			retErr := i%4 == 2
			c.setHook(id, "b", func(ctx context.Context, run *saga.StepRun, _ *st) error {
				if run.Attempt > 1 {
					return nil
				}
				if _, err := run.Tx.Exec(ctx, "INSERT INTO "+d.Table("scratch")+" VALUES ($1, -1, $2)", run.SagaID, run.Attempt); err != nil {
					return err
				}
				_, err := run.Tx.Exec(ctx, "SELECT 1/0")
				if retErr {
					return err
				}
				return nil
			})
		}
	}
	client := testkit.NewEngine(t, d.Pool, patient(d, 1, 16), c.def)
	for i := range ids {
		s, err := saga.Start(context.Background(), client, c.def, st{ID: fmt.Sprint("s", i)}, nil)
		require.NoError(t, err)
		ids[i] = s.ID
	}
	e, _ := testkit.StartEngine(t, d.Pool, patient(d, 1, 16), c.def)
	for i, id := range ids {
		in := endedWithin(t, e, id, wait)
		require.Equal(t, saga.StatusCompleted, in.Status, "s%d: %v", i, testkit.Timeline(in))
		require.Equal(t, completed, c.effects(t, id), "s%d: %v", i, testkit.Timeline(in))
		failed := testkit.Events(in, saga.EventStepFailed, "b")
		rows := d.Count(t, "SELECT count(*) FROM "+d.Table("scratch")+" WHERE saga_id = $1", id)
		switch i % 4 {
		case 0:
			require.Zero(t, failed, "s%d: %v", i, testkit.Timeline(in))
			require.Equal(t, heavy, rows, "s%d: the heavy step's rows", i)
		case 1, 2:
			require.Equal(t, 1, failed, "s%d: %v", i, testkit.Timeline(in))
			require.Zero(t, rows, "s%d: a write of the aborted attempt committed", i)
		default:
			require.Zero(t, failed, "s%d: %v", i, testkit.Timeline(in))
		}
	}
	require.Empty(t, doubles(t, c.fx, d))
	t.Logf("stats %+v", e.Stats())
}
