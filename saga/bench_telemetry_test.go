package saga_test

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// nowhere is a span exporter that drops what it is given.
type nowhere struct{}

func (nowhere) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (nowhere) Shutdown(context.Context) error                             { return nil }

// BenchmarkStepThroughputTelemetry runs the engine side of
// BenchmarkStepThroughput (conc 8) in three modes, three rounds each,
// interleaved, each mode on a schema of its own: with no provider set (OpenTelemetry's global no-op ones), with
// explicit no-op providers, and with the SDK (every span sampled, a batching
// exporter to nowhere, a meter provider with a manual reader that is never
// collected). Reported: the median engine_steps/s of each mode and the
// ratios of the medians to the one without a provider. The targets: sdk/none >= 0.9, noop/none >=
// 0.98; on a shared 2-core machine one run's noise is of that order, so
// compare several counts (make bench runs 3).
func BenchmarkStepThroughputTelemetry(b *testing.B) {
	const conc = 8
	steps := max(b.N, 300)
	// One schema and pool per mode, kept for its three rounds: the
	// server's connections are shared with other work.
	runner := func() func(mod func(*saga.Config)) float64 {
		pool, schema := pgtest.NewSchema(b)
		_, err := migrations.Migrate(context.Background(), pool, schema)
		require.NoError(b, err)
		big := biggerPool(b, pool, conc+4)
		return func(mod func(*saga.Config)) float64 {
			rate, _, _ := engineRunWith(b, big, schema, conc, steps, saturatingLoad, mod)
			return rate
		}
	}
	runNone, runNoop, runSDK := runner(), runner(), runner()
	noopCfg := func(c *saga.Config) {
		c.TracerProvider, c.MeterProvider = tracenoop.NewTracerProvider(), metricnoop.NewMeterProvider()
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(nowhere{}), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	defer func() {
		require.NoError(b, tp.Shutdown(context.Background()))
		require.NoError(b, mp.Shutdown(context.Background()))
	}()
	sdkCfg := func(c *saga.Config) { c.TracerProvider, c.MeterProvider = tp, mp }
	// Three rounds, the modes interleaved, and the median of each: the
	// machine's other load then weighs on every mode alike.
	var nones, noops, sdks []float64
	for range 3 {
		nones = append(nones, runNone(nil))
		noops = append(noops, runNoop(noopCfg))
		sdks = append(sdks, runSDK(sdkCfg))
	}
	none, noop, sdk := median(nones), median(noops), median(sdks)
	b.ReportMetric(none, "none_steps/s")
	b.ReportMetric(noop, "noop_steps/s")
	b.ReportMetric(sdk, "sdk_steps/s")
	b.ReportMetric(noop/none, "noop/none")
	b.ReportMetric(sdk/none, "sdk/none")
}

// median returns the median of xs, which it sorts.
func median(xs []float64) float64 {
	slices.Sort(xs)
	return xs[len(xs)/2]
}
