package review24

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/transport/webhook"
)

// The receiver's clock in these tests.
var recvNow = time.Unix(1_750_000_000, 0)

func unix(t time.Time) string { return strconv.FormatInt(t.Unix(), 10) }

// wire is a request as an attacker or a publisher puts it on the wire; an
// empty field is a header left out.
type wire struct {
	body, ts, idk, sig string
	chunked            bool // no Content-Length
}

// signedWire is a request signed by the documented scheme under keys.
func signedWire(body string, at time.Time, idk string, keys ...[]byte) wire {
	ts := unix(at)
	return wire{body: body, ts: ts, idk: idk, sig: sigHeader(ts, idk, []byte(body), keys...)}
}

func (w wire) request() *http.Request {
	var body io.Reader = strings.NewReader(w.body)
	if w.chunked {
		body = io.MultiReader(strings.NewReader(w.body)) // hides the length
	}
	r := httptest.NewRequest(http.MethodPost, "/hook", body)
	if w.chunked {
		r.ContentLength = -1
	}
	w.setHeaders(r.Header)
	return r
}

func (w wire) setHeaders(h http.Header) {
	if w.ts != "" {
		h.Set(webhook.HeaderTimestamp, w.ts)
	}
	if w.idk != "" {
		h.Set(webhook.HeaderIdempotencyKey, w.idk)
	}
	if w.sig != "" {
		h.Set(webhook.HeaderSignature, w.sig)
	}
}

type verdict int

const (
	accept verdict = iota
	noSignature
	badSignature
	stale
	tooLarge
	refuseAny // any refusal will do
)

var verdictErr = map[verdict]error{
	noSignature: webhook.ErrNoSignature, badSignature: webhook.ErrBadSignature,
	stale: webhook.ErrStale, tooLarge: webhook.ErrTooLarge,
}

var verdictStatus = map[verdict]int{
	accept: http.StatusOK, noSignature: http.StatusBadRequest, badSignature: http.StatusUnauthorized,
	stale: http.StatusUnauthorized, tooLarge: http.StatusRequestEntityTooLarge,
}

type receiverCase struct {
	name string
	w    wire
	keys [][]byte
	opts webhook.VerifyOpts // Now is set to recvNow when nil
	want verdict
}

