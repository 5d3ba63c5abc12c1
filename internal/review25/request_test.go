package review25_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
)

// "The same key with a different request: 422"; the request is "a SHA-256 of
// the method, path, query and body"; with the default scope (method and
// path) another method or path is another key, and "with a scope that leaves
// the path out, a key reused on another route is a different request (422)".
func TestSameKeyOtherRequest(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			first := q{key: "k", user: "alice", path: "/orders?x=1", body: []byte("A")}
			r := rg.do(t, first)
			require.Equal(t, http.StatusCreated, r.status)
			for name, x := range map[string]q{
				"body":       {key: "k", user: "alice", path: "/orders?x=1", body: []byte("B")},
				"empty body": {key: "k", user: "alice", path: "/orders?x=1"},
				"query":      {key: "k", user: "alice", path: "/orders?x=2", body: []byte("A")},
				"no query":   {key: "k", user: "alice", path: "/orders", body: []byte("A")},
			} {
				r := rg.settle(t, x)
				requireJSONError(t, r.status, r.hdr, r.body, http.StatusUnprocessableEntity, name)
			}
			require.Equal(t, int64(1), c.get())
			// another method or path: another scope, another key.
			for name, x := range map[string]q{
				"PUT":        {method: http.MethodPut, key: "k", user: "alice", path: "/orders?x=1", body: []byte("A")},
				"other path": {key: "k", user: "alice", path: "/orders/x?x=1", body: []byte("A")},
			} {
				r := rg.do(t, x)
				require.Equal(t, http.StatusCreated, r.status, name)
				require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed), name)
			}
			require.Equal(t, int64(3), c.get())
			// and the original still replays.
			r = rg.do(t, first)
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, int64(1), decodeEcho(t, r.body).Run)
		})
	}
}

// With a scope that leaves the method and the path out, the fingerprint alone
// tells requests apart: shifting bytes across the boundaries of method, path,
// query and body makes a different request, which must get 422, never the
// first request's response.
func TestFingerprintBoundaries(t *testing.T) {
	t.Parallel()
	type req struct{ method, path, query, body string }
	pairs := []struct {
		name string
		a, b req
	}{
		{"query|body", req{"POST", "/o", "x=1", "2"}, req{"POST", "/o", "x=12", ""}},
		{"path|query", req{"POST", "/o", "x", ""}, req{"POST", "/ox", "", ""}},
		{"method|path", req{"POST", "/o", "", ""}, req{"POS", "T/o", "", ""}},
		{"path|body", req{"POST", "/o", "", "x"}, req{"POST", "/ox", "", ""}},
		{"NUL joiner", req{"POST", "/o", "a", "\x00b"}, req{"POST", "/o", "a\x00", "b"}},
		{"newline joiner", req{"POST", "/o", "a", "\nb"}, req{"POST", "/o", "a\n", "b"}},
	}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			cfg := &idempotency.Config{Scope: func(*http.Request) string { return "one scope" }}
			rg := newRig(t, kind, cfg, echo(&c))
			for i, p := range pairs {
				key := "fp-" + p.name
				ra := rg.serveDirect(rawReq(p.a.method, p.a.path, p.a.query, key, "alice", []byte(p.a.body)))
				require.Equal(t, http.StatusCreated, ra.Code, "%s: %s", p.name, ra.Body.String())
				rb := rg.serveDirect(rawReq(p.b.method, p.b.path, p.b.query, key, "alice", []byte(p.b.body)))
				require.NotEqual(t, "true", rb.Header().Get(idempotency.HeaderReplayed),
					"pair %d (%s): %+v was answered with the response of %+v", i, p.name, p.b, p.a)
				requireJSONError(t, rb.Code, rb.Header(), rb.Body.Bytes(), http.StatusUnprocessableEntity, p.name)
			}
		})
	}
}

// A retry of an unchanged request is "the same request" whatever the
// headers that are not part of the fingerprint say (the docs name only the
// method, path, query and body).
func TestHeadersAreNotPartOfTheRequest(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			r := rg.do(t, q{key: "h", user: "alice", body: []byte("A"), hdr: http.Header{"Content-Type": {"text/plain"}, "X-Trace": {"1"}}})
			require.Equal(t, http.StatusCreated, r.status)
			r = rg.settle(t, q{key: "h", user: "alice", body: []byte("A"), hdr: http.Header{"Content-Type": {"application/json"}, "X-Trace": {"2"}}})
			require.Equal(t, http.StatusCreated, r.status)
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
		})
	}
}

// "Requests of safe methods (GET, HEAD, OPTIONS, TRACE) pass through
// untouched": with a key (even a bad one) and Required, they run every time.
func TestSafeMethodsPassThrough(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, &idempotency.Config{Required: true}, echo(&c))
			for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace} {
				for _, key := range []string{"", "safe", "bad\x00key", "\xff"} {
					for i := 0; i < 2; i++ {
						rec := rg.serveDirect(rawAnon(m, key))
						require.Equal(t, http.StatusCreated, rec.Code, "%s key %q: %d %s", m, key, rec.Code, rec.Body.String())
						require.Empty(t, rec.Header().Get(idempotency.HeaderReplayed))
					}
				}
			}
			require.Equal(t, int64(4*4*2), c.get())
		})
	}
}

// rawAnon is a request without an identity at all.
func rawAnon(method, key string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/orders", nil)
	r.Method = method
	if key != "" {
		r.Header[idempotency.HeaderDefault] = []string{key}
	}
	return r
}

// Required: an unsafe request without a key is 400 and runs nothing; without
// Required it runs, unprotected, every time (FromContext reports no key).
func TestRequiredAndNoKey(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, &idempotency.Config{Required: true}, echo(&c))
			r := rg.do(t, q{user: "alice", body: []byte("A")})
			requireJSONError(t, r.status, r.hdr, r.body, http.StatusBadRequest, "no key, required")
			require.Zero(t, c.get())

			var c2 counter
			sawKey := make(chan bool, 4)
			rg2 := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, ok := idempotency.FromContext(r.Context())
				sawKey <- ok
				echo(&c2)(w, r)
			}))
			for i := 0; i < 2; i++ {
				r := rg2.do(t, q{user: "alice", body: []byte("A")})
				require.Equal(t, http.StatusCreated, r.status)
				require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed))
				require.False(t, <-sawKey)
			}
			require.Equal(t, int64(2), c2.get())
		})
	}
}
