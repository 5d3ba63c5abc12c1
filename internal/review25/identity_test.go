package review25_test

import (
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
)

// "Keys belong to the caller who sent them ... one caller's key never
// answers another's request": whatever state alice's key is in (stored,
// in flight, stored without its body), bob's request with the same key runs
// his own handler and gets his own response, with alice's body or another.
func TestSecondCallerIsNeverAnsweredBlockedOrRevealed(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		for _, state := range []string{"stored", "in-flight", "body-omitted", "stored-4xx"} {
			t.Run(kind+"/"+state, func(t *testing.T) {
				t.Parallel()
				var c counter
				g := newGate()
				h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					who, _ := identityFromContext(r)
					switch {
					case state == "in-flight" && who == "alice":
						g.wait()
					case state == "body-omitted" && who == "alice":
						c.inc()
						w.Header().Set("Location", "/orders/alice")
						w.WriteHeader(http.StatusCreated)
						_, _ = w.Write([]byte(strings.Repeat("a", 2000)))
						return
					case state == "stored-4xx" && who == "alice":
						c.inc()
						http.Error(w, "alice's card declined", http.StatusPaymentRequired)
						return
					}
					echo(&c)(w, r)
				})
				cfg := &idempotency.Config{MaxResponseBytes: 1000}
				rg := newRig(t, kind, cfg, h)
				key := "shared-key-1"
				done := make(chan res, 1)
				if state == "in-flight" {
					go func() { done <- rg.do(t, q{key: key, user: "alice", body: []byte("X")}) }()
					g.waitEntered(t)
				} else {
					a := rg.do(t, q{key: key, user: "alice", body: []byte("X")})
					require.NoError(t, a.err)
				}
				before := c.get()
				for i, body := range []string{"X", "Y"} {
					user := fmt.Sprintf("bob%d", i)
					b := rg.do(t, q{key: key, user: user, body: []byte(body)})
					require.NoError(t, b.err)
					require.Equal(t, http.StatusCreated, b.status, "%s with alice's key (%s) got %d %q", user, state, b.status, trunc(b.body))
					require.Empty(t, b.hdr.Get(idempotency.HeaderReplayed), "%s got a replay", user)
					e := decodeEcho(t, b.body)
					require.Equal(t, hex.EncodeToString([]byte(user)), e.UserHex, "%s got another caller's response", user)
					require.NotContains(t, string(b.body), "alice")
				}
				require.Equal(t, before+2, c.get(), "bob's handler must run for each of his requests")
				if state == "in-flight" {
					g.release()
					require.Equal(t, http.StatusCreated, (<-done).status)
				}
				// alice's own retry still gets alice's outcome, not bob's.
				a := rg.settle(t, q{key: key, user: "alice", body: []byte("X")})
				require.Equal(t, "true", a.hdr.Get(idempotency.HeaderReplayed), "alice's retry: %d %q", a.status, trunc(a.body))
				switch state {
				case "body-omitted":
					require.Equal(t, http.StatusGone, a.status)
					require.Equal(t, "/orders/alice", a.hdr.Get("Location"))
				case "stored-4xx":
					require.Equal(t, http.StatusPaymentRequired, a.status)
					require.Contains(t, string(a.body), "alice's card declined")
				default:
					require.Equal(t, http.StatusCreated, a.status)
					require.Equal(t, hex.EncodeToString([]byte("alice")), decodeEcho(t, a.body).UserHex)
				}
			})
		}
	}
}

