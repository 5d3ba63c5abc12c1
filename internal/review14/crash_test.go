package review14

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// sagatest.CrashMatrix over sagas whose waits end into chained local
// steps: prep -> nap (30 ms timer) -> act -> await (a signal sent right
// after the start, kept until the saga reaches it) -> act2, which fails for
// good in odd sagas (compensating await and prep). Each boundary's crash
// must leave every effect exactly as often as the timeline says its step
// (or compensation) completed.
func TestCrashMatrixAroundWaitEnds(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	record := func(what string) saga.StepFunc[ord] {
		return func(ctx context.Context, run *saga.StepRun, _ *ord) error { return fx.Record(ctx, run, what) }
	}
	def := saga.Define("crashy",
		saga.Step[ord]{Name: "prep", Action: record("prep"), Compensate: record("unprep")},
		saga.Step[ord]{Name: "nap", Wait: saga.Sleep[ord](30 * time.Millisecond)},
		saga.Step[ord]{Name: "act", Action: record("act")},
		saga.Step[ord]{Name: "await", Compensate: record("unawait"),
			Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
				s.Got = p
				return fx.Record(ctx, run, "onsig")
			})},
		saga.Step[ord]{Name: "act2", Retry: noBackoff(2), Action: func(ctx context.Context, run *saga.StepRun, s *ord) error {
			if strings.HasSuffix(s.ID, "odd") {
				return steps.Permanent(errors.New("odd sagas fail here"))
			}
			return fx.Record(ctx, run, "act2")
		}},
	)
	cfg := d.Config()
	cfg.Workers = 2
	sagatest.CrashMatrix(t, d.Pool, def, &sagatest.CrashOpts{
		Config:  cfg,
		Sagas:   8,
		Timeout: 20 * time.Second,
		Start: func(ctx context.Context, e *saga.Engine, b sagatest.Round, i int) (uuid.UUID, error) {
			oid := fmt.Sprintf("%s-%d", b, i)
			if i%2 == 1 {
				oid += "-odd"
			}
			st, err := saga.Start(ctx, e, def, ord{ID: oid}, nil)
			if err != nil {
				return uuid.Nil, err
			}
			_, err = e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", ID: "s-" + oid, Payload: oid})
			return st.ID, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			rows, err := d.Pool.Query(ctx, "SELECT what, count(*)::int FROM "+fx.Table()+" WHERE saga_id = $1 GROUP BY what", in.ID)
			if err != nil {
				return nil, err
			}
			type wc struct {
				What string
				N    int
			}
			got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[wc])
			if err != nil {
				return nil, err
			}
			n := map[string]int{}
			for _, g := range got {
				n[g.What] = g.N
			}
			return map[sagatest.Effect]int{
				{Step: "prep"}:                      n["prep"],
				{Step: "act"}:                       n["act"],
				{Step: "await"}:                     n["onsig"],
				{Step: "act2"}:                      n["act2"],
				{Step: "prep", Compensation: true}:  n["unprep"],
				{Step: "await", Compensation: true}: n["unawait"],
			}, nil
		},
	})
}
