package webhook_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/webhook"
)

var (
	key    = []byte("0123456789abcdef-webhook-key-1")
	oldKey = []byte("0123456789abcdef-webhook-key-0")
	quiet  = slog.New(slog.NewTextHandler(io.Discard, nil))
)

// signed builds a request as a publisher would.
func signed(t *testing.T, body []byte, ts time.Time, keys ...[]byte) *http.Request {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/hook", bytes.NewReader(body))
	s := strconv.FormatInt(ts.Unix(), 10)
	r.Header.Set(webhook.HeaderTimestamp, s)
	r.Header.Set(webhook.HeaderIdempotencyKey, "msg-1")
	r.Header.Set(webhook.HeaderSignature, webhook.Sign(s, "msg-1", body, keys...))
	return r
}

func TestVerify(t *testing.T) {
	t.Parallel()
	now := time.Now()
	body := []byte(`{"order":"o-1"}`)

	got, err := webhook.Verify(signed(t, body, now, key), nil, key)
	require.NoError(t, err)
	require.Equal(t, body, got)

	// Rotation: signed with the old and the new key, a receiver with either
	// accepts; one with the old key only accepts a request signed with it.
	_, err = webhook.Verify(signed(t, body, now, oldKey, key), nil, key)
	require.NoError(t, err)
	_, err = webhook.Verify(signed(t, body, now, oldKey, key), nil, oldKey)
	require.NoError(t, err)
	_, err = webhook.Verify(signed(t, body, now, key), nil, oldKey)
	require.ErrorIs(t, err, webhook.ErrBadSignature)

	// A tampered body, a tampered timestamp.
	r := signed(t, body, now, key)
	r.Body = io.NopCloser(strings.NewReader(`{"order":"o-2"}`))
	_, err = webhook.Verify(r, nil, key)
	require.ErrorIs(t, err, webhook.ErrBadSignature)
	r = signed(t, body, now, key)
	r.Header.Set(webhook.HeaderTimestamp, strconv.FormatInt(now.Unix()+1, 10))
	_, err = webhook.Verify(r, nil, key)
	require.ErrorIs(t, err, webhook.ErrBadSignature)

	// The same request replayed under another Idempotency-Key (to get past
	// the receiver's deduplication) is refused: the key is signed.
	r = signed(t, body, now, key)
	r.Header.Set(webhook.HeaderIdempotencyKey, "msg-2")
	_, err = webhook.Verify(r, nil, key)
	require.ErrorIs(t, err, webhook.ErrBadSignature)
	// A receiver whose key is empty or short (an unset variable) refuses
	// everything, even a request signed with that same key.
	for _, weak := range [][]byte{nil, {}, []byte("short")} {
		_, err = webhook.Verify(signed(t, body, now, weak), nil, weak)
		require.ErrorIs(t, err, webhook.ErrBadSignature)
	}

	// Stale and future timestamps.
	_, err = webhook.Verify(signed(t, body, now.Add(-10*time.Minute), key), nil, key)
	require.ErrorIs(t, err, webhook.ErrStale)
	_, err = webhook.Verify(signed(t, body, now.Add(10*time.Minute), key), nil, key)
	require.ErrorIs(t, err, webhook.ErrStale)

	// Missing and malformed headers, bytes PostgreSQL refuses included.
	for _, h := range []map[string]string{
		{webhook.HeaderSignature: "v1=00"},
		{webhook.HeaderTimestamp: "yesterday\x00"},
		{webhook.HeaderSignature: "v1=zz" + strings.Repeat("0", 62)},
		{webhook.HeaderSignature: "v0=abc, t=1"},
		{webhook.HeaderSignature: strings.Repeat("v1=\xff,", 2000)},
	} {
		r := signed(t, body, now, key)
		for k, v := range h {
			r.Header.Set(k, v)
		}
		_, err := webhook.Verify(r, nil, key)
		require.ErrorIs(t, err, webhook.ErrNoSignature, "%v", h)
	}
	_, err = webhook.Verify(signed(t, bytes.Repeat([]byte("x"), 2048), now, key), &webhook.VerifyOpts{MaxBodyBytes: 1024}, key)
	require.ErrorIs(t, err, webhook.ErrTooLarge)
	// A limit of int64's largest ("no limit") reads the body: the read limit,
	// one byte past it, wrapped negative and read nothing, and every
	// signature failed.
	got, err = webhook.Verify(signed(t, body, now, key), &webhook.VerifyOpts{MaxBodyBytes: math.MaxInt64}, key)
	require.NoError(t, err)
	require.Equal(t, body, got)

	// The handler answers with the status that says why.
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		_, _ = w.Write(b)
	})
	h := webhook.Handler([][]byte{key}, nil, ok)
	for _, tc := range []struct {
		r    *http.Request
		want int
	}{
		{signed(t, body, now, key), http.StatusOK},
		{signed(t, body, now, oldKey), http.StatusUnauthorized},
		{signed(t, body, now.Add(-time.Hour), key), http.StatusUnauthorized},
		{httptest.NewRequest(http.MethodPost, "/hook", bytes.NewReader(body)), http.StatusBadRequest},
	} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, tc.r)
		require.Equal(t, tc.want, w.Code, w.Body.String())
		if tc.want == http.StatusOK {
			require.Equal(t, string(body), w.Body.String(), "the verified body reaches the handler")
		}
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	for _, cfg := range []webhook.Config{
		{},
		{URLs: map[string]string{"t": "ftp://x"}, Keys: [][]byte{key}},
		{URLs: map[string]string{"t": "http://x"}},
		{URLs: map[string]string{"t": "http://x"}, Keys: [][]byte{[]byte("short")}},
	} {
		_, err := webhook.New(cfg)
		require.ErrorIs(t, err, webhook.ErrInvalidConfig)
	}
}

