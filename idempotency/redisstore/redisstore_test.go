package redisstore_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/idempotency/redisstore"
)

func redisAddr() string {
	if a := os.Getenv("SAGAFLOW_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

// client returns a Redis client, or skips the test when Redis does not
// answer.
func client(t *testing.T) *redis.Client {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr()})
	t.Cleanup(func() { _ = rdb.Close() })
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		t.Skipf("no Redis at %s (set SAGAFLOW_REDIS_ADDR): %v", redisAddr(), err)
	}
	return rdb
}

// newStore returns a store under a prefix of the test's own, emptied at the
// end.
func newStore(t *testing.T, rdb *redis.Client, prefix string) *redisstore.Store {
	t.Helper()
	t.Cleanup(func() {
		keys, _ := rdb.Keys(context.Background(), prefix+"*").Result()
		if len(keys) > 0 {
			_ = rdb.Del(context.Background(), keys...).Err()
		}
	})
	st, err := redisstore.New(rdb, prefix)
	require.NoError(t, err)
	return st
}

func TestStoreClaimsCompletesReleasesAndFences(t *testing.T) {
	t.Parallel()
	rdb := client(t)
	st := newStore(t, rdb, "sagaflow-test:"+uuid.NewString()+":")
	ctx := context.Background()
	hash := []byte{0, 1, 2, 0xff}

	c1, ok, err := st.Claim(ctx, "scope", "k", hash, time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	_, ok, err = st.Claim(ctx, "scope", "k", hash, time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "a held key cannot be claimed")
	rec, err := st.Get(ctx, "scope", "k")
	require.NoError(t, err)
	require.Equal(t, hash, rec.RequestHash)
	require.Nil(t, rec.Response, "in flight")

	ok, err = st.Complete(ctx, "scope", "k", "not-the-token", &idempotency.Response{Status: 201}, time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "another claim's token completes nothing")
	ok, err = st.Complete(ctx, "scope", "k", c1, &idempotency.Response{Status: 201, Headers: map[string][]string{"Location": {"/o/1"}},
		Body: []byte("{\"id\":1}\x00")}, time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	rec, err = st.Get(ctx, "scope", "k")
	require.NoError(t, err)
	require.Equal(t, 201, rec.Response.Status)
	require.Equal(t, []byte("{\"id\":1}\x00"), rec.Response.Body)
	require.Equal(t, []string{"/o/1"}, rec.Response.Headers["Location"])
	ok, err = st.Release(ctx, "scope", "k", c1)
	require.NoError(t, err)
	require.False(t, ok, "a done key is not released")

	// A released key is free.
	c2, ok, err := st.Claim(ctx, "scope", "k2", hash, time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = st.Release(ctx, "scope", "k2", c2)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = st.Get(ctx, "scope", "k2")
	require.ErrorIs(t, err, idempotency.ErrKeyNotFound)

	// A lapsed claim frees the key; its late finisher is fenced out.
	old, ok, err := st.Claim(ctx, "scope", "k3", hash, 200*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)
	time.Sleep(300 * time.Millisecond)
	fresh, ok, err := st.Claim(ctx, "scope", "k3", []byte("other"), time.Minute)
	require.NoError(t, err)
	require.True(t, ok, "the lease ended")
	ok, err = st.Complete(ctx, "scope", "k3", old, &idempotency.Response{Status: 200}, time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "the late finisher cannot overwrite the new claim")
	ok, err = st.Release(ctx, "scope", "k3", old)
	require.NoError(t, err)
	require.False(t, ok, "nor free it")
	ok, err = st.Complete(ctx, "scope", "k3", fresh, &idempotency.Response{Status: 200, BodyOmitted: true, Body: []byte("x")}, time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	rec, err = st.Get(ctx, "scope", "k3")
	require.NoError(t, err)
	require.True(t, rec.Response.BodyOmitted)
	require.Empty(t, rec.Response.Body)
}

// Scopes (which carry the caller's identity) and keys of any bytes, of any
// length, are kept apart: no pair of them shares a Redis key.
func TestScopesAndKeysOfAnyBytesDoNotCollide(t *testing.T) {
	t.Parallel()
	rdb := client(t)
	st := newStore(t, rdb, "sagaflow-test:"+uuid.NewString()+":")
	ctx := context.Background()
	pairs := [][2]string{
		{"a", "bc"}, {"ab", "c"}, {"a\x00b", "c"}, {"a", "\x00bc"}, {"tenant-1", "k"}, {"tenant-2", "k"},
		{"\xff\xfe", "k"}, {strings.Repeat("s", 10_000), "k"}, {"s", strings.Repeat("k", 10_000)}, {"", ""},
	}
	for i, p := range pairs {
		_, ok, err := st.Claim(ctx, p[0], p[1], []byte{byte(i)}, time.Minute)
		require.NoError(t, err)
		require.True(t, ok, "pair %d collides with an earlier one", i)
	}
	for i, p := range pairs {
		rec, err := st.Get(ctx, p[0], p[1])
		require.NoError(t, err)
		require.Equal(t, []byte{byte(i)}, rec.RequestHash, "pair %d", i)
	}
}

const childEnv = "SAGAFLOW_REDISSTORE_CHILD"

// TestMain runs the child of TestKilledRequestFreesItsKeyWhenTheLeaseEnds
// when asked to: a process that takes a request through the middleware and
// blocks in the handler until it is killed.
func TestMain(m *testing.M) {
	if prefix := os.Getenv(childEnv); prefix != "" {
		rdb := redis.NewClient(&redis.Options{Addr: redisAddr()})
		st, err := redisstore.New(rdb, prefix)
		if err != nil {
			os.Exit(3)
		}
		mw, err := idempotency.New(nil, &idempotency.Config{Identity: idempotency.SharedIdentity, Store: st,
			InFlightTimeout: time.Second, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			os.Exit(3)
		}
		h := mw.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
			_, _ = os.Stdout.WriteString("claimed\n")
			select {} // until SIGKILL
		}))
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"order":"o-1"}`))
		req.Header.Set("Idempotency-Key", "k-killed")
		h.ServeHTTP(httptest.NewRecorder(), req)
		os.Exit(4) // never: the handler blocks
	}
	os.Exit(m.Run())
}

// A request whose process is killed mid-flight holds its key only until the
// lease (InFlightTimeout) ends: until then a retry gets 409; after, the
// retry runs the handler.
func TestKilledRequestFreesItsKeyWhenTheLeaseEnds(t *testing.T) {
	t.Parallel()
	rdb := client(t)
	prefix := "sagaflow-test:" + uuid.NewString() + ":"
	st := newStore(t, rdb, prefix)

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+prefix)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "claimed\n", line)
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	err = cmd.Wait()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child was killed: %v", err)

	var runs atomic.Int32
	mw, err := idempotency.New(nil, &idempotency.Config{Identity: idempotency.SharedIdentity, Store: st,
		InFlightTimeout: time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"o-1"}`)
	}))
	send := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"order":"o-1"}`))
		req.Header.Set("Idempotency-Key", "k-killed")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w
	}
	require.Equal(t, http.StatusConflict, send().Code, "the dead request's claim holds until its lease ends")
	require.Eventually(t, func() bool { return send().Code == http.StatusCreated }, 5*time.Second, 50*time.Millisecond,
		"after the lease the key is free")
	require.Equal(t, int32(1), runs.Load())
	w := send()
	require.Equal(t, http.StatusCreated, w.Code)
	require.Equal(t, "true", w.Header().Get(idempotency.HeaderReplayed))
	require.Equal(t, int32(1), runs.Load(), "then replayed, not run again")
}

// Two tenants with the same key see nothing of each other, whatever bytes
// their identities hold; a response that asks for a retry frees the key.
func TestMiddlewareOverRedisKeepsTenantsApart(t *testing.T) {
	t.Parallel()
	rdb := client(t)
	st := newStore(t, rdb, "sagaflow-test:"+uuid.NewString()+":")
	var status atomic.Int32
	status.Store(http.StatusCreated)
	mw, err := idempotency.New(nil, &idempotency.Config{Store: st, Logger: slog.New(slog.DiscardHandler),
		Identity: func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant") + "\x00\xff", nil }})
	require.NoError(t, err)
	var runs atomic.Int32
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(int(status.Load()))
		_, _ = io.WriteString(w, "for "+r.Header.Get("X-Tenant"))
	}))
	send := func(tenant string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "same-key")
		req.Header.Set("X-Tenant", tenant)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w
	}
	status.Store(http.StatusServiceUnavailable)
	require.Equal(t, http.StatusServiceUnavailable, send("acme").Code)
	status.Store(http.StatusCreated)
	require.Equal(t, "for acme", send("acme").Body.String(), "a 503 released the key: the retry ran")
	require.Equal(t, "for globex", send("globex").Body.String(), "another tenant's key is its own")
	w := send("acme")
	require.Equal(t, "for acme", w.Body.String())
	require.Equal(t, "true", w.Header().Get(idempotency.HeaderReplayed))
	require.Equal(t, int32(3), runs.Load())
}
