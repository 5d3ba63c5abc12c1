package review25_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
)

// "the key is inserted as in flight, in a statement of its own that commits
// at once": the middleware holds no database connection while handlers run,
// so more slow handlers than the pool has connections (testkit's pool has at
// most 12) all run at once.
func TestMoreConcurrentHandlersThanPoolConnections(t *testing.T) {
	t.Parallel()
	const n = 30
	var entered atomic.Int64
	all := make(chan struct{})
	var once sync.Once
	rg := newIsolatedRig(t, "pg", nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if entered.Add(1) == n {
			once.Do(func() { close(all) })
		}
		select {
		case <-all:
			w.WriteHeader(http.StatusCreated)
		case <-time.After(5 * time.Second):
			w.WriteHeader(http.StatusGatewayTimeout)
		}
	}))
	var wg sync.WaitGroup
	out := make(chan int, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			out <- rg.do(t, q{key: fmt.Sprint("c", i), user: "alice"}).status
		}(i)
	}
	wg.Wait()
	close(out)
	for st := range out {
		require.Equal(t, http.StatusCreated, st, "only %d of %d handlers ran at once", entered.Load(), n)
	}
}

// The stored headers are those the client got: headers changed after the
// response began are not sent by net/http, so a replay must not carry them.
func TestHeadersChangedAfterTheResponseBeganAreNotReplayed(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		for _, how := range []string{"after WriteHeader", "after Write"} {
			t.Run(kind+"/"+how, func(t *testing.T) {
				t.Parallel()
				var c counter
				rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					c.inc()
					w.Header().Set("Location", "/orders/sent")
					w.Header().Set("Content-Type", "text/plain")
					if how == "after WriteHeader" {
						w.WriteHeader(http.StatusCreated)
					}
					_, _ = w.Write([]byte("body"))
					w.Header().Set("Location", "/orders/never-sent")
					w.Header().Set("Content-Type", "application/never-sent")
					w.Header().Set("Etag", `"never-sent"`)
				}))
				r1 := rg.do(t, q{key: "late", user: "alice"})
				require.Equal(t, "/orders/sent", r1.hdr.Get("Location"))
				require.Empty(t, r1.hdr.Get("Etag"))
				r2 := rg.settle(t, q{key: "late", user: "alice"})
				require.Equal(t, "true", r2.hdr.Get(idempotency.HeaderReplayed))
				require.Equal(t, int64(1), c.get())
				require.Equal(t, r1.status, r2.status)
				require.Equal(t, r1.hdr.Get("Location"), r2.hdr.Get("Location"), "the replay carries a Location the client never got")
				require.Equal(t, r1.hdr.Get("Content-Type"), r2.hdr.Get("Content-Type"))
				require.Equal(t, r1.hdr.Get("Etag"), r2.hdr.Get("Etag"), "the replay carries an ETag the client never got")
			})
		}
	}
}

// A handler that assigns a header under a non-canonical name (net/http
// sends it as it is: the client gets a Location header) — measured, see O.
func TestNonCanonicalHeaderName(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header()["location"] = []string{"/orders/lower"}
				w.WriteHeader(http.StatusCreated)
			}))
			r1 := rg.do(t, q{key: "nc", user: "alice"})
			require.Equal(t, "/orders/lower", r1.hdr.Get("Location"), "the client got the header")
			r2 := rg.settle(t, q{key: "nc", user: "alice"})
			require.Equal(t, "true", r2.hdr.Get(idempotency.HeaderReplayed))
			t.Logf("%s: replayed Location %q (first response had %q)", kind, r2.hdr.Get("Location"), r1.hdr.Get("Location"))
		})
	}
}

