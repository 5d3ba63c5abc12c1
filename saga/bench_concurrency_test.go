package saga_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

// side is one side of an overhead benchmark: the saga's shape, and what to
// do to its fresh schema before the run (nil: nothing).
type side struct {
	shape   runShape
	prepare func(pool *pgxpool.Pool, schema string)
}

// overhead runs the benchmark's 3-step saga at concurrency 8 on side with
// and side without, alternately (each pair starting with the other side),
// three pairs, each run on a fresh schema, in one process. It reports the medians of both sides' steps/s under
// withName and withoutName, the median of with ÷ without as ratio, and the
// smallest as min_ratio.
func overhead(b *testing.B, with, without side, withName, withoutName string) {
	const conc, pairs = 8, 3
	steps := max(b.N, 300)
	var rates [2][]float64
	var ratios []float64
	for pair := range pairs {
		var rate [2]float64
		// Each pair runs the other side first: the order does not favour one.
		order := []int{0, 1}
		if pair%2 == 1 {
			order = []int{1, 0}
		}
		for _, i := range order {
			s := []side{with, without}[i]
			pool, schema := pgtest.NewSchema(b)
			_, err := migrations.Migrate(context.Background(), pool, schema)
			require.NoError(b, err)
			if s.prepare != nil {
				s.prepare(pool, schema)
			}
			big := biggerPool(b, pool, conc+4)
			rate[i], _, _ = engineRunShaped(b, big, schema, conc, steps, saturatingLoad, nil, s.shape)
			big.Close() // the shared server's connections are few
			pool.Close()
			rates[i] = append(rates[i], rate[i])
		}
		ratios = append(ratios, rate[0]/rate[1])
	}
	b.ReportMetric(median(rates[0]), withName)
	b.ReportMetric(median(rates[1]), withoutName)
	b.ReportMetric(slices.Min(ratios), "min_ratio")
	b.ReportMetric(median(ratios), "ratio")
}

// BenchmarkConcurrencyKeyOverhead measures what concurrency keys cost when
// no key is contended: the same 3-step saga with a key of its own per saga
// (limit 1) and without a key (see overhead). ratio is the median of
// keyed ÷ unkeyed steps/s over the pairs; the target is ≥ 0.9.
func BenchmarkConcurrencyKeyOverhead(b *testing.B) {
	overhead(b, side{shape: runShape{keyed: true}}, side{}, "keyed_steps/s", "nokey_steps/s")
}

// BenchmarkPauseTriggerOverhead measures what pause's outbox trigger
// (migration 010) costs when nothing is paused, the usual case: the same
// 3-step saga with the trigger enabled and disabled (see overhead). ratio
// is the median of enabled ÷ disabled steps/s.
func BenchmarkPauseTriggerOverhead(b *testing.B) {
	disable := func(pool *pgxpool.Pool, schema string) {
		_, err := pool.Exec(context.Background(), "ALTER TABLE "+pgx.Identifier{schema, "outbox"}.Sanitize()+" DISABLE TRIGGER saga_hold_paused")
		require.NoError(b, err)
	}
	overhead(b, side{}, side{prepare: disable}, "trigger_steps/s", "no_trigger_steps/s")
}

// BenchmarkStatementWatchOverhead measures what the statement watch costs
// (a step's statement on run.Tx is cancelled on the server when the step's
// context ends; see stmtwatch.go): the 3-step saga whose every step runs
// one trivial statement on run.Tx, with the step's context (watched) and
// with context.Background() (not watched; see overhead). A trivial
// statement shows the most the watch can cost a step; the unwatched side
// also skips pgx's own watch of a context that can end. ratio is the
// median of watched ÷ unwatched steps/s.
func BenchmarkStatementWatchOverhead(b *testing.B) {
	overhead(b, side{shape: runShape{stmt: stmtWatched}}, side{shape: runShape{stmt: stmtUnwatched}},
		"watched_steps/s", "unwatched_steps/s")
}
