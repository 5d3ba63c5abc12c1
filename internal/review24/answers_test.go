package review24

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/webhook"
)

// refusalBody is the body an endpoint sends with status s: 605 bytes, so
// that the default MaxResponseBytes (512) cuts it.
func refusalBody(s int) string {
	return fmt.Sprintf("R%03d:", s) + strings.Repeat("abcdefghij", 60)
}

// Every class of answer in the documented table, each message under a key
// of its own so that none holds another back: 2xx published at once; other
// 4xx dead at once as http_<status> with the status and the first 512 bytes
// of the body, never sent again; 408, 429 (with a Retry-After of an hour)
// and 5xx retried, each retry spending an attempt, with the same
// Idempotency-Key and a valid signature, until attempts_exhausted.
func TestEveryAnswerClass(t *testing.T) {
	t.Parallel()
	ep := newEndpoint(t, func(_ int, g got, w http.ResponseWriter) {
		s, _ := strconv.Atoi(g.header.Get("Sagaflow-Status"))
		if s == http.StatusTooManyRequests {
			w.Header().Set("Retry-After", "3600")
		}
		w.WriteHeader(s)
		_, _ = w.Write([]byte(refusalBody(s)))
	})
	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": ep.srv.URL}, Keys: [][]byte{keyA}}, nil)

	ok := []int{200, 201, 202, 204, 299}
	refused := []int{400, 401, 403, 404, 405, 409, 410, 413, 415, 422, 451, 499}
	retried := []int{408, 429, 500, 502, 503, 504, 599}
	ids := map[int]uuid.UUID{}
	var msgs []outbox.Message
	for _, group := range [][]int{ok, refused, retried} {
		for _, s := range group {
			msgs = append(msgs, outbox.Message{Topic: "t", Key: "key-" + strconv.Itoa(s), Type: strconv.Itoa(s),
				Payload: []byte(`{"status":` + strconv.Itoa(s) + `}`), Headers: map[string]string{"status": strconv.Itoa(s)}})
		}
	}
	for i, id := range e.insert(t, msgs...) {
		s, _ := strconv.Atoi(msgs[i].Type)
		ids[s] = id
	}

	e.runOnce(t)
	for _, s := range ok {
		require.Equal(t, "published", e.row(t, ids[s]).status, "%d", s)
	}
	for _, s := range refused {
		r := e.row(t, ids[s])
		require.Equal(t, "dead", r.status, "%d: %+v", s, r)
		code := "http_" + strconv.Itoa(s)
		require.True(t, strings.HasPrefix(r.lastError, code), "%d: the error starts with %s: %q", s, code, r.lastError)
		rest := strings.TrimPrefix(r.lastError, code)
		require.Contains(t, rest, strconv.Itoa(s), "the status is in the error")
		body := refusalBody(s)
		require.Contains(t, r.lastError, body[:512], "%d: the first 512 bytes of the body", s)
		require.NotContains(t, r.lastError, body[:513], "%d: no more than 512 bytes of the body", s)
	}
	for _, s := range retried {
		r := e.row(t, ids[s])
		require.Equal(t, "pending", r.status, "%d: %+v", s, r)
		require.Equal(t, 1, r.attempts, "%d: an attempt spent", s)
		require.Contains(t, r.lastError, strconv.Itoa(s))
	}

	// The relay's Backoff (1 ms here) spaces the retries: the hour of
	// Retry-After is not honoured.
	e.runUntil(t, "the retried rows to be parked", func() bool {
		for _, s := range retried {
			if e.row(t, ids[s]).status != "dead" {
				return false
			}
		}
		return true
	})
	for _, s := range retried {
		r := e.row(t, ids[s])
		require.True(t, strings.HasPrefix(r.lastError, relay.CodeAttemptsExhausted), "%d: %q", s, r.lastError)
		require.Contains(t, r.lastError, strconv.Itoa(s), "the last error is kept")
		require.Equal(t, 3, r.attempts, "%d", s)
		reqs := ep.byID(ids[s])
		require.Len(t, reqs, 3, "%d: one request per attempt, MaxAttempts 3", s)
		for _, g := range reqs {
			checkSigned(t, g, keyA)
		}
	}
	for _, s := range append(ok, refused...) {
		require.Len(t, ep.byID(ids[s]), 1, "%d: sent once, never again", s)
	}
}

