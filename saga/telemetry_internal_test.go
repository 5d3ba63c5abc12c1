package saga

import (
	"context"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/steps"
)

// stepAllocs is the allocations of one step attempt's telemetry: its span
// begun, its outcome's message stamped and its span ended.
func stepAllocs(t *testing.T, cfg Config, traced bool) float64 {
	t.Helper()
	c, err := cfg.withDefaults()
	require.NoError(t, err)
	c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	e := &Engine{cfg: c, log: c.Logger}
	e.tel, err = newEngineTelemetry(e)
	require.NoError(t, err)
	sg := &store.Saga{ID: uuid.New(), Name: "checkout", StepName: "reserve", Direction: string(steps.Forward)}
	if traced {
		sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
		sg.TraceContext = telemetry.Encode(sc)
	}
	bt := &batchTx{e: e}
	ctx := context.Background()
	tr := &store.Transition{Status: string(StatusRunning), History: []store.HistoryEntry{{Event: EventStepCompleted}},
		Messages: []store.Message{{Headers: map[string]string{}}}}
	return testing.AllocsPerRun(200, func() {
		tr.Messages[0].Headers = map[string]string{"sagaflow-type": "x"}
		_ = e.tel.beginStep(ctx, bt, sg, steps.Forward, trace.SpanContext{}, "")
		e.tel.stampStep(bt, sg, tr)
	})
}

// With no provider set (the global no-op ones) or no-op providers, a
// step's telemetry costs a few allocations, whether the saga carries a
// trace context or not.
func TestTelemetryOverheadWithoutProviders(t *testing.T) {
	noop := Config{TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: metricnoop.NewMeterProvider()}
	for _, c := range []struct {
		name   string
		cfg    Config
		traced bool
	}{
		{"global, untraced", Config{}, false},
		{"global, traced", Config{}, true},
		{"no-op, untraced", noop, false},
		{"no-op, traced", noop, true},
	} {
		allocs := stepAllocs(t, c.cfg, c.traced)
		t.Logf("%s: %.0f allocations per step", c.name, allocs)
		require.LessOrEqual(t, allocs, 10.0, c.name)
	}
}

// The engine's observable counters report its counters (Stats), each
// under its own name.
func TestTelemetryObservesTheEngineCounters(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	c, err := (&Config{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}).withDefaults()
	require.NoError(t, err)
	e := &Engine{cfg: c, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	e.tel, err = newEngineTelemetry(e)
	require.NoError(t, err)
	want := map[string]int64{}
	for i, s := range []struct {
		name string
		v    *atomic.Int64
	}{
		{"sagaflow.step.retries", &e.stats.retries}, {"sagaflow.step.deduplicated", &e.stats.dedup},
		{"sagaflow.command.deferrals", &e.stats.deferred}, {"sagaflow.command.parked", &e.stats.parked},
		{"sagaflow.command.stale", &e.stats.stale}, {"sagaflow.saga.rescues", &e.stats.rescued},
		{"sagaflow.step.abandoned", &e.stats.abandoned},
	} {
		s.v.Store(int64(10 + i))
		want[s.name] = int64(10 + i)
	}
	// The gauge of sagas by status reads the database: give it a fresh
	// reading, so that it does not try.
	e.tel.gaugeAt = time.Now()
	e.cfg.SagaGaugeInterval = time.Hour
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, p := range d.DataPoints {
					got[m.Name] += p.Value
				}
			}
		}
	}
	require.Equal(t, want, got)
}

// BenchmarkStepTelemetry measures one step attempt's telemetry alone (its
// span begun, its message stamped, its span ended, its metrics recorded):
// with no provider, with no-op providers, and with the SDK (every span
// sampled, a batching processor, a manual metric reader). Compare ns/op
// with the time of a step (make bench: about 200 µs of a 2-core machine).
func BenchmarkStepTelemetry(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discard{}), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	b.Cleanup(func() {
		_ = tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"none", Config{}},
		{"noop", Config{TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: metricnoop.NewMeterProvider()}},
		{"sdk", Config{TracerProvider: tp, MeterProvider: mp}},
	} {
		b.Run(c.name, func(b *testing.B) {
			cfg, err := c.cfg.withDefaults()
			require.NoError(b, err)
			e := &Engine{cfg: cfg, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
			e.tel, err = newEngineTelemetry(e)
			require.NoError(b, err)
			sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
			sg := &store.Saga{ID: uuid.New(), Name: "checkout", StepName: "reserve", Direction: string(steps.Forward),
				TraceContext: telemetry.Encode(sc)}
			bt := &batchTx{e: e}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				tr := &store.Transition{Status: string(StatusRunning), History: []store.HistoryEntry{{Event: EventStepCompleted}},
					Messages: []store.Message{{Headers: map[string]string{"sagaflow-type": "x"}}}}
				_ = e.tel.beginStep(ctx, bt, sg, steps.Forward, sc, "")
				e.tel.stampStep(bt, sg, tr)
			}
		})
	}
}

// discard is a span exporter that drops what it is given.
type discard struct{}

func (discard) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discard) Shutdown(context.Context) error                             { return nil }
