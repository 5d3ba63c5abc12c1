package shop

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"

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

// Handler serves the order service's API. wrap protects POST /orders with
// inbound idempotency keys (the idempotency package's middleware).
func (s *System) Handler(wrap func(http.Handler) http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /orders", wrap(http.HandlerFunc(s.placeOrder)))
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