// Each attempt is signed at its own time: Webhook-Timestamp moves with
// Config.Now, the Idempotency-Key does not, and every signature matches
// the timestamp it was sent with.
func TestEachAttemptSignedAtItsTime(t *testing.T) {
	t.Parallel()
	var tick atomic.Int64
	ep := newEndpoint(t, func(n int, _ got, w http.ResponseWriter) {
		if n < 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": ep.srv.URL}, Keys: [][]byte{keyA, keyB},
		Now: func() time.Time { return time.Unix(1_700_000_000+100*tick.Add(1), 0) }}, nil)
	id := e.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "x", Payload: []byte("same body")})[0]
	e.runUntil(t, "the row to be published", func() bool { return e.row(t, id).status == "published" })
	reqs := ep.all()
	require.Len(t, reqs, 3)
	var last int64
	for _, g := range reqs {
		require.Equal(t, id.String(), g.header.Get(webhook.HeaderIdempotencyKey))
		require.Equal(t, "same body", string(g.body))
		ts, err := strconv.ParseInt(g.header.Get(webhook.HeaderTimestamp), 10, 64)
		require.NoError(t, err)
		require.Greater(t, ts, last, "each attempt has its own time")
		last = ts
		checkSigned(t, g, keyA, keyB)
	}
}

// A refusing endpoint that answers 4 MiB: the row is parked with at most
// MaxResponseBytes of it, and the error is text PostgreSQL took even though
// the body holds NUL, invalid UTF-8 and a multi-byte character cut by the
// limit.
func TestHugeRefusalBodyIsCutToValidText(t *testing.T) {
	t.Parallel()
	head := "ab\x00c\xffd\r\nX-Injected: 1\r\n"
	ep := newEndpoint(t, func(_ int, _ got, w http.ResponseWriter) {
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte(head))
		chunk := []byte(strings.Repeat("é", 1<<16))
		for i := 0; i < 32; i++ {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	const limit = 101 // odd: cuts an é in two
	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": ep.srv.URL}, Keys: [][]byte{keyA},
		MaxResponseBytes: limit}, nil)
	ids := e.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "x"},
		outbox.Message{Topic: "t", Key: "other", Type: "y"})
	e.runOnce(t) // fails the test if PostgreSQL refused the error text
	for _, id := range ids {
		r := e.row(t, id)
		require.Equal(t, "dead", r.status)
		require.True(t, strings.HasPrefix(r.lastError, "http_422"), r.lastError)
		require.True(t, utf8.ValidString(r.lastError))
		require.NotContains(t, r.lastError, "\x00")
		require.LessOrEqual(t, strings.Count(r.lastError, "é"), (limit-len(head))/2+1, "at most MaxResponseBytes of the body")
		require.Less(t, len(r.lastError), 1024, r.lastError)
		t.Logf("%q", r.lastError)
	}
}

// A Client timeout is a failed attempt, not an outage: the row spends its
// attempts and is parked as attempts_exhausted, every try under the same
// Idempotency-Key.
func TestClientTimeoutSpendsAttempts(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	ep := newEndpoint(t, func(_ int, _ got, _ http.ResponseWriter) {
		<-release
	})
	t.Cleanup(func() { close(release) }) // before the server closes
	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": ep.srv.URL}, Keys: [][]byte{keyA},
		Client: &http.Client{Timeout: 300 * time.Millisecond}}, func(c *relay.Config) { c.MaxAttempts = 2 })
	id := e.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "x"})[0]
	e.runOnce(t)
	r := e.row(t, id)
	require.Equal(t, "pending", r.status)
	require.Equal(t, 1, r.attempts, "a timeout spends an attempt: %+v", r)
	e.runUntil(t, "the row to be parked", func() bool { return e.row(t, id).status == "dead" })
	r = e.row(t, id)
	require.True(t, strings.HasPrefix(r.lastError, relay.CodeAttemptsExhausted), r.lastError)
	reqs := ep.byID(id)
	require.Len(t, reqs, 2)
}

// A connection cut after the request arrived, before any answer: retried,
// spending attempts, then attempts_exhausted.
func TestConnectionCutSpendsAttempts(t *testing.T) {
	t.Parallel()
	ep := newEndpoint(t, func(_ int, _ got, w http.ResponseWriter) {
		c, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			_ = c.Close()
		}
	})
	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": ep.srv.URL}, Keys: [][]byte{keyA}},
		func(c *relay.Config) { c.MaxAttempts = 2 })
	id := e.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "x"})[0]
	e.runOnce(t)
	r := e.row(t, id)
	require.Equal(t, "pending", r.status)
	require.Equal(t, 1, r.attempts, "a cut connection spends an attempt: %+v", r)
	e.runUntil(t, "the row to be parked", func() bool { return e.row(t, id).status == "dead" })
	require.True(t, strings.HasPrefix(e.row(t, id).lastError, relay.CodeAttemptsExhausted))
	require.GreaterOrEqual(t, len(ep.byID(id)), 2)
}

