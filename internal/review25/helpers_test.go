// Package review25_test is an outside reviewer's black-box tests of package
// idempotency and idempotency/redisstore, written from their documentation
// only. See FINDINGS.md.
package review25_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/idempotency/redisstore"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/migrations"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 6) }

// kinds are the two stores; behaviour tests run on both.
var kinds = []string{"pg", "redis"}

func redisAddr() string {
	if a := os.Getenv("REVIEW25_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newRedis returns a client and a random key prefix; every key under the
// prefix is deleted and the client closed when the test ends.
func newRedis(t *testing.T) (*redis.Client, string) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr()})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	require.NoError(t, rdb.Ping(ctx).Err(), "Redis at %s", redisAddr())
	prefix := "review25:" + randHex(6) + ":"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, k := range redisKeys(t, rdb, prefix) {
			rdb.Del(ctx, k)
		}
		_ = rdb.Close()
	})
	return rdb, prefix
}

func redisKeys(t *testing.T, rdb *redis.Client, prefix string) []string {
	t.Helper()
	var out []string
	iter := rdb.Scan(context.Background(), 0, prefix+"*", 1000).Iterator()
	for iter.Next(context.Background()) {
		out = append(out, iter.Val())
	}
	require.NoError(t, iter.Err())
	return out
}

// newStore builds one store of kind directly (the Store interface).
func newStore(t *testing.T, kind string) idempotency.Store {
	t.Helper()
	switch kind {
	case "pg":
		d := testkit.NewDB(t)
		st, err := idempotency.NewPostgresStore(d.Pool, d.Schema)
		require.NoError(t, err)
		return st
	case "redis":
		rdb, prefix := newRedis(t)
		st, err := redisstore.New(rdb, prefix)
		require.NoError(t, err)
		return st
	}
	t.Fatalf("unknown kind %q", kind)
	return nil
}

// The test's "authentication": the identity travels in the request's
// context; over the network it comes from X-User (text) or X-User-Hex (any
// bytes); X-User-Empty gives the empty identity. No header: an error.
type userKey struct{}

const identitySecret = "secret-bearer-token-123"

func identityFromContext(r *http.Request) (string, error) {
	v, ok := r.Context().Value(userKey{}).(string)
	if !ok {
		return "", errors.New("no user: " + identitySecret)
	}
	return v, nil
}

func asUser(r *http.Request, id string) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), userKey{}, id))
}

func auth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Header.Get("X-User-Hex") != "":
			b, err := hex.DecodeString(r.Header.Get("X-User-Hex"))
			if err != nil {
				http.Error(w, "bad hex", http.StatusBadRequest)
				return
			}
			r = asUser(r, string(b))
		case r.Header.Get("X-User") != "":
			r = asUser(r, r.Header.Get("X-User"))
		case r.Header.Get("X-User-Empty") != "":
			r = asUser(r, "")
		}
		next.ServeHTTP(w, r)
	})
}

// rig is one middleware on one store, behind auth, served over a real
// HTTP server and reachable directly.
type rig struct {
	kind   string
	mw     *idempotency.Middleware
	h      http.Handler
	srv    *httptest.Server
	client *http.Client
	db     *testkit.DB
	rdb    *redis.Client
	prefix string
	logs   *lockedBuf
}

type lockedBuf struct {
	mu  chan struct{}
	buf bytes.Buffer
}

func newLockedBuf() *lockedBuf { return &lockedBuf{mu: make(chan struct{}, 1)} }
func (b *lockedBuf) Write(p []byte) (int, error) {
	b.mu <- struct{}{}
	defer func() { <-b.mu }()
	return b.buf.Write(p)
}
func (b *lockedBuf) String() string {
	b.mu <- struct{}{}
	defer func() { <-b.mu }()
	return b.buf.String()
}

// shared is one migrated schema that PostgreSQL rigs share, to keep the
// package's run short (migrating a schema costs about half a second). Each
// shared rig puts its callers in a namespace of its own (a random prefix
// on the identity), so rigs never see each other's keys. It is dropped when
// the last test using it ends, and made again if a later test needs it.
var shared struct {
	mu     sync.Mutex
	users  int
	pool   *pgxpool.Pool
	schema string
}

func sharedSchema(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.users == 0 {
		cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
		require.NoError(t, err)
		cfg.MaxConns = 24
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		schema := "r25_" + randHex(6)
		_, err = pool.Exec(context.Background(), "CREATE SCHEMA "+schema)
		require.NoError(t, err)
		_, err = migrations.Migrate(context.Background(), pool, schema)
		require.NoError(t, err)
		shared.pool, shared.schema = pool, schema
	}
	shared.users++
	pool, schema := shared.pool, shared.schema
	t.Cleanup(func() {
		shared.mu.Lock()
		defer shared.mu.Unlock()
		shared.users--
		if shared.users == 0 {
			_, _ = shared.pool.Exec(context.Background(), "DROP SCHEMA "+shared.schema+" CASCADE")
			shared.pool.Close()
			shared.pool = nil
		}
	})
	return pool, schema
}

