package store

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// Idempotency key statuses as stored.
const (
	// IdempotencyInFlight is a key whose first request is being handled.
	IdempotencyInFlight = "in_flight"
	// IdempotencyDone is a key whose response is stored.
	IdempotencyDone = "done"
)

// IdempotencyKey is a row of idempotency_keys: an inbound request's key and,
// once its handler finished, the response it produced.
type IdempotencyKey struct {
	Scope       string
	Key         string
	RequestHash []byte
	Status      string // IdempotencyInFlight or IdempotencyDone
	// Response is the stored response; nil while the key is in flight.
	Response  *IdempotencyResponse
	CreatedAt time.Time
	ExpiresAt time.Time
}

// IdempotencyResponse is the response stored with a done key.
type IdempotencyResponse struct {
	Status int
	// Headers come back byte for byte: values jsonb cannot hold are
	// stored escaped (see [EncodeHeaderValues]).
	Headers map[string][]string
	Body    []byte
	// BodyOmitted records that the response's body was not kept (it was
	// too large, or streamed): the key is done, Status and Headers are
	// stored, and Body is empty. Stored as a NULL response_body.
	BodyOmitted bool
}

// The statements are built per call from the schema: this file adds to the
// statements of [New] without changing them, and concatenating a few strings
// costs nothing next to a round trip.

// ClaimIdempotencyKey inserts key in scope as in flight, to expire after ttl.
// A row of the key whose expires_at has passed (by the database's clock) is
// replaced in the same statement. It reports the claim's creation time, which
// fences the claim in [Store.CompleteIdempotencyKey] and
// [Store.ReleaseIdempotencyKey], and false when an unexpired row of the key
// exists; then it writes nothing.
//
// Run on a pool (or committed at once), the insert is a lock: a concurrent
// claim of the same key waits for it and then finds the key taken.
func (s *Store) ClaimIdempotencyKey(ctx context.Context, db DBTX, scope, key string, requestHash []byte, ttl time.Duration) (time.Time, bool, error) {
	t := quoteSchema(s.schema) + ".idempotency_keys"
	// A replacement's created_at is its now(), which is at or after the old
	// row's expires_at, which is at least ttl after the old row's created_at:
	// so two claims of one key never share a creation time.
	var createdAt time.Time
	err := db.QueryRow(ctx, `INSERT INTO `+t+` AS k (scope, key, request_hash, status, created_at, expires_at)
		VALUES ($1, $2, $3, 'in_flight', now(), now() + $4 * interval '1 microsecond')
		ON CONFLICT (scope, key) DO UPDATE SET request_hash = EXCLUDED.request_hash, status = 'in_flight',
			response_status = NULL, response_headers = NULL, response_body = NULL,
			created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
			WHERE k.expires_at <= now()
		RETURNING created_at`, scope, key, requestHash, micros(ttl)).Scan(&createdAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("store: claim idempotency key %q in scope %q: %w", key, scope, err)
	}
	return createdAt, true, nil
}

