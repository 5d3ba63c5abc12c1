package spantree_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/examples/checkout/spantree"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type state struct{}

// A saga traced through the recorder is one tree: the start at the root
// (under the caller's span), each step attempt under it.
func TestARecordedSagaIsDrawnAsOneTree(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	rec := &spantree.Recorder{}
	e, err := saga.New(pool, &saga.Config{Schema: schema, TracerProvider: rec.Provider("orders"), PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	noop := func(context.Context, *saga.StepRun, *state) error { return nil }
	def := saga.Define("tree", saga.Step[state]{Name: "one", Action: noop}, saga.Step[state]{Name: "two", Action: noop})
	require.NoError(t, e.Register(def))
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Stop(context.Background()) })

	reqCtx, req := rec.Provider("web").Tracer("t").Start(ctx, "POST /orders")
	st, err := saga.Start(reqCtx, e, def, state{}, nil)
	require.NoError(t, err)
	req.End()
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, e, st.ID, nil).Status)

	id := req.SpanContext().TraceID()
	var spans []*spantree.Span
	require.Eventually(t, func() bool { spans = rec.Trace(id); return len(spans) >= 4 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"orders", "web"}, rec.Services(id))
	var out bytes.Buffer
	rec.Draw(&out, id)
	t.Log("\n" + out.String())
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Contains(t, lines[0], "spans across orders, web")
	require.True(t, strings.HasPrefix(lines[1], "└─ POST /orders"), lines[1])
	// Every other span is drawn below the request, indented.
	for _, l := range lines[2:] {
		require.True(t, strings.HasPrefix(l, "   "), "indented under the request: %q", l)
	}
	require.Contains(t, out.String(), "one")
	require.Contains(t, out.String(), "two")
	require.Empty(t, rec.Trace(trace.TraceID{1}), "another trace has nothing")
}
