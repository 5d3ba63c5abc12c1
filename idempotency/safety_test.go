package idempotency_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
)

// TestIdentitiesDoNotShareKeys: two callers who send the same key with the
// same request each get their own handler run and response; a caller's
// retry is replayed from its own.
func TestIdentitiesDoNotShareKeys(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &cfg, nil)
		alice := b.post(t, "/orders", "k-1", `{"sku":"A"}`, "X-User", "alice")
		bob := b.post(t, "/orders", "k-1", `{"sku":"A"}`, "X-User", "bob")
		require.Equal(t, http.StatusCreated, alice.status)
		require.Equal(t, http.StatusCreated, bob.status)
		require.False(t, alice.replayed())
		require.False(t, bob.replayed(), "bob does not get alice's stored response")
		require.NotEqual(t, alice.body, bob.body)
		require.Equal(t, int32(2), b.calls.Load(), "two identities, two handler runs")

		for _, first := range []response{alice, bob} {
			user := "alice"
			if first.body == bob.body {
				user = "bob"
			}
			again := b.post(t, "/orders", "k-1", `{"sku":"A"}`, "X-User", user)
			require.True(t, again.replayed())
			require.Equal(t, first.body, again.body, "%s gets its own response again", user)
		}
		require.Equal(t, int32(2), b.calls.Load(), "the same identity: one handler run, then replays")
		if b.pg { // how PostgreSQL stores it
			require.Equal(t, 2, b.count(t, "key = 'k-1'"))
		}
	})
}

func TestRequestWithoutIdentityIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	res := b.post(t, "/orders", "k-1", "{}", "X-User", "") // headerIdentity: no header, an error
	require.Equal(t, http.StatusUnauthorized, res.status)
	require.Contains(t, res.errorMessage(t), "could not be identified")
	require.NotContains(t, res.body, "X-User", "the identity function's error is not sent to the client")

	empty := setup(t, &idempotency.Config{Identity: func(*http.Request) (string, error) { return "", nil }}, nil)
	require.Equal(t, http.StatusUnauthorized, empty.post(t, "/orders", "k-1", "{}").status, "an empty identity is no identity")

	require.Equal(t, int32(0), b.calls.Load()+empty.calls.Load(), "the handler never ran")
	require.Equal(t, 0, b.count(t, "true")+empty.count(t, "true"), "nothing was stored")

	// Without a key there is nothing to scope: the identity is not asked for.
	require.Equal(t, http.StatusCreated, b.post(t, "/orders", "", "{}", "X-User", "").status)
}

// TestSharedIdentity: sharing keys among callers is possible, by name.
func TestSharedIdentity(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		cfg.Identity = idempotency.SharedIdentity
		b := setup(t, &cfg, nil)
		alice := b.post(t, "/orders", "k-1", "{}", "X-User", "alice")
		bob := b.post(t, "/orders", "k-1", "{}", "X-User", "bob")
		require.True(t, bob.replayed())
		require.Equal(t, alice.body, bob.body)
		require.Equal(t, int32(1), b.calls.Load())
		if b.pg { // how PostgreSQL stores it
			require.Equal(t, 1, b.count(t, "scope = '6:shared POST /orders'"))
		}
	})
}

// TestMaxResponseBytes: a response over the limit reaches the client whole
// but is not kept; the key is, so the handler does not run again, and a
// retry is told so (410 Gone, with the first response's Location).
func TestMaxResponseBytes(t *testing.T) {
	t.Parallel()
	eachStore(t, func(t *testing.T, cfg idempotency.Config) {
		b := setup(t, &idempotency.Config{MaxResponseBytes: 16, Store: cfg.Store}, func(b *bundle, w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			w.Header().Set("Location", "/reports/"+string(body))
			w.WriteHeader(http.StatusCreated)
			// Two writes: the limit is on their sum.
			_, _ = io.WriteString(w, strings.Repeat("a", 10))
			_, _ = io.WriteString(w, strings.Repeat("b", len(body)))
		})

		large := b.post(t, "/reports", "k-large", "1234567")
		require.Equal(t, http.StatusCreated, large.status)
		require.Equal(t, strings.Repeat("a", 10)+strings.Repeat("b", 7), large.body, "the client gets the whole response")
		if b.pg { // how PostgreSQL stores it
			require.Equal(t, 1, b.count(t, "key = 'k-large' AND status = 'done' AND response_status = 201 AND response_body IS NULL"),
				"done, without the body")
		}

		retry := b.post(t, "/reports", "k-large", "1234567")
		require.Equal(t, http.StatusGone, retry.status)
		require.True(t, retry.replayed())
		require.Equal(t, "/reports/1234567", retry.header.Get("Location"))
		msg := retry.errorMessage(t)
		require.Contains(t, msg, "was processed (status 201)")
		require.Contains(t, msg, "larger than 16 bytes")
		require.Equal(t, int32(1), b.calls.Load(), "the handler did not run again")

		// At the limit, the response is kept and replayed.
		fits := b.post(t, "/reports", "k-fits", "123456")
		require.Equal(t, 16, len(fits.body))
		again := b.post(t, "/reports", "k-fits", "123456")
		require.Equal(t, http.StatusCreated, again.status)
		require.True(t, again.replayed())
		require.Equal(t, fits.body, again.body)
		require.Equal(t, int32(2), b.calls.Load())
	})
}

