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
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/store"
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

// Config configures a [Middleware]. A nil *Config means the defaults.
type Config struct {
	// Schema holds the idempotency_keys table (migration 004). Defaults to
	// store.SchemaDefault.
	Schema string
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
	// Scope partitions keys: the same key in two scopes is two keys. Use it
	// to give each authenticated user keys of their own. It should return
	// valid UTF-8 text. Defaults to the method, a space and the escaped path
	// ("POST /orders"). With a scope that leaves the path out, a key reused
	// on another route is a different request (422).
	Scope func(r *http.Request) string
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
	pool          *pgxpool.Pool
	st            *store.Store
	header        string
	ttl           time.Duration
	inFlight      time.Duration
	required      bool
	maxKeyLength  int
	maxBodyBytes  int64
	scope         func(r *http.Request) string
	replayHeaders []string
	log           *slog.Logger
}

// New returns a middleware that keeps keys in the idempotency_keys table of
// cfg.Schema on pool; the schema must have been migrated with
// store.Migrate.
func New(pool *pgxpool.Pool, cfg *Config) (*Middleware, error) {
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if c.Schema == "" {
		c.Schema = store.SchemaDefault
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
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
	switch {
	case c.MaxKeyLength == 0:
		c.MaxKeyLength = MaxKeyLengthDefault
	case c.MaxKeyLength < 0:
		return nil, fmt.Errorf("%w: MaxKeyLength %d is negative", ErrInvalidConfig, c.MaxKeyLength)
	}
	switch {
	case c.MaxBodyBytes == 0:
		c.MaxBodyBytes = MaxBodyBytesDefault
	case c.MaxBodyBytes < 0:
		return nil, fmt.Errorf("%w: MaxBodyBytes %d is negative", ErrInvalidConfig, c.MaxBodyBytes)
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
		pool: pool, st: st, header: textproto.CanonicalMIMEHeaderKey(c.Header), ttl: c.TTL, inFlight: c.InFlightTimeout, required: c.Required,
		maxKeyLength: c.MaxKeyLength, maxBodyBytes: c.MaxBodyBytes, scope: c.Scope, replayHeaders: replay, log: c.Logger,
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
// is deduplicated too; keys are unique only within a scope, so combine it
// with what the scope stands for (see [ScopeFromContext]).
func FromContext(ctx context.Context) (key string, ok bool) {
	k, ok := ctx.Value(contextKey{}).(keyInfo)
	return k.key, ok
}

// ScopeFromContext returns the scope of the key that [FromContext] returns.
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
// how many it deleted. Run it periodically; a statement never deletes more
// than limit rows, so call it again while it returns limit.
func (m *Middleware) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("idempotency: delete expired keys: limit %d is not positive", limit)
	}
	n, err := m.st.DeleteExpiredIdempotencyKeys(ctx, m.pool, limit)
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
	body, status, msg := m.readBody(r)
	if status != 0 {
		writeError(w, status, msg)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	r.ContentLength = int64(len(body))
	scope := text(m.scope(r))
	hash := requestHash(r, body)
	ctx := r.Context()

	for range claimAttempts {
		claimedAt, claimed, err := m.st.ClaimIdempotencyKey(ctx, m.pool, scope, key, hash, m.inFlight)
		if err != nil {
			m.unavailable(ctx, w, fmt.Errorf("idempotency: store key %q: %w", key, err))
			return
		}
		if claimed {
			m.run(w, r, next, scope, key, claimedAt)
			return
		}
		k, err := m.st.GetIdempotencyKey(ctx, m.pool, scope, key)
		if errors.Is(err, store.ErrNotFound) {
			continue // released or expired since the claim: claim again
		}
		if err != nil {
			m.unavailable(ctx, w, fmt.Errorf("idempotency: load key %q: %w", key, err))
			return
		}
		switch {
		case !bytes.Equal(k.RequestHash, hash):
			writeError(w, http.StatusUnprocessableEntity, fmt.Sprintf(
				"%s %q was already used with a different request (method, path, query or body); use a new key for a new request", m.header, key))
		case k.Status == store.IdempotencyDone && k.Response != nil:
			replay(w, k.Response)
		default:
			inFlight(w, m.header)
		}
		return
	}
	inFlight(w, m.header) // the key keeps changing hands: let the client come back
}

func inFlight(w http.ResponseWriter, header string) {
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusConflict, "a request with this "+header+" is still being processed; retry later")
}

// run serves a request whose key this middleware claimed, then stores the
// response or, after a panic or a response that invites a retry, releases
// the key.
func (m *Middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, scope, key string, claimedAt time.Time) {
	rec := &recorder{w: w, replayHeaders: m.replayHeaders}
	returned := false
	defer func() {
		if !returned {
			// The handler panicked (or called runtime.Goexit). Release the
			// key and let the panic go on to the server; nothing was
			// recovered here.
			m.release(r.Context(), scope, key, claimedAt, "handler panicked")
		}
	}()
	next.ServeHTTP(rec, r.WithContext(context.WithValue(r.Context(), contextKey{}, keyInfo{scope: scope, key: key})))
	returned = true

	status, headers, body := rec.finish()
	if retryable(status) {
		m.release(r.Context(), scope, key, claimedAt, "handler answered "+strconv.Itoa(status))
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), bookkeepingTimeout)
	defer cancel()
	ok, err := m.st.CompleteIdempotencyKey(ctx, m.pool, scope, key, claimedAt,
		&store.IdempotencyResponse{Status: status, Headers: headers, Body: body}, m.ttl)
	switch {
	case err != nil:
		// The key stays in flight until it expires: retries get 409 rather
		// than running the handler a second time.
		m.log.ErrorContext(ctx, "idempotency: response not stored; the key stays in flight until it expires",
			"scope", scope, "idempotency_key", key, "error", fmt.Errorf("idempotency: store key %q: %w", key, err))
	case !ok:
		m.log.WarnContext(ctx, "idempotency: response not stored; the key expired and was claimed again while its request ran",
			"scope", scope, "idempotency_key", key)
	}
}

