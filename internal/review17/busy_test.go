package review17

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// holder takes over a saga's execution lock, as another transaction that
// holds the saga would: the transaction-scoped advisory lock (doc.go,
// guarantee 5) seen in pg_locks on the connection of a held step, taken
// by a transaction of the test's own the moment the step commits.
type holder struct {
	key      int64
	grabbed  chan time.Time
	release  chan struct{}
	released atomic.Int64 // unix nanos
	done     chan error
}

// lockKey reads the advisory lock held by backend pid (a held step's).
func lockKey(t *testing.T, d *testkit.DB, pid uint32) int64 {
	t.Helper()
	var key int64
	require.NoError(t, d.Pool.QueryRow(context.Background(), `SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1 AND pid = $1 AND granted`, int32(pid)).Scan(&key))
	return key
}

// hold queues for key on a connection of its own, and returns once its
// request waits in PostgreSQL's queue behind the held step's transaction;
// it holds the lock, once granted, until release is closed. Queued (a
// blocking pg_advisory_xact_lock), it is granted the lock the moment the
// step's transaction ends, before a worker's try for the next step can
// take it (a try does not jump a queue); a loop of tries raced the worker,
// and lost about one run in twenty.
func hold(t *testing.T, d *testkit.DB, key int64) *holder {
	t.Helper()
	conn, err := pgx.ConnectConfig(context.Background(), d.Pool.Config().ConnConfig.Copy())
	require.NoError(t, err)
	pid := conn.PgConn().PID()
	h := &holder{key: key, grabbed: make(chan time.Time, 1), release: make(chan struct{}), done: make(chan error, 1)}
	wait, stop := context.WithCancel(context.Background())
	go func() {
		<-h.release
		stop() // a request still waiting is given up
	}()
	go func() {
		ctx := context.Background()
		defer conn.Close(ctx)
		h.done <- pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(wait, `SELECT pg_advisory_xact_lock($1)`, key); err != nil {
				return err
			}
			h.grabbed <- time.Now()
			<-h.release
			h.released.Store(time.Now().UnixNano())
			return nil
		})
	}()
	t.Cleanup(func() { h.Release(); <-h.done })
	testkit.WaitFor(t, prompt, "the test's transaction to wait for the saga's lock", func() bool {
		var waiting bool
		require.NoError(t, d.Pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_locks
			WHERE locktype = 'advisory' AND pid = $1 AND NOT granted)`, int32(pid)).Scan(&waiting))
		return waiting
	})
	return h
}

func (h *holder) Release() {
	select {
	case <-h.release:
	default:
		close(h.release)
	}
}

// holdFor is how long the test's transaction holds a saga (REVIEW17_HOLD
// to try others).
func holdFor() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("REVIEW17_HOLD")); err == nil {
		return d
	}
	return 800 * time.Millisecond
}

// deferrals watches e's Stats.Deferred for d and returns when (since the
// start of the watch, rounded to 10 ms) each new deferral was seen.
func deferrals(e *saga.Engine, d time.Duration) []time.Duration {
	var out []time.Duration
	begin := time.Now()
	last := e.Stats().Deferred
	for time.Since(begin) < d {
		if n := e.Stats().Deferred; n != last {
			last = n
			out = append(out, time.Since(begin).Round(10*time.Millisecond))
		}
		time.Sleep(2 * time.Millisecond)
	}
	return out
}

// busyDef: first (held at gate, tells its backend pid) -> second -> done.
func busyDef(name string, fx *testkit.Effects, gate *testkit.Gate, pid *atomic.Uint32, secondRuns *atomic.Int32, secondAt *atomic.Int64) *saga.Definition[ord] {
	return saga.Define(name,
		saga.Step[ord]{Name: "first", Timeout: 20 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			var p uint32
			if err := run.Tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p); err != nil {
				return err
			}
			pid.Store(p)
			if err := gate.Pass(ctx); err != nil {
				return err
			}
			return fx.Record(ctx, run, "first")
		}},
		saga.Step[ord]{Name: "second", Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			secondRuns.Add(1)
			secondAt.Store(time.Now().UnixNano())
			return fx.Record(ctx, run, "second")
		}},
		saga.Step[ord]{Name: "done", Action: rec(fx, "done")},
	)
}

// Postgres-only mode: the next step's command finds its saga held by
// another transaction for 800 ms and is deferred (Stats.Deferred); once
// the holder commits, it must run promptly, not at the poll.
func TestDeferredCommandRunsWhenTheSagaIsFree(t *testing.T) {
	parallel(t)
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	var pid atomic.Uint32
	var runs2 atomic.Int32
	var at2 atomic.Int64
	def := busyDef("held", fx, gate, &pid, &runs2, &at2)
	e, _ := testkit.StartEngine(t, d.Pool, config(d, 2), def)
	st, err := saga.Start(ctx, e, def, ord{ID: "h"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, prompt, "first to be held", func() bool { return gate.Entered() == 1 })
	h := hold(t, d, lockKey(t, d, pid.Load()))
	gate.Open()
	testkit.Recv(t, h.grabbed, prompt, "the test's transaction to take the saga's lock")
	testkit.WaitFor(t, prompt, "second's command to be deferred", func() bool { return e.Stats().Deferred > 0 })
	cadence := deferrals(e, holdFor())
	require.Zero(t, runs2.Load(), "second ran while another transaction held its saga")
	h.Release()
	in := endedWithin(t, e, st.ID, prompt)
	require.Equal(t, saga.StatusCompleted, in.Status, timeline(in))
	lag := time.Duration(at2.Load() - h.released.Load())
	t.Logf("second ran %s after the holder let go; deferred at %v; stats %+v", lag, cadence, e.Stats())
	// Deferrals back off (about 0.5 s after 0.8 s held, 1.6 s after 3 s,
	// see FINDINGS.md O1): "promptly" is well within the poll.
	require.Less(t, lag, prompt)
	require.EqualValues(t, 1, runs2.Load())
	requireOnce(t, fx, st.ID, map[string]int{"first": 1, "second": 1, "done": 1})
}
