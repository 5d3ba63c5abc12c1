package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/limitread"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
)

const (
	// HeaderDefault is the request header that carries the key.
	HeaderDefault = "Idempotency-Key"
	// TTLDefault is how long a key and its response are kept.
	TTLDefault = 24 * time.Hour
	// TTLMin is the shortest TTL [New] accepts.
	TTLMin = time.Second
	// InFlightTimeoutDefault is how long an unfinished request keeps its key.
	InFlightTimeoutDefault = time.Minute
	// MaxKeyLengthDefault is the longest key accepted, in bytes.
	MaxKeyLengthDefault = 255
	// MaxBodyBytesDefault is the largest request body accepted.
	MaxBodyBytesDefault int64 = 1 << 20
	// MaxResponseBytesDefault is the largest response body kept for replay.
	MaxResponseBytesDefault int64 = 1 << 20
	// CleanupIntervalDefault is how often a middleware deletes expired keys.
	CleanupIntervalDefault = time.Minute
	// CleanupBatchDefault is how many expired keys one cleanup deletes at most.
	CleanupBatchDefault = 1000
)

// HeaderReplayed is set to "true" on a response replayed from the store.
const HeaderReplayed = "Idempotent-Replayed"

// bookkeepingTimeout bounds storing or releasing a key after the handler
// ran; those calls outlive the request's context, which is cancelled when
// the client goes away.
const bookkeepingTimeout = 10 * time.Second

// claimAttempts bounds how often a request tries to claim a key that keeps
// disappearing between the claim and the read (released or expired).
const claimAttempts = 3

// IdentityFunc returns who sends r: a stable id of the authenticated user,
// tenant or API client, typically read from what the authentication
// middleware in front of this one put in r's context. Keys are partitioned
// by identity, so two callers never see each other's responses.
//
// An error, or an empty identity, refuses the request with 401
// Unauthorized before its handler runs; the error is logged at debug level
// and not sent to the client. The identity is stored with each key and
// logged with it: return an id, never a credential such as a bearer token.
type IdentityFunc func(r *http.Request) (string, error)

// SharedIdentity gives every request the same identity, "shared": all callers
// share one set of keys. Anyone who sends a key that another caller used, with
// the same request, gets that caller's stored response. Use it only where
// callers need not be told apart (a service whose one client is another
// service of yours), and never in front of responses that belong to a user.
func SharedIdentity(*http.Request) (string, error) { return sharedIdentity, nil }

const sharedIdentity = "shared"

// Config configures a [Middleware]. [Config.Identity] has no default, so a
// nil *Config is refused.
type Config struct {
	// Identity returns who sends a request; keys are partitioned by it, and
	// within it by Scope. Required: [New] refuses a config without it. Set
	// it to [SharedIdentity] to share keys among all callers deliberately.
	Identity IdentityFunc
	// Schema holds the idempotency_keys table (migration 004). Defaults to
	// migrations.SchemaDefault.
	Schema string
	// Store, when set, keeps the keys instead of PostgreSQL (then [New]'s
	// pool may be nil and Schema is not used): for example
	// idempotency/redisstore. See [Store].
	Store Store
	// Header is the request header that carries the key. Defaults to
	// HeaderDefault ("Idempotency-Key").
	Header string
	// TTL is how long a key is kept from the moment its response was
	// stored. An expired key counts as absent. Defaults to TTLDefault (24
	// hours); at least TTLMin.
	TTL time.Duration
	// InFlightTimeout is how long a key stays claimed by a request that has
	// not finished: after it, the key counts as absent, so a client is not
	// locked out (409) for the whole TTL when the process handling its first
	// request died. It must be longer than the handler can run (a request
	// still running after it may run a second time). Defaults to
	// InFlightTimeoutDefault (1 minute); at most TTL.
	InFlightTimeout time.Duration
	// Required rejects requests of unsafe methods that carry no key with
	// 400 Bad Request. Defaults to false: such requests reach the handler
	// unprotected.
	Required bool
	// MaxKeyLength is the longest key accepted, in bytes; a longer one gets
	// 400 Bad Request. Defaults to MaxKeyLengthDefault (255).
	MaxKeyLength int
	// MaxBodyBytes is the largest request body accepted; the body is read
	// whole to be hashed, and a larger one gets 413 Content Too Large.
	// Defaults to MaxBodyBytesDefault (1 MiB).
	MaxBodyBytes int64
	// Scope partitions each identity's keys: the same key in two scopes is
	// two keys. Defaults to the method, a space and the escaped path ("POST
	// /orders"). With a scope that leaves the path out, a key reused on
	// another route is a different request (422).
	Scope func(r *http.Request) string
	// MaxResponseBytes is the largest response body kept for replay. A
	// larger response reaches the client in full, and its key is kept
	// without the body: the handler does not run again for the key, and a
	// retry gets 410 Gone (see the package documentation). Defaults to
	// MaxResponseBytesDefault (1 MiB).
	MaxResponseBytes int64
	// CleanupInterval is how often the middleware deletes expired keys by
	// itself, after a request that carries a key. Defaults to
	// CleanupIntervalDefault (1 minute).
	CleanupInterval time.Duration
	// CleanupBatch bounds the keys one cleanup deletes, in one statement; a
	// full batch lets the next request delete another. Defaults to
	// CleanupBatchDefault (1000).
	CleanupBatch int
	// ReplayHeaders are the response headers stored with a response and sent
	// again when it is replayed; others (Set-Cookie, Date, tracing headers)
	// are not. Defaults to Content-Type, Content-Language, Content-Location,
	// Location, ETag and Last-Modified.
	ReplayHeaders []string
	// Logger receives logs. Defaults to slog.Default().
	Logger *slog.Logger
}

