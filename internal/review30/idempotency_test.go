package review30_test

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/idempotency"
)

// idemServer serves a handler behind the middleware built from cfg (its
// Schema and Identity filled); the handler answers 201 with the length of
// the body it read, and counts its runs.
func idemServer(t *testing.T, cfg idempotency.Config) (*httptest.Server, *atomic.Int64, *idempotency.Middleware) {
	t.Helper()
	pool, schema := db(t)
	cfg.Schema, cfg.Identity, cfg.Logger = schema, idempotency.SharedIdentity, discard
	m, err := idempotency.New(pool, &cfg)
	if err != nil {
		t.Fatalf("idempotency.New: %v", err)
	}
	var runs atomic.Int64
	srv := httptest.NewServer(m.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "read %d bytes", len(b))
	})))
	t.Cleanup(srv.Close)
	return srv, &runs, m
}

type reply struct {
	status   int
	body     string
	replayed bool
}

func post(t *testing.T, srv *httptest.Server, key, body string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	res, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return reply{res.StatusCode, string(b), res.Header.Get(idempotency.HeaderReplayed) == "true"}
}

// TestIdempotencyTTLExtremes: TTL "is how long a key is kept from the
// moment its response was stored ... at least TTLMin"; InFlightTimeout "at
// most TTL". With TTLs of 37 minutes, 25 and 30 days, years and
// time.Duration's longest (and an in-flight lease as long), the first
// request runs and its retry gets the stored response.
func TestIdempotencyTTLExtremes(t *testing.T) {
	t.Parallel()
	for _, ttl := range []time.Duration{idempotency.TTLMin, 37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, 200 * 365 * 24 * time.Hour, math.MaxInt64} {
		t.Run(ttl.String(), func(t *testing.T) {
			t.Parallel()
			inflight := ttl
			if ttl == idempotency.TTLMin {
				inflight = 0
			}
			srv, runs, _ := idemServer(t, idempotency.Config{TTL: ttl, InFlightTimeout: inflight})
			first := post(t, srv, "k-1", "hello")
			second := post(t, srv, "k-1", "hello")
			if first.status != http.StatusCreated || second.status != http.StatusCreated || !second.replayed || second.body != first.body || runs.Load() != 1 {
				t.Fatalf("TTL %v: first %+v, retry %+v, handler runs %d; want 201, a replayed 201 with the same body, 1 run", ttl, first, second, runs.Load())
			}
		})
	}
}

// TestIdempotencyTTLBelowTheMinimumIsRefused: "at least TTLMin"; an
// InFlightTimeout above the TTL is "at most TTL".
func TestIdempotencyTTLBelowTheMinimumIsRefused(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	for _, cfg := range []idempotency.Config{{TTL: time.Nanosecond}, {TTL: time.Microsecond}, {TTL: time.Second - 1}, {TTL: -time.Hour}, {TTL: math.MinInt64}} {
		cfg.Schema, cfg.Identity = schema, idempotency.SharedIdentity
		if _, err := idempotency.New(pool, &cfg); err == nil {
			t.Errorf("New accepted TTL %v, below TTLMin", cfg.TTL)
		}
	}
}

// TestIdempotencyHugeLimits: MaxBodyBytes "is the largest request body
// accepted; the body is read whole to be hashed", MaxResponseBytes "the
// largest response body kept for replay", MaxKeyLength "the longest key
// accepted". Near int64's (int's) largest, an ordinary request reaches the
// handler with its whole body, its retry is replayed (not 410), the same
// key with another body gets 422, and a key of 600 bytes is accepted.
func TestIdempotencyHugeLimits(t *testing.T) {
	t.Parallel()
	srv, runs, _ := idemServer(t, idempotency.Config{MaxBodyBytes: math.MaxInt64 - 1, MaxResponseBytes: math.MaxInt64, MaxKeyLength: math.MaxInt})
	checkBodies(t, srv, runs, strings.Repeat("k", 600))
}

// TestIdempotencyMaxBodyBytesOfInt64sLargest: the same with MaxBodyBytes
// exactly math.MaxInt64 (the natural way to write "no limit").
func TestIdempotencyMaxBodyBytesOfInt64sLargest(t *testing.T) {
	t.Parallel()
	srv, runs, _ := idemServer(t, idempotency.Config{MaxBodyBytes: math.MaxInt64})
	checkBodies(t, srv, runs, "key-1")
}

func checkBodies(t *testing.T, srv *httptest.Server, runs *atomic.Int64, key string) {
	t.Helper()
	first := post(t, srv, key, "0123456789")
	if first.status != http.StatusCreated || first.body != "read 10 bytes" {
		t.Errorf("first request: %+v, want 201 \"read 10 bytes\"", first)
	}
	second := post(t, srv, key, "0123456789")
	if second.status != http.StatusCreated || !second.replayed || second.body != first.body || runs.Load() != 1 {
		t.Errorf("retry: %+v after %d runs, want the replayed 201", second, runs.Load())
	}
	other := post(t, srv, key, "another body")
	if other.status != http.StatusUnprocessableEntity {
		t.Errorf("the same key with another body: %+v, want 422", other)
	}
}

