package saga_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// traced is a setup whose engine records its spans and metrics in memory.
type traced struct {
	*bundle
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	reader *sdkmetric.ManualReader
}

func setupTraced(t *testing.T, cfg *saga.Config) *traced {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	c := saga.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.TracerProvider, c.MeterProvider = tp, mp
	c.SagaGaugeInterval = time.Millisecond
	return &traced{bundle: setup(t, &c), spans: rec, tp: tp, reader: reader}
}

// ended returns the ended spans of trace id whose name starts with prefix.
func (tr *traced) ended(id trace.TraceID, prefix string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range tr.spans.Ended() {
		if s.SpanContext().TraceID() == id && strings.HasPrefix(s.Name(), prefix) {
			out = append(out, s)
		}
	}
	return out
}

// waitSpans polls until trace id has n ended spans named with prefix.
func (tr *traced) waitSpans(t *testing.T, id trace.TraceID, prefix string, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	var got []sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		got = tr.ended(id, prefix)
		return len(got) >= n
	}, 30*time.Second, 10*time.Millisecond, "%d spans %q in trace %s", n, prefix, id)
	return got
}

func attr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// metricValue sums the points of the metric name whose attributes include
// want; found is false when no point matches.
func (tr *traced) metricValue(t *testing.T, name string, want ...attribute.KeyValue) (float64, bool) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, tr.reader.Collect(context.Background(), &rm))
	return sumMetric(rm, name, want...)
}

func sumMetric(rm metricdata.ResourceMetrics, name string, want ...attribute.KeyValue) (float64, bool) {
	match := func(set attribute.Set) bool {
		for _, kv := range want {
			if v, ok := set.Value(kv.Key); !ok || v != kv.Value {
				return false
			}
		}
		return true
	}
	total, found := 0.0, false
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total, found = total+float64(p.Value), true
					}
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total, found = total+float64(p.Value), true
					}
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total, found = total+float64(p.Count), true
					}
				}
			default:
				panic(fmt.Sprintf("metric %s: unexpected data %T", name, m.Data))
			}
		}
	}
	return total, found
}

// A saga started inside the caller's span is one trace: the start is a
// child of the caller's span, each step attempt a child of the start, and
// a retried attempt links to the attempt it repeats.
func TestTelemetryStepSpansAndRetryLinks(t *testing.T) {
	t.Parallel()
	tr := setupTraced(t, nil)
	var failures atomic.Int32
	def := threeSteps(tr.bundle, "traced", map[string]saga.StepFunc[order]{
		"charge/forward": func(context.Context, *saga.StepRun, *order) error {
			if failures.Add(1) == 1 {
				return steps.WithCode("card_timeout", errors.New("the card network timed out"))
			}
			return nil
		},
	})
	require.NoError(t, tr.engine.Register(def))
	tr.start(t)

	ctx, caller := tr.tp.Tracer("test").Start(context.Background(), "POST /orders")
	st, err := saga.Start(ctx, tr.engine, def, order{OrderID: "o-traced"}, nil)
	require.NoError(t, err)
	caller.End()
	require.Equal(t, saga.StatusCompleted, tr.waitTerminal(t, st.ID).Status)

	id := caller.SpanContext().TraceID()
	starts := tr.waitSpans(t, id, "saga start traced", 1)
	require.Len(t, starts, 1)
	start := starts[0]
	require.Equal(t, caller.SpanContext().SpanID(), start.Parent().SpanID(), "the start is a child of the caller's span")
	require.Equal(t, st.ID.String(), attr(start, "sagaflow.saga.id").AsString())

	stepSpans := tr.waitSpans(t, id, "step traced/", 4)
	require.Len(t, stepSpans, 4, "reserve, charge twice, ship")
	var charges []sdktrace.ReadOnlySpan
	for _, s := range stepSpans {
		require.Equal(t, start.SpanContext().SpanID(), s.Parent().SpanID(), "%s is a child of the saga's start", s.Name())
		require.Equal(t, st.ID.String(), attr(s, "sagaflow.saga.id").AsString())
		require.Equal(t, "traced", attr(s, "sagaflow.saga.name").AsString())
		require.Equal(t, "forward", attr(s, "sagaflow.step.direction").AsString())
		if s.Name() == "step traced/charge" {
			charges = append(charges, s)
		}
	}
	require.Len(t, charges, 2)
	first, second := charges[0], charges[1]
	if attr(first, "sagaflow.step.attempt").AsInt64() != 1 {
		first, second = second, first
	}
	require.EqualValues(t, 1, attr(first, "sagaflow.step.attempt").AsInt64())
	require.Equal(t, saga.OutcomeRetry, attr(first, "sagaflow.step.outcome").AsString())
	require.Equal(t, "card_timeout", attr(first, "sagaflow.error.code").AsString())
	require.EqualValues(t, 2, attr(second, "sagaflow.step.attempt").AsInt64())
	require.Equal(t, saga.OutcomeCompleted, attr(second, "sagaflow.step.outcome").AsString())
	require.Len(t, second.Links(), 1, "the retry links to the attempt it repeats")
	require.Equal(t, first.SpanContext().SpanID(), second.Links()[0].SpanContext.SpanID())

	// The metrics moved with the steps.
	for _, c := range []struct {
		name string
		want float64
		kv   []attribute.KeyValue
	}{
		{"sagaflow.step.started", 4, []attribute.KeyValue{attribute.String("sagaflow.saga.name", "traced")}},
		{"sagaflow.step.started", 2, []attribute.KeyValue{attribute.String("sagaflow.step.name", "charge")}},
		{"sagaflow.step.completed", 3, []attribute.KeyValue{attribute.String("sagaflow.saga.name", "traced")}},
		{"sagaflow.step.failed", 1, []attribute.KeyValue{attribute.String("sagaflow.error.code", "card_timeout"),
			attribute.String("sagaflow.step.name", "charge"), attribute.String("sagaflow.step.direction", "forward")}},
		{"sagaflow.step.duration", 4, nil},
		{"sagaflow.saga.duration", 1, []attribute.KeyValue{attribute.String("sagaflow.saga.status", "completed")}},
		{"sagaflow.step.retries", 1, nil},
		{"sagaflow.sagas", 1, []attribute.KeyValue{attribute.String("sagaflow.saga.name", "traced"), attribute.String("sagaflow.saga.status", "completed")}},
	} {
		got, found := tr.metricValue(t, c.name, c.kv...)
		require.True(t, found, "metric %s", c.name)
		require.Equal(t, c.want, got, "metric %s %v", c.name, c.kv)
	}
}

