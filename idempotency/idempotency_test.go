package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/idempotency/redisstore"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type bundle struct {
	pool   *pgxpool.Pool
	schema string
	mw     *idempotency.Middleware
	srv    *httptest.Server
	client *http.Client
	calls  atomic.Int32
	// pg is true when the keys are in PostgreSQL (not Config.Store).
	pg bool
}

// setup migrates a fresh schema and serves handler (nil: b.created) behind
// a middleware configured by cfg (its Schema is set here) on every path.
// Without cfg.Identity, the caller is the X-User header, path-unescaped
// (standing in for a claim of a verified token), and a request without it
// is refused; b.send sends X-User: alice unless told otherwise.
func setup(t *testing.T, cfg *idempotency.Config, handler func(b *bundle, w http.ResponseWriter, r *http.Request)) *bundle {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	c := idempotency.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.Schema = schema
	if _, ok := c.Store.(*redisstore.Store); ok {
		// A Redis store of this setup's own, as the schema is: subtests
		// that share a config do not share keys.
		c.Store = redisStore(t)
	}
	c.Logger = slog.New(slog.DiscardHandler)
	if c.Identity == nil {
		c.Identity = headerIdentity
	}
	mw, err := idempotency.New(pool, &c)
	require.NoError(t, err)
	b := &bundle{pool: pool, schema: schema, mw: mw, pg: c.Store == nil}
	if handler == nil {
		handler = (*bundle).created
	}
	srv := httptest.NewUnstartedServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		handler(b, w, r)
	})))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // handler panics are expected in some tests
	srv.Start()
	t.Cleanup(srv.Close)
	b.srv = srv
	// No keep-alive: Go's Transport retries a request that carries an
	// Idempotency-Key by itself when a reused connection breaks, and the
	// tests count every attempt.
	tr := &http.Transport{DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	b.client = &http.Client{Transport: tr}
	return b
}

func headerIdentity(r *http.Request) (string, error) {
	h := r.Header.Get("X-User")
	if h == "" {
		return "", errors.New("no X-User header")
	}
	return url.PathUnescape(h)
}

// created is a typical create handler: it reads the body and answers 201
// with headers that are replayed (Content-Type, Location) and one that is
// not (X-Request-Id), in two writes.
func (b *bundle) created(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	key, _ := idempotency.FromContext(r.Context())
	n := b.calls.Load()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", n))
	w.Header().Set("X-Request-Id", fmt.Sprintf("req-%d", n))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order":%d,`, n)
	fmt.Fprintf(w, `"key":%q,"body":%q}`, key, body)
}

type response struct {
	status int
	header http.Header
	body   string
}

func (r response) replayed() bool { return r.header.Get(idempotency.HeaderReplayed) == "true" }

