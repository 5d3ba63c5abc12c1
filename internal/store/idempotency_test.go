package store_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

func setupIdempotency(t *testing.T) (*pgxpool.Pool, *store.Store, string) {
	t.Helper()
	pool, st, schema := newStore(t)
	return pool, st, pgx.Identifier{schema, "idempotency_keys"}.Sanitize()
}

func TestIdempotencyKeyLifecycle(t *testing.T) {
	t.Parallel()
	pool, st, _ := setupIdempotency(t)
	ctx := context.Background()
	hash := []byte("hash-1")

	claimedAt, ok, err := st.ClaimIdempotencyKey(ctx, pool, "POST /orders", "k", hash, time.Hour)
	require.NoError(t, err)
	require.True(t, ok)
	_, ok, err = st.ClaimIdempotencyKey(ctx, pool, "POST /orders", "k", hash, time.Hour)
	require.NoError(t, err)
	require.False(t, ok, "a live key cannot be claimed twice")
	_, ok, err = st.ClaimIdempotencyKey(ctx, pool, "POST /payments", "k", hash, time.Hour)
	require.NoError(t, err)
	require.True(t, ok, "another scope, another key")

	k, err := st.GetIdempotencyKey(ctx, pool, "POST /orders", "k")
	require.NoError(t, err)
	require.Equal(t, store.IdempotencyInFlight, k.Status)
	require.Equal(t, hash, k.RequestHash)
	require.Nil(t, k.Response)
	require.True(t, k.CreatedAt.Equal(claimedAt))

	resp := &store.IdempotencyResponse{Status: 201, Headers: map[string][]string{"Location": {"/orders/1"}}, Body: []byte("{}")}
	done, err := st.CompleteIdempotencyKey(ctx, pool, "POST /orders", "k", claimedAt.Add(time.Microsecond), resp, time.Hour)
	require.NoError(t, err)
	require.False(t, done, "another claim's fence does not hold the key")
	done, err = st.CompleteIdempotencyKey(ctx, pool, "POST /orders", "k", claimedAt, resp, time.Hour)
	require.NoError(t, err)
	require.True(t, done)

	k, err = st.GetIdempotencyKey(ctx, pool, "POST /orders", "k")
	require.NoError(t, err)
	require.Equal(t, store.IdempotencyDone, k.Status)
	require.Equal(t, resp, k.Response)

	released, err := st.ReleaseIdempotencyKey(ctx, pool, "POST /orders", "k", claimedAt)
	require.NoError(t, err)
	require.False(t, released, "a done key is never released")

	_, err = st.GetIdempotencyKey(ctx, pool, "POST /orders", "missing")
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestIdempotencyKeyExpiredClaimIsFenced(t *testing.T) {
	t.Parallel()
	pool, st, table := setupIdempotency(t)
	ctx := context.Background()

	old, ok, err := st.ClaimIdempotencyKey(ctx, pool, "s", "k", []byte("a"), time.Hour)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = pool.Exec(ctx, "UPDATE "+table+" SET expires_at = now() - interval '1 second'")
	require.NoError(t, err)
	_, err = st.GetIdempotencyKey(ctx, pool, "s", "k")
	require.ErrorIs(t, err, store.ErrNotFound, "an expired key reads as absent")

	renewed, ok, err := st.ClaimIdempotencyKey(ctx, pool, "s", "k", []byte("b"), time.Hour)
	require.NoError(t, err)
	require.True(t, ok, "an expired key is claimed again")
	require.True(t, renewed.After(old))

	// The first claim's request finishes late: it can neither store its
	// response nor release the new claim.
	done, err := st.CompleteIdempotencyKey(ctx, pool, "s", "k", old, &store.IdempotencyResponse{Status: 201}, time.Hour)
	require.NoError(t, err)
	require.False(t, done)
	released, err := st.ReleaseIdempotencyKey(ctx, pool, "s", "k", old)
	require.NoError(t, err)
	require.False(t, released)

	k, err := st.GetIdempotencyKey(ctx, pool, "s", "k")
	require.NoError(t, err)
	require.Equal(t, []byte("b"), k.RequestHash)
	require.Equal(t, store.IdempotencyInFlight, k.Status)

	released, err = st.ReleaseIdempotencyKey(ctx, pool, "s", "k", renewed)
	require.NoError(t, err)
	require.True(t, released)
	_, err = st.GetIdempotencyKey(ctx, pool, "s", "k")
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestIdempotencyKeyConcurrentClaims(t *testing.T) {
	t.Parallel()
	pool, st, table := setupIdempotency(t)
	ctx := context.Background()

	// Fresh and expired keys alike: exactly one of many concurrent claims wins.
	for _, expired := range []bool{false, true} {
		if expired {
			_, err := pool.Exec(ctx, "UPDATE "+table+" SET expires_at = now() - interval '1 second'")
			require.NoError(t, err)
		}
		var wins atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range 8 {
			wg.Go(func() {
				<-start
				_, ok, err := st.ClaimIdempotencyKey(ctx, pool, "s", "k", []byte("h"), time.Hour)
				require.NoError(t, err)
				if ok {
					wins.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
		require.Equal(t, int32(1), wins.Load(), "expired=%v", expired)
	}
}

func TestDeleteExpiredIdempotencyKeys(t *testing.T) {
	t.Parallel()
	pool, st, table := setupIdempotency(t)
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c", "d"} {
		_, ok, err := st.ClaimIdempotencyKey(ctx, pool, "s", k, []byte("h"), time.Hour)
		require.NoError(t, err)
		require.True(t, ok)
	}
	_, err := pool.Exec(ctx, "UPDATE "+table+" SET expires_at = now() - interval '1 minute' WHERE key IN ('a', 'b', 'c')")
	require.NoError(t, err)

	n, err := st.DeleteExpiredIdempotencyKeys(ctx, pool, 2)
	require.NoError(t, err)
	require.Equal(t, int64(2), n)
	n, err = st.DeleteExpiredIdempotencyKeys(ctx, pool, 2)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	n, err = st.DeleteExpiredIdempotencyKeys(ctx, pool, 2)
	require.NoError(t, err)
	require.Equal(t, int64(0), n)
	_, err = st.GetIdempotencyKey(ctx, pool, "s", "d")
	require.NoError(t, err, "the live key stays")
}

func TestIdempotencyKeyBodyOmitted(t *testing.T) {
	t.Parallel()
	pool, st, table := setupIdempotency(t)
	ctx := context.Background()
	for _, tc := range []struct {
		key     string
		resp    store.IdempotencyResponse
		omitted bool
	}{
		{"empty", store.IdempotencyResponse{Status: 204}, false},
		{"omitted", store.IdempotencyResponse{Status: 201, Headers: map[string][]string{"Location": {"/r/1"}}, Body: []byte("not kept"), BodyOmitted: true}, true},
	} {
		claimedAt, ok, err := st.ClaimIdempotencyKey(ctx, pool, "s", tc.key, []byte("h"), time.Hour)
		require.NoError(t, err)
		require.True(t, ok)
		done, err := st.CompleteIdempotencyKey(ctx, pool, "s", tc.key, claimedAt, &tc.resp, time.Hour)
		require.NoError(t, err)
		require.True(t, done)

		k, err := st.GetIdempotencyKey(ctx, pool, "s", tc.key)
		require.NoError(t, err)
		require.Equal(t, store.IdempotencyDone, k.Status)
		require.Equal(t, tc.resp.Status, k.Response.Status)
		require.Equal(t, tc.omitted, k.Response.BodyOmitted, tc.key)
		require.Equal(t, []byte{}, k.Response.Body, "an empty body and an omitted one both read as empty")
		var null bool
		require.NoError(t, pool.QueryRow(ctx, "SELECT response_body IS NULL FROM "+table+" WHERE key = $1", tc.key).Scan(&null))
		require.Equal(t, tc.omitted, null, "only an omitted body is stored as NULL")
	}
}
