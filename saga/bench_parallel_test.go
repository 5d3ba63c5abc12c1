package saga_test

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// BenchmarkParallelVsSequential measures what a parallel step buys: a saga
// whose two steps each wait 50 ms, as a parallel step of two branches and
// as two steps in sequence, one saga at a time, alternately. Wall time is
// the saga's own, from its start to its end in database time. ratio is the
// median parallel ÷ sequential wall time; the target is ≤ 0.6.
func BenchmarkParallelVsSequential(b *testing.B) {
	const work = 50 * time.Millisecond
	pool, schema := pgtest.NewSchema(b)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(b, err)
	engine, err := saga.New(pool, &saga.Config{Schema: schema, Workers: 4, PollInterval: 100 * time.Millisecond})
	require.NoError(b, err)
	wait := func(ctx context.Context) error {
		select {
		case <-time.After(work):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	step := func(ctx context.Context, _ *saga.StepRun, _ *checkout) error { return wait(ctx) }
	branch := func(name string) saga.Branch[checkout] {
		return saga.Branch[checkout]{Name: name, Action: func(ctx context.Context, _ *saga.StepRun, _ checkout) (any, error) {
			return nil, wait(ctx)
		}}
	}
	par := saga.Define("bench-parallel", saga.Step[checkout]{Name: "both", Parallel: &saga.Parallel[checkout]{
		Branches: []saga.Branch[checkout]{branch("stock"), branch("card")},
		Join:     func(context.Context, *saga.StepRun, *checkout, map[string]json.RawMessage) error { return nil }}})
	seq := saga.Define("bench-sequential",
		saga.Step[checkout]{Name: "stock", Action: step}, saga.Step[checkout]{Name: "card", Action: step})
	require.NoError(b, engine.Register(par, seq))
	require.NoError(b, engine.Start(context.Background()))
	b.Cleanup(func() { _ = engine.Stop(context.Background()) })
	ctx := context.Background()
	run := func(start func() (saga.Started, error)) time.Duration {
		st, err := start()
		require.NoError(b, err)
		in := sagatest.WaitEnded(b, engine, st.ID, &sagatest.WaitOpts{Timeout: 30 * time.Second})
		require.Equal(b, saga.StatusCompleted, in.Status)
		return in.EndedAt.Sub(in.CreatedAt)
	}
	n := max(b.N, 10)
	var ratios []float64
	var pSum, sSum time.Duration
	b.ResetTimer()
	for range n {
		p := run(func() (saga.Started, error) { return saga.Start(ctx, engine, par, checkout{}, nil) })
		s := run(func() (saga.Started, error) { return saga.Start(ctx, engine, seq, checkout{}, nil) })
		pSum, sSum = pSum+p, sSum+s
		ratios = append(ratios, float64(p)/float64(s))
	}
	slices.Sort(ratios)
	b.ReportMetric(float64(pSum.Milliseconds())/float64(n), "parallel-ms")
	b.ReportMetric(float64(sSum.Milliseconds())/float64(n), "sequential-ms")
	b.ReportMetric(ratios[len(ratios)/2], "ratio")
}
