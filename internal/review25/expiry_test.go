package review25_test

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/idempotency/redisstore"
)

// "A key whose expiry has passed ... counts as absent: the request runs again
// and its key replaces the old row"; TTL counts "from the moment its response
// was stored".
func TestExpiry(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			const ttl = 2 * time.Second
			rg := newRig(t, kind, &idempotency.Config{TTL: ttl, InFlightTimeout: time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/slow" {
					time.Sleep(800 * time.Millisecond)
				}
				echo(&c)(w, r)
			}))
			// run 1: a handler of 0.8 s; its TTL counts from its response.
			r := rg.do(t, q{key: "slow", path: "/slow", user: "alice"})
			require.Equal(t, http.StatusCreated, r.status)
			tSlow := time.Now()
			r = rg.do(t, q{key: "e", user: "alice", body: []byte("A")})
			require.Equal(t, int64(2), decodeEcho(t, r.body).Run)
			r = rg.do(t, q{key: "e2", user: "alice", body: []byte("A")})
			require.Equal(t, int64(3), decodeEcho(t, r.body).Run)
			tE2 := time.Now()
			r = rg.settle(t, q{key: "e", user: "alice", body: []byte("A")})
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed), "within the TTL")
			// 1.5 s after the slow response, 2.3 s after its claim: kept.
			time.Sleep(time.Until(tSlow.Add(1500 * time.Millisecond)))
			r = rg.do(t, q{key: "slow", path: "/slow", user: "alice"})
			if since := time.Since(tSlow); since < ttl-200*time.Millisecond {
				require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed), "the TTL was counted from the claim, not the response")
			} else {
				t.Logf("too slow to check the TTL's start (%v)", since)
			}
			time.Sleep(time.Until(tE2.Add(ttl + 400*time.Millisecond)))
			r = rg.do(t, q{key: "e", user: "alice", body: []byte("A")})
			require.Equal(t, http.StatusCreated, r.status)
			require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed), "an expired key was replayed")
			require.Equal(t, int64(4), decodeEcho(t, r.body).Run)
			r = rg.settle(t, q{key: "e", user: "alice", body: []byte("A")})
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, int64(4), decodeEcho(t, r.body).Run, "the new response replaced the old one")
			// an expired key with another body is absent, not a 422.
			r = rg.do(t, q{key: "e2", user: "alice", body: []byte("B")})
			require.Equal(t, http.StatusCreated, r.status, "%q", r.body)
		})
	}
}

func countRows(t *testing.T, g *rig) int {
	t.Helper()
	return g.db.Count(t, "SELECT count(*) FROM "+g.db.Table("idempotency_keys"))
}

// DeleteExpired "deletes up to limit expired keys ... and returns how many";
// Redis expires its keys itself and DeleteExpired returns 0.
func TestDeleteExpired(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newIsolatedRig(t, kind, &idempotency.Config{TTL: 2 * time.Second, InFlightTimeout: time.Second, CleanupInterval: time.Hour}, echo(&c))
			start := time.Now()
			for i := 0; i < 5; i++ {
				rec := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", fmt.Sprint("x", i), "alice", nil))
				require.Equal(t, http.StatusCreated, rec.Code)
			}
			ctx := context.Background()
			n, err := rg.mw.DeleteExpired(ctx, 10)
			require.NoError(t, err)
			if time.Since(start) < 1500*time.Millisecond {
				require.Zero(t, n, "nothing has expired yet")
			}
			time.Sleep(2200 * time.Millisecond)
			if kind == "redis" {
				n, err := rg.mw.DeleteExpired(ctx, 10)
				require.NoError(t, err)
				require.Zero(t, n)
				require.Empty(t, redisKeys(t, rg.rdb, rg.prefix), "Redis kept expired keys")
				return
			}
			require.Equal(t, 5, countRows(t, rg))
			for _, want := range []int64{2, 2, 1, 0} {
				n, err := rg.mw.DeleteExpired(ctx, 2)
				require.NoError(t, err)
				require.Equal(t, want, n)
			}
			require.Zero(t, countRows(t, rg))
		})
	}
}

