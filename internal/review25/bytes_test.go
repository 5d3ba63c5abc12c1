package review25_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
)

// "A key longer than Config.MaxKeyLength, sent twice, or not printable UTF-8
// (a NUL, a control character, invalid UTF-8): 400. ... The handler does not
// run." Sent directly, so that bytes net/http refuses on the wire reach the
// middleware too (another server, HTTP/2 or a proxy might let them through).
func TestBadKeysAre400AndRunNothing(t *testing.T) {
	t.Parallel()
	bad := map[string][]string{
		"NUL":             {"a\x00b"},
		"SOH":             {"\x01"},
		"tab":             {"a\tb"},
		"CRLF":            {"a\r\nb"},
		"DEL":             {"a\x7fb"},
		"C1 NEL":          {"a\u0085b"},
		"invalid UTF-8":   {"\xff\xfe"},
		"truncated UTF-8": {"ab\xc3"},
		"256 bytes":       {strings.Repeat("k", 256)},
		"10 kB":           {strings.Repeat("k", 10_000)},
		"1 MB":            {strings.Repeat("k", 1<<20)},
		"twice, differ":   {"k1", "k2"},
		"twice, same":     {"k1", "k1"},
	}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			for name, vals := range bad {
				r := rawReq(http.MethodPost, "/orders", "", "", "alice", []byte("body"))
				r.Header[idempotency.HeaderDefault] = vals
				rec := rg.serveDirect(r)
				e := requireJSONError(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusBadRequest, name)
				require.Less(t, len(e), 1000, "%s: the error echoes the key back", name)
				if kind == "pg" {
					t.Logf("%s: %q", name, e)
				}
			}
			require.Zero(t, c.get(), "the handler ran for a bad key")
			// the same over the wire, for the bytes HTTP/1.1 carries.
			for name, k := range map[string]string{"invalid UTF-8": "\xff\xfe", "256 bytes": strings.Repeat("k", 256), "C1": "a\u0085b"} {
				x := rg.do(t, q{key: k, user: "alice", body: []byte("b")})
				requireJSONError(t, x.status, x.hdr, x.body, http.StatusBadRequest, name)
			}
			x := rg.do(t, q{user: "alice", hdr: http.Header{"Idempotency-Key": {"k1", "k2"}}})
			requireJSONError(t, x.status, x.hdr, x.body, http.StatusBadRequest, "two keys")
			require.Zero(t, c.get())
		})
	}
}

// Printable keys up to MaxKeyLength bytes are accepted and replayed.
func TestPrintableKeysWork(t *testing.T) {
	t.Parallel()
	good := []string{"ключ-😀", "a b", "a,b;c=d", strings.Repeat("k", 255), strings.Repeat("€", 85), "sha256:abc", "5:alice POST /orders"}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			for i, k := range good {
				r1 := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", k, "alice", []byte("b")))
				require.Equal(t, http.StatusCreated, r1.Code, "key %d %q: %s", i, trunc([]byte(k)), r1.Body.String())
				r2 := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", k, "alice", []byte("b")))
				require.Equal(t, http.StatusCreated, r2.Code, "key %d", i)
				require.Equal(t, "true", r2.Header().Get(idempotency.HeaderReplayed), "key %d", i)
				require.Equal(t, r1.Body.String(), r2.Body.String())
			}
			require.Equal(t, int64(len(good)), c.get())
		})
	}
}

// With a MaxKeyLength that allows them, keys of 10 kB and 1 MB work; "a key
// longer than 512 bytes" is stored as "sha256:" and its hex SHA-256. That
// stored form must not make the long key the same key as the 71-byte key
// that spells it, nor two long keys the same.
func TestLongKeysAreKeptApartFromTheirHashSpelling(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("L", 10_000)
	spelled := "sha256:" + sha256hex(long)
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, &idempotency.Config{MaxKeyLength: 2 << 20}, echo(&c))
			for _, k := range []string{long, long[:9999] + "M", strings.Repeat("m", 1<<20)} {
				r1 := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", k, "alice", []byte("b")))
				require.Equal(t, http.StatusCreated, r1.Code, r1.Body.String())
				require.Empty(t, r1.Header().Get(idempotency.HeaderReplayed), "a new long key of %d bytes was answered from another key", len(k))
				r2 := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", k, "alice", []byte("b")))
				require.Equal(t, "true", r2.Header().Get(idempotency.HeaderReplayed))
			}
			require.Equal(t, int64(3), c.get())
			// the 71-byte key that spells the long key's stored form is another key.
			r := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", spelled, "alice", []byte("b")))
			require.Equal(t, http.StatusCreated, r.Code, "key %q: %d %s", spelled, r.Code, r.Body.String())
			require.Empty(t, r.Header().Get(idempotency.HeaderReplayed), "key %q was answered with the response of the 10 kB key whose stored form it spells", spelled)
			require.Equal(t, int64(4), c.get())
			// and with another body it is a new request, not a 422.
			r = rg.serveDirect(rawReq(http.MethodPost, "/orders", "", "sha256:"+sha256hex(strings.Repeat("m", 1<<20)), "alice", []byte("other")))
			require.Equal(t, http.StatusCreated, r.Code, "%d %s", r.Code, r.Body.String())
		})
	}
}