func receiverCases() []receiverCase {
	const idk = "01a22b40-0000-7000-8000-000000000001"
	body := `{"order":"o-1","total":12.50}`
	good := signedWire(body, recvNow, idk, keyA)
	with := func(w wire, f func(*wire)) wire { f(&w); return w }
	forged := "v1=" + strings.Repeat("ab", 32)
	mine := "v1=" + mac(keyA, good.ts, idk, []byte(body))
	// The dot-shift forgeries: idk "a" and body "b.c" sign the same bytes
	// as idk "a.b" and body "c", or as timestamp "T.a", idk "b", body "c".
	shiftBase := signedWire("b.c", recvNow, "a", keyA)
	ks := func(k ...[]byte) [][]byte { return k }
	return []receiverCase{
		{name: "good", w: good, keys: ks(keyA), want: accept},
		{name: "signed with two keys, receiver holds the second", w: signedWire(body, recvNow, idk, keyB, keyA), keys: ks(keyA), want: accept},
		{name: "signed with two keys, receiver holds the first", w: signedWire(body, recvNow, idk, keyB, keyA), keys: ks(keyB), want: accept},
		{name: "receiver holds two keys", w: good, keys: ks(keyB, keyA), want: accept},
		{name: "duplicate v1 entries", w: with(good, func(w *wire) { w.sig = mine + ", " + mine }), keys: ks(keyA), want: accept},
		{name: "forged entry before the good one", w: with(good, func(w *wire) { w.sig = forged + ", " + mine }), keys: ks(keyA), want: accept},
		{name: "empty body", w: signedWire("", recvNow, idk, keyA), keys: ks(keyA), want: accept},
		{name: "4m59s old", w: signedWire(body, recvNow.Add(-299*time.Second), idk, keyA), keys: ks(keyA), want: accept},
		{name: "4m59s ahead", w: signedWire(body, recvNow.Add(299*time.Second), idk, keyA), keys: ks(keyA), want: accept},
		{name: "body at MaxBodyBytes", w: signedWire(strings.Repeat("x", 1024), recvNow, idk, keyA), keys: ks(keyA),
			opts: webhook.VerifyOpts{MaxBodyBytes: 1024}, want: accept},

		{name: "forged signature", w: with(good, func(w *wire) { w.sig = forged }), keys: ks(keyA), want: badSignature},
		{name: "wrong key", w: signedWire(body, recvNow, idk, keyB), keys: ks(keyA), want: badSignature},
		{name: "body tampered", w: with(good, func(w *wire) { w.body = `{"order":"o-1","total":0.01}` }), keys: ks(keyA), want: badSignature},
		{name: "body with a byte added", w: with(good, func(w *wire) { w.body += " " }), keys: ks(keyA), want: badSignature},
		{name: "timestamp moved by a second", w: with(good, func(w *wire) { w.ts = unix(recvNow.Add(time.Second)) }), keys: ks(keyA), want: badSignature},
		{name: "replayed under another Idempotency-Key", w: with(good, func(w *wire) { w.idk = "01a22b40-0000-7000-8000-000000000002" }), keys: ks(keyA), want: badSignature},
		{name: "signature of the old scheme (no idempotency key)", w: with(good, func(w *wire) {
			w.sig = "v1=" + macNoKey(keyA, good.ts, []byte(body))
		}), keys: ks(keyA), want: badSignature},

		{name: "replay 6 minutes later", w: signedWire(body, recvNow.Add(-6*time.Minute), idk, keyA), keys: ks(keyA), want: stale},
		{name: "6 minutes in the future", w: signedWire(body, recvNow.Add(6*time.Minute), idk, keyA), keys: ks(keyA), want: stale},
		{name: "11 s old, tolerance 10 s", w: signedWire(body, recvNow.Add(-11*time.Second), idk, keyA), keys: ks(keyA),
			opts: webhook.VerifyOpts{Tolerance: 10 * time.Second}, want: stale},
		{name: "9 s old, tolerance 10 s", w: signedWire(body, recvNow.Add(-9*time.Second), idk, keyA), keys: ks(keyA),
			opts: webhook.VerifyOpts{Tolerance: 10 * time.Second}, want: accept},

		{name: "no signature", w: with(good, func(w *wire) { w.sig = "" }), keys: ks(keyA), want: noSignature},
		{name: "no timestamp", w: with(good, func(w *wire) { w.ts = "" }), keys: ks(keyA), want: noSignature},
		{name: "timestamp not a number", w: with(good, func(w *wire) { w.ts = "yesterday" }), keys: ks(keyA), want: noSignature},
		{name: "timestamp in milliseconds", w: with(good, func(w *wire) {
			w.ts = strconv.FormatInt(recvNow.UnixMilli(), 10)
			w.sig = sigHeader(w.ts, w.idk, []byte(w.body), keyA)
		}), keys: ks(keyA), want: refuseAny},
		{name: "empty v1", w: with(good, func(w *wire) { w.sig = "v1=" }), keys: ks(keyA), want: noSignature},
		{name: "v1 not hex", w: with(good, func(w *wire) { w.sig = "v1=" + strings.Repeat("zz", 32) }), keys: ks(keyA), want: noSignature},
		{name: "other scheme", w: with(good, func(w *wire) { w.sig = strings.Replace(mine, "v1=", "sha256=", 1) }), keys: ks(keyA), want: noSignature},
		{name: "no Idempotency-Key", w: with(good, func(w *wire) { w.idk = "" }), keys: ks(keyA), want: noSignature},

		{name: "dot shifted from the body into the Idempotency-Key", w: wire{body: "c", ts: shiftBase.ts, idk: "a.b", sig: shiftBase.sig},
			keys: ks(keyA), want: refuseAny},
		{name: "dot shifted into the timestamp", w: wire{body: "c", ts: shiftBase.ts + ".a", idk: "b", sig: shiftBase.sig},
			keys: ks(keyA), want: refuseAny},

		{name: "body over MaxBodyBytes", w: signedWire(strings.Repeat("x", 1025), recvNow, idk, keyA), keys: ks(keyA),
			opts: webhook.VerifyOpts{MaxBodyBytes: 1024}, want: tooLarge},
		{name: "chunked body over MaxBodyBytes", w: with(signedWire(strings.Repeat("x", 4096), recvNow, idk, keyA), func(w *wire) { w.chunked = true }),
			keys: ks(keyA), opts: webhook.VerifyOpts{MaxBodyBytes: 1024}, want: tooLarge},
		{name: "body over the default 1 MiB", w: signedWire(strings.Repeat("x", webhook.MaxBodyBytesDefault+1), recvNow, idk, keyA),
			keys: ks(keyA), want: tooLarge},
	}
}

// macNoKey is the signature a scheme without the idempotency key would give.
func macNoKey(key []byte, ts string, body []byte) string {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(ts + "."))
	h.Write(body)
	return hex.EncodeToString(h.Sum(nil))
}

// Verify, case by case: what it accepts returns the body byte for byte;
// what it refuses is refused with the documented error.
func TestVerifyCases(t *testing.T) {
	t.Parallel()
	for _, c := range receiverCases() {
		opts := c.opts
		if opts.Now == nil {
			opts.Now = func() time.Time { return recvNow }
		}
		got, err := webhook.Verify(c.w.request(), &opts, c.keys...)
		switch c.want {
		case accept:
			require.NoError(t, err, c.name)
			require.Equal(t, c.w.body, string(got), c.name)
		case refuseAny:
			require.Error(t, err, c.name)
			t.Logf("%s: %v", c.name, err)
		default:
			require.ErrorIs(t, err, verdictErr[c.want], c.name)
		}
	}
}

