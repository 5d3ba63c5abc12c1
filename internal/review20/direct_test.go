package review20_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

var errFlaky = errors.New("review20: flaky, try again")

// plan gives every tenth saga a retry (b fails once), every tenth another
// a b that leaves its transaction aborted once and returns nil, and every
// tenth a third a failure for good at c (the saga compensates), and returns
// what each saga must end as.
func (c *chain) plan(prefix string, n int) (want func(i int) (saga.Status, map[string]int)) {
	for i := range n {
		id := fmt.Sprintf("%s%d", prefix, i)
		switch i % 10 {
		case 3:
			c.setHook(id, "b", func(_ context.Context, run *saga.StepRun, _ *st) error {
				if run.Attempt == 1 {
					return errFlaky
				}
				return nil
			})
		case 5:
			// leaves the step's transaction aborted on its first attempt
			// and returns success ("its step is rolled back the same way
			// and a failure recorded instead")
			c.setHook(id, "b", func(ctx context.Context, run *saga.StepRun, _ *st) error {
				if run.Attempt == 1 {
					_, _ = run.Tx.Exec(ctx, "SELECT 1/0")
				}
				return nil
			})
		case 7:
			c.setHook(id, "c", func(context.Context, *saga.StepRun, *st) error {
				return steps.Permanent(steps.WithCode("review20_no", errors.New("review20: never")))
			})
		}
	}
	return func(i int) (saga.Status, map[string]int) {
		if i%10 == 7 {
			return saga.StatusCompensated, compensatedAtC
		}
		return saga.StatusCompleted, completed
	}
}

// Postgres-only, BatchSize 16, every engine polling once a minute: 60
// sagas started concurrently (grouped starts), on one engine of 1 worker,
// one of 4 workers, and two engines of 2 workers sharing the schema (starts
// made from both). Every tenth saga's b fails once (a retry written by a
// batch, due 50 ms later), every tenth another's b leaves the transaction
// aborted once and returns nil (architecture.md: "its step is rolled back the
// same way and a failure recorded instead"; the other steps of its batch must
// not suffer), and every tenth's c fails for good (three compensations). "One step, one transaction": each saga ends as planned
// with each effect exactly once (the effects table has no unique key), the
// retried step's history says one failed attempt, and nothing is left in
// the outbox.
func TestManySagasPostgresOnly(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name             string
		engines, workers int
	}{{"1worker", 1, 1}, {"4workers", 1, 4}, {"twoEngines", 2, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := testkit.NewDB(t)
			c := newChain(t, d, "r20pg"+tc.name)
			const n = 60
			want := c.plan("s", n)
			var es []*saga.Engine
			for range tc.engines {
				e, _ := testkit.StartEngine(t, d.Pool, patient(d, tc.workers, 16), c.def)
				es = append(es, e)
			}
			ids := startMany(t, c.def, "s", n, 12, es...)
			for i, id := range ids {
				in := endedWithin(t, es[0], id, wait)
				status, fx := want(i)
				require.Equal(t, status, in.Status, "s%d: %v", i, testkit.Timeline(in))
				require.Equal(t, fx, c.effects(t, id), "s%d: %v", i, testkit.Timeline(in))
				if i%10 == 3 || i%10 == 5 {
					require.Equal(t, 1, testkit.Events(in, saga.EventStepFailed, "b"), "s%d: %v", i, testkit.Timeline(in))
				}
			}
			require.Empty(t, doubles(t, c.fx, d))
			require.Zero(t, d.Count(t, "SELECT count(*) FROM "+d.Table("outbox")+" WHERE status <> 'published'"),
				"commands left in the outbox after every saga ended")
			for i, e := range es {
				s := e.Stats()
				t.Logf("engine %d: succeeded %d, failed %d, retries %d, deferred %d, stale %d, dedup %d, grouped starts %d",
					i, s.StepsSucceeded, s.AttemptsFailed, s.Retries, s.Deferred, s.StaleDiscarded, s.Deduplicated, s.StartsGrouped)
			}
		})
	}
}