// retryable reports whether a response should not be replayed, because it
// tells the client to try again: a server error, 408 Request Timeout or 429
// Too Many Requests.
func retryable(status int) bool {
	return status >= 500 || status == http.StatusRequestTimeout || status == http.StatusTooManyRequests
}

func (m *Middleware) release(reqCtx context.Context, scope, key string, claimedAt time.Time, why string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(reqCtx), bookkeepingTimeout)
	defer cancel()
	if _, err := m.st.ReleaseIdempotencyKey(ctx, m.pool, scope, key, claimedAt); err != nil {
		m.log.ErrorContext(ctx, "idempotency: key not released; it stays in flight until it expires",
			"scope", scope, "idempotency_key", key, "reason", why, "error", fmt.Errorf("idempotency: release key %q: %w", key, err))
		return
	}
	m.log.DebugContext(ctx, "idempotency: key released", "scope", scope, "idempotency_key", key, "reason", why)
}

func (m *Middleware) unavailable(ctx context.Context, w http.ResponseWriter, err error) {
	m.log.ErrorContext(ctx, "idempotency: key not checked", "error", err)
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
	body, err := io.ReadAll(io.LimitReader(r.Body, m.maxBodyBytes+1))
	if err != nil {
		return nil, http.StatusBadRequest, "request body could not be read"
	}
	if int64(len(body)) > m.maxBodyBytes {
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

// text makes s storable in a PostgreSQL text column.
func text(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", `\0`)
}

func replay(w http.ResponseWriter, resp *store.IdempotencyResponse) {
	h := w.Header()
	for name, vs := range resp.Headers {
		h[name] = vs
	}
	h.Set(HeaderReplayed, "true")
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
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
