package participant

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/wire"
)

// Outcomes of a participant's handler: the sagaflow.step.outcome attribute
// of its span and of the sagaflow.participant.commands metric.
const (
	OutcomeReplied = "replied"
	OutcomeRefused = "refused"
	OutcomeError   = "error"
)

// participantTelemetry is a participant's tracer and instruments.
type participantTelemetry struct {
	tracer   trace.Tracer
	consumer string
	handled  metric.Int64Counter
	duration metric.Float64Histogram
}

func newParticipantTelemetry(c *Config) (*participantTelemetry, error) {
	t := &participantTelemetry{tracer: telemetry.Tracer(c.TracerProvider), consumer: c.Consumer}
	m := telemetry.Meter(c.MeterProvider)
	var err error
	if t.handled, err = m.Int64Counter("sagaflow.participant.commands", metric.WithUnit("{command}"),
		metric.WithDescription("Saga commands a participant's handlers dealt with, by type and outcome.")); err != nil {
		return nil, err
	}
	if t.duration, err = m.Float64Histogram("sagaflow.participant.duration", metric.WithUnit("s"), telemetry.Seconds(),
		metric.WithDescription("Duration of a participant's handler, with its reply.")); err != nil {
		return nil, err
	}
	return t, nil
}

// handling is what a traced handler learnt about its command.
type handling struct {
	refused string // the refusal's code, when the handler refused
}

type handlingKey struct{}

// noteReply records, for the running handler's span, the reply it sends;
// the last reply of a handler is its outcome.
func noteReply(ctx context.Context, r wire.Reply) {
	if h, _ := ctx.Value(handlingKey{}).(*handling); h != nil {
		h.refused = ""
		if !r.OK {
			h.refused = r.Code
			if h.refused == "" {
				h.refused = "refused"
			}
		}
	}
}

// traced wraps a command type's handler in a span: a child of the span in
// ctx (the inbox consumer's, which continues the command's trace), or,
// when ctx has none, of the trace context the command carries. Its reply
// carries the span's context on (see [Participant.writeReply]).
func (t *participantTelemetry) traced(commandType string, fn inbox.HandlerFunc) inbox.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		started := time.Now()
		if !trace.SpanContextFromContext(ctx).IsValid() {
			if sc := telemetry.FromMap(msg.Headers); sc.IsValid() {
				ctx = trace.ContextWithRemoteSpanContext(ctx, sc)
			}
		}
		ctx, span := t.tracer.Start(ctx, "handle "+commandType, trace.WithSpanKind(trace.SpanKindServer))
		if span.IsRecording() {
			span.SetAttributes(telemetry.KeyConsumer.String(t.consumer), telemetry.KeyMessageType.String(commandType),
				telemetry.KeyMessageID.String(safetext.Text(msg.ID, 200)),
				attribute.String("sagaflow.step.key", safetext.Text(msg.Headers[wire.HeaderStepKey], 600)))
		}
		h := &handling{}
		err := fn(context.WithValue(ctx, handlingKey{}, h), tx, msg)
		outcome := OutcomeReplied
		switch {
		case err != nil:
			outcome = OutcomeError
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		case h.refused != "":
			outcome = OutcomeRefused
			span.SetAttributes(telemetry.KeyErrorCode.String(h.refused))
		}
		if span.IsRecording() {
			span.SetAttributes(telemetry.KeyOutcome.String(outcome))
		}
		span.End()
		bg := context.Background()
		if t.handled.Enabled(bg) || t.duration.Enabled(bg) {
			set := metric.WithAttributeSet(attribute.NewSet(telemetry.KeyConsumer.String(t.consumer),
				telemetry.KeyMessageType.String(commandType), telemetry.KeyOutcome.String(outcome)))
			t.handled.Add(bg, 1, set)
			t.duration.Record(bg, time.Since(started).Seconds(), set)
		}
		return err
	}
}
