package shop_test

import (
	"bytes"
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestDemoScenarios runs what `make demo` runs and asserts every scenario.
func TestDemoScenarios(t *testing.T) {
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, shop.Topics...))
	runScenarios(t, shop.Env{Brokers: kc.Addrs()})
}

// TestDemoScenariosOverNATS runs them over NATS JetStream (what `make
// demo/nats` runs), on a throwaway nats-server.
func TestDemoScenariosOverNATS(t *testing.T) {
	if _, err := natstest.Binary(); err != nil {
		t.Skip(err)
	}
	srv := natstest.Start(t)
	nc, err := nats.Connect(srv.URL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	require.NoError(t, err)
	require.NoError(t, shop.SetupNATS(context.Background(), js))
	runScenarios(t, shop.Env{Bus: shop.NATSBus{JS: js, URL: srv.URL()}})
}

// runScenarios starts the system on env, with a schema per service, runs
// every scenario and asserts it.
func runScenarios(t *testing.T, env shop.Env) {
	ctx := context.Background()
	for _, d := range []*shop.DB{&env.Orders, &env.Inventory, &env.Payments, &env.Shipping} {
		pool, schema := pgtest.NewSchema(t)
		*d = shop.DB{Pool: pool, Schema: schema}
	}
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
