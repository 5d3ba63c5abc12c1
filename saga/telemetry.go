package saga

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/steps"
)

// SagaGaugeIntervalDefault is the least time between two of the queries
// behind the sagaflow.sagas gauge: a collection sooner than that reports
// the last counts again.
const SagaGaugeIntervalDefault = 15 * time.Second

// Span outcomes: the value of the sagaflow.step.outcome attribute of a
// step attempt's span and of the step metrics.
const (
	OutcomeCompleted    = "completed"
	OutcomeFailed       = "failed"
	OutcomeRetry        = "retry"
	OutcomeSent         = "sent"
	OutcomeDeduplicated = "deduplicated"
	OutcomeCancelled    = "cancelled"
	OutcomeAbandoned    = "abandoned"
	// OutcomeWaiting is an attempt of a step with a Wait that started (or
	// re-armed) the wait: the saga waits now.
	OutcomeWaiting = "waiting"
	// OutcomeStale is an attempt that wrote nothing: its command or reply
	// was stale, malformed or parked.
	OutcomeStale = "stale"
)

// telemetry is an engine's tracer and instruments.
type engineTelemetry struct {
	e      *Engine
	tracer trace.Tracer

	started, completed, failed metric.Int64Counter
	stepDuration, sagaDuration metric.Float64Histogram

	gaugeMu    sync.Mutex
	gaugeAt    time.Time
	gaugeCache []store.StatusCount

	// names caches the spans' names by spanNameKey: a step's span has the
	// same name every time.
	names sync.Map

	// lag is how far behind its partition's end the last command consumed
	// from Kafka was; lagKnown once one was.
	lag      atomic.Int64
	lagKnown atomic.Bool
}

// noteLag records how far behind its partition's end m is (from the
// fetch's high watermark), for the sagaflow.consumer.lag gauge.
func (t *engineTelemetry) noteLag(m kafka.Message) {
	if m.HighWaterMark > 0 {
		t.lag.Store(max(m.HighWaterMark-m.Offset-1, 0))
		t.lagKnown.Store(true)
	}
}

// spanName returns verb + " " + saga + "/" + step, built once.
func (t *engineTelemetry) spanName(verb, saga, step string) string {
	k := spanNameKey{verb, saga, step}
	if n, ok := t.names.Load(k); ok {
		return n.(string)
	}
	n := verb + " " + saga + "/" + step
	t.names.Store(k, n)
	return n
}

// stepSpan is the span of the step attempt a batch runs now.
type stepSpan struct {
	active  bool
	span    trace.Span
	sagaID  uuid.UUID
	name    string // the saga's
	step    string
	dir     steps.Direction
	started time.Time
}

// attrs are the attributes that name the step attempt's saga, step and
// direction, with room for two more.
func (st *stepSpan) attrs() []attribute.KeyValue {
	a := make([]attribute.KeyValue, 3, 5)
	a[0], a[1], a[2] = telemetry.KeySagaName.String(st.name), telemetry.KeyStep.String(st.step), telemetry.KeyDirection.String(string(st.dir))
	return a
}

// spanNameKey names a step attempt's span in the cache of span names.
type spanNameKey struct {
	verb, saga, step string
}

