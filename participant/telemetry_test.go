package participant_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/sagaflow/sagaflow/saga"
)

// One order across three services (orders, inventory, payments), over
// Kafka, is one trace: the caller's span, the saga's start, each step's
// attempt, the relays' publishes, the participants' consumers and handlers
// and the replies, each a child of the one before it across the services.
// The metrics of every part move with it.
func TestTelemetryOneTraceAcrossServices(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	// Kafka mode, so that the engine's own step commands cross the bus too
	// and their publish spans join the trace.
	s := buildSystem(t, true, providers{tp: tp, mp: mp, allSteps: true})

	ctx, caller := tp.Tracer("test").Start(context.Background(), "POST /orders")
	st, err := saga.Start(ctx, s.engine, s.def, checkout{OrderID: "o-traced", Amount: 40}, nil)
	require.NoError(t, err)
	caller.End()
	require.Equal(t, saga.StatusCompleted, s.wait(t, st.ID).Status)

	id := caller.SpanContext().TraceID()
	// one returns the one ended span of the trace named name, waiting for it.
	one := func(name string) sdktrace.ReadOnlySpan {
		t.Helper()
		var found []sdktrace.ReadOnlySpan
		require.Eventually(t, func() bool {
			found = found[:0]
			for _, sp := range rec.Ended() {
				if sp.SpanContext().TraceID() == id && sp.Name() == name {
					found = append(found, sp)
				}
			}
			return len(found) > 0
		}, 30*time.Second, 10*time.Millisecond, "span %q in the order's trace", name)
		require.Len(t, found, 1, "span %q", name)
		return found[0]
	}
	childOf := func(child, parent sdktrace.ReadOnlySpan) {
		t.Helper()
		require.Equal(t, parent.SpanContext().SpanID(), child.Parent().SpanID(), "%q is a child of %q", child.Name(), parent.Name())
	}
	// child returns the one span named name whose parent is parent.
	child := func(parent sdktrace.ReadOnlySpan, name string) sdktrace.ReadOnlySpan {
		t.Helper()
		var found []sdktrace.ReadOnlySpan
		require.Eventually(t, func() bool {
			found = found[:0]
			for _, sp := range rec.Ended() {
				if sp.Parent().SpanID() == parent.SpanContext().SpanID() && sp.Name() == name {
					found = append(found, sp)
				}
			}
			return len(found) > 0
		}, 30*time.Second, 10*time.Millisecond, "span %q under %q", name, parent.Name())
		require.Len(t, found, 1, "span %q under %q", name, parent.Name())
		require.Equal(t, id, found[0].SpanContext().TraceID())
		return found[0]
	}
	outcome := func(sp sdktrace.ReadOnlySpan) string {
		for _, kv := range sp.Attributes() {
			if kv.Key == "sagaflow.step.outcome" {
				return kv.Value.AsString()
			}
		}
		return ""
	}

	start := one("saga start checkout")
	require.Equal(t, caller.SpanContext().SpanID(), start.Parent().SpanID())
	child(start, "publish sagaflow.commands.checkout") // the first command, by the orders relay
	replies := map[string]sdktrace.ReadOnlySpan{}
	for _, c := range []struct{ step, typ, topic string }{
		{"reserve", "inventory.reserve", "inventory.commands"},
		{"charge", "payments.charge", "payments.commands"},
	} {
		step := one("step checkout/" + c.step)
		childOf(step, start)
		require.Equal(t, saga.OutcomeSent, outcome(step))
		child(step, "publish "+c.topic)                             // the orders relay sends the command
		process := child(step, "process "+c.typ)                    // the participant's consumer, across the bus
		handle := child(process, "handle "+c.typ)                   // its handler
		require.Equal(t, "replied", outcome(handle))                //
		child(handle, "publish sagaflow.commands.checkout.replies") // its relay sends the reply
		replies[c.step] = child(handle, "reply checkout/"+c.step)   // the engine applies the reply
		require.Equal(t, saga.OutcomeCompleted, outcome(replies[c.step]))
	}
	// The charge's command was sent in the reserve's reply's transaction
	// (no command of its own crossed the bus): its attempt links to the
	// reply.
	charge := one("step checkout/charge")
	require.Len(t, charge.Links(), 1)
	require.Equal(t, replies["reserve"].SpanContext().SpanID(), charge.Links()[0].SpanContext.SpanID())
	// Every service's relay published into the trace; their batch spans
	// link to the messages.
	var replyPublishes, batchLinks int
	for _, sp := range rec.Ended() {
		if sp.SpanContext().TraceID() == id && sp.Name() == "publish sagaflow.commands.checkout.replies" {
			replyPublishes++
		}
		if sp.Name() == "outbox publish" {
			for _, l := range sp.Links() {
				if l.SpanContext.TraceID() == id {
					batchLinks++
				}
			}
		}
	}
	require.Equal(t, 2, replyPublishes, "inventory's and payments' relays published their replies in the trace")
	require.GreaterOrEqual(t, batchLinks, 5, "the relays' batch spans link to the order's messages")

	// A relay counts a message published once it has marked it, which can
	// be after the saga, having consumed the last reply, completed: collect
	// until the relays' counts are in (seen once in CI: 4 of 5).
	var rm metricdata.ResourceMetrics
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		rm = metricdata.ResourceMetrics{}
		require.NoError(t, reader.Collect(context.Background(), &rm))
		published, _ := sumMetric(rm, "sagaflow.outbox.published")
		durations, _ := sumMetric(rm, "sagaflow.outbox.publish.duration")
		if (published >= 5 && durations >= 3) || time.Now().After(deadline) {
			break
		}
	}
	for _, c := range []struct {
		name string
		min  float64
		kv   []attribute.KeyValue
	}{
		{"sagaflow.step.started", 4, []attribute.KeyValue{attribute.String("sagaflow.saga.name", "checkout")}}, // two sends, two replies
		{"sagaflow.step.completed", 2, []attribute.KeyValue{attribute.String("sagaflow.step.outcome", saga.OutcomeSent)}},
		{"sagaflow.inbox.processed", 1, []attribute.KeyValue{attribute.String("sagaflow.consumer", "inventory")}},
		{"sagaflow.inbox.processed", 1, []attribute.KeyValue{attribute.String("sagaflow.consumer", "payments")}},
		{"sagaflow.participant.commands", 1, []attribute.KeyValue{attribute.String("sagaflow.consumer", "payments"),
			attribute.String("sagaflow.step.outcome", "replied")}},
		{"sagaflow.participant.duration", 2, nil},
		// The first command, two remote commands, two replies (the charge's
		// step command is sent in the reserve's reply's transaction).
		{"sagaflow.outbox.published", 5, nil},
		{"sagaflow.outbox.publish.duration", 3, nil},
		{"sagaflow.saga.duration", 1, nil},
		{"sagaflow.sagas", 1, []attribute.KeyValue{attribute.String("sagaflow.saga.status", "completed")}},
		{"sagaflow.consumer.lag", 0, []attribute.KeyValue{attribute.String("sagaflow.consumer", "engine")}},
	} {
		got, found := sumMetric(rm, c.name, c.kv...)
		require.True(t, found, "metric %s", c.name)
		require.GreaterOrEqual(t, got, c.min, "metric %s %v", c.name, c.kv)
	}
	for _, name := range []string{"sagaflow.outbox.pending", "sagaflow.outbox.oldest_pending.age", "sagaflow.outbox.dead",
		"sagaflow.dead_letters", "sagaflow.consumer.lag"} {
		_, found := sumMetric(rm, name)
		require.True(t, found, "metric %s is reported", name)
	}
}

// sumMetric sums the points of the metric name whose attributes include
// want (for a histogram, its counts); found is false when no point of that
// metric has those attributes.
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
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total, found = total+p.Value, true
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
