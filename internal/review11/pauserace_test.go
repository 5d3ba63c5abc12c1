package review11_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// The race of TestPauseRacesTheBranchRescue, made certain, for Pause and for Cancel: the rescuer's
// transaction has written the re-sent branch command and is stopped (a
// test trigger waits for an advisory lock the test holds) while Pause runs
// and commits. Then the rescuer commits. Whether or not the command
// escaped the pause's hold, no worker may run the branch of the paused
// saga; after Resume it runs once.
func TestOperatorActsWhileTheRescueIsOpen(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"pause", "cancel"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			operatorWhileTheRescueIsOpen(t, op)
		})
	}
}

func operatorWhileTheRescueIsOpen(t *testing.T, op string) {
	ctx := context.Background()
	e := newEnv(t)
	def := fanDef("open_"+op, e.fx, newBehave(), 3, "a", "b")
	e.loseBranch(t, "fan.b", 0)
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	id := e.startFan(t, g, def, "a")
	stop()
	require.True(t, e.age(t, id, 2*slack))

	// The gate: a trigger on the re-sent command waits for lock key.
	var key int64
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT ('x' || substr(md5($1), 1, 15))::bit(60)::bigint`, e.Schema).Scan(&key))
	gate, err := e.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer gate.Release()
	_, err = gate.Exec(ctx, `SELECT pg_advisory_lock($1)`, key)
	require.NoError(t, err)
	unlocked := false
	unlock := func() {
		if !unlocked {
			unlocked = true
			_, err := gate.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key)
			require.NoError(t, err)
		}
	}
	defer unlock()
	fn := e.Table("gate_fn")
	_, err = e.Pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_advisory_xact_lock(`+pgInt(key)+`); RETURN NULL; END $$`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `CREATE TRIGGER review11_gate AFTER INSERT ON `+e.Table("outbox")+` FOR EACH ROW WHEN (NEW.type = 'sagaflow.branch') EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)

	client := testkit.NewEngine(t, e.Pool, e.cfg(), def)
	rescued := make(chan saga.RescueResult, 1)
	go func() {
		res, err := client.RescueNow(ctx)
		if err != nil {
			t.Errorf("rescue: %v", err)
		}
		rescued <- res
	}()
	waitFor(t, "the rescuer's transaction at the gate", func() bool {
		return e.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
			AND ((classid::bigint << 32) | objid::bigint) = $1`, key) == 1
	})
	paused := make(chan error, 1)
	go func() {
		if op == "pause" {
			paused <- client.Pause(ctx, id, "mid-rescue")
		} else {
			paused <- client.Cancel(ctx, id, "mid-rescue")
		}
	}()
	pauseDone := false
	select {
	case err := <-paused:
		require.NoError(t, err)
		pauseDone = true
		t.Log(op, " committed while the rescue was open")
	case <-time.After(2 * time.Second):
		t.Log(op, " waits for the rescue (it serialises on the saga)")
	}
	unlock()
	res := testkit.Recv(t, rescued, wait, "the rescue")
	if !pauseDone {
		require.NoError(t, testkit.Recv(t, paused, wait, "the pause"))
	}
	t.Logf("rescue %+v; held or absent: %v\n%s", res, e.heldOrAbsent(t, id, "fan.b"), e.dump(t, id))
	_, err = e.Pool.Exec(ctx, `DROP TRIGGER review11_gate ON `+e.Table("outbox"))
	require.NoError(t, err)

	g2, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	if op == "cancel" {
		require.Equal(t, saga.StatusCompensated, testkit.WaitEnded(t, g2, id).Status, e.dump(t, id))
		testkit.Hold(t, 500*time.Millisecond, "the cancelled saga's branch never runs", func() bool { return e.fx.Count(t, id, "fan.b") == 0 })
		require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "undo:fan.a": 1, "undo:pre": 1}, e.fx.Counts(t, id))
		waitFor(t, "no branch command left", func() bool { return e.branchCommands(t, id, "fan.b", "pending") == 0 })
		return
	}
	testkit.Hold(t, time.Second, "the paused saga's branch does not run", func() bool { return e.fx.Count(t, id, "fan.b") == 0 })
	require.NoError(t, g2.Resume(ctx, id, "go"))
	require.True(t, e.age(t, id, 2*slack))
	rescue(t, g2)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, g2, id).Status, e.dump(t, id))
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "fan.b": 1, "post": 1}, e.fx.Counts(t, id))
	require.Equal(t, 2, branch(t, g2, id, "fan", "b", 0).Attempts, "the lost attempt, once, and the one that ran")
}

func pgInt(n int64) string { return strconv.FormatInt(n, 10) }
