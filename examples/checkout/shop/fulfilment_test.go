package shop_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

// bundle is what a fulfilment test needs: the system with the warehouse
// and the carrier silenced (the test sends their events), its order API,
// and the brokers.
type bundle struct {
	env  shop.Env
	sys  *shop.System
	base string
}

func setup(t *testing.T) *bundle {
	t.Helper()
	ctx := context.Background()
	var env shop.Env
	for _, d := range []*shop.DB{&env.Orders, &env.Inventory, &env.Payments, &env.Shipping} {
		pool, schema := pgtest.NewSchema(t)
		*d = shop.DB{Pool: pool, Schema: schema}
	}
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, shop.Topics...))
	env.Brokers = kc.Addrs()
	sys, err := shop.Start(ctx, env) // Escalation: the real 48 hours
	require.NoError(t, err)
	t.Cleanup(sys.Stop)
	sys.ManualFulfilment.Store(true)
	mw, err := idempotency.New(env.Orders.Pool, &idempotency.Config{Schema: env.Orders.Schema, Required: true, Identity: idempotency.SharedIdentity})
	require.NoError(t, err)
	srv := httptest.NewServer(sys.Handler(mw.Wrap))
	t.Cleanup(srv.Close)
	return &bundle{env: env, sys: sys, base: srv.URL}
}

