package review14

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// 200 sagas, each: a 100 ms timer, a local step (every tenth fails its
// first attempt), a 50 ms timer, a local step; one engine with two
// workers. Every saga completes, each step's effect is there once, each
// timer fired once, no command was written for a step after a timer
// except the retries', and nothing is left in the outbox.
func TestManyTimersThenLocalSteps(t *testing.T) {
	t.Parallel()
	const n = 200
	r := newRig(t)
	var acts tally
	def := saga.Define("naps",
		saga.Step[ord]{Name: "nap", Wait: saga.Sleep[ord](100 * time.Millisecond)},
		saga.Step[ord]{Name: "act", Retry: noBackoff(3), Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			var i int
			_, _ = fmt.Sscanf(o.ID, "o-%d", &i)
			if acts.add(o.ID) == 1 && i%10 == 0 {
				if err := r.fx.Record(ctx, run, "act-try"); err != nil {
					return err
				}
				return errors.New("first attempt fails")
			}
			return r.fx.Record(ctx, run, "act")
		}},
		saga.Step[ord]{Name: "nap2", Wait: saga.SleepFor(func(*ord) time.Duration { return 50 * time.Millisecond })},
		saga.Step[ord]{Name: "act2", Action: rec(r, "act2")},
	)
	r.start(t, func(c *saga.Config) { c.Workers = 2 }, def)
	ctx := context.Background()
	chained := r.engine.Stats().Chained

	var wg sync.WaitGroup
	for g := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; i < n; i += 10 {
				if _, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprintf("o-%d", i)}, nil); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	inst := r.db.Table("saga_instances")
	testkit.WaitFor(t, wait, "every saga to end", func() bool {
		return r.db.Count(t, "SELECT count(*) FROM "+inst+" WHERE status IN ('completed', 'compensated', 'failed')") == n
	})
	require.Equal(t, n, r.db.Count(t, "SELECT count(*) FROM "+inst+" WHERE status = 'completed'"))

	fx := r.fx.Table()
	require.Equal(t, 2*n, r.db.Count(t, "SELECT count(*) FROM "+fx))
	require.Equal(t, 0, r.db.Count(t, "SELECT count(*) FROM (SELECT 1 FROM "+fx+" GROUP BY saga_id, what HAVING count(*) <> 1) d"),
		"an effect doubled")
	for _, what := range []string{"act", "act2"} {
		require.Equal(t, n, r.db.Count(t, "SELECT count(DISTINCT saga_id) FROM "+fx+" WHERE what = $1", what), what)
	}
	hist := r.db.Table("saga_history")
	require.Equal(t, 2*n, r.db.Count(t, "SELECT count(*) FROM "+hist+" WHERE event = 'timer_fired'"))
	require.Equal(t, 0, r.db.Count(t, "SELECT count(*) FROM (SELECT 1 FROM "+hist+
		" WHERE event IN ('timer_fired', 'step_completed') GROUP BY saga_id, event, step_name HAVING count(*) <> 1) d"),
		"a timer fired, or a step completed, twice")
	require.Equal(t, n/10, r.db.Count(t, "SELECT count(*) FROM "+hist+" WHERE event = 'step_failed'"))

	st, err := r.engine.OutboxStatus(ctx)
	require.NoError(t, err)
	require.Zero(t, st.Pending, "%+v", st)
	require.Zero(t, st.Dead, "%+v", st)
	out := r.db.Table("outlog")
	require.Equal(t, n/10, r.db.Count(t, "SELECT count(*) FROM "+out+" WHERE step_key LIKE '%/act/forward/%'"),
		"only the retries write a command for act")
	require.Zero(t, r.db.Count(t, "SELECT count(*) FROM "+out+" WHERE step_key LIKE '%/act2/forward/%'"))
	got := r.engine.Stats().Chained - chained
	require.GreaterOrEqual(t, got, int64(2*n-n/10), "steps run in the transaction of a timer's end")
	t.Logf("chained: %d", got)
}
