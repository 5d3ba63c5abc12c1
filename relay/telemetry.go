package relay

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
)

// GaugeIntervalDefault is the least time between two of the queries behind
// the outbox gauges: a collection sooner than that reports the last values
// again.
const GaugeIntervalDefault = 15 * time.Second

// relayTelemetry is a relay's tracer and instruments.
type relayTelemetry struct {
	r       *Relay
	tracer  trace.Tracer
	latency metric.Float64Histogram

	mu     sync.Mutex
	statAt time.Time
	stat   store.OutboxStatus
}

func newRelayTelemetry(r *Relay) (*relayTelemetry, error) {
	t := &relayTelemetry{r: r, tracer: telemetry.Tracer(r.cfg.TracerProvider)}
	m := telemetry.Meter(r.cfg.MeterProvider)
	var err error
	if t.latency, err = m.Float64Histogram("sagaflow.outbox.publish.duration", metric.WithUnit("s"), telemetry.Seconds(),
		metric.WithDescription("Duration of one publish of a batch of outbox rows to the broker, until it acknowledged.")); err != nil {
		return nil, err
	}
	s := &r.stats
	counters := []struct {
		name, desc string
		v          func() int64
	}{
		{"sagaflow.outbox.published", "Outbox rows this relay published.", s.published.Load},
		{"sagaflow.outbox.retries", "Outbox rows put back for another attempt after a failed publish.", s.retries.Load},
		{"sagaflow.outbox.outage_waits", "Outbox rows put back, without spending an attempt, while the broker was down.", s.outageWaits.Load},
		{"sagaflow.outbox.dead_lettered", "Outbox rows this relay parked as dead.", s.dead.Load},
	}
	obsCounters := make([]metric.Int64ObservableCounter, len(counters))
	instruments := make([]metric.Observable, 0, len(counters)+4)
	for i, c := range counters {
		if obsCounters[i], err = m.Int64ObservableCounter(c.name, metric.WithUnit("{message}"), metric.WithDescription(c.desc)); err != nil {
			return nil, err
		}
		instruments = append(instruments, obsCounters[i])
	}
	pending, err := m.Int64ObservableGauge("sagaflow.outbox.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows waiting to be published, due or waiting for a retry."))
	if err != nil {
		return nil, err
	}
	oldest, err := m.Float64ObservableGauge("sagaflow.outbox.oldest_pending.age", metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest pending outbox row, by the database's clock; 0 when none is pending."))
	if err != nil {
		return nil, err
	}
	dead, err := m.Int64ObservableGauge("sagaflow.outbox.dead", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows parked as dead, by any relay."))
	if err != nil {
		return nil, err
	}
	deadLetters, err := m.Int64ObservableGauge("sagaflow.dead_letters", metric.WithUnit("{message}"),
		metric.WithDescription("Messages consumers dead-lettered that have not been requeued."))
	if err != nil {
		return nil, err
	}
	instruments = append(instruments, pending, oldest, dead, deadLetters)
	_, err = m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		for i, c := range obsCounters {
			o.ObserveInt64(c, counters[i].v())
		}
		if st, ok := t.status(ctx); ok {
			o.ObserveInt64(pending, st.Pending)
			o.ObserveFloat64(oldest, st.OldestPendingAge.Seconds())
			o.ObserveInt64(dead, st.Dead)
			o.ObserveInt64(deadLetters, st.DeadLetters)
		}
		return nil
	}, instruments...)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// status returns the outbox's status, from the database at most every
// GaugeInterval; false when it was never read.
func (t *relayTelemetry) status(ctx context.Context) (store.OutboxStatus, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.statAt.IsZero() && time.Since(t.statAt) < t.r.cfg.GaugeInterval {
		return t.stat, true
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := t.r.st.RelayOutboxStatus(ctx, t.r.pool)
	if err != nil {
		if ctx.Err() == nil {
			t.r.log.WarnContext(ctx, "sagaflow relay could not read the outbox's status for its gauges", slog.Any("error", err))
		}
		return t.stat, !t.statAt.IsZero()
	}
	t.statAt, t.stat = time.Now(), st
	return st, true
}

// publishing is the trace of one publish: a span for the batch, linked to
// each message's trace context, and, per message that has one, a producer
// span in the message's own trace.
type publishing struct {
	t       *relayTelemetry
	started time.Time
	batch   trace.Span
	spans   []trace.Span // parallel to the messages; nil for a message without trace context
}

// publish starts the spans of publishing msgs.
func (t *relayTelemetry) publish(ctx context.Context, msgs []kafka.Message) *publishing {
	p := &publishing{t: t, started: time.Now()}
	_, p.batch = t.tracer.Start(ctx, "outbox publish", trace.WithSpanKind(trace.SpanKindProducer))
	if !p.batch.IsRecording() {
		return p
	}
	p.batch.SetAttributes(telemetry.KeyMessagingSys.String("kafka"), telemetry.KeyMessagingOp.String("send"),
		telemetry.KeyBatchSize.Int(len(msgs)))
	p.spans = make([]trace.Span, len(msgs))
	for i := range msgs {
		sc := telemetry.FromKafka(msgs[i].Headers)
		if !sc.IsValid() {
			continue
		}
		p.batch.AddLink(trace.Link{SpanContext: sc})
		_, p.spans[i] = t.tracer.Start(trace.ContextWithRemoteSpanContext(ctx, sc), "publish "+msgs[i].Topic,
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithLinks(trace.Link{SpanContext: p.batch.SpanContext()}),
			trace.WithAttributes(telemetry.KeyMessagingSys.String("kafka"), telemetry.KeyMessagingOp.String("send"),
				telemetry.KeyDestination.String(msgs[i].Topic),
				telemetry.KeyMessageID.String(headerValue(msgs[i].Headers, store.HeaderMessageID))))
	}
	return p
}

// end ends the spans with each message's outcome (errs is parallel to the
// messages) and records the publish's duration.
func (p *publishing) end(errs []error) {
	elapsed := time.Since(p.started)
	failed := 0
	for i, s := range p.spans {
		if s == nil {
			continue
		}
		if errs[i] != nil {
			s.SetStatus(codes.Error, errs[i].Error())
		}
		s.End()
	}
	for _, err := range errs {
		if err != nil {
			failed++
		}
	}
	if p.batch.IsRecording() {
		p.batch.SetAttributes(attribute.Int("sagaflow.relay.failed", failed))
		if failed > 0 {
			p.batch.SetStatus(codes.Error, "some messages were not published")
		}
	}
	p.batch.End()
	ctx := context.Background()
	if p.t.latency.Enabled(ctx) {
		p.t.latency.Record(ctx, elapsed.Seconds())
	}
}