// Bytes PostgreSQL refuses and long values in the method, the path and the
// query: the request runs once, its retry is a replay, and a request that
// differs in the last byte is another request (another scope: runs; another
// query: 422), never answered with this one's response and never a 500.
func TestHostileMethodPathAndQuery(t *testing.T) {
	t.Parallel()
	type variant struct {
		name              string
		method, path, raw string
		// other is the same request changed in one byte.
		oMethod, oPath, oRaw string
		otherIs422           bool
	}
	bigPath := "/" + strings.Repeat("p", 1<<20)
	bigQuery := "q=" + strings.Repeat("v", 1<<20)
	vs := []variant{
		{name: "NUL in method", method: "POST\x00", path: "/orders", oMethod: "POST\x01", oPath: "/orders"},
		{name: "invalid UTF-8 method", method: "P\xffST", path: "/orders", oMethod: "P\xfeST", oPath: "/orders"},
		{name: "10 kB method", method: strings.Repeat("M", 10_000), path: "/orders", oMethod: strings.Repeat("M", 9_999) + "N", oPath: "/orders"},
		{name: "NUL in path", method: "POST", path: "/a\x00b", oMethod: "POST", oPath: "/a\x00c"},
		{name: "invalid UTF-8 path", method: "POST", path: "/\xff", oMethod: "POST", oPath: "/\xfe"},
		{name: "10 kB path", method: "POST", path: "/" + strings.Repeat("p", 10_000), oMethod: "POST", oPath: "/" + strings.Repeat("p", 9_999) + "q"},
		{name: "1 MB path", method: "POST", path: bigPath, oMethod: "POST", oPath: bigPath[:len(bigPath)-1] + "q"},
		{name: "raw NUL in query", method: "POST", path: "/orders", raw: "a=\x00", oMethod: "POST", oPath: "/orders", oRaw: "a=\x01", otherIs422: true},
		{name: "invalid UTF-8 query", method: "POST", path: "/orders", raw: "a=\xff", oMethod: "POST", oPath: "/orders", oRaw: "a=\xfe", otherIs422: true},
		{name: "1 MB query", method: "POST", path: "/orders", raw: bigQuery, oMethod: "POST", oPath: "/orders", oRaw: bigQuery[:len(bigQuery)-1] + "w", otherIs422: true},
	}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			for i, v := range vs {
				key := "hostile-" + string(rune('a'+i))
				before := c.get()
				r1 := rg.serveDirect(rawReq(v.method, v.path, v.raw, key, "alice", []byte("b")))
				require.Equal(t, http.StatusCreated, r1.Code, "%s: %d %s", v.name, r1.Code, trunc(r1.Body.Bytes()))
				r2 := rg.serveDirect(rawReq(v.method, v.path, v.raw, key, "alice", []byte("b")))
				require.Equal(t, http.StatusCreated, r2.Code, "%s retry: %s", v.name, trunc(r2.Body.Bytes()))
				require.Equal(t, "true", r2.Header().Get(idempotency.HeaderReplayed), v.name)
				require.Equal(t, r1.Body.String(), r2.Body.String())
				r3 := rg.serveDirect(rawReq(v.oMethod, v.oPath, v.oRaw, key, "alice", []byte("b")))
				if v.otherIs422 {
					requireJSONError(t, r3.Code, r3.Header(), r3.Body.Bytes(), http.StatusUnprocessableEntity, v.name)
					require.Equal(t, before+1, c.get(), v.name)
				} else {
					require.Equal(t, http.StatusCreated, r3.Code, "%s, changed: %d %s", v.name, r3.Code, trunc(r3.Body.Bytes()))
					require.Empty(t, r3.Header().Get(idempotency.HeaderReplayed), "%s: a request to another scope got this one's response", v.name)
					require.Equal(t, before+2, c.get(), v.name)
				}
			}
		})
	}
}

// Request bodies: any bytes; up to MaxBodyBytes accepted and handed to the
// handler whole; one byte more is 413 and the handler does not run, with or
// without a Content-Length; the key is not left held by a refused request.
func TestRequestBodies(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			bin := []byte("a\x00b\xff\xfe\xc3(")
			r := rg.do(t, q{key: "bin", user: "alice", body: bin})
			require.Equal(t, http.StatusCreated, r.status)
			sum := sha256.Sum256(bin)
			require.Equal(t, hex.EncodeToString(sum[:]), decodeEcho(t, r.body).BodySha, "the handler did not get the body as sent")
			r = rg.settle(t, q{key: "bin", user: "alice", body: bin})
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
			r = rg.do(t, q{key: "bin", user: "alice", body: []byte("a\x00b\xff\xfe\xc3)")})
			requireJSONError(t, r.status, r.hdr, r.body, http.StatusUnprocessableEntity, "one byte changed")

			full := bytes.Repeat([]byte{0, 0xff, 'x', '\n'}, (1<<20)/4)
			require.Len(t, full, int(idempotency.MaxBodyBytesDefault))
			r = rg.do(t, q{key: "full", user: "alice", body: full})
			require.Equal(t, http.StatusCreated, r.status, trunc(r.body))
			require.Equal(t, len(full), decodeEcho(t, r.body).Len)

			before := c.get()
			over := append(append([]byte{}, full...), 'z')
			r = rg.do(t, q{key: "over", user: "alice", body: over})
			requireJSONError(t, r.status, r.hdr, r.body, http.StatusRequestEntityTooLarge, "1 MiB + 1")
			// chunked, no Content-Length
			req := rg.build(t, q{key: "over-chunked", user: "alice"})
			req.Body = io.NopCloser(bytes.NewReader(append(over, over...)))
			req.ContentLength = -1
			resp, err := rg.client.Do(req)
			require.NoError(t, err)
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			requireJSONError(t, resp.StatusCode, resp.Header, b, http.StatusRequestEntityTooLarge, "chunked 2 MiB")
			require.Equal(t, before, c.get(), "the handler ran for a body over the limit")
			// the refused request left nothing behind: the key works with a good body.
			r = rg.do(t, q{key: "over", user: "alice", body: []byte("small")})
			require.Equal(t, http.StatusCreated, r.status, "after a 413 the key gave %d %q", r.status, trunc(r.body))
		})
	}
}
