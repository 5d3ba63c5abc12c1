package saga_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

// BenchmarkConcurrencyKeyOverhead measures what concurrency keys cost when
// no key is contended: the same 3-step saga, without a key and with a key
// of its own per saga (limit 1), alternately, three runs each, each on a
// fresh schema, in one process. ratio is the median of keyed ÷ unkeyed
// steps/s over the pairs; the target is ≥ 0.9.
func BenchmarkConcurrencyKeyOverhead(b *testing.B) {
	const conc, pairs = 8, 3
	steps := max(b.N, 300)
	var plain, keyed, ratios []float64
	for range pairs {
		var rate [2]float64
		for i, k := range []bool{false, true} {
			pool, schema := pgtest.NewSchema(b)
			_, err := migrations.Migrate(context.Background(), pool, schema)
			require.NoError(b, err)
			big := biggerPool(b, pool, conc+4)
			rate[i], _, _ = engineRunKeyed(b, big, schema, conc, steps, saturatingLoad, nil, k)
			big.Close() // the shared server's connections are few
			pool.Close()
		}
		plain, keyed = append(plain, rate[0]), append(keyed, rate[1])
		ratios = append(ratios, rate[1]/rate[0])
	}
	median := func(v []float64) float64 {
		v = slices.Clone(v)
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(median(plain), "nokey_steps/s")
	b.ReportMetric(median(keyed), "keyed_steps/s")
	b.ReportMetric(median(ratios), "ratio")
	b.ReportMetric(slices.Min(ratios), "min_ratio")
}

// BenchmarkPauseTriggerOverhead measures what pause's outbox trigger
// (migration 010) costs when nothing is paused, the usual case: the same
// 3-step saga with the trigger enabled and disabled, alternately, three
// pairs, each on a fresh schema. ratio is the median of enabled ÷ disabled
// steps/s.
func BenchmarkPauseTriggerOverhead(b *testing.B) {
	const conc, pairs = 8, 3
	steps := max(b.N, 300)
	var on, off, ratios []float64
	for range pairs {
		var rate [2]float64
		for i, enabled := range []bool{true, false} {
			pool, schema := pgtest.NewSchema(b)
			_, err := migrations.Migrate(context.Background(), pool, schema)
			require.NoError(b, err)
			if !enabled {
				_, err = pool.Exec(context.Background(), "ALTER TABLE "+pgx.Identifier{schema, "outbox"}.Sanitize()+" DISABLE TRIGGER saga_hold_paused")
				require.NoError(b, err)
			}
			big := biggerPool(b, pool, conc+4)
			rate[i], _, _ = engineRunKeyed(b, big, schema, conc, steps, saturatingLoad, nil, false)
			big.Close()
			pool.Close()
		}
		on, off = append(on, rate[0]), append(off, rate[1])
		ratios = append(ratios, rate[0]/rate[1])
	}
	median := func(v []float64) float64 {
		v = slices.Clone(v)
		slices.Sort(v)
		return v[len(v)/2]
	}
	b.ReportMetric(median(on), "trigger_steps/s")
	b.ReportMetric(median(off), "no_trigger_steps/s")
	b.ReportMetric(median(ratios), "ratio")
}