func replayHeadersDefault() []string {
	return []string{"Content-Type", "Content-Language", "Content-Location", "Location", "ETag", "Last-Modified"}
}

// Middleware makes unsafe HTTP requests idempotent by key. Build it with
// [New]; it is safe for concurrent use.
type Middleware struct {
	store         Store
	header        string
	ttl           time.Duration
	inFlight      time.Duration
	required      bool
	maxKeyLength  int
	maxBodyBytes  int64
	maxRespBytes  int64
	identity      IdentityFunc
	scope         func(r *http.Request) string
	replayHeaders []string
	log           *slog.Logger

	cleanupEvery time.Duration
	cleanupBatch int
	// nextCleanup is when (Unix nanoseconds, by this process's clock) the
	// next request may delete expired keys; expiry itself is decided in
	// database time.
	nextCleanup atomic.Int64
}

// New returns a middleware that keeps keys in the idempotency_keys table of
// cfg.Schema on pool; the schema must have been migrated with
// migrations.Migrate. cfg must set [Config.Identity].
func New(pool *pgxpool.Pool, cfg *Config) (*Middleware, error) {
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if pool == nil && c.Store == nil {
		return nil, fmt.Errorf("%w: pool is nil and Config.Store is not set", ErrInvalidConfig)
	}
	if c.Identity == nil {
		return nil, fmt.Errorf("%w: Identity is not set: set it to a function that returns the caller's user or tenant id,"+
			" or to idempotency.SharedIdentity to share keys among all callers deliberately", ErrInvalidConfig)
	}
	st := c.Store
	if st == nil {
		var err error
		if st, err = NewPostgresStore(pool, c.Schema); err != nil {
			return nil, err
		}
	}
	if c.Header == "" {
		c.Header = HeaderDefault
	}
	if !isToken(c.Header) {
		return nil, fmt.Errorf("%w: Header %q is not a valid HTTP header name", ErrInvalidConfig, c.Header)
	}
	switch {
	case c.TTL == 0:
		c.TTL = TTLDefault
	case c.TTL < TTLMin:
		return nil, fmt.Errorf("%w: TTL %v is shorter than %v", ErrInvalidConfig, c.TTL, TTLMin)
	}
	switch {
	case c.InFlightTimeout == 0:
		c.InFlightTimeout = min(InFlightTimeoutDefault, c.TTL)
	case c.InFlightTimeout < TTLMin || c.InFlightTimeout > c.TTL:
		return nil, fmt.Errorf("%w: InFlightTimeout %v must be between %v and TTL (%v)", ErrInvalidConfig, c.InFlightTimeout, TTLMin, c.TTL)
	}
	if err := defaultOrRefuse("MaxKeyLength", &c.MaxKeyLength, MaxKeyLengthDefault); err != nil {
		return nil, err
	}
	if err := defaultOrRefuse("MaxBodyBytes", &c.MaxBodyBytes, MaxBodyBytesDefault); err != nil {
		return nil, err
	}
	if err := defaultOrRefuse("MaxResponseBytes", &c.MaxResponseBytes, MaxResponseBytesDefault); err != nil {
		return nil, err
	}
	if err := defaultOrRefuse("CleanupInterval", &c.CleanupInterval, CleanupIntervalDefault); err != nil {
		return nil, err
	}
	if err := defaultOrRefuse("CleanupBatch", &c.CleanupBatch, CleanupBatchDefault); err != nil {
		return nil, err
	}
	if c.Scope == nil {
		c.Scope = defaultScope
	}
	if c.ReplayHeaders == nil {
		c.ReplayHeaders = replayHeadersDefault()
	}
	replay := make([]string, 0, len(c.ReplayHeaders))
	for _, h := range c.ReplayHeaders {
		if !isToken(h) {
			return nil, fmt.Errorf("%w: ReplayHeaders: %q is not a valid HTTP header name", ErrInvalidConfig, h)
		}
		replay = append(replay, textproto.CanonicalMIMEHeaderKey(h))
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return &Middleware{
		store: st, header: textproto.CanonicalMIMEHeaderKey(c.Header), ttl: c.TTL, inFlight: c.InFlightTimeout, required: c.Required,
		maxKeyLength: c.MaxKeyLength, maxBodyBytes: c.MaxBodyBytes, maxRespBytes: c.MaxResponseBytes,
		identity: c.Identity, scope: c.Scope, replayHeaders: replay, log: c.Logger,
		cleanupEvery: c.CleanupInterval, cleanupBatch: c.CleanupBatch,
	}, nil
}

func defaultScope(r *http.Request) string { return r.Method + " " + r.URL.EscapedPath() }

// isToken reports whether s is an HTTP token (RFC 9110), as header names are.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

type contextKey struct{}

type keyInfo struct{ scope, key string }

// FromContext returns the idempotency key of the request whose handler got
// ctx, and false when the request carried none. A handler can use it as a
// business key (saga.StartOpts.BusinessKey) so that its own database work
// is deduplicated too; keys are unique only within an identity and a scope,
// so combine it with [ScopeFromContext], which carries both.
func FromContext(ctx context.Context) (key string, ok bool) {
	k, ok := ctx.Value(contextKey{}).(keyInfo)
	return k.key, ok
}

// ScopeFromContext returns the scope of the key that [FromContext] returns,
// as stored: the identity and the scope of [Config], joined unambiguously
// (see the package documentation). It differs between callers.
func ScopeFromContext(ctx context.Context) (scope string, ok bool) {
	k, ok := ctx.Value(contextKey{}).(keyInfo)
	return k.scope, ok
}

// Wrap returns next behind the middleware. Requests of safe methods (GET,
// HEAD, OPTIONS, TRACE) pass through untouched; see the package
// documentation for what happens to the others.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next) })
}

