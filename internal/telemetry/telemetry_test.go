package telemetry_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/telemetry"
)

func spanContext(t *testing.T, state string) trace.SpanContext {
	t.Helper()
	tid, err := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	require.NoError(t, err)
	sid, err := trace.SpanIDFromHex("b7ad6b7169203331")
	require.NoError(t, err)
	ts, err := trace.ParseTraceState(state)
	require.NoError(t, err)
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts})
}

func TestStoredContextRoundTrips(t *testing.T) {
	t.Parallel()
	for _, state := range []string{"", "vendor=x,other=y z"} {
		sc := spanContext(t, state)
		stored := telemetry.Encode(sc)
		require.NotNil(t, stored)
		want := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		if state != "" {
			want += "\n" + state
		}
		require.Equal(t, want, *stored)
		got := telemetry.Decode(stored)
		require.True(t, got.IsRemote())
		require.True(t, got.Equal(sc.WithRemote(true)), "%v != %v", got, sc)
	}
	require.Nil(t, telemetry.Encode(trace.SpanContext{}))
	require.False(t, telemetry.Decode(nil).IsValid())
}

func TestHeadersRoundTrip(t *testing.T) {
	t.Parallel()
	sc := spanContext(t, "vendor=x")
	h := map[string]string{"other": "kept"}
	telemetry.Inject(trace.ContextWithSpanContext(context.Background(), sc), h)
	require.Equal(t, map[string]string{"other": "kept", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"tracestate": "vendor=x"}, h)
	require.True(t, telemetry.FromMap(h).Equal(sc.WithRemote(true)))
	var hs []kafka.Header
	for k, v := range h {
		hs = append(hs, kafka.Header{Key: k, Value: []byte(v)})
	}
	require.True(t, telemetry.FromKafka(hs).Equal(sc.WithRemote(true)))

	empty := map[string]string{}
	telemetry.Inject(context.Background(), empty)
	require.Empty(t, empty, "no span, no headers")
}

// Whatever a header holds, a malformed trace context is no context, never a
// panic or an error.
func TestMalformedTraceContextIsIgnored(t *testing.T) {
	t.Parallel()
	for _, tp := range []string{
		"", "00", "\x00", strings.Repeat("\x00", 55),
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0\x00",
		"00-0af7651916cd43dd\x00448eb211c80319c-b7ad6b7169203331-01",
		"00-00000000000000000000000000000000-b7ad6b7169203331-01", // zero trace id
		"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", // zero span id
		"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", // forbidden version
		"00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01", // upper case
		strings.Repeat("0", 10240), strings.Repeat("00-", 4000), string(bytes.Repeat([]byte{0xff, 0xfe}, 5000)),
	} {
		require.False(t, telemetry.FromText(tp, strings.Repeat("\x00=,", 3000)).IsValid(), "%q", tp)
		stored := tp + "\n\x00"
		require.False(t, telemetry.Decode(&stored).IsValid(), "%q", tp)
	}
}

func TestLogHandlerAddsTraceIDs(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := telemetry.Logger(slog.New(slog.NewTextHandler(&buf, nil)))
	require.Same(t, l, telemetry.Logger(l), "wrapped once")
	l.With("a", 1).InfoContext(trace.ContextWithSpanContext(context.Background(), spanContext(t, "")), "in a span")
	l.InfoContext(context.Background(), "outside")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 2)
	require.Contains(t, lines[0], "a=1 trace_id=0af7651916cd43dd8448eb211c80319c span_id=b7ad6b7169203331")
	require.NotContains(t, lines[1], "trace_id")
}

// FromText reads traceparents as OpenTelemetry's own propagator does.
func TestFromTextAgreesWithThePropagator(t *testing.T) {
	t.Parallel()
	prop := propagation.TraceContext{}
	for _, tp := range []string{
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03",
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-04",
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
		"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-09-extra",
		"fe-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
		"00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
		"0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
		"00-00000000000000000000000000000000-b7ad6b7169203331-01",
	} {
		for _, ts := range []string{"", "vendor=x", "=,bad"} {
			want := trace.SpanContextFromContext(prop.Extract(context.Background(),
				propagation.MapCarrier{"traceparent": tp, "tracestate": ts}))
			require.True(t, want.Equal(telemetry.FromText(tp, ts)), "%q %q", tp, ts)
		}
	}
}

func TestFromTextDoesNotAllocate(t *testing.T) {
	require.Zero(t, testing.AllocsPerRun(100, func() {
		telemetry.FromText("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "")
	}))
}
