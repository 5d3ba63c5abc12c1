package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

type userKey struct{}

// authenticate stands for your authentication: it puts the caller's user id
// in the request's context. Here a token is a user's name.
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok {
			http.Error(w, "unauthenticated", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), userKey{}, user)))
	})
}

// userID is the middleware's Identity: the user that authenticate found.
func userID(r *http.Request) (string, error) {
	user, ok := r.Context().Value(userKey{}).(string)
	if !ok {
		return "", errors.New("no authenticated user")
	}
	return user, nil
}

// A POST /orders handler behind the middleware: the client's retry gets the
// first response again, and the handler runs once per user and key.
func ExampleMiddleware_Wrap() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	idem, err := idempotency.New(pool, &idempotency.Config{Schema: schema, Required: true, Identity: userID})
	if err != nil {
		panic(err)
	}

	var orders atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /orders", authenticate(idem.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := orders.Add(1)
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", n))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d\n", n)
	}))))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(user, key string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"A"}`))
		req.Header.Set("Authorization", "Bearer "+user)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		res, err := srv.Client().Do(req)
		if err != nil {
			panic(err)
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		fmt.Printf("%s: %d %s replayed=%q %s", user, res.StatusCode, res.Header.Get("Location"),
			res.Header.Get("Idempotent-Replayed"), body)
	}
	post("alice", "8e0f7a52-order-1")
	post("alice", "8e0f7a52-order-1") // a retry
	post("bob", "8e0f7a52-order-1")   // another user's key, whatever it looks like
	post("alice", "c41d9b07-order-2") // a new operation
	post("alice", "")
	fmt.Println("\nhandler runs:", orders.Load())
	// Output:
	// alice: 201 /orders/1 replayed="" order 1
	// alice: 201 /orders/1 replayed="true" order 1
	// bob: 201 /orders/2 replayed="" order 2
	// alice: 201 /orders/3 replayed="" order 3
	// alice: 400  replayed="" {"error":"missing Idempotency-Key header: this request needs a unique key per operation (such as a UUID), sent again unchanged when the request is retried"}
	//
	// handler runs: 3
}