func newEngineTelemetry(e *Engine) (*engineTelemetry, error) {
	t := &engineTelemetry{e: e, tracer: telemetry.Tracer(e.cfg.TracerProvider)}
	m := telemetry.Meter(e.cfg.MeterProvider)
	var err error
	counter := func(name, desc string) metric.Int64Counter {
		c, cerr := m.Int64Counter(name, metric.WithUnit("{step}"), metric.WithDescription(desc))
		if err == nil {
			err = cerr
		}
		return c
	}
	t.started = counter("sagaflow.step.started", "Step attempts started.")
	t.completed = counter("sagaflow.step.completed", "Step attempts that completed (or sent a remote step's command).")
	t.failed = counter("sagaflow.step.failed", "Step attempts that failed, retried or not.")
	if err != nil {
		return nil, err
	}
	if t.stepDuration, err = m.Float64Histogram("sagaflow.step.duration", metric.WithUnit("s"), telemetry.Seconds(),
		metric.WithDescription("Duration of a step attempt, its handler and the decision on its outcome.")); err != nil {
		return nil, err
	}
	if t.sagaDuration, err = m.Float64Histogram("sagaflow.saga.duration", metric.WithUnit("s"), telemetry.Seconds(),
		metric.WithDescription("Time from a saga's start to its end (completed, compensated, failed or cancelled).")); err != nil {
		return nil, err
	}
	s := &e.stats
	obs := []struct {
		name, unit, desc string
		v                func() int64
	}{
		{"sagaflow.step.retries", "{step}", "Failed step attempts that are retried.", s.retries.Load},
		{"sagaflow.step.deduplicated", "{step}", "Steps skipped because their key was in the inbox.", s.dedup.Load},
		{"sagaflow.command.deferrals", "{command}", "Commands deferred because their saga was busy or unknown.", s.deferred.Load},
		{"sagaflow.command.parked", "{command}", "Commands parked as dead.", s.parked.Load},
		{"sagaflow.command.stale", "{command}", "Commands discarded because their saga had moved on.", s.stale.Load},
		{"sagaflow.saga.rescues", "{saga}", "Sagas re-driven by the rescuer after their deadline.", s.rescued.Load},
		{"sagaflow.step.abandoned", "{step}", "Handlers abandoned because they ignored their context.", s.abandoned.Load},
	}
	instruments := make([]metric.Observable, 0, len(obs)+1)
	counters := make([]metric.Int64ObservableCounter, len(obs))
	for i, o := range obs {
		if counters[i], err = m.Int64ObservableCounter(o.name, metric.WithUnit(o.unit), metric.WithDescription(o.desc)); err != nil {
			return nil, err
		}
		instruments = append(instruments, counters[i])
	}
	sagas, err := m.Int64ObservableGauge("sagaflow.sagas", metric.WithUnit("{saga}"),
		metric.WithDescription("Sagas by name and status, from one query at most every SagaGaugeInterval."))
	if err != nil {
		return nil, err
	}
	lag, err := m.Int64ObservableGauge("sagaflow.consumer.lag", metric.WithUnit("{message}"),
		metric.WithDescription(telemetry.LagDescription))
	if err != nil {
		return nil, err
	}
	lagAttrs := metric.WithAttributes(telemetry.KeyConsumer.String("engine"))
	instruments = append(instruments, sagas, lag)
	_, err = m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		for i, c := range counters {
			o.ObserveInt64(c, obs[i].v())
		}
		if t.lagKnown.Load() {
			o.ObserveInt64(lag, t.lag.Load(), lagAttrs)
		}
		for _, sc := range t.sagaCounts(ctx) {
			o.ObserveInt64(sagas, sc.Count, metric.WithAttributes(telemetry.KeySagaName.String(sc.Name), telemetry.KeySagaStatus.String(sc.Status)))
		}
		return nil
	}, instruments...)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// sagaCounts returns the sagas by name and status, from the database at
