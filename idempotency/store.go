package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/store"
)

// Store keeps the middleware's keys. The default keeps them in PostgreSQL
// (the idempotency_keys table of [Config.Schema]); package
// idempotency/redisstore keeps them in Redis, for services whose request
// path has no PostgreSQL. Scope and key reach a store as the middleware
// made them: the scope joins the caller's identity and [Config.Scope], so
// a store keeps them apart exactly, whatever bytes they hold.
type Store interface {
	// Claim takes key in scope for a request whose fingerprint is hash,
	// for lease: a claim that is neither completed nor released within it
	// lapses (its request's process died), and the key is free again. It
	// returns the claim, which fences Complete and Release, and false when
	// the key is held (claimed and not lapsed, or completed and not
	// expired): then it changes nothing.
	Claim(ctx context.Context, scope, key string, hash []byte, lease time.Duration) (Claim, bool, error)
	// Get returns the key's record, or an error wrapping ErrKeyNotFound
	// when the key is free (never claimed, released, lapsed or expired).
	Get(ctx context.Context, scope, key string) (*Record, error)
	// Complete stores resp with the key held by claim and keeps it for
	// ttl, every byte of its header values included (see
	// [HeaderValuesAsText]). It reports false, and changes nothing, when
	// claim no longer holds the key.
	Complete(ctx context.Context, scope, key string, claim Claim, resp *Response, ttl time.Duration) (bool, error)
	// Release frees the key held by claim. It reports false when claim no
	// longer holds it.
	Release(ctx context.Context, scope, key string, claim Claim) (bool, error)
	// DeleteExpired deletes up to limit expired keys and returns how many;
	// a store whose keys expire by themselves returns 0.
	DeleteExpired(ctx context.Context, limit int) (int64, error)
}

// Claim identifies one claim of a key: a store's token.
type Claim string

// Record is a key as a store holds it.
type Record struct {
	// RequestHash is the fingerprint of the request that claimed it.
	RequestHash []byte
	// Response is the stored response, nil while the key is in flight.
	Response *Response
}

// Response is a stored response.
type Response struct {
	Status  int
	Headers map[string][]string
	Body    []byte
	// BodyOmitted: the body was not kept (too large); a retry gets 410.
	BodyOmitted bool
}

// HeaderValuesAsText returns h with every value that JSON text cannot carry
// exactly (a value that is not valid UTF-8, or holds a NUL: HTTP allows
// both) escaped, for a [Store] that keeps headers as JSON; Go's
// encoding/json would replace such bytes, and PostgreSQL's jsonb refuses a
// NUL. [HeaderValuesFromText] gives the values back byte for byte. Both
// stores of this module use them. h is not changed.
func HeaderValuesAsText(h map[string][]string) map[string][]string {
	return store.EncodeHeaderValues(h)
}

// HeaderValuesFromText reverses [HeaderValuesAsText].
func HeaderValuesFromText(h map[string][]string) map[string][]string {
	return store.DecodeHeaderValues(h)
}

// ErrKeyNotFound is wrapped by [Store.Get] for a key that is free.
var ErrKeyNotFound = errors.New("idempotency: key not found")

// NewPostgresStore returns the PostgreSQL store of schema ("" for the
// default) on pool: what [New] uses by default.
func NewPostgresStore(pool *pgxpool.Pool, schema string) (Store, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if schema == "" {
		schema = store.SchemaDefault
	}
	st, err := store.New(schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	return &pgStore{pool: pool, st: st}, nil
}

// pgStore keeps keys in the idempotency_keys table; a claim is its
// created_at, in database time.
type pgStore struct {
	pool *pgxpool.Pool
	st   *store.Store
}

func pgClaim(t time.Time) Claim { return Claim(t.UTC().Format(time.RFC3339Nano)) }

// claimedAt reads a claim this store made; a claim it did not make holds
// no key of it (ok false).
func (p *pgStore) claimedAt(c Claim) (t time.Time, ok bool) {
	t, err := time.Parse(time.RFC3339Nano, string(c))
	return t, err == nil
}

// text makes scope or key storable in a text column, keeping every two
// apart: a NUL or invalid UTF-8, which PostgreSQL refuses in text, is
// escaped (the middleware itself hands over none; a direct user of the
// store may).
func text(s string) string {
	return store.EncodeText(s)
}

func (p *pgStore) Claim(ctx context.Context, scope, key string, hash []byte, lease time.Duration) (Claim, bool, error) {
	at, ok, err := p.st.ClaimIdempotencyKey(ctx, p.pool, text(scope), text(key), hash, lease)
	if err != nil || !ok {
		return "", ok, err
	}
	return pgClaim(at), true, nil
}

func (p *pgStore) Get(ctx context.Context, scope, key string) (*Record, error) {
	row, err := p.st.GetIdempotencyKey(ctx, p.pool, text(scope), text(key))
	if errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("%w: %w", ErrKeyNotFound, err)
	}
	if err != nil {
		return nil, err
	}
	rec := &Record{RequestHash: row.RequestHash}
	if row.Status == store.IdempotencyDone && row.Response != nil {
		r := row.Response
		rec.Response = &Response{Status: r.Status, Headers: r.Headers, Body: r.Body, BodyOmitted: r.BodyOmitted}
	}
	return rec, nil
}

func (p *pgStore) Complete(ctx context.Context, scope, key string, c Claim, resp *Response, ttl time.Duration) (bool, error) {
	at, ok := p.claimedAt(c)
	if !ok {
		return false, nil
	}
	return p.st.CompleteIdempotencyKey(ctx, p.pool, text(scope), text(key), at,
		&store.IdempotencyResponse{Status: resp.Status, Headers: resp.Headers, Body: resp.Body, BodyOmitted: resp.BodyOmitted}, ttl)
}

func (p *pgStore) Release(ctx context.Context, scope, key string, c Claim) (bool, error) {
	at, ok := p.claimedAt(c)
	if !ok {
		return false, nil
	}
	return p.st.ReleaseIdempotencyKey(ctx, p.pool, text(scope), text(key), at)
}

func (p *pgStore) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	return p.st.DeleteExpiredIdempotencyKeys(ctx, p.pool, limit)
}
