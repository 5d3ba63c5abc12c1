package review25_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
)

// The Store contract, table-driven over both stores: claim, get, complete,
// release, fenced by the claim; a lapsed lease and an expired TTL free the
// key; what is stored comes back byte for byte.
func TestStoreContract(t *testing.T) {
	t.Parallel()
	hash := []byte("\x00\xff\xfe h\x00")
	resp := &idempotency.Response{
		Status:  201,
		Headers: map[string][]string{"Location": {"/orders/1"}, "Content-Language": {"en", "de"}, "Etag": {`"v1"`}},
		Body:    append([]byte("\x00\xff\xfe"), bytes.Repeat([]byte("b"), 1<<20)...),
	}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			st := newStore(t, kind)
			ctx := context.Background()
			const scope = "5:alice POST /orders"

			_, err := st.Get(ctx, scope, "k")
			require.ErrorIs(t, err, idempotency.ErrKeyNotFound, "a key never claimed")

			c1, ok, err := st.Claim(ctx, scope, "k", hash, time.Minute)
			require.NoError(t, err)
			require.True(t, ok)
			require.NotEmpty(t, c1)
			_, ok, err = st.Claim(ctx, scope, "k", []byte("other"), time.Minute)
			require.NoError(t, err)
			require.False(t, ok, "a held key was claimed twice")
			rec, err := st.Get(ctx, scope, "k")
			require.NoError(t, err)
			require.Equal(t, hash, rec.RequestHash, "the second claim changed the hash, or the hash's bytes were altered")
			require.Nil(t, rec.Response, "in flight")

			ok, err = st.Complete(ctx, scope, "k", c1, resp, time.Hour)
			require.NoError(t, err)
			require.True(t, ok)
			rec, err = st.Get(ctx, scope, "k")
			require.NoError(t, err)
			require.NotNil(t, rec.Response)
			require.Equal(t, resp.Status, rec.Response.Status)
			require.Equal(t, resp.Headers, rec.Response.Headers)
			require.True(t, bytes.Equal(resp.Body, rec.Response.Body), "body altered")
			require.False(t, rec.Response.BodyOmitted)
			_, ok, err = st.Claim(ctx, scope, "k", hash, time.Minute)
			require.NoError(t, err)
			require.False(t, ok, "a completed key was claimed again")

			// release, and a stale claim is fenced out.
			c2, ok, err := st.Claim(ctx, scope, "r", hash, time.Minute)
			require.NoError(t, err)
			require.True(t, ok)
			ok, err = st.Release(ctx, scope, "r", c2)
			require.NoError(t, err)
			require.True(t, ok)
			_, err = st.Get(ctx, scope, "r")
			require.ErrorIs(t, err, idempotency.ErrKeyNotFound)
			c3, ok, err := st.Claim(ctx, scope, "r", []byte("h3"), time.Minute)
			require.NoError(t, err)
			require.True(t, ok)
			require.NotEqual(t, c2, c3, "two claims of a key share a token")
			ok, err = st.Release(ctx, scope, "r", c2)
			require.NoError(t, err)
			require.False(t, ok, "a stale claim released the new one")
			ok, err = st.Complete(ctx, scope, "r", c2, resp, time.Hour)
			require.NoError(t, err)
			require.False(t, ok, "a stale claim completed the new one")
			rec, err = st.Get(ctx, scope, "r")
			require.NoError(t, err)
			require.Equal(t, []byte("h3"), rec.RequestHash)
			require.Nil(t, rec.Response)
			// a forged claim holds no key: false, no error (O8 b: the
			// PostgreSQL store returned an error; now both stores agree).
			ok, err = st.Complete(ctx, scope, "r", idempotency.Claim("forged"), resp, time.Hour)
			require.False(t, ok)
			require.NoError(t, err, "Complete with a forged claim")
			ok, err = st.Release(ctx, scope, "r", "")
			require.False(t, ok)
			require.NoError(t, err, "Release with an empty claim")
			rec, err = st.Get(ctx, scope, "r")
			require.NoError(t, err)
			require.Nil(t, rec.Response)

			// body omitted.
			c4, _, err := st.Claim(ctx, scope, "o", hash, time.Minute)
			require.NoError(t, err)
			ok, err = st.Complete(ctx, scope, "o", c4, &idempotency.Response{Status: 201, Headers: map[string][]string{"Location": {"/x"}}, BodyOmitted: true}, time.Hour)
			require.NoError(t, err)
			require.True(t, ok)
			rec, err = st.Get(ctx, scope, "o")
			require.NoError(t, err)
			require.True(t, rec.Response.BodyOmitted)
			require.Equal(t, []string{"/x"}, rec.Response.Headers["Location"])

			// a lapsed lease frees the key, and fences its claim.
			c5, ok, err := st.Claim(ctx, scope, "l", hash, 300*time.Millisecond)
			require.NoError(t, err)
			require.True(t, ok)
			// an expired response frees its key.
			c6, _, err := st.Claim(ctx, scope, "t", hash, time.Minute)
			require.NoError(t, err)
			ok, err = st.Complete(ctx, scope, "t", c6, resp, time.Second)
			require.NoError(t, err)
			require.True(t, ok)
			time.Sleep(1200 * time.Millisecond)
			for _, k := range []string{"l", "t"} {
				_, err = st.Get(ctx, scope, k)
				require.ErrorIs(t, err, idempotency.ErrKeyNotFound, "key %s", k)
				_, ok, err = st.Claim(ctx, scope, k, []byte("new"), time.Minute)
				require.NoError(t, err)
				require.True(t, ok, "key %s was not free", k)
			}
			ok, err = st.Complete(ctx, scope, "l", c5, resp, time.Hour)
			require.NoError(t, err)
			require.False(t, ok, "a lapsed claim completed its successor")
			ok, err = st.Release(ctx, scope, "l", c5)
			require.NoError(t, err)
			require.False(t, ok, "a lapsed claim released its successor")
		})
	}
}

