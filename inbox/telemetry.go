package inbox

import (
	"context"
	"strconv"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/telemetry"
)

// consumerTelemetry is a consumer's tracer and instruments.
type consumerTelemetry struct {
	tracer                      trace.Tracer
	processed, duplicates, dead metric.Int64Counter
	duration                    metric.Float64Histogram
	attrs                       metric.MeasurementOption // the consumer's name
	lag                         atomic.Int64
	lagKnown                    atomic.Bool
	consumer                    string
}

func newConsumerTelemetry(consumer string, cfg *ConsumerConfig) (*consumerTelemetry, error) {
	t := &consumerTelemetry{tracer: telemetry.Tracer(cfg.TracerProvider), consumer: consumer,
		attrs: metric.WithAttributeSet(attribute.NewSet(telemetry.KeyConsumer.String(consumer)))}
	m := telemetry.Meter(cfg.MeterProvider)
	var err error
	counter := func(name, desc string) metric.Int64Counter {
		c, cerr := m.Int64Counter(name, metric.WithUnit("{message}"), metric.WithDescription(desc))
		if err == nil {
			err = cerr
		}
		return c
	}
	t.processed = counter("sagaflow.inbox.processed", "Messages processed: their handler ran and its transaction committed.")
	t.duplicates = counter("sagaflow.inbox.duplicates", "Messages skipped because their id was in the inbox.")
	t.dead = counter("sagaflow.inbox.dead_letters", "Messages dead-lettered by the consumer.")
	if err != nil {
		return nil, err
	}
	if t.duration, err = m.Float64Histogram("sagaflow.inbox.process.duration", metric.WithUnit("s"), telemetry.Seconds(),
		metric.WithDescription("Time to deal with one message, retries included.")); err != nil {
		return nil, err
	}
	lag, err := m.Int64ObservableGauge("sagaflow.consumer.lag", metric.WithUnit("{message}"),
		metric.WithDescription(telemetry.LagDescription))
	if err != nil {
		return nil, err
	}
	if _, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		if t.lagKnown.Load() {
			o.ObserveInt64(lag, t.lag.Load(), t.attrs)
		}
		return nil
	}, lag); err != nil {
		return nil, err
	}
	return t, nil
}

// msgRecord collects what happened to one message, for its span and
// metrics.
type msgRecord struct {
	duplicate bool
	dead      string
}

type msgRecordKey struct{}

// noteDuplicate records that ctx's message was a duplicate.
func noteDuplicate(ctx context.Context) {
	if r, _ := ctx.Value(msgRecordKey{}).(*msgRecord); r != nil {
		r.duplicate = true
	}
}

// noteDead records that ctx's message was dead-lettered for reason.
func noteDead(ctx context.Context, reason string) {
	if r, _ := ctx.Value(msgRecordKey{}).(*msgRecord); r != nil {
		r.dead = reason
	}
}

// traced deals with msg (see [Consumer.handle]) inside a consumer span: a
// child of the trace context the message carries, or a new trace when it
// carries none or a malformed one.
func (c *Consumer) traced(fetch, ctx context.Context, msg Message, highWaterMark int64) bool {
	tr := c.beginTrace(ctx, msg)
	done := c.handle(fetch, tr.ctx, msg)
	tr.end(c, done, "given up at a stop; the message comes again", highWaterMark)
	return done
}

// msgTrace is the span, record and clock of one message being dealt with.
type msgTrace struct {
	ctx     context.Context // the span's, carrying the record
	span    trace.Span
	rec     *msgRecord
	msg     *Message
	started time.Time
}

func (c *Consumer) beginTrace(ctx context.Context, msg Message) *msgTrace {
	t := c.tel
	started := time.Now()
	pctx := ctx
	if sc := telemetry.FromMap(msg.Headers); sc.IsValid() {
		pctx = trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	name := "process"
	if msg.Type != "" {
		name = "process " + msg.Type
	}
	sctx, span := t.tracer.Start(pctx, name, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(telemetry.KeyMessagingSys.String("kafka"), telemetry.KeyMessagingOp.String("process"),
			telemetry.KeyDestination.String(msg.Topic), telemetry.KeyPartition.String(strconv.Itoa(msg.Partition)),
			telemetry.KeyKafkaOffset.Int64(msg.Offset), telemetry.KeyConsumer.String(t.consumer),
			telemetry.KeyMessageID.String(logText(msg.ID)), telemetry.KeyMessageType.String(logText(msg.Type)))
	}
	rec := &msgRecord{}
	return &msgTrace{ctx: context.WithValue(sctx, msgRecordKey{}, rec), span: span, rec: rec, msg: &msg, started: started}
}

// end ends the message's span and, when it was dealt with (done), records
// its metrics; notDone is the span's error when it was not.
func (tr *msgTrace) end(c *Consumer, done bool, notDone string, highWaterMark int64) {
	t := c.tel
	rec, span := tr.rec, tr.span
	if span.IsRecording() {
		span.SetAttributes(telemetry.KeyDuplicate.Bool(rec.duplicate), telemetry.KeyDeadLettered.Bool(rec.dead != ""))
		switch {
		case rec.dead != "":
			span.SetStatus(codes.Error, "dead-lettered: "+logText(rec.dead))
		case !done:
			span.SetStatus(codes.Error, notDone)
		}
	}
	span.End()
	if !done {
		return
	}
	bg := context.Background()
	switch {
	case rec.dead != "":
		t.dead.Add(bg, 1, t.attrs)
	case rec.duplicate:
		t.duplicates.Add(bg, 1, t.attrs)
	default:
		t.processed.Add(bg, 1, t.attrs)
	}
	if t.duration.Enabled(bg) {
		t.duration.Record(bg, time.Since(tr.started).Seconds(), t.attrs)
	}
	if highWaterMark > 0 {
		t.lag.Store(max(highWaterMark-tr.msg.Offset-1, 0))
		t.lagKnown.Store(true)
	}
}