// most every SagaGaugeInterval. A failed query reports the last counts.
func (t *engineTelemetry) sagaCounts(ctx context.Context) []store.StatusCount {
	t.gaugeMu.Lock()
	defer t.gaugeMu.Unlock()
	if !t.gaugeAt.IsZero() && time.Since(t.gaugeAt) < t.e.cfg.SagaGaugeInterval {
		return t.gaugeCache
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	counts, err := t.e.st.CountSagas(ctx, t.e.pool)
	if err != nil {
		if ctx.Err() == nil {
			t.e.log.WarnContext(ctx, "sagaflow could not count sagas for the sagaflow.sagas gauge", slog.Any("error", err))
		}
		return t.gaugeCache
	}
	t.gaugeAt, t.gaugeCache = time.Now(), counts
	return counts
}

// traceStart starts the span of a saga's start, a child of ctx's span or
// a new trace, stores its context with the saga and puts it in the first
// command's headers. The caller ends the span with [endStart].
func (t *engineTelemetry) traceStart(ctx context.Context, sg *store.Saga, rows *store.Transition) trace.Span {
	_, span := t.tracer.Start(ctx, "saga start "+sg.Name, trace.WithSpanKind(trace.SpanKindProducer))
	if span.IsRecording() {
		span.SetAttributes(telemetry.KeySagaName.String(sg.Name), telemetry.KeySagaID.String(sg.ID.String()))
	}
	sg.TraceContext = telemetry.Encode(span.SpanContext())
	for i := range rows.Messages {
		stamp(&rows.Messages[i], sg.TraceContext)
	}
	return span
}

// endStart ends a start's span.
func endStart(span trace.Span, inserted bool, err error) {
	if span.IsRecording() {
		span.SetAttributes(attribute.Bool("sagaflow.saga.existing", err == nil && !inserted))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}

// stampAll puts the saga's stored trace context in the headers of every
// message of tr, so that every row a saga writes carries its trace (a step
// attempt's span then puts its own context in their place, see
// [engineTelemetry.stampStep]).
func stampAll(tr *store.Transition, stored *string) {
	for i := range tr.Messages {
		stamp(&tr.Messages[i], stored)
	}
}

// stamp puts the stored trace context in m's headers, unless m has one.
func stamp(m *store.Message, stored *string) {
	if stored == nil {
		return
	}
	if m.Headers == nil {
		m.Headers = make(map[string]string, 2)
	}
	if _, ok := m.Headers[telemetry.HeaderTraceParent]; ok {
		return
	}
	parent, state, _ := strings.Cut(*stored, "\n")
	m.Headers[telemetry.HeaderTraceParent] = parent
	if state != "" {
		m.Headers[telemetry.HeaderTraceState] = state
	}
}

// traceStep starts the span of the step attempt that b is about to run for
// sg (see [engineTelemetry.beginStep]), from the command c.
func (b *batch) traceStep(ctx context.Context, c *store.Claimed, sg *store.Saga, dir steps.Direction) context.Context {
	return b.e.tel.beginStep(ctx, b.tx, sg, dir, telemetry.FromText(c.TraceParent, c.TraceState), "")
}

// traceWake starts the span of a wake-up that makes sg's waiting step look
// again; it links to the context of the signal's sender.
func (b *batch) traceWake(ctx context.Context, c *store.Claimed, sg *store.Saga) context.Context {
	return b.e.tel.beginStep(ctx, b.tx, sg, steps.Forward, telemetry.FromText(c.TraceParent, c.TraceState), "wake")
}

// traceWait records, when a wait of sg ends, the time it waited as a span
// from when the saga was parked (its row's last update) to now, a child of
// the saga's start, with what it waited for and how it ended (event).
func (t *engineTelemetry) traceWait(ctx context.Context, sg *store.Saga, event string) {
	if sg.WaitKind == nil {
		return
	}
	parent := telemetry.Decode(sg.TraceContext)
	if parent.IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	_, span := t.tracer.Start(ctx, t.spanName("wait", sg.Name, sg.StepName), trace.WithTimestamp(sg.UpdatedAt))
	if span.IsRecording() {
		span.SetAttributes(telemetry.KeySagaName.String(sg.Name), telemetry.KeySagaID.String(sg.ID.String()),
			telemetry.KeyStep.String(sg.StepName), attribute.String("sagaflow.wait.kind", *sg.WaitKind),
			attribute.String("sagaflow.wait.for", deref(sg.WaitFor)), attribute.String("sagaflow.wait.end", event))
	}
	span.End()
}

// traceReply starts the span of applying a participant's reply to sg.
func (b *batch) traceReply(ctx context.Context, c *store.Claimed, sg *store.Saga, dir steps.Direction) context.Context {
	return b.e.tel.beginStep(ctx, b.tx, sg, dir, telemetry.FromText(c.TraceParent, c.TraceState), "reply")
}

// beginStep starts a step attempt's span and counts the attempt. Its
// parent is the context the saga was started under; it links to the
// context of the message that asked for it (the attempt it repeats, for a
// retry), or, for a reply, continues the participant's span. The span ends
// when the attempt's transition is written ([engineTelemetry.endStep]) or
// when the batch ends without one.
func (t *engineTelemetry) beginStep(ctx context.Context, bt *batchTx, sg *store.Saga, dir steps.Direction, msg trace.SpanContext, kind string) context.Context {
	reply := kind == "reply"
	if bt.attempt.active {
		t.endStep(bt, nil, nil)
	}
	parent := telemetry.Decode(sg.TraceContext)
	var link trace.SpanContext
	if reply && msg.IsValid() {
		parent = msg
	} else if msg.IsValid() && !msg.Equal(parent) {
		link = msg
	}
	pctx := ctx
	if parent.IsValid() {
		pctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	verb := "step"
	switch {
	case kind != "":
		verb = kind
	case dir == steps.Compensate:
		verb = "compensate"
	}
	var opts []trace.SpanStartOption
	if link.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: link}))
	}
	ctx, span := t.tracer.Start(pctx, t.spanName(verb, sg.Name, sg.StepName), opts...)
	bt.attempt = stepSpan{active: true, span: span, sagaID: sg.ID, name: sg.Name, step: sg.StepName, dir: dir, started: time.Now()}
	st := &bt.attempt
	if span.IsRecording() {
		span.SetAttributes(append(st.attrs(), telemetry.KeySagaID.String(sg.ID.String()), telemetry.KeyAttempt.Int(sg.Attempt+1))...)
	}
	if t.started.Enabled(ctx) {
		t.started.Add(ctx, 1, metric.WithAttributes(st.attrs()...))
	}
	return withStepLog(ctx, t.e.log, sg, dir)
}