// No connection at all: refused, or a name that does not resolve. The row
// waits, however many cycles find the endpoint down, and spends no attempt
// (MaxAttempts 2, five cycles); once the endpoint listens, it is published.
func TestNoConnectionIsAnOutage(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())

	// A DNS failure without leaving the machine: the Client's dialer
	// answers as the resolver does for an unknown name.
	dnsFail := &http.Client{Transport: &http.Transport{DialContext: func(_ context.Context, _, address string) (net.Conn, error) {
		host, _, _ := net.SplitHostPort(address)
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}}
	}}}

	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": "http://" + addr + "/hook"}, Keys: [][]byte{keyA}},
		func(c *relay.Config) { c.MaxAttempts = 2 })
	// One relay claims every topic of its schema (see O4): the DNS case
	// gets a schema of its own.
	eDNS := newEnv(t, webhook.Config{URLs: map[string]string{"t": "http://hooks.example.invalid/hook"},
		Keys: [][]byte{keyA}, Client: dnsFail}, func(c *relay.Config) { c.MaxAttempts = 2 })
	refused := e.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "refused"})[0]
	dns := eDNS.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "dns"})[0]
	for i := 0; i < 5; i++ {
		time.Sleep(30 * time.Millisecond) // past OutageBackoffMax (10 ms)
		e.runOnce(t)
		eDNS.runOnce(t)
	}
	for _, c := range []struct {
		e  *env
		id uuid.UUID
	}{{e, refused}, {eDNS, dns}} {
		r := c.e.row(t, c.id)
		require.Equal(t, "pending", r.status, "%+v", r)
		require.Equal(t, 0, r.attempts, "an outage spends no attempt: %+v", r)
		require.NotEmpty(t, r.lastError)
	}

	l, err = net.Listen("tcp", addr)
	if err != nil {
		t.Logf("the port was taken meanwhile (%v): recovery not checked", err)
		return
	}
	ep := &endpoint{}
	srv := &http.Server{Handler: http.HandlerFunc(ep.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	e.runUntil(t, "the row to be published once the endpoint is back", func() bool {
		return e.row(t, refused).status == "published"
	})
	require.Len(t, ep.byID(refused), 1)
	checkSigned(t, ep.byID(refused)[0], keyA)
}

// O3 (fixed in this session; the test fails without the fix): 3xx answers
// were not in the documented table, and the default Client followed
// redirects: a 302 or 303 turns the POST into a GET without the
// body, and the 2xx of that GET marks the row published although the
// payload never reached any endpoint. The test states what a user would
// expect (a row is published only once its body was POSTed) and is skipped
// while the behaviour stands.
func TestRedirectDoesNotPublishWithoutTheBody(t *testing.T) {
	t.Parallel()
	var ep *endpoint
	ep = newEndpoint(t, func(_ int, g got, w http.ResponseWriter) {
		if g.method == http.MethodPost && !strings.HasPrefix(g.header.Get("Referer"), ep.srv.URL) {
			w.Header().Set("Location", "/moved")
			w.WriteHeader(http.StatusFound)
			return
		}
		w.WriteHeader(http.StatusOK) // the new location answers 200 to anything
	})
	e := newEnv(t, webhook.Config{URLs: map[string]string{"t": ep.srv.URL + "/hook"}, Keys: [][]byte{keyA}}, nil)
	id := e.insert(t, outbox.Message{Topic: "t", Key: "k", Type: "x", Payload: []byte(`{"important":true}`)})[0]
	e.runOnce(t)
	if e.row(t, id).status == "published" {
		var delivered bool
		for _, g := range ep.byID(id) {
			delivered = delivered || (g.method == http.MethodPost && string(g.body) == `{"important":true}` && g.header.Get("Referer") != "")
		}
		require.True(t, delivered, "published, but the body was never POSTed where the 2xx came from: %d requests", ep.count())
	}
}

// A topic without a URL is parked at once as no_webhook_url, never sent,
// and does not hold back another key. The relay claims every topic of its
// schema, so a topic meant for another transport meets the same fate (O4).
func TestTopicWithoutURLParkedAtOnce(t *testing.T) {
	t.Parallel()
	ep := newEndpoint(t, nil)
	e := newEnv(t, webhook.Config{URLs: map[string]string{"hooks": ep.srv.URL}, Keys: [][]byte{keyA}},
		func(c *relay.Config) { c.MaxAttempts = 10 })
	ids := e.insert(t,
		outbox.Message{Topic: "kafka.orders", Key: "k1", Type: "for-kafka"},
		outbox.Message{Topic: "hooks", Key: "k2", Type: "for-hooks"},
	)
	e.runOnce(t)
	r := e.row(t, ids[0])
	require.Equal(t, "dead", r.status)
	require.True(t, strings.HasPrefix(r.lastError, webhook.CodeNoURL), r.lastError)
	require.Equal(t, "published", e.row(t, ids[1]).status)
	require.Empty(t, ep.byID(ids[0]))
	require.Len(t, ep.byID(ids[1]), 1)
}
