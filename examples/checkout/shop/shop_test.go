package shop_test

import (
	"bytes"
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestDemoScenarios runs what `make demo` runs and asserts every scenario.
func TestDemoScenarios(t *testing.T) {
	ctx := context.Background()
	var env shop.Env
	for _, d := range []*shop.DB{&env.Orders, &env.Inventory, &env.Payments, &env.Shipping} {
		pool, schema := pgtest.NewSchema(t)
		*d = shop.DB{Pool: pool, Schema: schema}
	}
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, shop.Topics...))
	env.Brokers = kc.Addrs()
	env.Escalation = 2 * time.Second // the "never delivered" order waits this long, in the demo's compressed time
	sys, err := shop.Start(ctx, env)
	require.NoError(t, err)
	t.Cleanup(sys.Stop)
	mw, err := idempotency.New(env.Orders.Pool, &idempotency.Config{Schema: env.Orders.Schema, Required: true, Identity: idempotency.SharedIdentity})
	require.NoError(t, err)
	srv := httptest.NewServer(sys.Handler(mw.Wrap))
	t.Cleanup(srv.Close)

	var out bytes.Buffer
	results, err := sys.Run(ctx, srv.URL, &out)
	require.NoError(t, err)
	t.Log(out.String())
	require.Len(t, results, 9)
	for _, r := range results {
		require.True(t, r.OK, "%s: want %s, got %s", r.Scenario, r.Want, r.Got)
	}
	require.True(t, shop.PrintSummary(&out, results))
}
