package inbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// The consumer continues the trace a message carries; a malformed
// traceparent (NUL bytes, 10 kB of noise, a repeated header) is ignored:
// the message is processed in a new trace, never refused. Its metrics count
// what happened to each message.
func TestConsumerTelemetry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))

	const valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	r := &memReader{}
	add := func(id string, headers ...string) {
		r.add("charge.requested", id, []byte(`{}`))
		m := &r.msgs[len(r.msgs)-1]
		m.HighWaterMark = 10
		for i := 0; i < len(headers); i += 2 {
			m.Headers = append(m.Headers, kafka.Header{Key: headers[i], Value: []byte(headers[i+1])})
		}
	}
	add("m-valid", "traceparent", valid, "tracestate", "vendor=x")
	add("m-nul", "traceparent", "00-0af7651916cd43dd\x00448eb211c80319c-b7ad6b7169203331-01\x00")
	add("m-noise", "traceparent", strings.Repeat("\xff-00-", 2048), "tracestate", strings.Repeat("=,", 5000))
	add("m-repeated", "traceparent", valid, "traceparent", "00-zz")
	add("m-valid", "traceparent", valid) // a duplicate
	r.add("refund.requested", "m-unknown", []byte(`{}`))
	r.msgs[len(r.msgs)-1].HighWaterMark = 10

	var mu sync.Mutex
	seen := map[string]trace.SpanContext{}
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{
		Handlers: map[string]inbox.HandlerFunc{"charge.requested": func(ctx context.Context, _ pgx.Tx, msg inbox.Message) error {
			mu.Lock()
			defer mu.Unlock()
			seen[msg.ID] = trace.SpanContextFromContext(ctx)
			return nil
		}},
		TracerProvider: tp, MeterProvider: mp,
	})
	require.NoError(t, err)
	runConsumer(t, c, func() bool { r.mu.Lock(); defer r.mu.Unlock(); return len(r.committed) == 6 })

	require.Len(t, seen, 4, "every message with a traceparent, malformed or not, was processed once")
	spans := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		spans[s.SpanContext().SpanID()] = s
	}
	require.Len(t, spans, 6, "one span per message")
	for id, sc := range seen {
		s := spans[sc.SpanID()]
		require.NotNil(t, s, id)
		require.Equal(t, "process charge.requested", s.Name())
		switch id {
		case "m-valid":
			require.Equal(t, "0af7651916cd43dd8448eb211c80319c", sc.TraceID().String(), "the message's trace goes on")
			require.Equal(t, "b7ad6b7169203331", s.Parent().SpanID().String())
			require.Equal(t, "vendor=x", sc.TraceState().String())
		case "m-repeated":
			require.False(t, s.Parent().IsValid(), "the last traceparent counts, and it is malformed: a new trace")
		default:
			require.False(t, s.Parent().IsValid(), "%s: a malformed traceparent starts a new trace", id)
			require.NotEqual(t, "0af7651916cd43dd8448eb211c80319c", sc.TraceID().String())
		}
	}

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					require.Equal(t, attribute.NewSet(attribute.String("sagaflow.consumer", "payments")), p.Attributes)
					got[m.Name] += p.Value
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					got[m.Name] += p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					got[m.Name] += int64(p.Count)
				}
			}
		}
	}
	require.Equal(t, map[string]int64{
		"sagaflow.inbox.processed":        4,
		"sagaflow.inbox.duplicates":       1,
		"sagaflow.inbox.dead_letters":     1,
		"sagaflow.inbox.process.duration": 6,
		"sagaflow.consumer.lag":           4, // high watermark 10, last offset 5
	}, got)
}

// A consumer is ready while it runs and its database answers.
func TestConsumerHealth(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := &memReader{}
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{Default: func(context.Context, pgx.Tx, inbox.Message) error { return nil }})
	require.NoError(t, err)
	ctx := context.Background()
	rep := c.Health(ctx)
	require.Equal(t, "inbox consumer payments", rep.Component)
	require.True(t, rep.Live)
	require.False(t, rep.Ready, "not running")
	require.NoError(t, c.Start(ctx))
	rep = c.Health(ctx)
	require.True(t, rep.Ready, "%+v", rep)
	require.NoError(t, c.Stop(ctx))
	require.False(t, c.Health(ctx).Ready)
}

// Right after a database restart the pool still holds connections the
// restart broke, used too recently to be pinged: the database check asks
// again on the next connection instead of reporting the broken one.
func TestConsumerHealthAfterTheDatabaseBrokeThePoolsConnections(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := pgtest.RecentPool(t, 3)
	in, err := inbox.New(pool, &inbox.Config{Consumer: "payments", Schema: b.schema})
	require.NoError(t, err)
	c, err := in.NewConsumer(&memReader{}, &inbox.ConsumerConfig{Default: func(context.Context, pgx.Tx, inbox.Message) error { return nil }})
	require.NoError(t, err)
	require.Equal(t, 3, pgtest.BreakIdle(t, pool))
	rep := c.Health(context.Background())
	require.Equal(t, "database", rep.Checks[1].Name)
	require.True(t, rep.Checks[1].OK, "%+v", rep)
}