// DeleteExpired deletes up to limit expired keys, oldest first, and returns
// how many it deleted. The middleware deletes expired keys by itself (see
// [Config.CleanupInterval]); call this for a purge of your own, again while
// it returns limit.
func (m *Middleware) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("idempotency: delete expired keys: limit %d is not positive", limit)
	}
	n, err := m.store.DeleteExpired(ctx, limit)
	if err != nil {
		return 0, fmt.Errorf("idempotency: delete expired keys: %w", err)
	}
	return n, nil
}

func safeMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if safeMethod(r.Method) {
		next.ServeHTTP(w, r)
		return
	}
	values := r.Header.Values(m.header)
	if len(values) == 0 || (len(values) == 1 && values[0] == "") {
		if m.required {
			writeError(w, http.StatusBadRequest, "missing "+m.header+" header: this request needs a unique key per operation (such as a UUID), sent again unchanged when the request is retried")
			return
		}
		next.ServeHTTP(w, r)
		return
	}
	if len(values) > 1 {
		writeError(w, http.StatusBadRequest, m.header+" header must appear once")
		return
	}
	key := values[0]
	if len(key) > m.maxKeyLength {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("%s header is longer than %d bytes", m.header, m.maxKeyLength))
		return
	}
	if !printable(key) {
		writeError(w, http.StatusBadRequest, m.header+" header must be printable UTF-8 text")
		return
	}
	identity, err := m.identity(r)
	if err == nil && identity == "" {
		err = errors.New("empty identity")
	}
	if err != nil {
		m.log.DebugContext(r.Context(), "idempotency: request refused: no identity", "error", err)
		writeError(w, http.StatusUnauthorized, "the caller could not be identified; the request was not processed")
		return
	}
	body, status, msg := m.readBody(r)
	if status != 0 {
		writeError(w, status, msg)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	r.ContentLength = int64(len(body))
	k := keyInfo{scope: joinScope(identity, m.scope(r)), key: key}
	m.serveKey(w, r, next, k, requestHash(r, body))
	m.cleanup(r.Context())
}