// Handler over a real server: the documented status for each case, the
// reason in plain text, and next runs only for a verified request, with
// the body in r.Body.
func TestHandlerCases(t *testing.T) {
	t.Parallel()
	for _, c := range receiverCases() {
		opts := c.opts
		if opts.Now == nil {
			opts.Now = func() time.Time { return recvNow }
		}
		var mu sync.Mutex
		var served [][]byte
		srv := newHandlerServer(t, webhook.Handler(c.keys, &opts, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, err := io.ReadAll(r.Body)
			require.NoError(t, err)
			mu.Lock()
			served = append(served, b)
			mu.Unlock()
			w.WriteHeader(http.StatusOK)
		})))
		var body io.Reader = bytes.NewReader([]byte(c.w.body))
		if c.w.chunked {
			body = io.MultiReader(body)
		}
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/hook", body)
		require.NoError(t, err)
		c.w.setHeaders(req.Header)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err, c.name)
		reason, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		mu.Lock()
		n := len(served)
		mu.Unlock()
		switch c.want {
		case accept:
			require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", c.name, reason)
			require.Equal(t, 1, n, c.name)
			require.Equal(t, c.w.body, string(served[0]), c.name)
		default:
			if want, ok := verdictStatus[c.want]; ok {
				require.Equal(t, want, resp.StatusCode, "%s: %s", c.name, reason)
			} else {
				require.GreaterOrEqual(t, resp.StatusCode, 400, c.name)
			}
			require.Zero(t, n, "%s: next ran for a refused request", c.name)
			require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain"), c.name)
			require.NotEmpty(t, strings.TrimSpace(string(reason)), "%s: the reason is given", c.name)
		}
	}
}

// Keys shorter than 16 bytes are refused on both sides, with an error that
// says so; 16 bytes exactly are taken.
func TestShortKeysRefusedOnBothSides(t *testing.T) {
	t.Parallel()
	k15, k16 := []byte("fifteen-bytes!!"), []byte("sixteen-bytes!!!")
	require.Len(t, k15, 15)
	require.Len(t, k16, 16)
	urls := map[string]string{"t": "http://127.0.0.1:1/hook"}

	for name, cfg := range map[string]webhook.Config{
		"15-byte key":       {URLs: urls, Keys: [][]byte{k15}},
		"one short of two":  {URLs: urls, Keys: [][]byte{keyA, k15}},
		"empty key":         {URLs: urls, Keys: [][]byte{{}}},
		"no key":            {URLs: urls},
		"no URLs":           {Keys: [][]byte{keyA}},
		"non-HTTP URL":      {URLs: map[string]string{"t": "ftp://127.0.0.1/x"}, Keys: [][]byte{keyA}},
		"negative Concurr.": {URLs: urls, Keys: [][]byte{keyA}, Concurrency: -1},
	} {
		_, err := webhook.New(cfg)
		require.ErrorIs(t, err, webhook.ErrInvalidConfig, name)
		t.Logf("New, %s: %v", name, err)
		if strings.Contains(name, "key") && name != "no key" {
			require.Contains(t, err.Error(), "16", "%s: the error says how long a key must be", name)
		}
	}
	_, err := webhook.New(webhook.Config{URLs: urls, Keys: [][]byte{k16}})
	require.NoError(t, err, "16 bytes are enough")

	opts := &webhook.VerifyOpts{Now: func() time.Time { return recvNow }}
	w := signedWire("x", recvNow, "id-1", k15)
	_, err = webhook.Verify(w.request(), opts, k15)
	require.Error(t, err, "a receiver with a 15-byte key accepts nothing")
	require.Contains(t, err.Error(), "16", "the error says why: %v", err)
	_, err = webhook.Verify(w.request(), opts, k15, keyA)
	require.Error(t, err, "a request signed with the short key is refused beside a good key")
	_, err = webhook.Verify(w.request(), opts)
	require.Error(t, err, "no key at all")
	w = signedWire("x", recvNow, "id-1", k16)
	_, err = webhook.Verify(w.request(), opts, k16)
	require.NoError(t, err)
	_, err = webhook.Verify(signedWire("x", recvNow, "id-1", keyA).request(), opts, k15, keyA)
	t.Logf("a good request, receiver holding a short and a good key: %v", err)

	var served bool
	srv := newHandlerServer(t, webhook.Handler([][]byte{k15}, opts, http.HandlerFunc(func(http.ResponseWriter, *http.Request) { served = true })))
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("x"))
	require.NoError(t, err)
	signedWire("x", recvNow, "id-1", k15).setHeaders(req.Header)
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	reason, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.False(t, served)
	require.GreaterOrEqual(t, resp.StatusCode, 400)
	require.Contains(t, string(reason), "16", "the reason says why")
}