// A saga started without a span still gets a trace: its start is a new
// root, stored with the saga, and its steps are in it.
func TestTelemetrySagaWithoutSpanGetsATrace(t *testing.T) {
	t.Parallel()
	tr := setupTraced(t, nil)
	def := threeSteps(tr.bundle, "untraced", nil)
	require.NoError(t, tr.engine.Register(def))
	tr.start(t)
	st, err := saga.Start(context.Background(), tr.engine, def, order{OrderID: "o-root"}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, tr.waitTerminal(t, st.ID).Status)

	var start sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range tr.spans.Ended() {
			if s.Name() == "saga start untraced" {
				start = s
				return true
			}
		}
		return false
	}, 30*time.Second, 10*time.Millisecond)
	require.False(t, start.Parent().IsValid(), "a new root")
	id := start.SpanContext().TraceID()
	require.Len(t, tr.waitSpans(t, id, "step untraced/", 3), 3)

	var stored string
	require.NoError(t, tr.pool.QueryRow(context.Background(), "SELECT trace_context FROM "+tr.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&stored))
	require.Equal(t, fmt.Sprintf("00-%s-%s-01", id, start.SpanContext().SpanID()), stored)
}

// A saga whose stored trace context is garbage (NUL bytes, 10 kB of
// noise, a wrong version) runs as any other: its steps start new traces.
func TestTelemetryMalformedStoredContextIsIgnored(t *testing.T) {
	t.Parallel()
	tr := setupTraced(t, nil)
	gate := make(chan struct{})
	def := threeSteps(tr.bundle, "garbled", map[string]saga.StepFunc[order]{
		"reserve/forward": func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			select {
			case <-gate:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		},
	})
	require.NoError(t, tr.engine.Register(def))
	tr.start(t)
	garbage := []string{
		"00-\x00\x00\x00-\x00-01",
		strings.Repeat("zq-", 3500),
		"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"00-00000000000000000000000000000000-b7ad6b7169203331-01\n\x00=\x00",
	}
	var ids []uuid.UUID
	for i, g := range garbage {
		st, err := saga.Start(context.Background(), tr.engine, def, order{OrderID: fmt.Sprint("o-garbled-", i)}, nil)
		require.NoError(t, err)
		// NUL cannot be stored in text: put what PostgreSQL takes.
		_, err = tr.pool.Exec(context.Background(), "UPDATE "+tr.table("saga_instances")+" SET trace_context = $2 WHERE id = $1",
			st.ID, strings.ReplaceAll(g, "\x00", "\u2400"))
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	close(gate)
	for _, id := range ids {
		require.Equal(t, saga.StatusCompleted, tr.waitTerminal(t, id).Status)
	}
}

// A rescued saga's re-drive is a span in the saga's trace, linked to the
// context the lost attempt ran under, and the attempt that repeats the lost
// one links to the rescue. The rescue counter moves.
func TestTelemetryRescueLinks(t *testing.T) {
	t.Parallel()
	tr := setupTraced(t, nil)
	def := threeSteps(tr.bundle, "rescued", nil)
	require.NoError(t, tr.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, tr.engine, def, order{}, nil)
	require.NoError(t, err)
	tr.deleteCommands(t, st.ID) // lost in transit
	tr.overdue(t, st.ID)
	res, err := tr.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Redriven: 1}, res)
	tr.start(t)
	require.Equal(t, saga.StatusCompleted, tr.waitTerminal(t, st.ID).Status)

	var start sdktrace.ReadOnlySpan
	for _, s := range tr.spans.Ended() {
		if s.Name() == "saga start rescued" {
			start = s
		}
	}
	require.NotNil(t, start)
	id := start.SpanContext().TraceID()
	rescue := tr.waitSpans(t, id, "rescue rescued/reserve", 1)[0]
	require.Equal(t, start.SpanContext().SpanID(), rescue.Parent().SpanID())
	require.Len(t, rescue.Links(), 1)
	require.Equal(t, start.SpanContext().SpanID(), rescue.Links()[0].SpanContext.SpanID(), "linked to the context the lost attempt ran under")
	reserve := tr.waitSpans(t, id, "step rescued/reserve", 1)[0]
	require.Len(t, reserve.Links(), 1)
	require.Equal(t, rescue.SpanContext().SpanID(), reserve.Links()[0].SpanContext.SpanID(), "the repeated attempt links to the rescue")
	got, found := tr.metricValue(t, "sagaflow.saga.rescues")
	require.True(t, found)
	require.Equal(t, 1.0, got)
}

