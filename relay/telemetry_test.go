package relay_test

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

// The relay's metrics move as it works: rows waiting out an outage, a row
// parked as dead, rows published, the publishes' durations and the
// outbox's gauges. A published row with a trace context gets a producer
// span in its trace, under the batch's span that links to it.
func TestRelayTelemetry(t *testing.T) {
	t.Parallel()
	e := setup(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	w := &outageWriter{errs: []error{io.ErrUnexpectedEOF}, down: true}
	r := e.relay(t, w, relay.Config{PollInterval: 20 * time.Millisecond, OutageBackoffMax: 20 * time.Millisecond,
		TracerProvider: tp, MeterProvider: mp, GaugeInterval: time.Nanosecond})
	const parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	e.insert(t, topicOrders, "k", 1, func(m *store.Message) { m.Headers = map[string]string{"traceparent": parent} })
	e.insert(t, topicOrders, "k", 2)
	e.insert(t, "not a topic!", "k", 3) // parked at once

	metrics := func() map[string]float64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(context.Background(), &rm))
		got := map[string]float64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				switch d := m.Data.(type) {
				case metricdata.Sum[int64]:
					for _, p := range d.DataPoints {
						got[m.Name] += float64(p.Value)
					}
				case metricdata.Gauge[int64]:
					for _, p := range d.DataPoints {
						got[m.Name] += float64(p.Value)
					}
				case metricdata.Gauge[float64]:
					for _, p := range d.DataPoints {
						got[m.Name] += p.Value
					}
				case metricdata.Histogram[float64]:
					for _, p := range d.DataPoints {
						got[m.Name] += float64(p.Count)
					}
				}
			}
		}
		return got
	}
	require.NoError(t, r.Start(e.ctx))
	var got map[string]float64
	require.Eventually(t, func() bool {
		got = metrics()
		return got["sagaflow.outbox.outage_waits"] >= 2 && got["sagaflow.outbox.dead_lettered"] == 1
	}, 30*time.Second, 10*time.Millisecond, "%v", got)
	require.Equal(t, 2.0, got["sagaflow.outbox.pending"])
	require.Equal(t, 1.0, got["sagaflow.outbox.dead"])
	require.Positive(t, got["sagaflow.outbox.oldest_pending.age"])
	require.Zero(t, got["sagaflow.outbox.published"])

	w.mu.Lock()
	w.down = false
	w.mu.Unlock()
	require.Eventually(t, func() bool { got = metrics(); return got["sagaflow.outbox.published"] == 2 }, 30*time.Second, 10*time.Millisecond, "%v", got)
	require.GreaterOrEqual(t, got["sagaflow.outbox.publish.duration"], 2.0, "a failed write and the one that got through")
	require.Zero(t, got["sagaflow.outbox.pending"])
	require.Zero(t, got["sagaflow.outbox.oldest_pending.age"])

	// The traced row: its publish span is in its trace; the batch links to
	// it.
	var publish trace.SpanID
	for _, s := range rec.Ended() {
		if s.Name() == "publish "+topicOrders && s.SpanContext().TraceID().String() == "0af7651916cd43dd8448eb211c80319c" {
			require.Equal(t, "b7ad6b7169203331", s.Parent().SpanID().String())
			publish = s.SpanContext().SpanID()
		}
	}
	require.True(t, publish.IsValid(), "a publish span in the row's trace")
	linked := false
	for _, s := range rec.Ended() {
		for _, l := range s.Links() {
			if s.Name() == "outbox publish" && l.SpanContext.SpanID().String() == "b7ad6b7169203331" {
				linked = true
			}
		}
	}
	require.True(t, linked, "a batch span links to the row's context")
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range w.msgs {
		if string(m.Value) == `{"seq":1}` {
			require.Contains(t, m.Headers, kafka.Header{Key: "traceparent", Value: []byte(parent)}, "the context travels as a Kafka header")
		}
	}
}
