// Package telemetry is sagaflow's one owner of OpenTelemetry plumbing: the
// instrumentation scope, the W3C trace context carried in message headers
// and stored with a saga, and the attribute keys every package uses. It
// depends on the OpenTelemetry API only; users bring the SDK and the
// exporters (see docs/observability.md).
//
// Trace context from the wire is untrusted: whatever a header holds, a
// malformed traceparent is ignored (the span starts a new trace), never an
// error.
package telemetry

import (
	"context"
	"strings"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of every tracer and meter
// sagaflow makes.
const ScopeName = "github.com/sagaflow/sagaflow"

// Headers of the W3C trace context, as sagaflow writes them to outbox rows
// and Kafka messages.
const (
	HeaderTraceParent = "traceparent"
	HeaderTraceState  = "tracestate"
)

// Attribute keys shared by the packages.
const (
	KeySagaName      = attribute.Key("sagaflow.saga.name")
	KeySagaID        = attribute.Key("sagaflow.saga.id")
	KeySagaStatus    = attribute.Key("sagaflow.saga.status")
	KeyStep          = attribute.Key("sagaflow.step.name")
	KeyDirection     = attribute.Key("sagaflow.step.direction")
	KeyAttempt       = attribute.Key("sagaflow.step.attempt")
	KeyOutcome       = attribute.Key("sagaflow.step.outcome")
	KeyErrorCode     = attribute.Key("sagaflow.error.code")
	KeyConsumer      = attribute.Key("sagaflow.consumer")
	KeyMessageType   = attribute.Key("sagaflow.message.type")
	KeyMessageID     = attribute.Key("messaging.message.id")
	KeyDestination   = attribute.Key("messaging.destination.name")
	KeyBatchSize     = attribute.Key("messaging.batch.message_count")
	KeyMessagingSys  = attribute.Key("messaging.system")
	KeyMessagingOp   = attribute.Key("messaging.operation.type")
	KeyPartition     = attribute.Key("messaging.destination.partition.id")
	KeyKafkaOffset   = attribute.Key("messaging.kafka.offset")
	KeyDuplicate     = attribute.Key("sagaflow.message.duplicate")
	KeyDeadLettered  = attribute.Key("sagaflow.message.dead_lettered")
	KeyRelayOutcome  = attribute.Key("sagaflow.relay.outcome")
	KeyTraceIDForLog = "trace_id"
	KeySpanIDForLog  = "span_id"
)

// LagDescription describes the sagaflow.consumer.lag gauge, which the
// engine and inbox consumers both report: one description, so that the
// instruments agree.
const LagDescription = "Messages behind the partition's end at the last message consumed (from the fetch's high watermark)."

// Seconds are the bucket boundaries of sagaflow's duration histograms, in
// seconds (the default boundaries are meant for milliseconds): from 5 ms to
// an hour.
func Seconds() metric.HistogramOption {
	return metric.WithExplicitBucketBoundaries(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10,
		30, 60, 300, 900, 3600)
}

// Tracer returns sagaflow's tracer from tp, or from the global provider
// when tp is nil.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopeName)
}

// Meter returns sagaflow's meter from mp, or from the global provider
// when mp is nil.
func Meter(mp metric.MeterProvider) metric.Meter {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter(ScopeName)
}

// prop is the W3C trace context format: sagaflow always speaks it, whatever
// global propagator the application set, so that services agree.
var prop = propagation.TraceContext{}

// mapCarrier reads and writes a header map.
type mapCarrier map[string]string

func (c mapCarrier) Get(k string) string { return c[k] }
func (c mapCarrier) Set(k, v string)     { c[k] = v }
func (c mapCarrier) Keys() []string {
	out := make([]string, 0, len(c))
	for k := range c {
		out = append(out, k)
	}
	return out
}

// Inject writes the trace context of ctx's span into headers (traceparent
// and, when it has one, tracestate). It writes nothing when ctx has no valid
// span context. headers must not be nil.
func Inject(ctx context.Context, headers map[string]string) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	prop.Inject(ctx, mapCarrier(headers))
}

// InjectSpanContext writes sc into headers, as [Inject] does.
func InjectSpanContext(sc trace.SpanContext, headers map[string]string) {
	if !sc.IsValid() {
		return
	}
	Inject(trace.ContextWithSpanContext(context.Background(), sc), headers)
}