// The middleware's own cleanup: "after a request that carries a key, at
// most once per Config.CleanupInterval ... per middleware, up to
// Config.CleanupBatch keys in one statement, and again on the next request
// while batches come back full. That request waits for the statement."
func TestAutomaticCleanup(t *testing.T) {
	t.Parallel()
	var c counter
	const ttl = 2 * time.Second
	rg := newIsolatedRig(t, "pg", &idempotency.Config{TTL: ttl, InFlightTimeout: time.Second, CleanupInterval: time.Hour}, echo(&c))
	for i := 0; i < 5; i++ {
		rg.serveDirect(rawReq(http.MethodPost, "/orders", "", fmt.Sprint("old", i), "alice", nil))
	}
	require.Equal(t, 5, countRows(t, rg))
	time.Sleep(ttl + 200*time.Millisecond)
	// a second middleware on the same schema, batch 2.
	mw2, err := idempotency.New(rg.db.Pool, &idempotency.Config{Schema: rg.db.Schema, Identity: identityFromContext,
		TTL: ttl, InFlightTimeout: time.Second, CleanupInterval: time.Hour, CleanupBatch: 2, Logger: discard()})
	require.NoError(t, err)
	h2 := mw2.Wrap(echo(&c))
	send := func(key string) {
		rec := serveRec(h2, rawReq(http.MethodPost, "/orders", "", key, "alice", nil))
		require.Equal(t, http.StatusCreated, rec.Code)
	}
	send("new0") // deletes 2 of 5: 3 old + 1 new
	require.Equal(t, 4, countRows(t, rg))
	send("new1") // full batch before: deletes 2 more: 1 old + 2 new
	require.Equal(t, 3, countRows(t, rg))
	send("new2") // deletes the last old one (not a full batch): 3 new
	require.Equal(t, 3, countRows(t, rg))
	time.Sleep(ttl + 200*time.Millisecond)
	send("new3") // the interval has not passed and the last batch was not full
	require.Equal(t, 4, countRows(t, rg))
}

// Redis: every key the store writes has a time to live (the lease while in
// flight, the TTL once done), is named Prefix + 64 hex digits, and a
// released key is gone.
func TestRedisKeysLiveAsDocumented(t *testing.T) {
	t.Parallel()
	g := newGate()
	var c counter
	rg := newRig(t, "redis", &idempotency.Config{TTL: time.Hour, InFlightTimeout: 30 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/held" {
			g.wait()
		}
		if r.URL.Path == "/fail" {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		echo(&c)(w, r)
	}))
	name := regexp.MustCompile("^" + regexp.QuoteMeta(rg.prefix) + "[0-9a-f]{64}$")
	ctx := context.Background()
	done := make(chan res, 1)
	go func() { done <- rg.do(t, q{key: "held", path: "/held", user: "alice"}) }()
	g.waitEntered(t)
	keys := redisKeys(t, rg.rdb, rg.prefix)
	require.Len(t, keys, 1)
	require.Regexp(t, name, keys[0])
	ttl := rg.rdb.PTTL(ctx, keys[0]).Val()
	require.True(t, ttl > 25*time.Second && ttl <= 30*time.Second, "in-flight key's TTL %v, want the 30 s lease", ttl)
	g.release()
	require.Equal(t, http.StatusCreated, (<-done).status)
	ttl = rg.rdb.PTTL(ctx, keys[0]).Val()
	require.True(t, ttl > 59*time.Minute && ttl <= time.Hour, "done key's TTL %v, want the 1 h TTL", ttl)
	r := rg.do(t, q{key: "f", path: "/fail", user: "alice"})
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	keys = redisKeys(t, rg.rdb, rg.prefix)
	require.Len(t, keys, 1, "a released key is still in Redis")
	for _, k := range keys {
		require.Regexp(t, name, k)
		require.Positive(t, rg.rdb.PTTL(ctx, k).Val(), "key %s has no time to live", k)
	}
	_, err := redisstore.New(nil, "")
	require.Error(t, err, "redisstore.New(nil)")
}

// With the default scope, a request to /orders with key "x1" and one to
// /ordersx with key "1" (same caller) are two keys: the store must not join
// scope and key in a way that makes them one.
func TestScopeAndKeyJoinIsUnambiguous(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			for _, p := range [][2]q{
				{{path: "/orders", key: "x1"}, {path: "/ordersx", key: "1"}},
				{{path: "/a", key: "/b"}, {path: "/a/", key: "b"}},
				{{path: "/a", key: ":b"}, {path: "/a:", key: "b"}},
			} {
				for i, x := range p {
					x.user = "alice"
					x.body = []byte("same")
					r := rg.do(t, x)
					require.Equal(t, http.StatusCreated, r.status, "%+v", x)
					require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed), "request %d (%s, %q) answered from another scope's key", i, x.path, x.key)
				}
			}
			require.Equal(t, int64(6), c.get())
		})
	}
}
