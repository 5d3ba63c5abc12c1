package review24

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/webhook"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 8) }

var (
	keyA  = []byte("review24-signing-key-A-0123456789")
	keyB  = []byte("review24-signing-key-B-9876543210")
	quiet = slog.New(slog.NewTextHandler(io.Discard, nil))
)

// mac computes the documented signature of one request under one key,
// without the package: lower-case hex of HMAC-SHA256(key, ts "." idk "." body).
func mac(key []byte, ts, idk string, body []byte) string {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(ts))
	h.Write([]byte("."))
	h.Write([]byte(idk))
	h.Write([]byte("."))
	h.Write(body)
	return hex.EncodeToString(h.Sum(nil))
}

// sigHeader builds a Webhook-Signature value as documented.
func sigHeader(ts, idk string, body []byte, keys ...[]byte) string {
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = "v1=" + mac(k, ts, idk, body)
	}
	return strings.Join(parts, ", ")
}

// env is one tenant: a migrated schema, an outbox and a relay whose writer
// is a webhook publisher.
type env struct {
	db    *testkit.DB
	ob    *outbox.Outbox
	relay *relay.Relay
}

// fastRelay is a relay configuration whose retries come due at once, so
// that RunOnce after RunOnce walks through a row's attempts.
func fastRelay(schema string) *relay.Config {
	return &relay.Config{
		Schema: schema, Logger: quiet, MaxAttempts: 3, PollInterval: 20 * time.Millisecond,
		Backoff:          func(int) time.Duration { return time.Millisecond },
		OutageBackoffMax: 10 * time.Millisecond, PublishTimeout: 20 * time.Second,
	}
}

func newEnv(t *testing.T, cfg webhook.Config, tune func(*relay.Config)) *env {
	t.Helper()
	db := testkit.NewDB(t)
	pub, err := webhook.New(cfg)
	require.NoError(t, err)
	rc := fastRelay(db.Schema)
	if tune != nil {
		tune(rc)
	}
	r, err := relay.New(db.Pool, pub, rc)
	require.NoError(t, err)
	ob, err := outbox.New(db.Pool, db.Schema)
	require.NoError(t, err)
	return &env{db: db, ob: ob, relay: r}
}

// insert writes msgs in one transaction, in order, and returns their ids.
func (e *env) insert(t *testing.T, msgs ...outbox.Message) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, len(msgs))
	for i := range msgs {
		if msgs[i].ID == uuid.Nil {
			msgs[i].ID = uuid.Must(uuid.NewV7())
		}
		ids[i] = msgs[i].ID
	}
	require.NoError(t, pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
		for _, m := range msgs {
			if err := e.ob.InsertTx(context.Background(), tx, m); err != nil {
				return err
			}
		}
		return nil
	}))
	return ids
}

// insertRaw writes a relay row with SQL, as another producer (a CDC
// pipeline, an operator, an older version) could: the headers column as
// given, no checks.
func (e *env) insertRaw(t *testing.T, topic, key, typ string, payload []byte, headersJSON string) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	_, err := e.db.Pool.Exec(context.Background(), "INSERT INTO "+e.db.Table("outbox")+
		" (id, topic, aggregateid, type, payload, headers) VALUES ($1, $2, $3, $4, $5, $6::jsonb)",
		id, topic, key, typ, payload, headersJSON)
	require.NoError(t, err)
	return id
}

type row struct {
	status    string
	attempts  int
	lastError string
}

func (e *env) row(t *testing.T, id uuid.UUID) row {
	t.Helper()
	var r row
	var le *string
	require.NoError(t, e.db.Pool.QueryRow(context.Background(), "SELECT status, attempts, last_error FROM "+
		e.db.Table("outbox")+" WHERE id = $1", id).Scan(&r.status, &r.attempts, &le))
	if le != nil {
		r.lastError = *le
	}
	return r
}

// runOnce runs one relay cycle and fails the test on a cycle error.
func (e *env) runOnce(t *testing.T) (published, failed int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, f, err := e.relay.RunOnce(ctx)
	require.NoError(t, err)
	return p, f
}

// runUntil runs cycles until cond holds, for at most 20 s.
func (e *env) runUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); !cond(); time.Sleep(15 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		e.runOnce(t)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); !cond(); time.Sleep(15 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// got is one request an endpoint received.
type got struct {
	method string
	header http.Header
	body   []byte
	raw    string // the headers as the server parsed them, written out
}

// endpoint is a real HTTP server on 127.0.0.1 that records every request
// and answers as answer says (200 when nil).
type endpoint struct {
	srv    *httptest.Server
	mu     sync.Mutex
	reqs   []got
	answer func(n int, g got, w http.ResponseWriter) // n counts from 0
}

func newEndpoint(t *testing.T, answer func(n int, g got, w http.ResponseWriter)) *endpoint {
	t.Helper()
	ep := &endpoint{answer: answer}
	ep.srv = httptest.NewServer(http.HandlerFunc(ep.serve))
	t.Cleanup(ep.srv.Close)
	return ep
}

func (ep *endpoint) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var raw bytes.Buffer
	_ = r.Header.Write(&raw)
	g := got{method: r.Method, header: r.Header.Clone(), body: body, raw: raw.String()}
	ep.mu.Lock()
	n := len(ep.reqs)
	ep.reqs = append(ep.reqs, g)
	ep.mu.Unlock()
	if ep.answer == nil {
		w.WriteHeader(http.StatusOK)
		return
	}
	ep.answer(n, g, w)
}

func (ep *endpoint) all() []got {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return append([]got(nil), ep.reqs...)
}

func (ep *endpoint) count() int {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return len(ep.reqs)
}

// byID returns the requests that carried Idempotency-Key id.
func (ep *endpoint) byID(id uuid.UUID) []got {
	var out []got
	for _, g := range ep.all() {
		if g.header.Get(webhook.HeaderIdempotencyKey) == id.String() {
			out = append(out, g)
		}
	}
	return out
}

// newRelay builds one more relay on e's schema with a publisher of its
// own, for tests that compare configurations on one database.
func (e *env) newRelay(t *testing.T, cfg webhook.Config, tune func(*relay.Config)) *relay.Relay {
	t.Helper()
	pub, err := webhook.New(cfg)
	require.NoError(t, err)
	rc := fastRelay(e.db.Schema)
	if tune != nil {
		tune(rc)
	}
	r, err := relay.New(e.db.Pool, pub, rc)
	require.NoError(t, err)
	return r
}

// checkSigned fails the test unless g carries a timestamp, an
// Idempotency-Key and a Webhook-Signature whose entries are exactly the
// documented HMACs of g under keys, in some order.
func checkSigned(t *testing.T, g got, keys ...[]byte) {
	t.Helper()
	ts := g.header.Get(webhook.HeaderTimestamp)
	idk := g.header.Get(webhook.HeaderIdempotencyKey)
	require.NotEmpty(t, ts)
	require.NotEmpty(t, idk)
	sig := g.header.Values(webhook.HeaderSignature)
	require.Len(t, sig, 1, "one Webhook-Signature header")
	entries := strings.Split(sig[0], ", ")
	want := make([]string, len(keys))
	for i, k := range keys {
		want[i] = "v1=" + mac(k, ts, idk, g.body)
	}
	require.ElementsMatch(t, want, entries, "Webhook-Signature %q", sig[0])
}

// newHandlerServer serves h on 127.0.0.1 until the test ends.
func newHandlerServer(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}