// "a store keeps them apart exactly, whatever bytes they hold": pairs of
// (scope, key) that a careless join or a text column would make one.
func TestStoreKeepsScopeAndKeyApart(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("s", 600)
	pairs := [][2][2]string{
		{{"ab", "c"}, {"a", "bc"}},
		{{"a ", "b"}, {"a", " b"}},
		{{"a:", "b"}, {"a", ":b"}},
		{{"a\n", "b"}, {"a", "\nb"}},
		{{long + "1", "k"}, {long + "2", "k"}},
		{{"s", strings.Repeat("k", 600) + "1"}, {"s", strings.Repeat("k", 600) + "2"}},
		{{"sha256:" + sha256hex("x"), "k"}, {"x", "k"}},
	}
	hostile := [][2][2]string{
		{{"a\x00", "b"}, {"a", "\x00b"}},
		{{"a\x00b", "k"}, {"a\x00c", "k"}},
		{{"\xff", "k"}, {"\xfe", "k"}},
		{{"s", "\xff"}, {"s", "\ufffd"}},
	}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			st := newStore(t, kind)
			ctx := context.Background()
			for i, p := range pairs {
				for j, sk := range p {
					_, ok, err := st.Claim(ctx, sk[0], sk[1], []byte{byte(j)}, time.Minute)
					require.NoError(t, err, "pair %d", i)
					require.True(t, ok, "pair %d: (%q, %q) was held by (%q, %q)", i, trunc([]byte(sk[0])), trunc([]byte(sk[1])), trunc([]byte(p[0][0])), trunc([]byte(p[0][1])))
				}
			}
			for i, p := range hostile {
				for j, sk := range p {
					// The middleware never hands a store these bytes (it
					// hashes them first), but the Store doc says a store
					// keeps them apart "whatever bytes they hold" (O8 a: the
					// PostgreSQL store refused them with SQLSTATE 22021).
					_, ok, err := st.Claim(ctx, sk[0], sk[1], []byte{byte(j)}, time.Minute)
					require.NoError(t, err, "%s: hostile pair %d", kind, i)
					require.True(t, ok, "hostile pair %d: (%q, %q) was held by the other", i, sk[0], sk[1])
					rec, err := st.Get(ctx, sk[0], sk[1])
					require.NoError(t, err)
					require.Equal(t, []byte{byte(j)}, rec.RequestHash, "hostile pair %d: read back another's key", i)
				}
			}
		})
	}
}

// "Complete stores resp": a response whose header values are not valid
// UTF-8 (obs-text, legal in HTTP), given to a store directly, comes back as
// it was stored, or is refused; never altered.
func TestStoreKeepsHeaderBytes(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			// F2 (fixed): the stores replaced invalid UTF-8 with U+FFFD.
			st := newStore(t, kind)
			ctx := context.Background()
			c, _, err := st.Claim(ctx, "s", "k", []byte("h"), time.Minute)
			require.NoError(t, err)
			want := map[string][]string{"Etag": {"\"\xff\xfe\""}, "Content-Language": {"de-\xc3"}}
			ok, err := st.Complete(ctx, "s", "k", c, &idempotency.Response{Status: 201, Headers: want}, time.Hour)
			if err != nil {
				t.Logf("%s: Complete refused invalid UTF-8 header values: %v", kind, err)
				return
			}
			require.True(t, ok)
			rec, err := st.Get(ctx, "s", "k")
			require.NoError(t, err)
			require.Equal(t, want, rec.Response.Headers, "the stored headers came back altered")
		})
	}
}