// env is an outbox on a real PostgreSQL and a relay that publishes it
// through a webhook publisher.
type env struct {
	pool   *pgxpool.Pool
	schema string
	ob     *outbox.Outbox
}

func setup(t *testing.T, urls map[string]string, client *http.Client) *env {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(t, err)
	pub, err := webhook.New(webhook.Config{URLs: urls, Keys: [][]byte{key}, Client: client})
	require.NoError(t, err)
	r, err := relay.New(pool, pub, &relay.Config{Schema: schema, PollInterval: 20 * time.Millisecond, Logger: quiet,
		MaxAttempts: 3, Backoff: func(int) time.Duration { return 50 * time.Millisecond }, OutageBackoffMax: 100 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, r.Stop(context.Background())) })
	ob, err := outbox.New(pool, schema)
	require.NoError(t, err)
	return &env{pool: pool, schema: schema, ob: ob}
}

func (e *env) insert(t *testing.T, msgs ...outbox.Message) {
	t.Helper()
	require.NoError(t, pgx.BeginFunc(context.Background(), e.pool, func(tx pgx.Tx) error {
		for _, m := range msgs {
			if err := e.ob.InsertTx(context.Background(), tx, m); err != nil {
				return err
			}
		}
		return nil
	}))
}

type row struct {
	status, lastError string
	attempts          int
}

func (e *env) row(t *testing.T, typ string) row {
	t.Helper()
	var r row
	var le *string
	require.NoError(t, e.pool.QueryRow(context.Background(), "SELECT status, last_error, attempts FROM "+
		pgx.Identifier{e.schema, "outbox"}.Sanitize()+" WHERE type = $1", typ).Scan(&r.status, &le, &r.attempts))
	if le != nil {
		r.lastError = *le
	}
	return r
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// recorder is an endpoint that verifies and records what it gets, and
// answers as answer says.
type recorder struct {
	mu     sync.Mutex
	got    []http.Header
	bodies []string
	answer func(n int, r *http.Request) int
}

func (rc *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := webhook.Verify(r, nil, key)
	if err != nil {
		http.Error(w, err.Error(), http.StatusUnauthorized)
		return
	}
	rc.mu.Lock()
	n := len(rc.got)
	rc.got = append(rc.got, r.Header.Clone())
	rc.bodies = append(rc.bodies, string(body))
	rc.mu.Unlock()
	status := http.StatusOK
	if rc.answer != nil {
		status = rc.answer(n, r)
	}
	w.WriteHeader(status)
	if status == http.StatusGone {
		_, _ = w.Write([]byte("order o-9 was archived\x00\xff; do not send again"))
	}
}

func (rc *recorder) count() int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return len(rc.got)
}

