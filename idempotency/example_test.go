package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/store"
)

// A POST /orders handler behind the middleware: the client's retry gets the
// first response again, and the handler runs once.
func ExampleMiddleware_Wrap() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := store.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	idem, err := idempotency.New(pool, &idempotency.Config{Schema: schema, Required: true})
	if err != nil {
		panic(err)
	}

	var orders atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /orders", idem.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := orders.Add(1)
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", n))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d\n", n)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(key string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"A"}`))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		res, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		fmt.Printf("%d %s replayed=%q %s", res.StatusCode, res.Header.Get("Location"),
			res.Header.Get("Idempotent-Replayed"), body)
	}
	post("8e0f7a52-order-1")
	post("8e0f7a52-order-1") // a retry
	post("c41d9b07-order-2") // a new operation
	post("")
	fmt.Println("\nhandler runs:", orders.Load())
	// Output:
	// 201 /orders/1 replayed="" order 1
	// 201 /orders/1 replayed="true" order 1
	// 201 /orders/2 replayed="" order 2
	// 400  replayed="" {"error":"missing Idempotency-Key header: this request needs a unique key per operation (such as a UUID), sent again unchanged when the request is retried"}
	//
	// handler runs: 2
}