// The fingerprint's "path" and "query", measured with a scope that leaves the
// path out: an escaped slash, and the same parameters in another order.
func TestFingerprintPathAndQueryForms(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			rg := newRig(t, kind, &idempotency.Config{Scope: func(*http.Request) string { return "s" }}, echo(new(counter)))
			for _, p := range [][2]string{{"/a/b", "/a%2Fb"}, {"/o?a=1&b=2", "/o?b=2&a=1"}, {"/o?a=1", "/o?a=%31"}} {
				r1 := rg.do(t, q{key: p[0], user: "alice", path: p[0]})
				require.Equal(t, http.StatusCreated, r1.status)
				r2 := rg.do(t, q{key: p[0], user: "alice", path: p[1]})
				require.NotEqual(t, http.StatusInternalServerError, r2.status)
				t.Logf("%s: %s then %s with one key: %d replayed=%q", kind, p[0], p[1], r2.status, r2.hdr.Get(idempotency.HeaderReplayed))
			}
		})
	}
}

// "or hijacked the connection": handlers that hijack through the older type
// assertion (w.(http.Hijacker)), as many WebSocket libraries do, work too.
func TestHijackerTypeAssertion(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				c.inc()
				hj, ok := w.(http.Hijacker)
				if !ok {
					http.Error(w, "the writer is not an http.Hijacker", http.StatusTeapot)
					return
				}
				conn, bw, err := hj.Hijack()
				if err != nil {
					http.Error(w, err.Error(), http.StatusTeapot)
					return
				}
				defer conn.Close()
				_, _ = bw.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
				_ = bw.Flush()
			}))
			r := rg.do(t, q{key: "hj", user: "alice"})
			require.Equal(t, http.StatusCreated, r.status, "%q", r.body)
			r = rg.settle(t, q{key: "hj", user: "alice"})
			requireJSONError(t, r.status, r.hdr, r.body, http.StatusGone, "hijacked")
			require.Equal(t, int64(1), c.get())
		})
	}
}

// "If ... the response cannot be stored, the key stays in flight, and
// retries get 409, until it expires; the handler does not run twice." The
// response is made unstorable with a trigger of the test's own that refuses
// every UPDATE of idempotency_keys while the first request runs (the key's
// claim, an INSERT, goes through). Measured: what the retries get, before and
// after InFlightTimeout (see O1).
func TestResponseThatCannotBeStored(t *testing.T) {
	t.Parallel()
	var c counter
	rg := newIsolatedRig(t, "pg", &idempotency.Config{InFlightTimeout: time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.inc()
		w.WriteHeader(http.StatusCreated)
	}))
	ctx := context.Background()
	tbl := rg.db.Table("idempotency_keys")
	fn := `"` + rg.db.Schema + `".review25_refuse`
	_, err := rg.db.Pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'review25: refused'; END$$`)
	require.NoError(t, err)
	_, err = rg.db.Pool.Exec(ctx, `CREATE TRIGGER review25_refuse BEFORE UPDATE ON `+tbl+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)
	start := time.Now()
	r := rg.do(t, q{key: "lost", user: "alice"})
	require.Equal(t, http.StatusCreated, r.status)
	// both readings of the docs agree on this: the key is held, 409.
	r = rg.do(t, q{key: "lost", user: "alice"})
	if time.Since(start) < 900*time.Millisecond {
		requireJSONError(t, r.status, r.hdr, r.body, http.StatusConflict, "retry after the store failed")
		require.Equal(t, "1", r.hdr.Get("Retry-After"))
	}
	require.NotEqual(t, "true", r.hdr.Get(idempotency.HeaderReplayed), "an unstored response was replayed")
	_, err = rg.db.Pool.Exec(ctx, `DROP TRIGGER review25_refuse ON `+tbl)
	require.NoError(t, err)
	require.Contains(t, rg.logs.String(), "level=ERROR", "the store's failure was not logged as an error")
	time.Sleep(time.Until(start.Add(1300 * time.Millisecond)))
	r = rg.do(t, q{key: "lost", user: "alice"})
	t.Logf("retry after InFlightTimeout: %d replayed=%q, handler runs %d; logs:\n%s", r.status, r.hdr.Get(idempotency.HeaderReplayed), c.get(), rg.logs.String())
	require.Less(t, r.status, 500)
}