// TestStreamedResponseIsNotStored: a handler that flushes (directly, through
// http.ResponseController, or as a stream of server-sent events) or
// hijacks the connection streams its response: it is not kept, and the
// handler does not run again for its key.
func TestStreamedResponseIsNotStored(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		handler func(w http.ResponseWriter)
		want    string
	}{
		{"Flusher", func(w http.ResponseWriter) {
			_, _ = io.WriteString(w, "part 1;")
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, "part 2")
		}, "part 1;part 2"},
		{"ResponseController", func(w http.ResponseWriter) {
			_, _ = io.WriteString(w, "part 1;")
			if err := http.NewResponseController(w).Flush(); err != nil {
				panic(err)
			}
			_, _ = io.WriteString(w, "part 2")
		}, "part 1;part 2"},
		{"server-sent events", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			for i := range 3 {
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
			}
		}, "data: 0\n\ndata: 1\n\ndata: 2\n\n"},
		{"Hijacker", func(w http.ResponseWriter) {
			conn, rw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				panic(err)
			}
			defer conn.Close()
			_, _ = rw.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nhijacked")
			_ = rw.Flush()
		}, "hijacked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil, func(b *bundle, w http.ResponseWriter, r *http.Request) { tc.handler(w) })
			first := b.post(t, "/stream", "k-1", "{}")
			require.Equal(t, http.StatusOK, first.status)
			require.Equal(t, tc.want, first.body, "the client gets the stream")
			require.False(t, first.replayed())
			// A hijacked connection's client may read its response before
			// the handler returns and the key is stored.
			require.Eventually(t, func() bool { return b.count(t, "key = 'k-1' AND status = 'done'") == 1 }, 10*time.Second, 5*time.Millisecond)
			require.Equal(t, 1, b.count(t, "key = 'k-1' AND response_body IS NULL"), "the stream is not stored")

			retry := b.post(t, "/stream", "k-1", "{}")
			require.Equal(t, http.StatusGone, retry.status)
			require.Contains(t, retry.errorMessage(t), "streamed")
			require.Equal(t, int32(1), b.calls.Load(), "the handler ran once")
		})
	}
}

// TestExpiredKeysAreDeletedWithoutACall: the middleware deletes expired
// keys itself, after requests, in batches of CleanupBatch, at most once per
// CleanupInterval unless a batch came back full.
func TestExpiredKeysAreDeletedWithoutACall(t *testing.T) {
	t.Parallel()

	t.Run("every request may clean", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &idempotency.Config{CleanupInterval: time.Nanosecond, CleanupBatch: 2}, nil)
		for i := range 5 {
			require.Equal(t, http.StatusCreated, b.post(t, "/orders", fmt.Sprintf("k-%d", i), "{}").status)
		}
		for _, k := range []string{"k-0", "k-2", "k-4"} {
			b.expire(t, k)
		}
		require.Equal(t, 3, b.count(t, "expires_at <= now()"))

		b.post(t, "/orders", "k-5", "{}")
		require.Equal(t, 1, b.count(t, "expires_at <= now()"), "one request deletes one batch")
		require.True(t, b.post(t, "/orders", "k-1", "{}").replayed(), "a replay cleans too")
		require.Equal(t, 0, b.count(t, "expires_at <= now()"), "no DeleteExpired call was needed")
		require.Equal(t, 3, b.count(t, "key IN ('k-1', 'k-3', 'k-5')"), "live keys stay")
	})

	t.Run("once per interval, unless a batch was full", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &idempotency.Config{CleanupBatch: 2}, nil) // CleanupIntervalDefault: a minute
		addExpired := func(n int) {
			b.exec(t, "INSERT INTO "+b.table()+` (scope, key, request_hash, status, created_at, expires_at)
				SELECT 'old', 'old-' || i || '-' || gen_random_uuid(), '\x00', 'in_flight', now() - interval '1 hour', now() - interval '1 second'
				FROM generate_series(1, $1) AS i`, n)
		}
		addExpired(5)
		for i, left := range []int{3, 1, 0} {
			b.post(t, "/orders", fmt.Sprintf("k-%d", i), "{}")
			require.Equal(t, left, b.count(t, "expires_at <= now()"), "after request %d", i)
		}
		addExpired(1)
		b.post(t, "/orders", "k-3", "{}")
		require.Equal(t, 1, b.count(t, "expires_at <= now()"), "the last batch was not full: no cleanup within the interval")
	})
}