// joinScope makes the stored scope of a key: the identity's length in bytes,
// a colon, the identity, a space and the scope ("5:alice POST /orders"), so
// that no two (identity, scope) pairs share one. A result that PostgreSQL
// cannot store as it is, or longer than safetext.MaxKeyBytes, is replaced by
// its SHA-256 (safetext.Key): identities and scopes are untrusted bytes.
func joinScope(identity, scope string) string {
	return safetext.Key(strconv.Itoa(len(identity)) + ":" + identity + " " + scope)
}

// serveKey claims the key or answers from its row.
func (m *Middleware) serveKey(w http.ResponseWriter, r *http.Request, next http.Handler, k keyInfo, hash []byte) {
	ctx := r.Context()
	// The key is printable UTF-8 but may be longer than an index entry can
	// hold when MaxKeyLength allows it: such a key is stored as its hash.
	storedKey := safetext.Key(k.key)
	for range claimAttempts {
		claimedAt, claimed, err := m.store.Claim(ctx, k.scope, storedKey, hash, m.inFlight)
		if err != nil {
			m.unavailable(ctx, w, fmt.Errorf("idempotency: store key %q: %w", storedKey, err))
			return
		}
		if claimed {
			m.run(w, r, next, k, storedKey, claimedAt)
			return
		}
		row, err := m.store.Get(ctx, k.scope, storedKey)
		if errors.Is(err, ErrKeyNotFound) {
			continue // released or expired since the claim: claim again
		}
		if err != nil {
			m.unavailable(ctx, w, fmt.Errorf("idempotency: load key %q: %w", storedKey, err))
			return
		}
		switch {
		case !bytes.Equal(row.RequestHash, hash):
			writeError(w, http.StatusUnprocessableEntity, fmt.Sprintf(
				"%s %q was already used with a different request (method, path, query or body); use a new key for a new request", m.header, k.key))
		case row.Response != nil && row.Response.BodyOmitted:
			m.gone(w, row.Response)
		case row.Response != nil:
			replay(w, row.Response)
		default:
			inFlight(w, m.header)
		}
		return
	}
	inFlight(w, m.header) // the key keeps changing hands: let the client come back
}

// cleanup deletes up to cleanupBatch expired keys when cleanupEvery has
// passed since the last cleanup of this middleware, or the last one found a
// full batch. One request at a time wins the turn.
func (m *Middleware) cleanup(reqCtx context.Context) {
	now := time.Now().UnixNano()
	next := m.nextCleanup.Load()
	if now < next || !m.nextCleanup.CompareAndSwap(next, now+int64(m.cleanupEvery)) {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(reqCtx), bookkeepingTimeout)
	defer cancel()
	n, err := m.store.DeleteExpired(ctx, m.cleanupBatch)
	if err != nil {
		m.log.WarnContext(ctx, "idempotency: expired keys not deleted; the next cleanup tries again",
			"error", fmt.Errorf("idempotency: delete expired keys: %w", err))
		return
	}
	if n == int64(m.cleanupBatch) {
		m.nextCleanup.Store(0) // more may have expired: the next request deletes another batch
	}
	if n > 0 {
		m.log.DebugContext(ctx, "idempotency: expired keys deleted", "count", n)
	}
}

func inFlight(w http.ResponseWriter, header string) {
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusConflict, "a request with this "+header+" is still being processed; retry later")
}

// run serves a request whose key this middleware claimed, then stores the
// response or, after a panic or a response that invites a retry, releases
// the key.
func (m *Middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, k keyInfo, storedKey string, claimedAt Claim) {
	rec := &recorder{w: w, replayHeaders: m.replayHeaders, maxBody: m.maxRespBytes}
	returned := false
	defer func() {
		if !returned {
			// The handler panicked (or called runtime.Goexit). Release the
			// key and let the panic go on to the server; nothing was
			// recovered here.
			m.release(r.Context(), k.scope, storedKey, claimedAt, "handler panicked")
		}
	}()
	next.ServeHTTP(rec, r.WithContext(context.WithValue(r.Context(), contextKey{}, k)))
	returned = true

	resp := rec.finish()
	if retryable(resp.Status) {
		m.release(r.Context(), k.scope, storedKey, claimedAt, "handler answered "+strconv.Itoa(resp.Status))
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), bookkeepingTimeout)
	defer cancel()
	if resp.BodyOmitted {
		m.log.InfoContext(ctx, "idempotency: response body not kept; a retry with the key gets 410 Gone",
			"scope", k.scope, "idempotency_key", storedKey, "reason", rec.omitted)
	}
	ok, err := m.store.Complete(ctx, k.scope, storedKey, claimedAt, resp, m.ttl)
	switch {
	case err != nil:
		// The key stays in flight until it expires: retries get 409 rather
		// than running the handler a second time.
		m.log.ErrorContext(ctx, "idempotency: response not stored; the key stays in flight until it expires",
			"scope", k.scope, "idempotency_key", storedKey, "error", fmt.Errorf("idempotency: store key %q: %w", storedKey, err))
	case !ok:
		m.log.WarnContext(ctx, "idempotency: response not stored; the key expired and was claimed again while its request ran",
			"scope", k.scope, "idempotency_key", storedKey)
	}
}