// FromHeaders returns the span context that headers (looked up by get)
// carry: invalid (the zero value) when they carry none or a malformed one.
// The result is marked remote.
func FromHeaders(get func(string) string) trace.SpanContext {
	return FromText(get(HeaderTraceParent), get(HeaderTraceState))
}

// FromMap is [FromHeaders] over a header map.
func FromMap(headers map[string]string) trace.SpanContext {
	return FromText(headers[HeaderTraceParent], headers[HeaderTraceState])
}

// FromKafka is [FromHeaders] over a Kafka message's headers; when a header
// is repeated, the last one counts.
func FromKafka(hs []kafka.Header) trace.SpanContext {
	var parent, state []byte
	for _, h := range hs {
		switch h.Key {
		case HeaderTraceParent:
			parent = h.Value
		case HeaderTraceState:
			state = h.Value
		}
	}
	if len(parent) == 0 {
		return trace.SpanContext{}
	}
	return FromText(string(parent), string(state))
}

// maxVersion is the highest traceparent version; ff is invalid.
const maxVersion = 254

// FromText is [FromHeaders] over a traceparent and a tracestate value. It
// reads them as the W3C Trace Context specification says, as OpenTelemetry's
// propagation.TraceContext does, without allocating: a version above 254, a
// part of the wrong length, anything but lower-case hex, extra fields or
// reserved flags in version 00, or an all-zero id make the traceparent
// invalid. A malformed tracestate is dropped, keeping the traceparent.
func FromText(traceParent, traceState string) trace.SpanContext {
	if traceParent == "" {
		return trace.SpanContext{}
	}
	h := traceParent
	var ver, opts [1]byte
	var scc trace.SpanContextConfig
	if !hexPart(ver[:], &h, 2) || ver[0] > maxVersion || !hexPart(scc.TraceID[:], &h, 32) || !hexPart(scc.SpanID[:], &h, 16) ||
		!hexPart(opts[:], &h, 2) || (ver[0] == 0 && (h != "" || opts[0] > 3)) {
		return trace.SpanContext{}
	}
	scc.TraceFlags = trace.TraceFlags(opts[0]) & (trace.FlagsSampled | trace.FlagsRandom)
	if traceState != "" {
		scc.TraceState, _ = trace.ParseTraceState(traceState)
	}
	scc.Remote = true
	sc := trace.NewSpanContext(scc)
	if !sc.IsValid() {
		return trace.SpanContext{}
	}
	return sc
}

// hexPart decodes the next dash-separated part of *h, which must be n
// lower-case hex digits, into dst, and moves *h past it.
func hexPart(dst []byte, h *string, n int) bool {
	part, rest, _ := strings.Cut(*h, "-")
	*h = rest
	if len(part) != n {
		return false
	}
	for i := 0; i < n; i += 2 {
		hi, ok1 := unhex(part[i])
		lo, ok2 := unhex(part[i+1])
		if !ok1 || !ok2 {
			return false
		}
		dst[i/2] = hi<<4 | lo
	}
	return true
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}

// Encode returns the stored form of sc, as saved with a saga: the
// traceparent value, then, when sc has a trace state, a newline and the
// tracestate value. nil when sc is not valid.
func Encode(sc trace.SpanContext) *string {
	if !sc.IsValid() {
		return nil
	}
	h := make(map[string]string, 2)
	InjectSpanContext(sc, h)
	s := h[HeaderTraceParent]
	if ts := h[HeaderTraceState]; ts != "" {
		s += "\n" + ts
	}
	return &s
}

// Decode reads what [Encode] wrote; nil, or anything malformed, gives the
// invalid span context.
func Decode(stored *string) trace.SpanContext {
	if stored == nil || *stored == "" {
		return trace.SpanContext{}
	}
	parent, state, _ := strings.Cut(*stored, "\n")
	return FromText(parent, state)
}

// Links returns a link to sc, or nil when sc is not valid.
func Links(sc trace.SpanContext) []trace.Link {
	if !sc.IsValid() {
		return nil
	}
	return []trace.Link{{SpanContext: sc}}
}
