// Package idempotency makes the HTTP routes that create things safe to
// retry. A client sends a unique key with each operation in the
// Idempotency-Key header and sends the same key again when it retries; the
// [Middleware] runs the handler for the first request only and answers the
// retries with the response the first one produced, kept in PostgreSQL.
// Keys belong to the caller who sent them: the middleware asks
// [Config.Identity] who that is, and one caller's key never answers
// another's request.
//
// # Usage
//
// Migrate the schema (migration 004 creates the idempotency_keys table),
// build a middleware that knows who the caller is, and wrap the handlers
// that create things, behind your authentication:
//
//	if _, err := migrations.Migrate(ctx, pool, "sagaflow"); err != nil {
//		return err
//	}
//	idem, err := idempotency.New(pool, &idempotency.Config{
//		Schema:   "sagaflow",
//		Required: true,
//		// The user your authentication middleware found: keys are per user.
//		Identity: func(r *http.Request) (string, error) { return userID(r.Context()) },
//	})
//	if err != nil {
//		return err
//	}
//	mux := http.NewServeMux()
//	mux.Handle("POST /orders", authenticate(idem.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
//		ctx := r.Context()
//		retry := func() { http.Error(w, "try again", http.StatusServiceUnavailable) } // 5xx: the key is released
//		key, _ := idempotency.FromContext(ctx)
//		scope, _ := idempotency.ScopeFromContext(ctx) // the user and the route
//		id := uuid.New()
//		tx, err := pool.Begin(ctx)
//		if err != nil {
//			retry()
//			return
//		}
//		defer tx.Rollback(ctx)
//		// The key, with its scope, is also the saga's business key: if a run
//		// of this handler committed and then failed to answer, the next run
//		// finds its saga and inserts nothing.
//		started, err := saga.StartTx(ctx, engine, tx, checkout, Order{ID: id.String()},
//			&saga.StartOpts{ID: id, BusinessKey: scope + "/" + key})
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
//	}))))
//
// # Identity and scope
//
// [Config.Identity] has no default, and [New] refuses a config without it:
// a middleware that does not know its callers would answer one caller's
// request with another's response when both sent the same key. Return a
// stable id (a user, tenant or API client id), not a credential: it is
// stored with the key. Where callers need not be told apart, say so with
// [SharedIdentity].
//
// Within an identity, [Config.Scope] partitions keys further (by default by
// method and path). The stored scope joins both: the identity's length in
// bytes, a colon, the identity, a space and the scope ("5:alice POST
// /orders"). Identities and scopes are untrusted bytes: when that stored
// scope cannot be kept as text (a NUL, invalid UTF-8) or is longer than 512
// bytes, it is stored as "sha256:" and the hex SHA-256 of its bytes, and so
// is a key longer than 512 bytes when [Config.MaxKeyLength] allows one.
//
// # What a request gets
//
// Requests of safe methods (GET, HEAD, OPTIONS, TRACE) pass through
// untouched. For the others, with keys partitioned by identity and scope:
//
//   - No key (an empty header counts as none): 400 Bad Request when
//     [Config.Required], else the handler runs without protection. Keys are
//     compared byte for byte, never trimmed or folded. A key longer than [Config.MaxKeyLength], sent twice,
//     or not printable UTF-8 (a NUL, a control character, invalid UTF-8):
//     400. An identity error, or an empty identity: 401 Unauthorized. A body
//     larger than [Config.MaxBodyBytes]: 413 Content Too Large. The handler
//     does not run.
//   - A new key: the key is inserted as in flight, in a statement of its own
//     that commits at once, so that a concurrent duplicate sees it. The
//     handler runs with a writer that sends its response to the client as
//     usual and keeps a copy; then the status, the body and the headers named
//     by [Config.ReplayHeaders] are stored with the key, which is kept for
//     [Config.TTL] from then.
//   - The same key and the same request (a SHA-256 of the method, path,
//     query and body; the path and query as sent, so a client that encodes
//     or orders its query differently on a retry sends another request)
//     after the first response was stored: that response again (status,
//     headers, body) with the header Idempotent-Replayed: true. Header
//     values come back byte for byte, obs-text included. The handler does
//     not run.
//   - The same, when the first response's body was not kept (see below): 410
//     Gone with Idempotent-Replayed: true and the first response's Location,
//     if it had one. The handler does not run.
//   - The same key with a different request: 422 Unprocessable Entity, also
//     while the first request is still in flight.
//   - The same key and the same request while the first is still in
//     flight: 409 Conflict with Retry-After: 1.
//   - A key whose expiry has passed, by the database's clock, counts as
//     absent: the request runs again and its key replaces the old row.
//   - The database cannot be reached before the handler: 503 Service
//     Unavailable with Retry-After: 1; the handler does not run. So does a
//     schema that was never migrated (the log says so): migrate it before
//     the middleware takes requests.
//
// The errors are JSON objects, {"error": "..."}, with Content-Type
// application/json.
//
// # What is kept
//
// A response whose body is larger than [Config.MaxResponseBytes] (1 MiB by
// default), or that is streamed (the handler flushed it, through
// http.Flusher or http.ResponseController, as a stream of server-sent events
// does, or hijacked the connection), reaches the client as the handler sent
// it but is not kept: its key is stored as done with its status and
// headers, without the body. The operation took place, so a retry does not
// run it again; it gets 410 Gone, which tells the client to look for the
// result another way (the Location, if any) or to use a new key for a new
// operation. Only the kept part is held in memory while the handler runs.
//
// Expired keys are deleted by the middleware itself: after a request that
// carries a key, at most once per [Config.CleanupInterval] (a minute by
// default) per middleware, up to [Config.CleanupBatch] keys in one statement,
// and again on the next request while batches come back full. That request
// waits for the statement. [Middleware.DeleteExpired] deletes on demand.
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
// be stored, the key stays in flight, and retries get 409, until its lease
// ends ([Config.InFlightTimeout], a minute by default and at most the TTL:
// a TTL under a minute shortens it); a retry after that runs the handler
// again, which the handler must make safe as above. A client may also see
// its response before the response is stored and get 409 on an immediate
// retry.
//
// The stored body is what the handler wrote, whatever reached the client.
// The stored headers are those named by [Config.ReplayHeaders] as they were
// when the status was written, found under their canonical names (a value
// set with w.Header()["location"] is sent but not kept); trailers are not
// kept. The request body is read whole to be hashed before the handler
// runs.
//
// # Stores
//
// Keys live in PostgreSQL by default (the idempotency_keys table). Set
// [Config.Store] to keep them elsewhere: package idempotency/redisstore keeps
// them in Redis, with the same 409, 422, 410 and replay behaviour, an atomic
// claim whose lease (InFlightTimeout) frees the key of a request whose
// process died, and a token that fences a late finisher. Use it for services
// whose request path has no PostgreSQL transaction. Saga steps and inbox
// consumers keep deduplicating in PostgreSQL whatever this middleware uses:
// their key must commit in the same transaction as the effect it guards,
// and only the database that holds the effect can do that.
//
// # Business keys
//
// [FromContext] gives the handler its request's key, and [ScopeFromContext]
// its stored scope, which carries the identity. Used as a business key
// (saga.StartOpts.BusinessKey, a unique column), the key makes the
// handler's own writes idempotent as well, which covers what the middleware
// cannot: a handler that committed and then panicked. Keys are unique only
// within a scope, so a business key should carry the scope too, as in the
// snippet above.
package idempotency