// TestIdempotencyNegativeLimits: negative sizes, intervals and batches are
// refused by New with ErrInvalidConfig, or work; they must not panic or
// make every request fail.
func TestIdempotencyNegativeLimits(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	cases := map[string]idempotency.Config{
		"MaxBodyBytes":     {MaxBodyBytes: -1},
		"MaxResponseBytes": {MaxResponseBytes: -1},
		"MaxKeyLength":     {MaxKeyLength: -1},
		"CleanupInterval":  {CleanupInterval: -time.Second},
		"CleanupBatch":     {CleanupBatch: -1},
		"InFlightTimeout":  {InFlightTimeout: -time.Second},
	}
	for name, cfg := range cases {
		cfg.Schema, cfg.Identity, cfg.Logger = schema, idempotency.SharedIdentity, discard
		m, err := idempotency.New(pool, &cfg)
		if err != nil {
			if !strings.Contains(err.Error(), name) {
				t.Errorf("%s negative refused without naming it: %v", name, err)
			}
			continue
		}
		srv := httptest.NewServer(m.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "ok")
		})))
		a := post(t, srv, "neg-"+name, "x")
		b := post(t, srv, "neg-"+name, "x")
		srv.Close()
		if a.status != http.StatusCreated || b.status != http.StatusCreated || !b.replayed {
			t.Errorf("%s negative accepted by New; then first %+v, retry %+v; want 201 and a replayed 201", name, a, b)
		}
	}
}

// TestIdempotencyDeleteExpiredLimits: DeleteExpired "deletes up to limit
// expired keys ... and returns how many". Limits of 1, 2^31 and int's
// largest work; 0 or a negative limit deletes nothing (or is an error), and
// never everything.
func TestIdempotencyDeleteExpiredLimits(t *testing.T) {
	t.Parallel()
	srv, _, m := idemServer(t, idempotency.Config{TTL: idempotency.TTLMin, CleanupInterval: 1000 * time.Hour})
	for i := range 4 {
		if r := post(t, srv, fmt.Sprintf("e-%d", i), "x"); r.status != http.StatusCreated {
			t.Fatalf("post: %+v", r)
		}
	}
	time.Sleep(1100 * time.Millisecond) // the TTL (1 s) passes
	ctx := context.Background()
	for _, lim := range []int{0, -1, math.MinInt} {
		if n, err := m.DeleteExpired(ctx, lim); n != 0 {
			t.Errorf("DeleteExpired(%d) = %d, %v; want 0 deleted", lim, n, err)
		}
	}
	if n, err := m.DeleteExpired(ctx, 1); err != nil || n != 1 {
		t.Errorf("DeleteExpired(1) = %d, %v; want 1", n, err)
	}
	if n, err := m.DeleteExpired(ctx, 1<<31); err != nil || n != 3 {
		t.Errorf("DeleteExpired(2^31) = %d, %v; want 3", n, err)
	}
	if n, err := m.DeleteExpired(ctx, math.MaxInt); err != nil || n != 0 {
		t.Errorf("DeleteExpired(MaxInt) = %d, %v; want 0 (none left)", n, err)
	}
}

// TestPostgresStoreLeaseExtremes: Claim takes a key "for lease: a claim
// that is neither completed nor released within it lapses ... and the key
// is free again"; Complete "keeps it for ttl". A lease of 1 ns lapses at
// once; leases and TTLs of 25 days and time.Duration's longest hold.
func TestPostgresStoreLeaseExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	st, err := idempotency.NewPostgresStore(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	hash := []byte("h")
	// A 1 ns lease lapses.
	if _, ok, err := st.Claim(ctx, "s", "short", hash, time.Nanosecond); err != nil || !ok {
		t.Fatalf("Claim 1ns: %v %v", ok, err)
	}
	time.Sleep(5 * time.Millisecond)
	if _, ok, err := st.Claim(ctx, "s", "short", hash, time.Minute); err != nil || !ok {
		t.Errorf("a claim of 1 ns did not lapse: second Claim = %v, %v", ok, err)
	}
	for _, d := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, math.MaxInt64} {
		key := "long-" + d.String()
		c, ok, err := st.Claim(ctx, "s", key, hash, d)
		if err != nil || !ok {
			t.Errorf("Claim with lease %v: %v, %v", d, ok, err)
			continue
		}
		if _, ok, err := st.Claim(ctx, "s", key, hash, d); err != nil || ok {
			t.Errorf("lease %v: a second Claim took the held key (%v, %v)", d, ok, err)
		}
		ok, err = st.Complete(ctx, "s", key, c, &idempotency.Response{Status: 201, Body: []byte("b")}, d)
		if err != nil || !ok {
			t.Errorf("Complete with ttl %v: %v, %v", d, ok, err)
			continue
		}
		rec, err := st.Get(ctx, "s", key)
		if err != nil || rec.Response == nil || string(rec.Response.Body) != "b" {
			t.Errorf("Get after Complete with ttl %v: %+v, %v", d, rec, err)
		}
	}
}