// stampStep puts the trace context of the running step attempt (or the
// saga's own, outside one) into every message of tr, and, when tr is the
// running attempt's outcome, ends its span.
func (t *engineTelemetry) stampStep(bt *batchTx, sg *store.Saga, tr *store.Transition) {
	st := &bt.attempt
	bt.stamped = trace.SpanContext{}
	if !st.active || st.sagaID != sg.ID {
		stampAll(tr, sg.TraceContext)
		return
	}
	if !st.span.IsRecording() {
		// Not traced here: the saga's own context, if any, travels on
		// (the span of a no-op tracer has it anyway), without encoding it
		// again.
		stampAll(tr, sg.TraceContext)
		t.endStep(bt, sg, tr)
		return
	}
	// The attempt's context replaces the saga's, which the transition
	// carries already.
	sc := st.span.SpanContext()
	bt.stamped = sc
	for i := range tr.Messages {
		m := &tr.Messages[i]
		if m.Headers == nil {
			m.Headers = make(map[string]string, 2)
		}
		telemetry.InjectSpanContext(sc, m.Headers)
	}
	t.endStep(bt, sg, tr)
}

// lastStamped is the context of the step attempt whose transition bt
// wrote last, when that attempt was traced here: what the transition's
// messages carry instead of the saga's own context (see
// [engineTelemetry.stampStep]).
func (t *engineTelemetry) lastStamped(bt *batchTx) trace.SpanContext {
	return bt.stamped
}

// endStepWith ends the running step attempt's span with the outcome tr
// records, as [engineTelemetry.stampStep] would, for an attempt whose
// transition is written together with the next attempt's. It returns the
// attempt's context when it was traced here (for the next attempt to link
// to), else an invalid one.
func (t *engineTelemetry) endStepWith(bt *batchTx, sg *store.Saga, tr *store.Transition) trace.SpanContext {
	st := &bt.attempt
	if !st.active || st.sagaID != sg.ID {
		return trace.SpanContext{}
	}
	var sc trace.SpanContext
	if st.span.IsRecording() {
		sc = st.span.SpanContext()
	}
	t.endStep(bt, sg, tr)
	return sc
}

// endStep ends the running step attempt's span with the outcome tr
// records and records its metrics. A nil tr means the attempt wrote no
// transition: its handler was abandoned (the batch's connection was given
// up), or its command turned out stale, malformed or parked.
func (t *engineTelemetry) endStep(bt *batchTx, sg *store.Saga, tr *store.Transition) {
	st := bt.attempt
	if !st.active {
		return
	}
	bt.attempt = stepSpan{}
	ctx := context.Background()
	outcome, code, errText := OutcomeStale, "", ""
	switch {
	case tr != nil:
		outcome, code, errText = stepOutcome(tr)
	case bt.abandoned:
		outcome, code, errText = OutcomeAbandoned, CodeAbandonedRunOn, "the handler ignored its context; its worker abandoned it"
	}
	elapsed := time.Since(st.started)
	span := st.span
	if span.IsRecording() {
		span.SetAttributes(telemetry.KeyOutcome.String(outcome))
		if code != "" {
			span.SetAttributes(telemetry.KeyErrorCode.String(code))
		}
		if errText != "" {
			span.SetStatus(codes.Error, errText)
		}
	}
	span.End()
	if outcome == OutcomeStale {
		return
	}
	failed := outcome == OutcomeFailed || outcome == OutcomeRetry || outcome == OutcomeAbandoned
	c := t.completed
	if failed {
		c = t.failed
	}
	if c.Enabled(ctx) || t.stepDuration.Enabled(ctx) {
		attrs := append(st.attrs(), telemetry.KeyOutcome.String(outcome))
		if failed {
			attrs = append(attrs, telemetry.KeyErrorCode.String(code))
		}
		set := metric.WithAttributeSet(attribute.NewSet(attrs...))
		c.Add(ctx, 1, set)
		t.stepDuration.Record(ctx, elapsed.Seconds(), set)
	}
	if sg != nil && tr != nil && Status(tr.Status).Terminal() && !sg.CreatedAt.IsZero() && t.sagaDuration.Enabled(ctx) {
		// The app's clock against the database's: a duration for a
		// histogram, never a decision.
		t.sagaDuration.Record(ctx, time.Since(sg.CreatedAt).Seconds(), metric.WithAttributes(
			telemetry.KeySagaName.String(sg.Name), telemetry.KeySagaStatus.String(tr.Status)))
	}
}