// newRig builds a middleware of kind with cfg (nil: defaults) around
// handler. cfg.Identity defaults to identityFromContext. A PostgreSQL rig
// uses the shared schema, with its callers' identities prefixed by a
// namespace of its own; see newIsolatedRig for exact identities.
func newRig(t *testing.T, kind string, cfg *idempotency.Config, handler http.Handler) *rig {
	t.Helper()
	return makeRig(t, kind, cfg, handler, false)
}

// newIsolatedRig is newRig on a schema of its own (testkit.NewDB, a pool of
// at most 12 connections), with the identities exactly as given.
func newIsolatedRig(t *testing.T, kind string, cfg *idempotency.Config, handler http.Handler) *rig {
	t.Helper()
	return makeRig(t, kind, cfg, handler, true)
}

func makeRig(t *testing.T, kind string, cfg *idempotency.Config, handler http.Handler, isolated bool) *rig {
	t.Helper()
	if cfg == nil {
		cfg = &idempotency.Config{}
	}
	if cfg.Identity == nil {
		cfg.Identity = identityFromContext
	}
	if kind == "pg" && !isolated {
		inner, ns := cfg.Identity, randHex(4)+"/"
		cfg.Identity = func(r *http.Request) (string, error) {
			id, err := inner(r)
			if err != nil || id == "" {
				return id, err
			}
			return ns + id, nil
		}
	}
	g := &rig{kind: kind, logs: newLockedBuf()}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(g.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	var err error
	switch kind {
	case "pg":
		if isolated {
			g.db = testkit.NewDB(t)
			cfg.Schema = g.db.Schema
			g.mw, err = idempotency.New(g.db.Pool, cfg)
			break
		}
		pool, schema := sharedSchema(t)
		cfg.Schema = schema
		g.mw, err = idempotency.New(pool, cfg)
	case "redis":
		g.rdb, g.prefix = newRedis(t)
		st, serr := redisstore.New(g.rdb, g.prefix)
		require.NoError(t, serr)
		cfg.Store = st
		g.mw, err = idempotency.New(nil, cfg)
	default:
		t.Fatalf("unknown kind %q", kind)
	}
	require.NoError(t, err)
	g.h = auth(g.mw.Wrap(handler))
	g.srv = httptest.NewServer(g.h)
	tr := &http.Transport{DisableCompression: true}
	g.client = &http.Client{Transport: tr, Timeout: 30 * time.Second}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		g.srv.CloseClientConnections()
		g.srv.Close()
	})
	return g
}

// q is one request.
type q struct {
	method string // POST by default
	path   string // /orders by default
	key    string // no header when empty (use hdr for an empty one)
	user   string // X-User; userHex for any bytes
	uhex   bool
	body   []byte
	hdr    http.Header
}

type res struct {
	status  int
	hdr     http.Header
	body    []byte
	trailer http.Header
	err     error
}

func (g *rig) url(path string) string { return g.srv.URL + path }

func (g *rig) build(t *testing.T, x q) *http.Request {
	t.Helper()
	if x.method == "" {
		x.method = http.MethodPost
	}
	if x.path == "" {
		x.path = "/orders"
	}
	r, err := http.NewRequest(x.method, g.url(x.path), bytes.NewReader(x.body))
	require.NoError(t, err)
	if x.key != "" {
		r.Header.Set(idempotency.HeaderDefault, x.key)
	}
	if x.user != "" {
		if x.uhex {
			r.Header.Set("X-User-Hex", hex.EncodeToString([]byte(x.user)))
		} else {
			r.Header.Set("X-User", x.user)
		}
	}
	for k, vs := range x.hdr {
		for _, v := range vs {
			r.Header.Add(k, v)
		}
	}
	return r
}