// Through a real relay and outbox: a 2xx delivers once, signed, with the
// idempotency key and the headers; a 410 parks the row with the response;
// a 503 is retried and delivered; per-key order holds.
func TestPublisherThroughTheRelay(t *testing.T) {
	t.Parallel()
	rc := &recorder{}
	rc.answer = func(n int, r *http.Request) int {
		switch r.Header.Get(webhook.HeaderPrefix + "sagaflow-type") {
		case "archived":
			return http.StatusGone
		case "flaky":
			var flaky int
			rc.mu.Lock()
			for _, h := range rc.got {
				if h.Get(webhook.HeaderPrefix+"sagaflow-type") == "flaky" {
					flaky++
				}
			}
			rc.mu.Unlock()
			if flaky == 1 {
				return http.StatusServiceUnavailable
			}
		}
		return http.StatusOK
	}
	srv := httptest.NewServer(rc)
	t.Cleanup(srv.Close)
	e := setup(t, map[string]string{"orders": srv.URL + "/hook", "archive": srv.URL + "/archive"}, nil)

	e.insert(t, outbox.Message{Topic: "orders", Key: "o-1", Type: "paid", Payload: []byte(`{"order":"o-1"}`),
		Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}})
	waitFor(t, "the delivery", func() bool { return e.row(t, "paid").status == "published" })
	require.Equal(t, 1, rc.count())
	h := rc.got[0]
	require.NotEmpty(t, h.Get(webhook.HeaderIdempotencyKey))
	require.Equal(t, h.Get(webhook.HeaderIdempotencyKey), h.Get(webhook.HeaderPrefix+"sagaflow-message-id"))
	require.Equal(t, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", h.Get("Sagaflow-Traceparent"))
	require.Equal(t, `{"order":"o-1"}`, rc.bodies[0])

	e.insert(t, outbox.Message{Topic: "archive", Key: "o-9", Type: "archived", Payload: []byte(`{}`)})
	waitFor(t, "the refusal", func() bool { return e.row(t, "archived").status == "dead" })
	r := e.row(t, "archived")
	require.Contains(t, r.lastError, "http_410")
	require.Contains(t, r.lastError, "410")
	require.Contains(t, r.lastError, "order o-9 was archived")
	require.NotContains(t, r.lastError, "\x00")

	e.insert(t, outbox.Message{Topic: "orders", Key: "o-2", Type: "flaky", Payload: []byte(`{}`)})
	waitFor(t, "the retry", func() bool { return e.row(t, "flaky").status == "published" })
	require.Equal(t, 2, e.row(t, "flaky").attempts, "one failed attempt, then the delivery")

	// One key's messages arrive in order, whatever the concurrency.
	var msgs []outbox.Message
	for i := range 30 {
		msgs = append(msgs, outbox.Message{Topic: "orders", Key: "k-" + strconv.Itoa(i%3), Type: "seq-" + strconv.Itoa(i),
			Payload: []byte(strconv.Itoa(i))})
	}
	e.insert(t, msgs...)
	waitFor(t, "the sequence", func() bool {
		return e.row(t, "seq-29").status == "published" && e.row(t, "seq-28").status == "published" && e.row(t, "seq-27").status == "published"
	})
	last := map[string]int{}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for i, hd := range rc.got {
		if !strings.HasPrefix(hd.Get(webhook.HeaderPrefix+"sagaflow-type"), "seq-") {
			continue
		}
		n, _ := strconv.Atoi(rc.bodies[i])
		k := hd.Get(webhook.HeaderKey)
		require.Equal(t, "k-"+strconv.Itoa(n%3), k)
		prev, seen := last[k]
		require.True(t, !seen || n > prev, "key %s: %d after %d", k, n, prev)
		last[k] = n
	}
}

// A timeout is retried (the endpoint may have acted: it spends an attempt),
// and a refused connection is an outage that spends none.
func TestTimeoutsAndOutages(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			time.Sleep(600 * time.Millisecond)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(slow.Close)
	// A port nothing listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	down := "http://" + l.Addr().String() + "/hook"
	require.NoError(t, l.Close())

	e := setup(t, map[string]string{"slow": slow.URL, "down": down}, &http.Client{Timeout: 200 * time.Millisecond})
	e.insert(t, outbox.Message{Topic: "slow", Key: "a", Type: "slow", Payload: []byte(`{}`)},
		outbox.Message{Topic: "down", Key: "b", Type: "down", Payload: []byte(`{}`)})
	waitFor(t, "the retried delivery", func() bool { return e.row(t, "slow").status == "published" })
	require.Equal(t, 2, e.row(t, "slow").attempts)
	time.Sleep(500 * time.Millisecond) // several cycles against the dead endpoint
	r := e.row(t, "down")
	require.Equal(t, "pending", r.status)
	require.Zero(t, r.attempts, "an outage spends no attempt")
	require.Contains(t, r.lastError, "connect")
}

// A header HTTP cannot carry parks its row with a clear reason; the other
// rows of the batch go through.
func TestHeadersHTTPCannotCarry(t *testing.T) {
	t.Parallel()
	rc := &recorder{}
	srv := httptest.NewServer(rc)
	t.Cleanup(srv.Close)
	e := setup(t, map[string]string{"orders": srv.URL}, nil)
	// outbox.Message.Check refuses control bytes, so the row is written
	// as another writer could have.
	_, err := e.pool.Exec(context.Background(), fmt.Sprintf(`INSERT INTO %s.outbox (id, topic, aggregateid, type, payload, headers)
		VALUES (gen_random_uuid(), 'orders', 'k', 'crlf', '\x7b7d', jsonb_build_object('x-note', E'a\r\nInjected: yes'))`,
		pgx.Identifier{e.schema}.Sanitize()))
	require.NoError(t, err)
	e.insert(t, outbox.Message{Topic: "orders", Key: "k2", Type: "fine", Payload: []byte(`{}`), Headers: map[string]string{"x-note": strings.Repeat("n", 8000)}})
	waitFor(t, "both rows", func() bool { return e.row(t, "crlf").status == "dead" && e.row(t, "fine").status == "published" })
	require.Contains(t, e.row(t, "crlf").lastError, webhook.CodeBadHeader)
	for _, h := range rc.got {
		require.Empty(t, h.Get("Injected"), "no header was injected")
	}
}