// errorMessage decodes a JSON error response.
func (r response) errorMessage(t *testing.T) string {
	t.Helper()
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	var e struct {
		Error string `json:"error"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.body), &e), r.body)
	require.NotEmpty(t, e.Error)
	return e.Error
}

// send sends a request; key "" sends no key header; header adds headers,
// and X-User: alice unless it names X-User.
func (b *bundle) send(method, path, key, body string, header ...string) (response, error) {
	req, err := http.NewRequest(method, b.srv.URL+path, strings.NewReader(body))
	if err != nil {
		return response{}, err
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("X-User", "alice")
	for i := 0; i+1 < len(header); i += 2 {
		if http.CanonicalHeaderKey(header[i]) == "X-User" {
			req.Header.Del("X-User")
		}
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	res, err := b.client.Do(req)
	if err != nil {
		return response{}, err
	}
	defer res.Body.Close()
	got, err := io.ReadAll(res.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: res.StatusCode, header: res.Header, body: string(got)}, nil
}

func (b *bundle) post(t *testing.T, path, key, body string, header ...string) response {
	t.Helper()
	res, err := b.send(http.MethodPost, path, key, body, header...)
	require.NoError(t, err)
	return res
}

// redisStore returns a Redis store with a prefix of the test's own, its
// keys deleted at the end; the test is skipped when Redis does not answer.
func redisStore(t *testing.T) *redisstore.Store {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr()})
	t.Cleanup(func() { _ = rdb.Close() })
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		t.Skipf("no Redis at %s (set SAGAFLOW_REDIS_ADDR): %v", redisAddr(), err)
	}
	prefix := "sagaflow-test:" + uuid.NewString() + ":"
	t.Cleanup(func() {
		ctx := context.Background()
		keys, _ := rdb.Keys(ctx, prefix+"*").Result()
		if len(keys) > 0 {
			_ = rdb.Del(ctx, keys...).Err()
		}
	})
	st, err := redisstore.New(rdb, prefix)
	require.NoError(t, err)
	return st
}

func redisAddr() string {
	if a := os.Getenv("SAGAFLOW_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

// eachStore runs fn against the PostgreSQL store (the default) and the
// Redis store, with cfg's Store set accordingly.
func eachStore(t *testing.T, fn func(t *testing.T, cfg idempotency.Config)) {
	t.Run("postgres", func(t *testing.T) { t.Parallel(); fn(t, idempotency.Config{}) })
	t.Run("redis", func(t *testing.T) { t.Parallel(); fn(t, idempotency.Config{Store: redisStore(t)}) })
}

func (b *bundle) table() string { return pgx.Identifier{b.schema, "idempotency_keys"}.Sanitize() }

func (b *bundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func (b *bundle) count(t *testing.T, where string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.table()+" WHERE "+where, args...).Scan(&n))
	return n
}

// expire moves the expiry of key into the past, by the database's clock.
func (b *bundle) expire(t *testing.T, key string) {
	t.Helper()
	b.exec(t, "UPDATE "+b.table()+" SET expires_at = now() - interval '1 second' WHERE key = $1", key)
}

func TestReplaysStoredResponse(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &cfg, nil)

		first := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
		require.Equal(t, http.StatusCreated, first.status)
		require.JSONEq(t, `{"order":1,"key":"k-1","body":"{\"sku\":\"A\"}"}`, first.body, "the handler sees the body and the key")
		require.Equal(t, "/orders/1", first.header.Get("Location"))
		require.Equal(t, "req-1", first.header.Get("X-Request-Id"))
		require.False(t, first.replayed())

		again := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
		require.Equal(t, http.StatusCreated, again.status)
		require.Equal(t, first.body, again.body, "the body as it was written, both parts")
		require.Equal(t, "application/json", again.header.Get("Content-Type"))
		require.Equal(t, "/orders/1", again.header.Get("Location"))
		require.Empty(t, again.header.Get("X-Request-Id"), "headers outside ReplayHeaders are not replayed")
		require.True(t, again.replayed())
		require.Equal(t, int32(1), b.calls.Load(), "the handler ran once")
		if b.pg { // how PostgreSQL stores it
			require.Equal(t, 1, b.count(t, "key = 'k-1' AND status = 'done' AND response_status = 201"))
		}

		// A safe method passes through: no key is needed and nothing is stored.
		get, err := b.send(http.MethodGet, "/orders/1", "", "")
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, get.status)
		require.Equal(t, int32(2), b.calls.Load())
	})
}

func TestReplaysResponseWithoutExplicitStatus(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &cfg, func(b *bundle, w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "accepted")
		})
		first := b.post(t, "/jobs", "k", "")
		again := b.post(t, "/jobs", "k", "")
		require.Equal(t, http.StatusOK, first.status)
		require.Equal(t, http.StatusOK, again.status)
		require.Equal(t, "accepted", again.body)
		require.True(t, again.replayed())
		require.Equal(t, int32(1), b.calls.Load())
	})
}

func TestSameKeyDifferentRequestIsRefused(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &cfg, nil)
		require.Equal(t, http.StatusCreated, b.post(t, "/orders", "k-1", `{"sku":"A"}`).status)

		changed := b.post(t, "/orders", "k-1", `{"sku":"B"}`)
		require.Equal(t, http.StatusUnprocessableEntity, changed.status)
		require.Contains(t, changed.errorMessage(t), "Idempotency-Key")
		require.Contains(t, changed.errorMessage(t), "different request")

		query := b.post(t, "/orders?dry_run=true", "k-1", `{"sku":"A"}`)
		require.Equal(t, http.StatusUnprocessableEntity, query.status, "the query is part of the request")
		require.Equal(t, int32(1), b.calls.Load())

		// The stored response is untouched.
		again := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
		require.True(t, again.replayed())
	})
}

func TestConflictWhileInFlightThenReplay(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		entered := make(chan struct{})
		release := make(chan struct{})
		b := setup(t, &cfg, func(b *bundle, w http.ResponseWriter, r *http.Request) {
			if b.calls.Load() == 1 {
				close(entered)
				<-release
			}
			b.created(w, r)
		})

		type result struct {
			res response
			err error
		}
		firstDone := make(chan result, 1)
		go func() {
			res, err := b.send(http.MethodPost, "/orders", "k-1", `{"sku":"A"}`)
			firstDone <- result{res, err}
		}()
		<-entered

		dup := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
		require.Equal(t, http.StatusConflict, dup.status)
		require.Equal(t, "1", dup.header.Get("Retry-After"))
		require.Contains(t, dup.errorMessage(t), "Idempotency-Key")
		// A different request under the same key is refused as such, in flight too.
		require.Equal(t, http.StatusUnprocessableEntity, b.post(t, "/orders", "k-1", `{"sku":"B"}`).status)

		close(release)
		first := <-firstDone
		require.NoError(t, first.err)
		require.Equal(t, http.StatusCreated, first.res.status)

		retry := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
		require.Equal(t, http.StatusCreated, retry.status)
		require.True(t, retry.replayed())
		require.Equal(t, first.res.body, retry.body)
		require.Equal(t, int32(1), b.calls.Load())
	})
}

func TestExpiredKeyCountsAsAbsent(t *testing.T) {
	t.Parallel()

	t.Run("done", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil, nil)
		first := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
		b.expire(t, "k-1")
		// Even a different request: the old key is gone.
		again := b.post(t, "/orders", "k-1", `{"sku":"B"}`)
		require.Equal(t, http.StatusCreated, again.status)
		require.False(t, again.replayed())
		require.NotEqual(t, first.body, again.body)
		require.Equal(t, int32(2), b.calls.Load())
		require.Equal(t, 1, b.count(t, "key = 'k-1' AND status = 'done' AND expires_at > now()"), "the row was replaced")
		require.True(t, b.post(t, "/orders", "k-1", `{"sku":"B"}`).replayed())
	})

	t.Run("in flight", func(t *testing.T) {
		t.Parallel()
		// A request whose process died before its response was stored
		// leaves its key in flight; the key is blocked until it expires.
		b := setup(t, nil, nil)
		require.Equal(t, http.StatusCreated, b.post(t, "/orders", "k-1", "{}").status)
		b.exec(t, "UPDATE "+b.table()+" SET status = 'in_flight', response_status = NULL, response_headers = NULL, response_body = NULL")
		require.Equal(t, http.StatusConflict, b.post(t, "/orders", "k-1", "{}").status)
		b.expire(t, "k-1")
		again := b.post(t, "/orders", "k-1", "{}")
		require.Equal(t, http.StatusCreated, again.status)
		require.False(t, again.replayed())
		require.Equal(t, int32(2), b.calls.Load())
	})

	t.Run("short TTL", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &idempotency.Config{TTL: idempotency.TTLMin}, nil)
		require.False(t, b.post(t, "/orders", "k-1", "").replayed())
		// Wait, by the database's clock, for the key to expire.
		require.Eventually(t, func() bool { return b.count(t, "key = 'k-1' AND expires_at <= now()") == 1 },
			10*time.Second, 10*time.Millisecond)
		require.False(t, b.post(t, "/orders", "k-1", "").replayed())
		require.Equal(t, int32(2), b.calls.Load())
	})
}

func TestRetryableResponsesReleaseTheKey(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		for _, tc := range []struct {
			name  string
			first func(w http.ResponseWriter)
		}{
			{"500", func(w http.ResponseWriter) { http.Error(w, "database down", http.StatusInternalServerError) }},
			{"503", func(w http.ResponseWriter) { w.WriteHeader(http.StatusServiceUnavailable) }},
			{"429", func(w http.ResponseWriter) { w.WriteHeader(http.StatusTooManyRequests) }},
			{"panic", func(w http.ResponseWriter) { panic("handler bug") }},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, &cfg, func(b *bundle, w http.ResponseWriter, r *http.Request) {
					if b.calls.Load() == 1 {
						tc.first(w)
						return
					}
					b.created(w, r)
				})
				first, err := b.send(http.MethodPost, "/orders", "k-1", `{"sku":"A"}`)
				if tc.name == "panic" {
					require.Error(t, err, "net/http drops the connection of a panicking handler")
				} else {
					require.NoError(t, err)
					require.Equal(t, tc.name, fmt.Sprint(first.status))
				}
				if b.pg { // how PostgreSQL stores it
					require.Equal(t, 0, b.count(t, "key = 'k-1'"), "the key was released")
				}

				retry := b.post(t, "/orders", "k-1", `{"sku":"A"}`)
				require.Equal(t, http.StatusCreated, retry.status)
				require.False(t, retry.replayed())
				require.Equal(t, int32(2), b.calls.Load(), "the retry ran the handler")
				require.True(t, b.post(t, "/orders", "k-1", `{"sku":"A"}`).replayed(), "the success is stored")
			})
		}
	})
}

func TestClientErrorIsReplayed(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &cfg, func(b *bundle, w http.ResponseWriter, r *http.Request) {
			http.Error(w, "no such product", http.StatusBadRequest)
		})
		require.Equal(t, http.StatusBadRequest, b.post(t, "/orders", "k-1", "").status)
		again := b.post(t, "/orders", "k-1", "")
		require.Equal(t, http.StatusBadRequest, again.status)
		require.Equal(t, "no such product\n", again.body)
		require.True(t, again.replayed())
		require.Equal(t, int32(1), b.calls.Load())
	})
}

func TestRejectsBadRequests(t *testing.T) {
	t.Parallel()
	b := setup(t, &idempotency.Config{Required: true, MaxBodyBytes: 16}, nil)

	missing := b.post(t, "/orders", "", "{}")
	require.Equal(t, http.StatusBadRequest, missing.status)
	require.Contains(t, missing.errorMessage(t), "missing Idempotency-Key header")

	long := b.post(t, "/orders", strings.Repeat("k", idempotency.MaxKeyLengthDefault+1), "{}")
	require.Equal(t, http.StatusBadRequest, long.status)
	require.Contains(t, long.errorMessage(t), "longer than 255 bytes")
	require.Equal(t, http.StatusCreated, b.post(t, "/orders", strings.Repeat("k", idempotency.MaxKeyLengthDefault), "{}").status)

	twice := b.post(t, "/orders", "k-1", "{}", "Idempotency-Key", "k-2")
	require.Equal(t, http.StatusBadRequest, twice.status)
	require.Contains(t, twice.errorMessage(t), "appear once")

	large := b.post(t, "/orders", "k-3", strings.Repeat("x", 17))
	require.Equal(t, http.StatusRequestEntityTooLarge, large.status)
	require.Contains(t, large.errorMessage(t), "larger than 16 bytes")

	// Without a Content-Length, the body is measured as it is read.
	req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/orders", io.MultiReader(strings.NewReader(strings.Repeat("x", 17))))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "k-4")
	req.Header.Set("X-User", "alice")
	res, err := b.client.Do(req)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusRequestEntityTooLarge, res.StatusCode)

	require.Equal(t, http.StatusCreated, b.post(t, "/orders", "k-3", strings.Repeat("x", 16)).status, "a body of the limit is accepted")
	require.Equal(t, int32(2), b.calls.Load(), "refused requests never reach the handler")
	require.Equal(t, 0, b.count(t, "key IN ('k-1', 'k-2', 'k-4')"), "refused requests store nothing")

	// A safe method needs no key.
	get, err := b.send(http.MethodGet, "/orders", "", "")
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, get.status)
}

func TestOptionalKey(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil) // Required defaults to false
	for range 2 {
		res := b.post(t, "/orders", "", "{}")
		require.Equal(t, http.StatusCreated, res.status)
		require.False(t, res.replayed())
	}
	require.Equal(t, int32(2), b.calls.Load(), "without a key every request runs")
	require.Equal(t, 0, b.count(t, "true"))
}

func TestScopesDoNotCollide(t *testing.T) {
	t.Parallel()

	t.Run("default: method and path", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil, nil)
		require.False(t, b.post(t, "/orders", "k-1", "{}").replayed())
		require.False(t, b.post(t, "/payments", "k-1", "{}").replayed())
		res, err := b.send(http.MethodPut, "/orders", "k-1", "{}")
		require.NoError(t, err)
		require.False(t, res.replayed())
		require.Equal(t, int32(3), b.calls.Load())
		require.Equal(t, 1, b.count(t, "scope = '5:alice POST /orders'"))
	})

	t.Run("custom: one scope for every route of a user", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &idempotency.Config{Scope: func(r *http.Request) string { return "api" }},
			func(b *bundle, w http.ResponseWriter, r *http.Request) {
				scope, _ := idempotency.ScopeFromContext(r.Context())
				w.Header().Set("X-Scope", scope)
				b.created(w, r)
			})
		alice := b.post(t, "/orders", "k-1", "{}")
		require.False(t, alice.replayed())
		require.Equal(t, "5:alice api", alice.header.Get("X-Scope"), "the identity is part of the stored scope")
		require.Equal(t, http.StatusUnprocessableEntity, b.post(t, "/payments", "k-1", "{}").status, "one scope: another route is another request")
		bob := b.post(t, "/payments", "k-1", "{}", "X-User", "bob")
		require.False(t, bob.replayed(), "another identity, another key")
		require.Equal(t, "3:bob api", bob.header.Get("X-Scope"))
		require.Equal(t, int32(2), b.calls.Load())
	})
}

func TestDeleteExpired(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	ctx := context.Background()
	for i := range 5 {
		require.Equal(t, http.StatusCreated, b.post(t, "/orders", fmt.Sprintf("k-%d", i), "{}").status)
	}
	for _, k := range []string{"k-0", "k-2", "k-4"} {
		b.expire(t, k)
	}

	for _, want := range []int64{2, 1, 0} {
		n, err := b.mw.DeleteExpired(ctx, 2)
		require.NoError(t, err)
		require.Equal(t, want, n, "bounded by the limit")
	}
	require.Equal(t, 2, b.count(t, "true"))
	require.Equal(t, 2, b.count(t, "key IN ('k-1', 'k-3')"), "live keys stay")

	_, err := b.mw.DeleteExpired(ctx, 0)
	require.Error(t, err)
}

func TestConcurrentDuplicatesRunHandlerOnce(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &cfg, nil)
		const n = 8
		start := make(chan struct{})
		results := make([]response, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				res, err := b.send(http.MethodPost, "/orders", "k-1", `{"sku":"A"}`)
				if err != nil {
					res.body = err.Error()
				}
				results[i] = res
			})
		}
		close(start)
		wg.Wait()

		require.Equal(t, int32(1), b.calls.Load(), "the handler ran exactly once")
		var original response
		originals, replays, conflicts := 0, 0, 0
		for _, res := range results {
			switch {
			case res.status == http.StatusCreated && !res.replayed():
				originals++
				original = res
			case res.status == http.StatusCreated:
				replays++
			case res.status == http.StatusConflict:
				conflicts++
			default:
				t.Fatalf("unexpected response %d: %s", res.status, res.body)
			}
		}
		require.Equal(t, 1, originals)
		require.Equal(t, n-1, replays+conflicts)
		for _, res := range results {
			if res.status == http.StatusCreated {
				require.Equal(t, original.body, res.body)
			}
		}
		t.Logf("%d replays, %d conflicts", replays, conflicts)
	})
}

func TestFromContextOutsideMiddleware(t *testing.T) {
	t.Parallel()
	_, ok := idempotency.FromContext(context.Background())
	require.False(t, ok)
	_, ok = idempotency.ScopeFromContext(context.Background())
	require.False(t, ok)
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewSchema(t)
	_, err := idempotency.New(pool, &idempotency.Config{Identity: idempotency.SharedIdentity})
	require.NoError(t, err, "only Identity has no default")

	_, err = idempotency.New(nil, &idempotency.Config{Identity: idempotency.SharedIdentity})
	require.ErrorIs(t, err, idempotency.ErrInvalidConfig)

	// No identity, no middleware: keys shared by every caller must be asked for.
	for _, cfg := range []*idempotency.Config{nil, {}, {Required: true, Scope: func(r *http.Request) string { return r.URL.Path }}} {
		_, err = idempotency.New(pool, cfg)
		require.ErrorIs(t, err, idempotency.ErrInvalidConfig)
		require.ErrorContains(t, err, "Identity")
		require.ErrorContains(t, err, "SharedIdentity")
	}

	for _, tc := range []struct {
		name  string
		cfg   idempotency.Config
		field string
	}{
		{"bad schema", idempotency.Config{Schema: "a-b"}, "Schema"},
		{"bad header", idempotency.Config{Header: "Idempotency Key"}, "Header"},
		{"short TTL", idempotency.Config{TTL: time.Millisecond}, "TTL"},
		{"negative MaxKeyLength", idempotency.Config{MaxKeyLength: -1}, "MaxKeyLength"},
		{"negative MaxBodyBytes", idempotency.Config{MaxBodyBytes: -1}, "MaxBodyBytes"},
		{"negative MaxResponseBytes", idempotency.Config{MaxResponseBytes: -1}, "MaxResponseBytes"},
		{"negative CleanupInterval", idempotency.Config{CleanupInterval: -time.Second}, "CleanupInterval"},
		{"negative CleanupBatch", idempotency.Config{CleanupBatch: -1}, "CleanupBatch"},
		{"bad ReplayHeaders", idempotency.Config{ReplayHeaders: []string{"Location", "a:b"}}, "ReplayHeaders"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Identity = idempotency.SharedIdentity
			_, err := idempotency.New(pool, &tc.cfg)
			require.ErrorIs(t, err, idempotency.ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.field)
		})
	}
}

func TestCustomHeader(t *testing.T) {
	t.Parallel()
	b := setup(t, &idempotency.Config{Header: "x-request-key", Required: true}, nil)
	res := b.post(t, "/orders", "k-1", "{}") // sends Idempotency-Key, which is not the configured header
	require.Equal(t, http.StatusBadRequest, res.status)
	require.Contains(t, res.errorMessage(t), "X-Request-Key")
	require.False(t, b.post(t, "/orders", "", "{}", "X-Request-Key", "k-1").replayed())
	require.True(t, b.post(t, "/orders", "", "{}", "X-Request-Key", "k-1").replayed())
}

// TestUnfinishedRequestHoldsItsKeyOnlyForTheInFlightTimeout: a request whose
// process died leaves its key in flight; the key is held for
// InFlightTimeout, not for the whole TTL, and kept for the TTL once done.
func TestUnfinishedRequestHoldsItsKeyOnlyForTheInFlightTimeout(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	b := setup(t, &idempotency.Config{TTL: time.Hour, InFlightTimeout: 2 * time.Second}, func(b *bundle, w http.ResponseWriter, r *http.Request) {
		<-release
		b.created(w, r)
	})
	done := make(chan response, 1)
	go func() {
		resp, err := b.send(http.MethodPost, "/orders", "k-lease", `{"sku":"book"}`)
		require.NoError(t, err)
		done <- resp
	}()
	lease := func() time.Duration {
		var d time.Duration
		require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT expires_at - created_at FROM "+b.table()+" WHERE key = 'k-lease'").Scan(&d))
		return d
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.count(t, "key = 'k-lease'") == 0 {
		require.True(t, time.Now().Before(deadline), "the key was never claimed")
		time.Sleep(5 * time.Millisecond)
	}
	require.Equal(t, 2*time.Second, lease(), "in flight: held for InFlightTimeout")
	close(release)
	<-done
	var left time.Duration
	require.NoError(t, b.pool.QueryRow(context.Background(), "SELECT expires_at - now() FROM "+b.table()+" WHERE key = 'k-lease'").Scan(&left))
	require.Greater(t, left, 59*time.Minute, "done: kept for the TTL")

	_, err := idempotency.New(b.pool, &idempotency.Config{Identity: idempotency.SharedIdentity, TTL: time.Minute, InFlightTimeout: time.Hour})
	require.ErrorContains(t, err, "InFlightTimeout 1h0m0s must be between 1s and TTL (1m0s)")
}
