package review26_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/ui"
)

// observation skips a test that shows an observation (docs silent, unclear
// or wrong; a smaller issue) unless REVIEW26_FINDINGS=1; it then fails.
func observation(t *testing.T, id, what string) {
	t.Helper()
	if os.Getenv("REVIEW26_FINDINGS") != "1" {
		t.Skip("OBSERVATION " + id + ": " + what)
	}
}

// TestCSRFCookieAttributes: the cookie is "random, HttpOnly,
// SameSite=Strict, Secure over TLS".
func TestCSRFCookieAttributes(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	check := func(res *http.Response, secure bool) {
		t.Helper()
		var found *http.Cookie
		for _, k := range res.Cookies() {
			if k.Name == "sagaflow_csrf" {
				found = k
			}
		}
		require.NotNil(t, found, "no sagaflow_csrf cookie")
		require.True(t, found.HttpOnly)
		require.Equal(t, http.SameSiteStrictMode, found.SameSite)
		require.Equal(t, secure, found.Secure)
		require.GreaterOrEqual(t, len(found.Value), 32, "a random token")
	}
	res, err := http.Get(r.srv.URL + "/")
	require.NoError(t, err)
	res.Body.Close()
	check(res, false)
	ts := httptest.NewTLSServer(r.h)
	t.Cleanup(ts.Close)
	res, err = ts.Client().Get(ts.URL + "/")
	require.NoError(t, err)
	res.Body.Close()
	check(res, true)
}

// TestRequeueRecordsTheReasonTyped: docs/ui.md said "A requeue has no saga
// history entry" (O1); a requeued dead command of a saga adds
// command_requeued, and the doc now says so, with the reason typed.
func TestRequeueRecordsTheReasonTyped(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow, Actor: func(*http.Request) string { return "erin" }})
	id := r.failed(order{ID: "rq"}, "rq")
	dm := uuid.New()
	_, err := r.db.Pool.Exec(context.Background(), `INSERT INTO `+r.db.Table("outbox")+
		` (id, topic, aggregateid, type, payload, status, saga_id, step_key, last_error) VALUES ($1, 'orders.events', 'k', 'T', 'x', 'dead', $2, $3, 'parked')`,
		dm, id, id.String()+"/charge/forward/0")
	require.NoError(t, err)
	before := len(r.get(id).History)
	c := r.client()
	res := c.confirm("/requeue?msg="+dm.String(), url.Values{"reason": {"provider fixed"}})
	require.Less(t, res.code, 400, res.String())
	in := r.get(id)
	require.Len(t, in.History, before+1, "one entry: %v", testkit.Timeline(in)[before:])
	last := in.History[len(in.History)-1]
	require.Equal(t, "command_requeued", last.Type)
	require.Contains(t, string(last.Detail), "requeue by erin in the web UI: provider fixed")
}

// TestPreviewOffersOnlyApplicableActions: "pause | sagas that have not ended
// and are not paused"; "unpause | sagas paused on their own". A preview of
// either for another saga says what it would do and offers a confirmation,
// which is then refused.
func TestPreviewOffersOnlyApplicableActions(t *testing.T) {
	t.Parallel()
	// O2 (fixed): they offered one.
	r := newRig(t, &ui.Config{Authorize: allow})
	failed := r.failed(order{ID: "pv"}, "pv")
	running := r.waiting("pv2")
	c := r.client()
	for _, p := range []string{"/sagas/" + failed.String() + "/pause", "/sagas/" + failed.String() + "/unpause", "/sagas/" + running.String() + "/unpause"} {
		res := c.get(p)
		require.NotContains(t, res.body, `id="confirm-form"`, "%s offers a confirmation", p)
	}
}

// TestForeignHostIsRefused: the origin check compares Origin with the
// request's own Host, which a DNS-rebinding page controls: a page of
// evil.example whose name resolves to 127.0.0.1 reads a token and posts it,
// same-origin as far as the browser knows. O3 (answered): Config.Hosts
// names the hosts the UI answers (`sagaflow ui` sets it); with it, the
// rebinding page gets 421 and nothing acts.
func TestForeignHostIsRefused(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow, Hosts: []string{"ui.example:8080"}})
	id := r.failed(order{ID: "dns"}, "dns")
	c := r.client()
	good := map[string]string{"Host": "ui.example:8080"}
	p := c.do("GET", c.url("/sagas/"+id.String()+"/resume"), nil, good)
	require.Equal(t, 200, p.code)
	f := c.confirmForm(p)
	host := map[string]string{"Host": "evil.example:8080"}
	require.Equal(t, http.StatusMisdirectedRequest, c.do("GET", c.url("/sagas/"+id.String()+"/resume"), nil, host).code)
	hdr := map[string]string{"Host": "evil.example:8080", "Origin": "http://evil.example:8080", "Sec-Fetch-Site": "same-origin",
		"Cookie": "sagaflow_csrf=" + f.vals.Get("csrf")}
	bare := &client{t: t, r: r, c: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	res := bare.do("POST", r.srv.URL+f.action, f.vals, hdr)
	require.Equal(t, http.StatusMisdirectedRequest, res.code, "a request for host evil.example acted: %s", res)
	require.Equal(t, "failed", string(r.get(id).Status), "nothing acted")
}

// TestCSRFTokenIsTheServers: a cookie the browser never got from the UI
// (planted by a sibling subdomain, "cookie tossing") and a form field of the
// same value are not a token.
func TestCSRFTokenIsTheServers(t *testing.T) {
	t.Parallel()
	observation(t, "O4", "any 64-hex value in both the cookie and the form is accepted: the token is not bound to the server "+
		"(answered in docs/ui.md: the origin check, required since F4, is what stops a cross-site post)")
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "toss"}, "toss")
	planted := strings.Repeat("0123456789abcdef", 4)
	bare := &client{t: t, r: r, c: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	h := bare.sameOrigin()
	h["Cookie"] = "sagaflow_csrf=" + planted
	res := bare.do("POST", bare.url("/sagas/"+id.String()+"/resume"),
		url.Values{"csrf": {planted}, "version": {strconv.FormatInt(r.get(id).Version, 10)}}, h)
	require.Equal(t, http.StatusForbidden, res.code, res.String())
}

// TestNewRefusesAnotherSchemasEngine: Config.Schema "must be the engine's".
// New takes an engine of another schema without a word, and the UI then
// shows one tenant's list and sagas (read through the engine) beside the
// other's overview and dead items (read through the pool).
func TestNewRefusesAnotherSchemasEngine(t *testing.T) {
	t.Parallel()
	// O5 (fixed): New accepted it.
	a := newRig(t, nil)
	b := newRig(t, nil)
	theirs := b.failed(order{ID: "b"}, "b-key")
	h, err := ui.New(a.db.Pool, b.eng, &ui.Config{Schema: a.db.Schema, Logger: testkit.Discard})
	if err != nil {
		return // refused: what the docs ask for
	}
	mixed := &rig{t: t, db: a.db, eng: b.eng, srv: newServer(t, h)}
	res := mixed.client().get("/sagas")
	require.NotContains(t, res.body, theirs.String(), "the UI of schema %s lists a saga of schema %s", a.db.Schema, b.db.Schema)
}