// TestPoisonKeys: a key header the database cannot store, or too long, gets
// 400 with a message, never a 5xx; a long key that MaxKeyLength allows is
// stored as its hash.
func TestPoisonKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)

	// net/http's server refuses a NUL in a header before any handler; the
	// middleware may sit behind another server, so it is given one directly.
	req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "k\x00-1")
	req.Header.Set("X-User", "alice")
	rec := httptest.NewRecorder()
	b.mw.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("the handler ran") })).ServeHTTP(rec, req)
	require.Equal(t, http.StatusBadRequest, rec.Code)
	require.Contains(t, response{status: rec.Code, header: rec.Header(), body: rec.Body.String()}.errorMessage(t), "printable UTF-8")

	invalid := b.post(t, "/orders", "k\xff\xfe-1", "{}")
	require.Equal(t, http.StatusBadRequest, invalid.status)
	require.Contains(t, invalid.errorMessage(t), "printable UTF-8")

	long := b.post(t, "/orders", strings.Repeat("k", 10_000), "{}")
	require.Equal(t, http.StatusBadRequest, long.status)
	require.Contains(t, long.errorMessage(t), "longer than 255 bytes")
	require.Equal(t, int32(0), b.calls.Load())
	require.Equal(t, 0, b.count(t, "true"))

	// Allowed long keys are stored as their hash, past the index's limit.
	wide := setup(t, &idempotency.Config{MaxKeyLength: 20_000}, func(b *bundle, w http.ResponseWriter, r *http.Request) {
		key, _ := idempotency.FromContext(r.Context())
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, fmt.Sprint(len(key)))
	})
	for _, key := range []string{strings.Repeat("k", 10_000), strings.Repeat("k", 10_001)} {
		first := wide.post(t, "/orders", key, "{}")
		require.Equal(t, http.StatusCreated, first.status)
		require.Equal(t, fmt.Sprint(len(key)), first.body, "the handler sees the key as sent")
		require.True(t, wide.post(t, "/orders", key, "{}").replayed())
	}
	require.Equal(t, int32(2), wide.calls.Load(), "two long keys, two keys")
	require.Equal(t, 2, wide.count(t, "key LIKE 'sha256:%' AND length(key) = 71"))
}

// TestPoisonIdentities: identities are untrusted bytes too (a claim from a
// token): NUL, invalid UTF-8 and 10 kB identities each get their own keys,
// are never confused with one another, and never cause a 5xx.
func TestPoisonIdentities(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	identities := []string{
		"a\x00b",
		`a\0b`, // what a NUL would become if it were escaped rather than hashed
		"a\xffb",
		"a\xfeb",
		"a\uFFFDb", // what invalid UTF-8 would become if it were replaced
		strings.Repeat("u", 10_000),
		strings.Repeat("u", 10_000) + "\x00",
	}
	bodies := map[string]bool{}
	for _, id := range identities {
		first := b.post(t, "/orders", "k-1", "{}", "X-User", url.PathEscape(id))
		require.Equal(t, http.StatusCreated, first.status, "%q: %s", id, first.body)
		require.False(t, first.replayed(), "%q got another identity's response", id)
		bodies[first.body] = true
		again := b.post(t, "/orders", "k-1", "{}", "X-User", url.PathEscape(id))
		require.True(t, again.replayed(), "%q", id)
		require.Equal(t, first.body, again.body)
	}
	require.Len(t, bodies, len(identities))
	require.Equal(t, int32(len(identities)), b.calls.Load())
	require.Equal(t, len(identities), b.count(t, "key = 'k-1'"))
}

// TestHijackUnsupported: the recorder offers Hijack; where the connection
// cannot be hijacked, the handler gets the error and the response is kept
// as usual.
func TestHijackUnsupported(t *testing.T) {
	t.Parallel()
	b := setup(t, nil, nil)
	h := b.mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _, err := w.(http.Hijacker).Hijack()
		require.Error(t, err)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "kept")
	}))
	serve := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k-1")
		req.Header.Set("X-User", "alice")
		rec := httptest.NewRecorder() // cannot be hijacked
		h.ServeHTTP(rec, req)
		return rec
	}
	require.Equal(t, http.StatusCreated, serve().Code)
	again := serve()
	require.Equal(t, "kept", again.Body.String())
	require.Equal(t, "true", again.Header().Get(idempotency.HeaderReplayed))
}
