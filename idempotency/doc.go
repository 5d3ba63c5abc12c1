// Package idempotency makes the HTTP routes that create things safe to
// retry. A client sends a unique key with each operation in the
// Idempotency-Key header and sends the same key again when it retries; the
// [Middleware] runs the handler for the first request only and answers the
// retries with the response the first one produced, kept in PostgreSQL.
//
// # Usage
//
// Migrate the schema (migration 004 creates the idempotency_keys table),
// build a middleware and wrap the handlers that create things:
//
//	if _, err := store.Migrate(ctx, pool, "sagaflow"); err != nil {
//		return err
//	}
//	idem, err := idempotency.New(pool, &idempotency.Config{
//		Schema:   "sagaflow",
//		Required: true,
//		// One set of keys per user, so that users cannot collide.
//		Scope: func(r *http.Request) string { return userID(r) + " " + r.URL.Path },
//	})
//	if err != nil {
//		return err
//	}
//	mux := http.NewServeMux()
//	mux.Handle("POST /orders", idem.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		ctx := r.Context()
//		retry := func() { http.Error(w, "try again", http.StatusServiceUnavailable) } // 5xx: the key is released
//		key, _ := idempotency.FromContext(ctx)
//		id := uuid.New()
//		tx, err := pool.Begin(ctx)
//		if err != nil {
//			retry()
//			return
//		}
//		defer tx.Rollback(ctx)
//		// The key, scoped to the user, is also the saga's business key: if a
//		// run of this handler committed and then failed to answer, the next
//		// run finds its saga and inserts nothing.
//		started, err := saga.StartTx(ctx, engine, tx, checkout, Order{ID: id.String()},
//			&saga.StartOpts{ID: id, BusinessKey: userID(r) + "/" + key})
//		if err != nil {
//			retry()
//			return
//		}
//		if !started.Existing {
//			if _, err := tx.Exec(ctx, `INSERT INTO shop.orders (id) VALUES ($1)`, id); err != nil || tx.Commit(ctx) != nil {
//				retry()
//				return
//			}
//		}
//		w.Header().Set("Content-Type", "application/json")
//		w.Header().Set("Location", "/orders/"+started.ID.String())
//		w.WriteHeader(http.StatusCreated)
//		json.NewEncoder(w).Encode(map[string]string{"id": started.ID.String()})
//	})))
//
// and delete expired keys now and then, in bounded batches:
//
//	for {
//		n, err := idem.DeleteExpired(ctx, 1000)
//		if err != nil || n < 1000 {
//			break
//		}
//	}
//
// # What a request gets
//
// Requests of safe methods (GET, HEAD, OPTIONS, TRACE) pass through
// untouched. For the others, with keys partitioned by [Config.Scope] (by
// default the method and path):
//
//   - No key: 400 Bad Request when [Config.Required], else the handler runs
//     without protection. A key longer than [Config.MaxKeyLength], sent twice,
//     or not printable UTF-8: 400. A body larger than [Config.MaxBodyBytes]:
//     413 Content Too Large.
//   - A new key: the key is inserted as in flight, in a statement of its own
//     that commits at once, so that a concurrent duplicate sees it. The
//     handler runs with a writer that sends its response to the client as
//     usual and keeps a copy; then the status, the body and the headers named
//     by [Config.ReplayHeaders] are stored with the key, which is kept for
//     [Config.TTL] from then.
//   - The same key and the same request (a SHA-256 of the method, path,
//     query and body) after the first response was stored: that response
//     again (status, headers, body) with the header Idempotent-Replayed: true.
//     The handler does not run.
//   - The same key with a different request: 422 Unprocessable Entity.
//   - The same key while the first request is still in flight: 409 Conflict
//     with Retry-After: 1.
//   - A key whose expiry has passed, by the database's clock, counts as
//     absent: the request runs again and its key replaces the old row.
//   - The database cannot be reached before the handler: 503 Service
//     Unavailable with Retry-After: 1; the handler does not run.
//
// The errors are JSON objects, {"error": "..."}, with Content-Type
// application/json.
//
// # Failures
//
// When the handler panics, or answers with a status that asks for a retry
// (5xx, 408 Request Timeout, 429 Too Many Requests), the key is deleted
// instead of stored, so that the client's retry runs the handler again: such
// a response says the operation did not happen, or may be tried again. A
// handler that commits its effects and then fails this way must make the
// second run safe by itself, for example with [FromContext] as a business key.
// The panic itself goes on to net/http.
//
// Retries may come from the client library too: Go's http.Transport resends
// a request that carries an Idempotency-Key header by itself when a reused
// connection breaks before the response arrives.
//
// The handler's database work is not in the transaction that records the
// key: the key commits before the handler runs and the response is stored
// after it returned. If the process dies in between, or the response cannot
// be stored, the key stays in flight, and retries get 409, until it expires;
// the handler does not run twice. A client may also see its response before
// the response is stored and get 409 on an immediate retry.
//
// Whatever the handler writes is stored in full, whatever reached the client.
// Responses are held in memory while the handler runs, and the body is read
// whole to be hashed before it does.
//
// # Business keys
//
// [FromContext] gives the handler its request's key, and [ScopeFromContext]
// its scope. Used as a business key (saga.StartOpts.BusinessKey, a unique
// column), the key makes the handler's own writes idempotent as well, which
// covers what the middleware cannot: a handler that committed and then
// panicked. Keys are unique only within a scope, so a business key should
// carry what the scope carries (the user in the snippet above).
package idempotency
