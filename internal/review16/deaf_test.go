package review16

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// A deaf step (ignores ctx, 1.2 s; Timeout 200 ms, HandlerGrace 150 ms) on
// the engine workers of one Postgres-only engine with Workers 4, in eight
// sagas at once, MaxAttempts 4, backoff 5 ms, BatchSize 1 and 16. Doc
// (0c4ef86): the abandoned attempt "is recorded as failed; until it is, the
// engine's workers leave the saga's commands alone, so that the attempt is
// in the history before the retry and counts". So each saga's handler runs
// exactly 4 times, with run.Attempt 1..4, each run finding the attempts
// before it already recorded; the history has attempts [1 2 3 4], all
// handler_overran; the saga compensates (pick undone once).
//
// F1: under load, one attempt k runs twice: a second run, with run.Attempt
// k, starts after attempt k's abandonment is recorded (it finds k failures
// in the history); its own failure is recorded again as attempt k (detail
// "superseded"). The handler runs MaxAttempts+1 times on one engine.
func TestDeafStepOnFourWorkersCountsExactlyMaxAttempts(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 16} {
		t.Run(fmt.Sprint(batch), func(t *testing.T) {
			t.Parallel()
			d := testkit.NewDB(t)
			fx := testkit.NewEffects(t, d)
			rd := readerPool(t, d)
			type seen struct {
				attempt, before int
				err             error
			}
			var mu sync.Mutex
			runs := map[uuid.UUID][]seen{}
			var sleepers testkit.Stragglers
			def := saga.Define(fmt.Sprint("deafw", batch),
				saga.Step[ord]{Name: "pick", Retry: noBackoff(1),
					Action:     func(ctx context.Context, run *saga.StepRun, _ *ord) error { return fx.Record(ctx, run, "pick") },
					Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return fx.Record(ctx, run, "unpick") }},
				saga.Step[ord]{Name: "deaf", Timeout: 200 * time.Millisecond, Retry: noBackoff(4),
					Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error {
						// The run is listed as it starts, then what it found.
						mu.Lock()
						k := len(runs[run.SagaID])
						runs[run.SagaID] = append(runs[run.SagaID], seen{attempt: run.Attempt})
						mu.Unlock()
						b, err := historyCount(context.Background(), rd, run.SagaID, "step_failed", "deaf")
						mu.Lock()
						runs[run.SagaID][k].before, runs[run.SagaID][k].err = b, err
						mu.Unlock()
						defer sleepers.Enter()()
						time.Sleep(1200 * time.Millisecond)
						return fx.Record(context.Background(), run, "deaf-late")
					}},
			)
			cfg := d.Config()
			cfg.Workers = 4
			cfg.BatchSize = batch
			cfg.HandlerGrace = 150 * time.Millisecond
			e, _ := testkit.StartEngine(t, d.Pool, cfg, def)
			t.Cleanup(sleepers.Wait)
			ctx := context.Background()
			var ids []uuid.UUID
			for i := range 8 {
				st, err := saga.Start(ctx, e, def, ord{ID: fmt.Sprint(i)}, nil)
				require.NoError(t, err)
				ids = append(ids, st.ID)
			}
			for _, id := range ids {
				in := testkit.WaitEnded(t, e, id)
				mu.Lock()
				got := runs[id]
				mu.Unlock()
				require.Len(t, got, 4, "the handler ran MaxAttempts times: %+v %v", got, timeline(in))
				require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
				require.Equal(t, []int{1, 2, 3, 4}, failedAttempts(in, "deaf"), "exactly MaxAttempts, in order: %v", timeline(in))
				for _, ev := range in.History {
					if ev.Type == "step_failed" && ev.Step == "deaf" {
						require.Equal(t, saga.CodeAbandonedRunOn, ev.ErrorCode, "%v", timeline(in))
					}
				}
				for i, s := range got {
					require.NoError(t, s.err)
					require.Equal(t, i+1, s.attempt, "%+v", got)
					// At least the attempts before it recorded. (Its own may be
					// too: the read is the handler's first act, on another
					// pool, and under load it can return after the attempt was
					// abandoned and recorded, 350 ms in.)
					require.GreaterOrEqual(t, s.before, i, "attempt %d began with the %d attempts before it recorded: %+v", i+1, i, got)
				}
				require.Equal(t, []string{"pick", "unpick"}, fx.List(t, id), "%v", timeline(in))
			}
			require.Equal(t, int64(32), e.Stats().HandlersAbandoned)
		})
	}
}