// traceRescue records the rescuer's re-drive (or fail-over) of sg as a
// span: a child of the saga's start that links to it, the context the lost
// attempt ran under. The messages of tr carry the span on, so the attempt
// that repeats the lost one links to the rescue.
func (t *engineTelemetry) traceRescue(ctx context.Context, sg *store.Saga, tr *store.Transition, failOver bool) {
	parent := telemetry.Decode(sg.TraceContext)
	if parent.IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	_, span := t.tracer.Start(ctx, t.spanName("rescue", sg.Name, sg.StepName), trace.WithLinks(telemetry.Links(parent)...))
	if span.IsRecording() {
		span.SetAttributes(telemetry.KeySagaName.String(sg.Name), telemetry.KeySagaID.String(sg.ID.String()),
			telemetry.KeyStep.String(sg.StepName), telemetry.KeyDirection.String(sg.Direction),
			attribute.Bool("sagaflow.rescue.fail_over", failOver))
		sc := span.SpanContext()
		for i := range tr.Messages {
			m := &tr.Messages[i]
			if m.Headers == nil {
				m.Headers = make(map[string]string, 2)
			}
			telemetry.InjectSpanContext(sc, m.Headers)
		}
	}
	span.End()
}

// stepOutcome reads a step attempt's outcome from its transition's history:
// the outcome, the error code and the error text of a failure.
func stepOutcome(tr *store.Transition) (outcome, code, errText string) {
	outcome = OutcomeCompleted
	for i := range tr.History {
		h := &tr.History[i]
		switch h.Event {
		case EventStepFailed:
			outcome, code, errText = OutcomeFailed, h.ErrorCode, h.Error
			if len(tr.Messages) > 0 && tr.Status == string(StatusRunning) && tr.StepName == h.StepName && tr.Direction == h.Direction {
				outcome = OutcomeRetry
			}
			return outcome, code, errText
		case EventSagaFailed:
			return OutcomeFailed, h.ErrorCode, h.Error
		case EventSagaCancelled:
			return OutcomeCancelled, "", ""
		case EventStepDeduplicated:
			return OutcomeDeduplicated, "", ""
		case EventCommandSent:
			return OutcomeSent, "", ""
		case EventWaitStarted:
			return OutcomeWaiting, "", ""
		}
	}
	if tr.WaitKind != "" && tr.SetWaitUntil {
		return OutcomeWaiting, "", ""
	}
	return outcome, "", ""
}

// stepLogKey is the context key of a step's logger.
type stepLogKey struct{}

// stepLog builds a step's logger when it is asked for.
type stepLog struct {
	base      *slog.Logger
	sagaID    uuid.UUID
	name      string
	step      string
	direction steps.Direction
	attempt   int
}

func withStepLog(ctx context.Context, base *slog.Logger, sg *store.Saga, dir steps.Direction) context.Context {
	return context.WithValue(ctx, stepLogKey{}, &stepLog{base: base, sagaID: sg.ID, name: sg.Name, step: sg.StepName,
		direction: dir, attempt: sg.Attempt + 1})
}

// Logger returns the logger for a step handler that runs with ctx: the
// engine's Config.Logger with the saga's id and name, the step, its
// direction and attempt, and, on every record logged with a context that
// carries a span (ctx does, when tracing is on), its trace_id and span_id.
// Outside a step it returns the default logger with trace ids.
func Logger(ctx context.Context) *slog.Logger {
	l, _ := ctx.Value(stepLogKey{}).(*stepLog)
	if l == nil {
		return telemetry.Logger(slog.Default())
	}
	return l.base.With(slog.String("saga_id", l.sagaID.String()), slog.String("saga", l.name),
		slog.String("step", l.step), slog.String("direction", string(l.direction)), slog.Int("attempt", l.attempt))
}