// retryable reports whether a response should not be replayed, because it
// tells the client to try again: a server error, 408 Request Timeout or 429
// Too Many Requests.
func retryable(status int) bool {
	return status >= 500 || status == http.StatusRequestTimeout || status == http.StatusTooManyRequests
}

func (m *Middleware) release(reqCtx context.Context, scope, key string, claimedAt Claim, why string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(reqCtx), bookkeepingTimeout)
	defer cancel()
	if _, err := m.store.Release(ctx, scope, key, claimedAt); err != nil {
		m.log.ErrorContext(ctx, "idempotency: key not released; it stays in flight until it expires",
			"scope", scope, "idempotency_key", key, "reason", why, "error", fmt.Errorf("idempotency: release key %q: %w", key, err))
		return
	}
	m.log.DebugContext(ctx, "idempotency: key released", "scope", scope, "idempotency_key", key, "reason", why)
}

func (m *Middleware) unavailable(ctx context.Context, w http.ResponseWriter, err error) {
	msg := "idempotency: key not checked"
	if pgerr.Undefined(err) {
		// No retry mends this one: say what will.
		msg += "; the schema is not migrated (run migrations.Migrate, or `sagaflow migrate`)"
	}
	m.log.ErrorContext(ctx, msg, "error", err)
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusServiceUnavailable, "the "+m.header+" could not be checked; the request was not processed, retry later")
}

// readBody reads the whole request body, or returns the status and message
// of the error to send.
func (m *Middleware) readBody(r *http.Request) ([]byte, int, string) {
	tooLarge := fmt.Sprintf("request body is larger than %d bytes", m.maxBodyBytes)
	if r.ContentLength > m.maxBodyBytes {
		return nil, http.StatusRequestEntityTooLarge, tooLarge
	}
	if r.Body == nil {
		return []byte{}, 0, ""
	}
	body, over, err := limitread.Read(r.Body, m.maxBodyBytes)
	if err != nil {
		return nil, http.StatusBadRequest, "request body could not be read"
	}
	if over {
		return nil, http.StatusRequestEntityTooLarge, tooLarge
	}
	return body, 0, ""
}

// requestHash identifies a request: its method, escaped path and query, and
// body, each prefixed by its length so that no two requests share an input.
func requestHash(r *http.Request, body []byte) []byte {
	h := sha256.New()
	target := r.URL.EscapedPath()
	if r.URL.RawQuery != "" {
		target += "?" + r.URL.RawQuery
	}
	for _, part := range [][]byte{[]byte(r.Method), []byte(target), body} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, c := range s {
		if unicode.IsControl(c) {
			return false
		}
	}
	return true
}

func replay(w http.ResponseWriter, resp *Response) {
	h := w.Header()
	for name, vs := range resp.Headers {
		h[name] = vs
	}
	h.Set(HeaderReplayed, "true")
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
}

// gone answers a retry whose first response was not kept (streamed, or
// larger than MaxResponseBytes): 410 Gone, with the first response's
// Location so that the client can find what it made.
func (m *Middleware) gone(w http.ResponseWriter, resp *Response) {
	if loc := resp.Headers["Location"]; len(loc) > 0 {
		w.Header()["Location"] = loc
	}
	w.Header().Set(HeaderReplayed, "true")
	writeError(w, http.StatusGone, fmt.Sprintf("the request with this %s was processed (status %d), but its response was streamed or larger than %d bytes and was not kept;"+
		" it will not run again: use a new key for a new request", m.header, resp.Status, m.maxRespBytes))
}

func writeError(w http.ResponseWriter, status int, msg string) {
	body, _ := json.Marshal(struct {
		Error string `json:"error"`
	}{msg}) // a struct of one string always encodes
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// defaultOrRefuse sets *v to def when it is zero, and refuses a negative
// value, naming field.
func defaultOrRefuse[T int | int64 | time.Duration](field string, v *T, def T) error {
	switch {
	case *v == 0:
		*v = def
	case *v < 0:
		return fmt.Errorf("%w: %s %v is negative", ErrInvalidConfig, field, *v)
	}
	return nil
}