// Identities that an implementation might normalise into each other (case,
// blanks, Unicode forms, NUL and invalid UTF-8 replaced or stripped, long
// values cut at 512 bytes) are distinct callers: the second one's request
// with the first one's key and body runs and is answered for the second one.
func TestIdentitiesThatCouldCollideStayApart(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("u", 10_000)
	long600 := strings.Repeat("v", 600)
	pairs := [][2]string{
		{"alice", "Alice"},
		{"alice", "alice "},
		{"alice", " alice"},
		{"\u00e9", "e\u0301"},
		{"a\x00b", "a\x00c"},
		{"a\x00b", "ab"},
		{"a\x00b", "a b"},
		{"a\x00b", "a\ufffdb"},
		{"a\x00", "a"},
		{"\xff", "\xfe"},
		{"\xff", "\ufffd"},
		{"a\xffb", "ab"},
		{"a\x01b", "a\x02b"},
		{long + "1", long + "2"},
		{long600 + "1", long600 + "2"},
		{long + "\x00", long + "\xff"},
		{"1:a", "a"},
		{"a POST /orders", "a"},
		{"sha256:" + sha256hex("5:alice POST /orders"), "alice"},
	}
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newIsolatedRig(t, kind, nil, echo(&c))
			for i, p := range pairs {
				key := fmt.Sprintf("collide-%d", i)
				for j, who := range p {
					before := c.get()
					r := rg.do(t, q{key: key, user: who, uhex: true, body: []byte("same body")})
					require.NoError(t, r.err)
					require.Equal(t, http.StatusCreated, r.status, "pair %d (%q, %q), caller %d: %d %q", i, trunc([]byte(p[0])), trunc([]byte(p[1])), j, r.status, trunc(r.body))
					require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed), "pair %d caller %d was answered with the other's response", i, j)
					require.Equal(t, before+1, c.get())
					require.Equal(t, hex.EncodeToString([]byte(who)), decodeEcho(t, r.body).UserHex)
				}
				// each one's retry gets its own.
				for j, who := range p {
					r := rg.settle(t, q{key: key, user: who, uhex: true, body: []byte("same body")})
					require.Equal(t, http.StatusCreated, r.status, "pair %d caller %d retry", i, j)
					require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
					require.Equal(t, hex.EncodeToString([]byte(who)), decodeEcho(t, r.body).UserHex, "pair %d caller %d got the other's response", i, j)
				}
			}
		})
	}
}

// "An identity error, or an empty identity: 401 Unauthorized ... The handler
// does not run", and "the error is logged at debug level and not sent to the
// client".
func TestIdentityErrorsAre401WithoutTheError(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, &idempotency.Config{Required: true}, echo(&c))
			for name, x := range map[string]q{
				"error":                {key: "k1"},
				"empty":                {key: "k1", hdr: http.Header{"X-User-Empty": {"1"}}},
				"error-no-key":         {},
				"empty-with-key-twice": {hdr: http.Header{"X-User-Empty": {"1"}, "Idempotency-Key": {"a", "b"}}},
			} {
				r := rg.do(t, x)
				require.NoError(t, r.err)
				if name == "error-no-key" || name == "empty-with-key-twice" {
					// which check comes first is not documented; either is a 4xx.
					require.Contains(t, []int{400, 401}, r.status, name)
					continue
				}
				e := requireJSONError(t, r.status, r.hdr, r.body, http.StatusUnauthorized, name)
				require.NotContains(t, e, identitySecret, "%s: the identity error reached the client", name)
				require.NotContains(t, string(r.body), identitySecret)
			}
			require.Zero(t, c.get(), "the handler ran for an unidentified caller")
			require.Contains(t, rg.logs.String(), identitySecret, "the identity error is logged (at debug level)")
			for _, line := range strings.Split(rg.logs.String(), "\n") {
				if strings.Contains(line, identitySecret) {
					require.Contains(t, line, "level=DEBUG", "the identity error is logged above debug: %s", line)
				}
			}
		})
	}
}

// ScopeFromContext is the stored scope: "5:alice POST /orders", its length
// in bytes, and the SHA-256 form when it holds a NUL or invalid UTF-8 or is
// longer than 512 bytes.
func TestScopeFromContextIsTheDocumentedStoredScope(t *testing.T) {
	t.Parallel()
	type seen struct{ scope, key string }
	got := make(chan seen, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s, ok1 := idempotency.ScopeFromContext(r.Context())
		k, ok2 := idempotency.FromContext(r.Context())
		if !ok1 || !ok2 {
			s = "missing"
		}
		got <- seen{s, k}
		w.WriteHeader(http.StatusCreated)
	})
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			rg := newIsolatedRig(t, kind, nil, h)
			const scope = "POST /orders"
			// the identity length that makes the stored scope exactly 512 bytes.
			n512 := 512 - len(" "+scope) - len("000:")
			for _, id := range []string{"alice", "ü", "a\x00b", "\xff", strings.Repeat("x", n512), strings.Repeat("x", n512+1), strings.Repeat("y", 10_000), strings.Repeat("z", 1<<20)} {
				r := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", "scope-key", id, nil))
				require.Equal(t, http.StatusCreated, r.Code, "%q: %q", trunc([]byte(id)), r.Body.String())
				s := <-got
				want := storedScope(id, scope)
				require.Equal(t, want, s.scope, "identity of %d bytes", len(id))
				require.Equal(t, "scope-key", s.key)
			}
			require.Equal(t, "5:alice POST /orders", storedScope("alice", scope))
			require.Len(t, storedScope(strings.Repeat("x", n512), scope), 512)
		})
	}
}