// TestTelemetryWaitsAppearAsSpans: the time a saga waited is a span of its
// trace, the wake-up a signal sends links to the sender's span, and the
// attempt that parks the saga says it waits.
func TestTelemetryWaitsAppearAsSpans(t *testing.T) {
	t.Parallel()
	tr := setupTraced(t, nil)
	def := saga.Define("tracedwait",
		saga.Step[order]{Name: "nap", Wait: saga.Sleep[order](time.Hour)},
		saga.Step[order]{Name: "picked", Wait: saga.OnSignal("picked", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
	)
	require.NoError(t, tr.engine.Register(def))
	tr.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, tr.engine, def, order{}, nil)
	require.NoError(t, err)
	in := sagatest.Wait(t, tr.engine, st.ID, sagatest.Cond("sleeping", func(in *saga.Instance) bool { return in.Wait != nil }),
		&sagatest.WaitOpts{Timeout: 20 * time.Second})
	require.NoError(t, sagatest.NewClock(tr.pool, tr.schema, tr.engine).Advance(ctx, time.Hour))
	sagatest.Wait(t, tr.engine, st.ID, sagatest.Step("picked"), &sagatest.WaitOpts{Timeout: 20 * time.Second})
	sagatest.Wait(t, tr.engine, st.ID, sagatest.Cond("awaiting", func(in *saga.Instance) bool { return in.Wait != nil }),
		&sagatest.WaitOpts{Timeout: 20 * time.Second})

	sender, span := tr.tp.Tracer("webhook").Start(ctx, "POST /delivered")
	_, err = tr.engine.Signal(sender, saga.Signal{SagaID: st.ID, Name: "picked"})
	require.NoError(t, err)
	span.End()
	require.Equal(t, saga.StatusCompleted, tr.waitTerminal(t, st.ID).Status)

	var stored string
	require.NoError(t, tr.pool.QueryRow(ctx, "SELECT trace_context FROM "+tr.table("saga_instances")+" WHERE id = $1", st.ID).Scan(&stored))
	id := telemetryTraceID(t, stored)
	waits := tr.waitSpans(t, id, "wait tracedwait/", 2)
	require.Equal(t, "timer", attr(waits[0], "sagaflow.wait.kind").AsString())
	require.Equal(t, saga.EventTimerFired, attr(waits[0], "sagaflow.wait.end").AsString())
	require.False(t, waits[0].StartTime().After(in.UpdatedAt.Add(time.Second)), "the span starts when the saga was parked")
	require.Equal(t, "signal", attr(waits[1], "sagaflow.wait.kind").AsString())
	wakes := tr.waitSpans(t, id, "wake tracedwait/", 1)
	require.Len(t, wakes[0].Links(), 1)
	require.Equal(t, span.SpanContext().SpanID(), wakes[0].Links()[0].SpanContext.SpanID(), "the wake-up links to the sender")
	var waiting int
	for _, s := range tr.ended(id, "step tracedwait/") {
		if attr(s, "sagaflow.step.outcome").AsString() == saga.OutcomeWaiting {
			waiting++
		}
	}
	require.Equal(t, 2, waiting, "each wait was started by an attempt whose outcome is waiting")
}

func telemetryTraceID(t *testing.T, traceparent string) trace.TraceID {
	t.Helper()
	parts := strings.Split(traceparent, "-")
	require.Len(t, parts, 4)
	id, err := trace.TraceIDFromHex(parts[1])
	require.NoError(t, err)
	return id
}