// do sends x over the network.
func (g *rig) do(t *testing.T, x q) res {
	t.Helper()
	resp, err := g.client.Do(g.build(t, x))
	if err != nil {
		return res{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return res{status: resp.StatusCode, hdr: resp.Header, body: b, trailer: resp.Trailer, err: err}
}

// settle sends x until it gets something other than 409 (the docs allow
// a 409 on an immediate retry, before the first response is stored).
func (g *rig) settle(t *testing.T, x q) res {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		r := g.do(t, x)
		if r.status != http.StatusConflict || r.hdr.Get(idempotency.HeaderReplayed) != "" || time.Now().After(deadline) {
			return r
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// rawReq builds a request by hand so that any bytes can be put in the
// method, the path, the query and the headers (net/http's client and server
// would refuse some of them before they reach the middleware).
func rawReq(method, path, rawQuery, key, user string, body []byte) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
	r.Method = method
	r.URL.Path = path
	r.URL.RawPath = ""
	r.URL.RawQuery = rawQuery
	r.RequestURI = ""
	if key != "" {
		r.Header[idempotency.HeaderDefault] = []string{key}
	}
	return asUser(r, user)
}

// serveDirect runs r through auth+middleware+handler with a recorder.
func (g *rig) serveDirect(r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	g.h.ServeHTTP(rec, r)
	return rec
}

// requireJSONError checks the documented shape of the middleware's errors.
func requireJSONError(t *testing.T, status int, hdr http.Header, body []byte, want int, msg ...any) string {
	t.Helper()
	require.Equal(t, want, status, append([]any{"body %q"}, append([]any{trunc(body)}, msg...)...)...)
	require.True(t, strings.HasPrefix(hdr.Get("Content-Type"), "application/json"),
		"Content-Type %q of a %d", hdr.Get("Content-Type"), status)
	var m map[string]any
	require.NoError(t, json.Unmarshal(body, &m), "error body %q is not a JSON object", trunc(body))
	e, ok := m["error"].(string)
	require.True(t, ok && e != "", "error body %q has no \"error\" string", trunc(body))
	return e
}

func trunc(b []byte) string {
	if len(b) > 200 {
		return string(b[:200]) + fmt.Sprintf("...(%d bytes)", len(b))
	}
	return string(b)
}

// counter counts handler runs.
type counter struct{ n atomic.Int64 }

func (c *counter) inc() int64     { return c.n.Add(1) }
func (c *counter) get() int64     { return c.n.Load() }
func (c *counter) String() string { return fmt.Sprint(c.n.Load()) }

// echo is a handler that creates "an order": it counts its run, reads the
// body and answers 201 with the run number, the caller and the body's hash.
func echo(c *counter) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := c.inc()
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "read: "+err.Error(), http.StatusBadRequest)
			return
		}
		who, _ := identityFromContext(r)
		sum := sha256.Sum256(b)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", n))
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{
			"run": n, "user_hex": hex.EncodeToString([]byte(who)), "body_sha": hex.EncodeToString(sum[:]), "len": len(b),
		})
	}
}

type echoed struct {
	Run     int64  `json:"run"`
	UserHex string `json:"user_hex"`
	BodySha string `json:"body_sha"`
	Len     int    `json:"len"`
}

func decodeEcho(t *testing.T, b []byte) echoed {
	t.Helper()
	var e echoed
	require.NoError(t, json.Unmarshal(b, &e), "body %q", trunc(b))
	return e
}

// storedScope is the documented stored scope: len(identity) ":" identity " "
// scope, or "sha256:" + hex when it is not storable text of at most 512 bytes.
func storedScope(identity, scope string) string {
	s := fmt.Sprintf("%d:%s %s", len(identity), identity, scope)
	if !utf8.ValidString(s) || strings.ContainsRune(s, 0) || len(s) > 512 {
		sum := sha256.Sum256([]byte(s))
		return "sha256:" + hex.EncodeToString(sum[:])
	}
	return s
}

func sha256hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// gate holds handlers until opened.
type gate struct {
	entered chan struct{}
	open    chan struct{}
}

func newGate() *gate { return &gate{entered: make(chan struct{}, 100), open: make(chan struct{})} }
func (g *gate) wait() {
	g.entered <- struct{}{}
	<-g.open
}
func (g *gate) release() { close(g.open) }
func (g *gate) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the handler was not entered within 5s")
	}
}

func discard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func serveRec(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return rec
}

// unreachable builds a middleware whose store cannot be reached: nothing
// listens on 127.0.0.1:1.
func unreachable(t *testing.T, kind string, cfg *idempotency.Config) *idempotency.Middleware {
	t.Helper()
	var mw *idempotency.Middleware
	var err error
	switch kind {
	case "pg":
		pool, perr := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2")
		require.NoError(t, perr)
		t.Cleanup(pool.Close)
		cfg.Schema = "sagaflow"
		mw, err = idempotency.New(pool, cfg)
	case "redis":
		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", DialTimeout: time.Second, MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		st, serr := redisstore.New(rdb, "")
		require.NoError(t, serr)
		cfg.Store = st
		mw, err = idempotency.New(nil, cfg)
	}
	require.NoError(t, err)
	return mw
}
