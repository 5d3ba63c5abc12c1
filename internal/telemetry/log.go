package telemetry

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// LogHandler wraps h so that every record logged with a context that
// carries a valid span gets the span's trace_id and span_id attributes.
type LogHandler struct {
	h slog.Handler
}

// Logger returns l with its handler wrapped in a [LogHandler]; a logger
// already wrapped is returned as it is.
func Logger(l *slog.Logger) *slog.Logger {
	if _, ok := l.Handler().(LogHandler); ok {
		return l
	}
	return slog.New(LogHandler{h: l.Handler()})
}

// Enabled reports whether the wrapped handler handles records at level.
func (l LogHandler) Enabled(ctx context.Context, level slog.Level) bool {
	return l.h.Enabled(ctx, level)
}

// Handle adds the trace attributes of ctx's span, if any, and hands r on.
func (l LogHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r = r.Clone()
		r.AddAttrs(slog.String(KeyTraceIDForLog, sc.TraceID().String()), slog.String(KeySpanIDForLog, sc.SpanID().String()))
	}
	return l.h.Handle(ctx, r)
}

// WithAttrs returns a LogHandler over the wrapped handler with attrs.
func (l LogHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return LogHandler{h: l.h.WithAttrs(attrs)}
}

// WithGroup returns a LogHandler over the wrapped handler in group name.
func (l LogHandler) WithGroup(name string) slog.Handler {
	return LogHandler{h: l.h.WithGroup(name)}
}
