package shop

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/saga"
)

// PlaceOrder is the body of POST /orders.
type PlaceOrder struct {
	SKU     string `json:"sku"`
	Qty     int    `json:"qty"`
	Amount  int    `json:"amount"`
	Address string `json:"address"`
}

// OrderView is the body of GET /orders/{id}.
type OrderView struct {
	ID     string         `json:"id"`
	Status string         `json:"status"`
	SagaID uuid.UUID      `json:"saga_id"`
	Saga   *saga.Instance `json:"saga"`
}

// Handler serves the order service's API. wrap protects POST /orders and
// the carrier's webhook (POST /webhooks/carrier) with inbound idempotency
// keys (the idempotency package's middleware).
func (s *System) Handler(wrap func(http.Handler) http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /orders", wrap(http.HandlerFunc(s.placeOrder)))
	mux.Handle("POST "+WebhookPath, wrap(http.HandlerFunc(s.carrierWebhook)))
	mux.HandleFunc("GET /orders/{id}", s.getOrder)
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// placeOrder creates the order row and starts its checkout saga in one
// transaction: both exist, or neither does.
func (s *System) placeOrder(w http.ResponseWriter, r *http.Request) {
	var req PlaceOrder
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.SKU == "" || req.Qty <= 0 || req.Amount <= 0 {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "want {sku, qty > 0, amount > 0, address}"})
		return
	}
	ctx := r.Context()
	// The order's id comes from the request's idempotency key: if this
	// transaction commits but the answer is lost, the client's retry finds
	// the same order (and, by business key, the same saga) instead of
	// creating another.
	id := "ord_" + strings.ReplaceAll(uuid.Must(uuid.NewV7()).String(), "-", "")[20:]
	if key, ok := idempotency.FromContext(ctx); ok {
		scope, _ := idempotency.ScopeFromContext(ctx)
		id = "ord_" + strings.ReplaceAll(uuid.NewSHA1(uuid.NameSpaceURL, []byte(scope+"\x00"+key)).String(), "-", "")[20:]
	}
	d := s.env.Orders
	var started saga.Started
	err := pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+d.table("orders")+" (id, sku, qty, amount, address, status) VALUES ($1, $2, $3, $4, $5, 'placed') ON CONFLICT (id) DO NOTHING",
			id, req.SKU, req.Qty, req.Amount, req.Address); err != nil {
			return err
		}
		var err error
		started, err = saga.StartTx(ctx, s.Engine, tx, s.Checkout,
			Order{ID: id, SKU: req.SKU, Qty: req.Qty, Amount: req.Amount, Address: req.Address}, &saga.StartOpts{BusinessKey: id})
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "UPDATE "+d.table("orders")+" SET saga_id = $2 WHERE id = $1", id, started.ID)
		return err
	})
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	w.Header().Set("Location", "/orders/"+id)
	writeJSON(w, http.StatusCreated, map[string]any{"id": id, "saga_id": started.ID})
}

func (s *System) getOrder(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	d := s.env.Orders
	var v OrderView
	err := d.Pool.QueryRow(ctx, "SELECT saga_id FROM "+d.table("orders")+" WHERE id = $1", r.PathValue("id")).Scan(&v.SagaID)
	if errors.Is(err, pgx.ErrNoRows) {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such order"})
		return
	}
	// The saga first, then the order's status: a step changes both in one
	// transaction, so the order read second is never behind the saga.
	if err == nil {
		v.Saga, err = s.Engine.Get(ctx, v.SagaID)
	}
	if err == nil {
		err = d.Pool.QueryRow(ctx, "SELECT id, status FROM "+d.table("orders")+" WHERE id = $1", r.PathValue("id")).Scan(&v.ID, &v.Status)
	}
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// MaxWebhookBytes bounds the body of the carrier's webhook.
const MaxWebhookBytes = 4 << 10

// carrierWebhook takes the carrier's "delivered" event: it records the
// webhook and signals the order's checkout saga in one transaction, the
// request's. The idempotency middleware in front answers a resent webhook
// (same Idempotency-Key) with the first answer, without running this
// again; the signal's id is the key as well, so even a webhook that
// slipped past the middleware would have one effect.
func (s *System) carrierWebhook(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxWebhookBytes))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		writeJSON(w, http.StatusRequestEntityTooLarge, map[string]string{"error": fmt.Sprintf("the webhook's body is larger than %d bytes", MaxWebhookBytes)})
		return
	case err != nil:
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "read the webhook's body: " + err.Error()})
		return
	}
	ev, err := decodeCarrierEvent(body)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	ctx := r.Context()
	key, _ := idempotency.FromContext(ctx)
	scope, _ := idempotency.ScopeFromContext(ctx)
	var res saga.SignalResult
	var sigErr error
	err = pgx.BeginFunc(ctx, s.env.Orders.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+s.env.Orders.table("carrier_webhooks")+" (order_id, event, tracking) VALUES ($1, $2, $3)",
			ev.OrderID, ev.Event, ev.Tracking); err != nil {
			return err
		}
		res, sigErr = s.Engine.SignalTx(ctx, tx, saga.Signal{Saga: s.Checkout.Name(), BusinessKey: ev.OrderID,
			Name: SignalDelivered, ID: "carrier/" + scope + "/" + key, Payload: ev})
		if errors.Is(sigErr, saga.ErrSignalRejected) {
			return nil // recorded as rejected: commit it, and say why below
		}
		return sigErr
	})
	switch {
	case errors.Is(sigErr, saga.ErrInvalidInput):
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": sigErr.Error()})
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()}) // the key is released: the carrier retries
	case errors.Is(sigErr, saga.ErrNotFound):
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no order " + ev.OrderID + " (the webhook is recorded)"})
	case errors.Is(sigErr, saga.ErrSignalRejected):
		writeJSON(w, http.StatusConflict, map[string]string{"error": "order " + ev.OrderID + " no longer awaits its delivery (the webhook is recorded): " + sigErr.Error()})
	default:
		writeJSON(w, http.StatusAccepted, map[string]any{"saga_id": res.SagaID, "duplicate": res.Duplicate})
	}
}

// decodeCarrierEvent checks the webhook's bytes before anything is
// stored: JSON in valid UTF-8, a known event, an order id and tracking
// number of printable text.
func decodeCarrierEvent(body []byte) (CarrierEvent, error) {
	var ev CarrierEvent
	if !utf8.Valid(body) {
		return ev, errors.New("the webhook's body is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ev); err != nil {
		return ev, fmt.Errorf("the webhook's body is not a carrier event {event, order_id, tracking}: %w", err)
	}
	if ev.Event != "delivered" {
		return ev, fmt.Errorf("unknown carrier event %q: want \"delivered\"", ev.Event)
	}
	for _, f := range []struct{ name, v string }{{"order_id", ev.OrderID}, {"tracking", ev.Tracking}} {
		if f.v == "" || len(f.v) > 100 {
			return ev, fmt.Errorf("%s must have 1 to 100 bytes", f.name)
		}
		for _, r := range f.v {
			if !unicode.IsPrint(r) {
				return ev, fmt.Errorf("%s holds a character that is not printable (%U)", f.name, r)
			}
		}
	}
	return ev, nil
}
