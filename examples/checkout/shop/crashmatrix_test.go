package shop_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// TestCheckoutUnderTheCrashMatrix crashes the order service's engine at
// each commit boundary while it runs checkouts that complete, run out of
// stock, and cannot be shipped (refund and release), restarts it, and
// counts the participants' rows: each reservation, charge, refund, release
// and shipment must be there exactly as often as the saga says its step
// completed. The order service's own steps (accept, confirm) set a status,
// which cannot be counted; their steps are not checked here.
func TestCheckoutUnderTheCrashMatrix(t *testing.T) {
	ctx := context.Background()
	var env shop.Env
	for _, d := range []*shop.DB{&env.Orders, &env.Inventory, &env.Payments, &env.Shipping} {
		pool, schema := pgtest.NewSchema(t)
		*d = shop.DB{Pool: pool, Schema: schema}
	}
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, shop.Topics...))
	env.Brokers = kc.Addrs()
	sys, err := shop.Start(ctx, env)
	require.NoError(t, err)
	t.Cleanup(sys.Stop)
	// The checkout saga waits for the warehouse (which publishes by itself)
	// and the carrier's webhook: serve it.
	mw, err := idempotency.New(env.Orders.Pool, &idempotency.Config{Schema: env.Orders.Schema, Required: true, Identity: idempotency.SharedIdentity})
	require.NoError(t, err)
	srv := httptest.NewServer(sys.Handler(mw.Wrap))
	t.Cleanup(srv.Close)
	sys.Carrier.SetWebhook(srv.URL + shop.WebhookPath)
	table := func(d shop.DB, name string) string { return pgx.Identifier{d.Schema, name}.Sanitize() }
	start := func(ctx context.Context, e *saga.Engine, o shop.Order) (uuid.UUID, error) {
		var id uuid.UUID
		err := pgx.BeginFunc(ctx, env.Orders.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+table(env.Orders, "orders")+" (id, sku, qty, amount, address, status) VALUES ($1, $2, $3, $4, $5, 'placed')",
				o.ID, o.SKU, o.Qty, o.Amount, o.Address); err != nil {
				return err
			}
			st, err := saga.StartTx(ctx, e, tx, sys.Checkout, o, &saga.StartOpts{BusinessKey: o.ID})
			id = st.ID
			return err
		})
		return id, err
	}
	// The matrix runs the order service's engine: the one Start made steps
	// aside once it has run an order (a Kafka reader that is still joining
	// its group is slow to close); the relays and the participants keep
	// running.
	id, err := start(ctx, sys.Engine, shop.Order{ID: "warm-up", SKU: "book", Qty: 1, Amount: 30, Address: "1 Main St"})
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, sagatest.WaitEnded(t, sys.Engine, id, nil).Status)
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, sys.Engine.Stop(stopCtx))

	orders := map[uuid.UUID]string{} // saga ID → order ID
	opts := &sagatest.CrashOpts{
		Config: &saga.Config{Schema: env.Orders.Schema, Workers: 2,
			Kafka: &saga.KafkaConfig{Brokers: env.Brokers, ReplyTopic: shop.TopicReplies}},
		Start: func(ctx context.Context, e *saga.Engine, b sagatest.Round, i int) (uuid.UUID, error) {
			o := shop.Order{ID: fmt.Sprintf("%s-%d", b, i), SKU: "book", Qty: 1, Amount: 30, Address: "1 Main St"}
			switch i % 4 {
			case 2:
				o.SKU = "lamp" // out of stock: compensated after reserve fails
			case 3:
				o.Address = "nowhere" // cannot be shipped: refund and release
			}
			id, err := start(ctx, e, o)
			orders[id] = o.ID
			return id, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			order := orders[in.ID]
			got := map[sagatest.Effect]int{}
			for e, q := range map[sagatest.Effect]struct {
				db    shop.DB
				query string
			}{
				{Step: "reserve"}:                     {env.Inventory, "SELECT count(*) FROM " + table(env.Inventory, "reservations") + " WHERE order_id = $1"},
				{Step: "reserve", Compensation: true}: {env.Inventory, "SELECT count(*) FROM " + table(env.Inventory, "reservations") + " WHERE order_id = $1 AND released"},
				{Step: "charge"}:                      {env.Payments, "SELECT count(*) FROM " + table(env.Payments, "payments") + " WHERE order_id = $1"},
				{Step: "charge", Compensation: true}:  {env.Payments, "SELECT count(*) FROM " + table(env.Payments, "payments") + " WHERE order_id = $1 AND refunded"},
				{Step: "ship"}:                        {env.Shipping, "SELECT count(*) FROM " + table(env.Shipping, "shipments") + " WHERE order_id = $1"},
			} {
				var n int
				if err := q.db.Pool.QueryRow(ctx, q.query, order).Scan(&n); err != nil {
					return nil, fmt.Errorf("count %s of order %s: %w", e, order, err)
				}
				got[e] = n
			}
			return got, nil
		},
	}
	began := time.Now()
	sagatest.CrashMatrix(t, env.Orders.Pool, sys.Checkout, opts)
	t.Logf("the crash matrix of the checkout saga took %s", time.Since(began).Round(time.Millisecond))
}