// place posts an order and waits until its saga awaits step.
func (b *bundle) place(t *testing.T, key, step string) (orderID string, sagaID uuid.UUID) {
	t.Helper()
	body, _ := json.Marshal(shop.PlaceOrder{SKU: "book", Qty: 1, Amount: 45, Address: "5 Oak St"})
	req, _ := http.NewRequest(http.MethodPost, b.base+"/orders", bytes.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	var out struct {
		ID     string    `json:"id"`
		SagaID uuid.UUID `json:"saga_id"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	b.awaiting(t, out.SagaID, step)
	return out.ID, out.SagaID
}

// awaiting waits until saga id awaits step's signal.
func (b *bundle) awaiting(t *testing.T, id uuid.UUID, step string) {
	t.Helper()
	require.Eventually(t, func() bool {
		in, err := b.sys.Engine.Get(context.Background(), id)
		return err == nil && in.Step == step && in.Wait != nil && in.Wait.Kind == "signal"
	}, 30*time.Second, 10*time.Millisecond, "saga %s never awaited step %s", id, step)
}

// webhook posts a carrier webhook with the given key and body.
func (b *bundle) webhook(t *testing.T, key string, body []byte) (int, string, bool) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.base+shop.WebhookPath, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var out bytes.Buffer
	_, _ = out.ReadFrom(resp.Body)
	return resp.StatusCode, out.String(), resp.Header.Get("Idempotent-Replayed") == "true"
}

func delivered(orderID string) []byte {
	body, _ := json.Marshal(shop.CarrierEvent{Event: "delivered", OrderID: orderID, Tracking: "TRK-" + orderID})
	return body
}

// publishPicked writes the warehouse's event for the order to its topic,
// times times with message id id (more than once: a redelivery).
func (b *bundle) publishPicked(t *testing.T, orderID, id string, times int) {
	t.Helper()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(b.env.Brokers...), Topic: shop.TopicWarehouse, BatchTimeout: time.Millisecond,
		RequiredAcks: kafka.RequireAll, Transport: tr}
	defer w.Close()
	value, _ := json.Marshal(shop.WarehousePicked{OrderID: orderID, Picker: "bay-1"})
	for range times {
		require.NoError(t, w.WriteMessages(context.Background(), kafka.Message{Key: []byte(orderID), Value: value,
			Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte(id)}, {Key: wire.HeaderType, Value: []byte("WarehousePicked")}}}))
	}
}

// signals counts saga id's signals by name and status, and by id.
func (b *bundle) signals(t *testing.T, id uuid.UUID) (byStatus, byID map[string]int) {
	t.Helper()
	sigs, err := b.sys.Engine.Signals(context.Background(), id)
	require.NoError(t, err)
	byStatus, byID = map[string]int{}, map[string]int{}
	for _, s := range sigs {
		byStatus[s.Name+" "+s.Status]++
		byID[s.ID]++
	}
	return byStatus, byID
}

func (b *bundle) orderStatus(t *testing.T, orderID string) string {
	t.Helper()
	var status string
	require.NoError(t, b.env.Orders.Pool.QueryRow(context.Background(),
		"SELECT status FROM "+pgx.Identifier{b.env.Orders.Schema, "orders"}.Sanitize()+" WHERE id = $1", orderID).Scan(&status))
	return status
}

func countHistory(in *saga.Instance, event, step string) int {
	n := 0
	for _, h := range in.History {
		if h.Type == event && h.Step == step {
			n++
		}
	}
	return n
}

// TestOrderIsDeliveredOnceDespiteDuplicates: the warehouse's event comes
// twice (same message id) and the carrier's webhook twice (same
// Idempotency-Key); each has one effect, and the order is delivered.
func TestOrderIsDeliveredOnceDespiteDuplicates(t *testing.T) {
	b := setup(t)
	orderID, id := b.place(t, "k-dup-events", "picked")

	dup := uuid.NewString()
	b.publishPicked(t, orderID, dup, 2)
	b.awaiting(t, id, "delivered")
	require.Equal(t, "picked", b.orderStatus(t, orderID))

	status, body, replayed := b.webhook(t, "dlv-1", delivered(orderID))
	require.Equal(t, http.StatusAccepted, status, body)
	require.False(t, replayed)
	in := sagatest.WaitEnded(t, b.sys.Engine, id, nil)
	require.Equal(t, saga.StatusCompleted, in.Status)

	status, again, replayed := b.webhook(t, "dlv-1", delivered(orderID))
	require.Equal(t, http.StatusAccepted, status)
	require.True(t, replayed, "the resent webhook gets the stored answer")
	require.Equal(t, body, again)

	// An event with another id, behind the two copies on their partition
	// (same key): once it is recorded, the second copy has been consumed.
	sentinel := uuid.NewString()
	b.publishPicked(t, orderID, sentinel, 1)
	require.Eventually(t, func() bool { _, byID := b.signals(t, id); return byID[sentinel] == 1 },
		30*time.Second, 10*time.Millisecond, "the event after the copies is consumed")

	in, err := b.sys.Engine.Get(context.Background(), id)
	require.NoError(t, err)
	require.Equal(t, 1, countHistory(in, saga.EventSignalReceived, "picked"))
	require.Equal(t, 1, countHistory(in, saga.EventSignalReceived, "delivered"))
	byStatus, byID := b.signals(t, id)
	require.Equal(t, 1, byID[dup], "the redelivered event is one signal")
	require.Equal(t, 1, byStatus["picked delivered"])
	require.Equal(t, 1, byStatus["delivered delivered"])
	require.Equal(t, "delivered", b.orderStatus(t, orderID))
	var webhooks int
	require.NoError(t, b.env.Orders.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+
		pgx.Identifier{b.env.Orders.Schema, "carrier_webhooks"}.Sanitize()+" WHERE order_id = $1", orderID).Scan(&webhooks))
	require.Equal(t, 1, webhooks, "the resent webhook did not run the handler again")
}

// TestUndeliveredOrderIsCancelledAndRefunded: picked, then no delivery for
// 48 hours of database time: the escalation cancels the order, refunds
// the payment and releases the stock.
func TestUndeliveredOrderIsCancelledAndRefunded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	orderID, id := b.place(t, "k-lost", "picked")
	b.publishPicked(t, orderID, uuid.NewString(), 1)
	b.awaiting(t, id, "delivered")

	clock := sagatest.NewClock(b.env.Orders.Pool, b.env.Orders.Schema, b.sys.Engine)
	require.NoError(t, clock.Advance(ctx, 47*time.Hour))
	in, err := b.sys.Engine.Get(ctx, id)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status, "47 hours: still waiting")

	require.NoError(t, clock.Advance(ctx, 2*time.Hour))
	in = sagatest.WaitEnded(t, b.sys.Engine, id, nil)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeWaitTimeout, in.LastError.Code)
	require.Equal(t, "cancelled", b.orderStatus(t, orderID))
	require.True(t, b.sys.Provider.Refunded("ch_"+orderID), "the payment is refunded")
	var released bool
	require.NoError(t, b.env.Inventory.Pool.QueryRow(ctx, "SELECT released FROM "+
		pgx.Identifier{b.env.Inventory.Schema, "reservations"}.Sanitize()+" WHERE order_id = $1", orderID).Scan(&released))
	require.True(t, released, "the stock is released")

	// A delivery that comes after all is refused, and recorded.
	status, body, _ := b.webhook(t, "dlv-late", delivered(orderID))
	require.Equal(t, http.StatusConflict, status, body)
	require.Contains(t, body, "no longer awaits its delivery")
	byStatus, _ := b.signals(t, id)
	require.Equal(t, map[string]int{"picked delivered": 1, "delivered rejected": 1}, byStatus)
}

// TestWebhookWithBadBytes: bad bodies get a clear 4xx, signal nothing,
// and a good webhook afterwards delivers the order.
func TestWebhookWithBadBytes(t *testing.T) {
	b := setup(t)
	orderID, id := b.place(t, "k-bad-bytes", "picked")

	for i, tc := range []struct {
		name   string
		body   []byte
		status int
		says   string
	}{
		{"a NUL byte", []byte(`{"event":"delivered","order_id":"` + orderID + "\x00" + `","tracking":"T"}`), http.StatusBadRequest, "not a carrier event"},
		{"an escaped NUL", []byte(`{"event":"delivered","order_id":"` + orderID + `\u0000","tracking":"T"}`), http.StatusBadRequest, "not printable"},
		{"invalid UTF-8", []byte(`{"event":"delivered","order_id":"` + orderID + "\xff\xfe" + `","tracking":"T"}`), http.StatusBadRequest, "not valid UTF-8"},
		{"10 kB", []byte(`{"event":"delivered","order_id":"` + orderID + `","tracking":"` + strings.Repeat("x", 10<<10) + `"}`), http.StatusRequestEntityTooLarge, "larger than"},
		{"an unknown event", []byte(`{"event":"lost","order_id":"` + orderID + `","tracking":"T"}`), http.StatusBadRequest, "unknown carrier event"},
		{"not JSON", []byte("delivered!"), http.StatusBadRequest, "not a carrier event"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, body, _ := b.webhook(t, fmt.Sprintf("bad-%d", i), tc.body)
			require.Equal(t, tc.status, status, body)
			require.Contains(t, body, tc.says)
		})
	}
	byStatus, _ := b.signals(t, id)
	require.Empty(t, byStatus, "no bad webhook became a signal")

	// Nothing was lost: the events that follow deliver the order.
	b.publishPicked(t, orderID, uuid.NewString(), 1)
	status, body, _ := b.webhook(t, "dlv-good", delivered(orderID))
	require.Equal(t, http.StatusAccepted, status, body)
	in := sagatest.WaitEnded(t, b.sys.Engine, id, nil)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, "delivered", b.orderStatus(t, orderID))
}
