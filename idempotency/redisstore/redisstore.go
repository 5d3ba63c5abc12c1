// Package redisstore keeps the keys of package idempotency's middleware in
// Redis, for services whose request path has no PostgreSQL transaction.
//
// Each key is one Redis hash, named Prefix + the hex SHA-256 of the scope and
// the key (so that any bytes, of any length, in either are safe and no two
// pairs share a name), holding the claim's token, the request's fingerprint
// and, once done, the response. A claim is an atomic script: the hash is
// written only if it does not exist, with a time to live of the claim's
// lease, so the key of a request whose process died frees itself when the
// lease ends. Completing and releasing are scripts too, fenced by the
// claim's random token: a request that ran past its lease, whose key was
// claimed again since, can neither overwrite nor free the new claim. A
// completed key lives for the middleware's TTL; Redis expires it, so
// DeleteExpired has nothing to do.
//
// Why saga steps and inbox consumers do not deduplicate in Redis: their
// idempotency key must commit in the same transaction as the effect it
// guards (a step's writes, a consumer's handler), or a crash between the
// two either loses the effect or lets it happen twice. Only PostgreSQL
// holds both. The HTTP middleware guards a request, not a transaction, so
// it can keep its keys where the service keeps its state.
package redisstore

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sagaflow/sagaflow/idempotency"
)

// PrefixDefault prefixes every key's name.
const PrefixDefault = "sagaflow:idem:"

// Store is an idempotency.Store in Redis.
type Store struct {
	rdb    redis.UniversalClient
	prefix string
}

var _ idempotency.Store = (*Store)(nil)

// New returns a store on rdb; prefix "" means PrefixDefault.
func New(rdb redis.UniversalClient, prefix string) (*Store, error) {
	if rdb == nil {
		return nil, fmt.Errorf("%w: the Redis client is nil", idempotency.ErrInvalidConfig)
	}
	if prefix == "" {
		prefix = PrefixDefault
	}
	return &Store{rdb: rdb, prefix: prefix}, nil
}

// name is the Redis key of (scope, key): the scope's length keeps
// ("a", "bc") and ("ab", "c") apart.
func (s *Store) name(scope, key string) string {
	h := sha256.New()
	h.Write([]byte(strconv.Itoa(len(scope))))
	h.Write([]byte{0})
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return s.prefix + hex.EncodeToString(h.Sum(nil))
}

var claimScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'hash', ARGV[2], 'status', 'in_flight')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1`)

var completeScript = redis.NewScript(`
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'status') ~= 'in_flight' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'done', 'response', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1`)

var releaseScript = redis.NewScript(`
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'status') ~= 'in_flight' then return 0 end
redis.call('DEL', KEYS[1])
return 1`)

// Claim takes the key for lease, atomically.
func (s *Store) Claim(ctx context.Context, scope, key string, hash []byte, lease time.Duration) (idempotency.Claim, bool, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", false, fmt.Errorf("redisstore: token: %w", err)
	}
	token := hex.EncodeToString(b[:])
	n, err := claimScript.Run(ctx, s.rdb, []string{s.name(scope, key)}, token, hash, max(lease.Milliseconds(), 1)).Int()
	if err != nil {
		return "", false, fmt.Errorf("redisstore: claim: %w", err)
	}
	if n != 1 {
		return "", false, nil
	}
	return idempotency.Claim(token), true, nil
}

// response is a stored response, as JSON.
type response struct {
	Status      int                 `json:"status"`
	Headers     map[string][]string `json:"headers,omitempty"`
	Body        []byte              `json:"body,omitempty"`
	BodyOmitted bool                `json:"body_omitted,omitempty"`
}

// Get reads the key.
func (s *Store) Get(ctx context.Context, scope, key string) (*idempotency.Record, error) {
	m, err := s.rdb.HGetAll(ctx, s.name(scope, key)).Result()
	if err != nil {
		return nil, fmt.Errorf("redisstore: get: %w", err)
	}
	if len(m) == 0 {
		return nil, fmt.Errorf("redisstore: %w", idempotency.ErrKeyNotFound)
	}
	rec := &idempotency.Record{RequestHash: []byte(m["hash"])}
	if m["status"] == "done" {
		var r response
		if err := json.Unmarshal([]byte(m["response"]), &r); err != nil {
			return nil, fmt.Errorf("redisstore: the stored response does not decode: %w", err)
		}
		if r.Body == nil {
			r.Body = []byte{}
		}
		rec.Response = &idempotency.Response{Status: r.Status, Headers: idempotency.HeaderValuesFromText(r.Headers), Body: r.Body,
			BodyOmitted: r.BodyOmitted}
	}
	return rec, nil
}

// Complete stores resp with the key held by claim, for ttl.
func (s *Store) Complete(ctx context.Context, scope, key string, claim idempotency.Claim, resp *idempotency.Response, ttl time.Duration) (bool, error) {
	// JSON text cannot carry every byte a header value may hold (encoding/json
	// would replace invalid UTF-8): such values are stored escaped.
	r := response{Status: resp.Status, Headers: idempotency.HeaderValuesAsText(resp.Headers), Body: resp.Body, BodyOmitted: resp.BodyOmitted}
	if r.BodyOmitted {
		r.Body = nil
	}
	raw, err := json.Marshal(r)
	if err != nil {
		return false, fmt.Errorf("redisstore: encode response: %w", err)
	}
	n, err := completeScript.Run(ctx, s.rdb, []string{s.name(scope, key)}, string(claim), raw, max(ttl.Milliseconds(), 1)).Int()
	if err != nil {
		return false, fmt.Errorf("redisstore: complete: %w", err)
	}
	return n == 1, nil
}

// Release frees the key held by claim.
func (s *Store) Release(ctx context.Context, scope, key string, claim idempotency.Claim) (bool, error) {
	n, err := releaseScript.Run(ctx, s.rdb, []string{s.name(scope, key)}, string(claim)).Int()
	if err != nil {
		return false, fmt.Errorf("redisstore: release: %w", err)
	}
	return n == 1, nil
}

// DeleteExpired does nothing: Redis expires the keys.
func (s *Store) DeleteExpired(context.Context, int) (int64, error) { return 0, nil }