// GetIdempotencyKey reads key in scope. It returns [ErrNotFound] when there
// is no such key or it has expired.
func (s *Store) GetIdempotencyKey(ctx context.Context, db DBTX, scope, key string) (*IdempotencyKey, error) {
	var (
		k       = &IdempotencyKey{Scope: scope, Key: key}
		status  *int32
		headers map[string][]string
		body    []byte
	)
	err := db.QueryRow(ctx, `SELECT request_hash, status, response_status, response_headers, response_body, created_at, expires_at
		FROM `+quoteSchema(s.schema)+`.idempotency_keys
		WHERE scope = $1 AND key = $2 AND expires_at > now()`, scope, key).
		Scan(&k.RequestHash, &k.Status, &status, &headers, &body, &k.CreatedAt, &k.ExpiresAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("store: idempotency key %q in scope %q: %w", key, scope, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: load idempotency key %q in scope %q: %w", key, scope, err)
	}
	if k.Status == IdempotencyDone && status != nil {
		k.Response = &IdempotencyResponse{Status: int(*status), Headers: DecodeHeaderValues(headers), Body: body}
		if body == nil {
			k.Response.Body = []byte{}
			k.Response.BodyOmitted = true
		}
	}
	return k, nil
}

// CompleteIdempotencyKey stores resp with the key claimed at claimedAt, marks
// it done and makes it expire ttl from now. With resp.BodyOmitted, the body
// is stored as NULL whatever resp.Body holds. It reports false, and writes
// nothing, when that claim no longer holds the key (it expired and another
// request claimed the key again, or it was released).
func (s *Store) CompleteIdempotencyKey(ctx context.Context, db DBTX, scope, key string, claimedAt time.Time, resp *IdempotencyResponse, ttl time.Duration) (bool, error) {
	headers := EncodeHeaderValues(resp.Headers)
	if headers == nil {
		headers = map[string][]string{}
	}
	body := resp.Body
	switch {
	case resp.BodyOmitted:
		body = nil // NULL: the body was not kept
	case body == nil:
		body = []byte{}
	}
	tag, err := db.Exec(ctx, `UPDATE `+quoteSchema(s.schema)+`.idempotency_keys
		SET status = 'done', response_status = $4, response_headers = $5, response_body = $6,
			expires_at = now() + $7 * interval '1 microsecond'
		WHERE scope = $1 AND key = $2 AND created_at = $3 AND status = 'in_flight'`,
		scope, key, claimedAt, resp.Status, headers, body, micros(ttl))
	if err != nil {
		return false, fmt.Errorf("store: complete idempotency key %q in scope %q: %w", key, scope, err)
	}
	return tag.RowsAffected() == 1, nil
}

// ReleaseIdempotencyKey deletes the in-flight key claimed at claimedAt, so
// the next request with the key runs again. It reports false when that claim
// no longer holds the key.
func (s *Store) ReleaseIdempotencyKey(ctx context.Context, db DBTX, scope, key string, claimedAt time.Time) (bool, error) {
	tag, err := db.Exec(ctx, `DELETE FROM `+quoteSchema(s.schema)+`.idempotency_keys
		WHERE scope = $1 AND key = $2 AND created_at = $3 AND status = 'in_flight'`, scope, key, claimedAt)
	if err != nil {
		return false, fmt.Errorf("store: release idempotency key %q in scope %q: %w", key, scope, err)
	}
	return tag.RowsAffected() == 1, nil
}

// DeleteExpiredIdempotencyKeys deletes up to limit keys whose expires_at has
// passed, oldest first, skipping rows other transactions hold, and returns
// how many it deleted.
func (s *Store) DeleteExpiredIdempotencyKeys(ctx context.Context, db DBTX, limit int) (int64, error) {
	t := quoteSchema(s.schema) + ".idempotency_keys"
	tag, err := db.Exec(ctx, `DELETE FROM `+t+` WHERE (scope, key) IN (
			SELECT scope, key FROM `+t+` WHERE expires_at <= now()
			ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)`, limit)
	if err != nil {
		return 0, fmt.Errorf("store: delete expired idempotency keys: %w", err)
	}
	return tag.RowsAffected(), nil
}

// headerEscape begins a stored header value that holds the value's bytes
// in base64: a value jsonb cannot hold (invalid UTF-8, a NUL), or one that
// begins with headerEscape itself, so that every value comes back exactly.
const headerEscape = "\x01b64:"

// EncodeText returns s as it is when PostgreSQL text and JSON text can hold
// it exactly (valid UTF-8 without NUL) and it does not begin with the
// escape, else the escape and its bytes in base64: two different strings
// never encode alike.
func EncodeText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) && !strings.HasPrefix(s, headerEscape) {
		return s
	}
	return headerEscape + base64.StdEncoding.EncodeToString([]byte(s))
}

// EncodeHeaderValues returns h with every value that JSON text cannot carry
// exactly (invalid UTF-8, a NUL) written as headerEscape and its bytes in
// base64; [DecodeHeaderValues] reverses it. h is not changed.
func EncodeHeaderValues(h map[string][]string) map[string][]string {
	if h == nil {
		return nil
	}
	out := make(map[string][]string, len(h))
	for name, vs := range h {
		enc := make([]string, len(vs))
		for i, v := range vs {
			enc[i] = EncodeText(v)
		}
		out[name] = enc
	}
	return out
}

// DecodeHeaderValues reverses [EncodeHeaderValues]. A value that begins
// with the escape but does not decode (not written by it) is kept as it is.
func DecodeHeaderValues(h map[string][]string) map[string][]string {
	if h == nil {
		return nil
	}
	out := make(map[string][]string, len(h))
	for name, vs := range h {
		dec := make([]string, len(vs))
		for i, v := range vs {
			dec[i] = v
			if rest, ok := strings.CutPrefix(v, headerEscape); ok {
				if b, err := base64.StdEncoding.DecodeString(rest); err == nil {
					dec[i] = string(b)
				}
			}
		}
		out[name] = dec
	}
	return out
}