// docs/architecture.md, "Wake-ups come after the commit": every other
// process learns of a start "by one NOTIFY in a transaction of its own: the
// first commit after a quiet spell is announced at once, and the next
// notification waits until a millisecond after the last one and covers every
// commit made meanwhile".
//
// Engine A (2 workers, BatchSize 4, polling once a minute) is the only one
// with workers; client C, never started, starts every saga (one step), so
// each of A's wake-ups is C's notification. The starts come in the timings
// around the coalescing window: lone starts after quiet spells of 5 to 250
// ms, pairs and triples 0.2 to 3 ms apart, and bursts of 6 goroutines with
// random gaps below 2 ms, each burst after a quiet spell. After each group,
// every saga of it must have ended within 15 s (a lost notification waits for
// A's poll: a minute).
func TestNotificationsAroundTheQuietSpell(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	def := saga.Define("r20notify", saga.Step[st]{Name: "only", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
		return fx.Record(ctx, run, "only")
	}})
	a, _ := testkit.StartEngine(t, d.Pool, patient(d, 2, 4), def)
	client := testkit.NewEngine(t, d.Pool, patient(d, 1, 4), def)
	ctx := context.Background()
	n := 0
	start := func() uuid.UUID {
		t.Helper()
		n++
		s, err := saga.Start(ctx, client, def, st{ID: fmt.Sprint("n", n)}, nil)
		require.NoError(t, err)
		return s.ID
	}
	ended := func(what string, ids []uuid.UUID) {
		t.Helper()
		for _, id := range ids {
			in := endedWithin(t, a, id, within)
			require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", what, testkit.Timeline(in))
			require.Equal(t, 1, fx.Count(t, id, "only"), what)
		}
	}
	// Lone starts after quiet spells.
	for _, quiet := range []time.Duration{5, 1, 30, 2, 250, 1, 60, 1} {
		time.Sleep(quiet * time.Millisecond)
		ended(fmt.Sprintf("a lone start after %d ms", quiet), []uuid.UUID{start()})
	}
	// Pairs and triples around the millisecond.
	for _, gap := range []time.Duration{0, 200 * time.Microsecond, 700 * time.Microsecond, time.Millisecond,
		1300 * time.Microsecond, 2 * time.Millisecond, 3 * time.Millisecond} {
		for _, k := range []int{2, 3} {
			time.Sleep(20 * time.Millisecond) // a quiet spell first
			ids := []uuid.UUID{start()}
			for range k - 1 {
				time.Sleep(gap)
				ids = append(ids, start())
			}
			ended(fmt.Sprintf("%d starts %s apart", k, gap), ids)
		}
	}
	// Bursts from several goroutines with random gaps below 2 ms.
	for burst := range 4 {
		time.Sleep(time.Duration(10+burst*40) * time.Millisecond)
		ids := make(chan uuid.UUID, 200)
		errs := make(chan error, 200)
		done := make(chan struct{})
		for g := range 6 {
			go func() {
				defer func() { done <- struct{}{} }()
				for j := range 8 {
					time.Sleep(time.Duration((g*7+j*13+burst*5)%20) * 100 * time.Microsecond)
					s, err := saga.Start(ctx, client, def, st{ID: fmt.Sprintf("b%d-%d-%d", burst, g, j)}, nil)
					if err != nil {
						errs <- err
						return
					}
					ids <- s.ID
				}
			}()
		}
		for range 6 {
			<-done
		}
		close(ids)
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		var list []uuid.UUID
		for id := range ids {
			list = append(list, id)
		}
		require.Len(t, list, 48)
		ended(fmt.Sprintf("burst %d", burst), list)
	}
	require.Empty(t, doubles(t, fx, d))
	t.Logf("A: %+v; client: grouped starts %d", a.Stats(), client.Stats().StartsGrouped)
}
