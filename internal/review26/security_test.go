package review26_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// world is one saga of each kind the actions apply to, and a dead row and
// letter.
type world struct {
	failed, waiting, paused uuid.UUID
	deadMsg                 uuid.UUID
	deadLetter              int64
}

func (r *rig) world() world {
	r.t.Helper()
	w := world{failed: r.failed(order{ID: "f1"}, "f1"), waiting: r.waiting("w1"), paused: r.waiting("p1")}
	require.NoError(r.t, r.eng.Pause(context.Background(), w.paused, "hold it"))
	w.deadMsg = r.deadRow("orders.events", "OrderPaid", "o-1", "broker refused", []byte(`{"n":1}`))
	w.deadLetter = r.deadLetter("billing", "orders.events", "m-1", "undecodable", []byte("k"), []byte("v"), nil)
	return w
}

// write is one operator action as a form would post it.
type write struct {
	name, preview, post string
	vals                url.Values
}

func (r *rig) writes(w world) []write {
	v := func(id uuid.UUID) string { return strconv.FormatInt(r.get(id).Version, 10) }
	f, wt, p := w.failed.String(), w.waiting.String(), w.paused.String()
	return []write{
		{"resume", "/sagas/" + f + "/resume", "/sagas/" + f + "/resume", url.Values{"version": {v(w.failed)}, "reason": {"x"}}},
		{"rerun", "/sagas/" + f + "/rerun?from=charge", "/sagas/" + f + "/rerun", url.Values{"version": {v(w.failed)}, "from": {"charge"}, "reason": {"x"}}},
		{"cancel", "/sagas/" + wt + "/cancel", "/sagas/" + wt + "/cancel", url.Values{"version": {v(w.waiting)}, "reason": {"x"}}},
		{"pause", "/sagas/" + wt + "/pause", "/sagas/" + wt + "/pause", url.Values{"version": {v(w.waiting)}, "reason": {"x"}}},
		{"unpause", "/sagas/" + p + "/unpause", "/sagas/" + p + "/unpause", url.Values{"version": {v(w.paused)}, "reason": {"x"}}},
		{"replay", "/replay?status=failed", "/replay", url.Values{"status": {"failed"}}},
		{"requeue msg", "/requeue?msg=" + w.deadMsg.String(), "/requeue", url.Values{"msg": {w.deadMsg.String()}}},
		{"requeue letter", "/requeue?letter=" + strconv.FormatInt(w.deadLetter, 10), "/requeue", url.Values{"letter": {strconv.FormatInt(w.deadLetter, 10)}}},
	}
}

// TestActionLinksAreThePathsUsedHere checks, with every action allowed, that
// the pages link to the previews the other tests use, and that each preview
// posts to the path they post to: so that a refusal elsewhere is a refusal,
// not a wrong address.
func TestActionLinksAreThePathsUsedHere(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	w := r.world()
	c := r.client()
	for id, want := range map[uuid.UUID][]string{
		w.failed:  {"/sagas/" + w.failed.String() + "/resume", "/sagas/" + w.failed.String() + "/rerun"},
		w.waiting: {"/sagas/" + w.waiting.String() + "/cancel", "/sagas/" + w.waiting.String() + "/pause"},
		w.paused:  {"/sagas/" + w.paused.String() + "/unpause"},
	} {
		p := c.get("/sagas/" + id.String())
		require.Equal(t, 200, p.code)
		for _, h := range want {
			require.Contains(t, hrefs(p.body), h, "saga page of %s", id)
		}
	}
	dead := c.get("/dead")
	require.Contains(t, hrefs(dead.body), "/requeue?msg="+w.deadMsg.String())
	require.Contains(t, hrefs(dead.body), "/requeue?letter="+strconv.FormatInt(w.deadLetter, 10))
	for _, wr := range r.writes(w) {
		p := c.get(wr.preview)
		require.Equal(t, 200, p.code, "%s: %s", wr.name, p)
		f := c.confirmForm(p)
		require.Equal(t, "post", strings.ToLower(f.method), wr.name)
		require.Equal(t, wr.post, f.action, wr.name)
		require.Equal(t, c.cookie(), f.vals.Get("csrf"), "%s: the form's token is the cookie's", wr.name)
	}
}

// TestReadOnlyRefusesEveryWrite: "Without Config.Authorize no action is shown
// and every write is refused (403)", whatever the method or trick.
func TestReadOnlyRefusesEveryWrite(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	w := r.world()
	writes := r.writes(w)
	c := r.client()
	for _, p := range []string{"/", "/sagas", "/sagas/" + w.failed.String(), "/sagas/" + w.waiting.String(), "/sagas/" + w.paused.String(), "/dead"} {
		page := c.get(p)
		require.Equal(t, 200, page.code, p)
		require.NotContains(t, page.body, `class="action"`, "%s shows an action in read-only mode", p)
		require.NotRegexp(t, `(?i)<form[^>]*method="post"`, page.body, p)
	}
	token := c.cookie()
	require.NotEmpty(t, token, "the UI gives a browser its token cookie")
	before := r.snapshot()
	for _, wr := range writes {
		p := c.get(wr.preview)
		require.NotContains(t, p.body, `id="confirm-form"`, "%s: read-only preview offers a confirmation", wr.name)
		vals := url.Values{"csrf": {token}}
		for k, v := range wr.vals {
			vals[k] = v
		}
		res := c.post(wr.post, vals)
		require.Equal(t, http.StatusForbidden, res.code, "%s: POST in read-only mode: %s", wr.name, res)
		// Method override tricks, other methods, and the write as a GET.
		for _, m := range []struct {
			method string
			hdr    map[string]string
			q      bool
		}{
			{"POST", map[string]string{"X-HTTP-Method-Override": "PUT"}, false},
			{"PUT", nil, false}, {"PATCH", nil, false}, {"DELETE", nil, false},
			{"GET", nil, true}, {"HEAD", nil, true},
			{"GET", map[string]string{"X-HTTP-Method-Override": "POST", "X-HTTP-Method": "POST", "X-Method-Override": "POST"}, true},
		} {
			hdr := c.sameOrigin()
			for k, v := range m.hdr {
				hdr[k] = v
			}
			u := c.url(wr.post)
			var body url.Values
			if m.q {
				q := url.Values{"_method": {"POST"}}
				for k, v := range vals {
					q[k] = v
				}
				u += "?" + q.Encode()
			} else {
				body = url.Values{"_method": {"POST"}}
				for k, v := range vals {
					body[k] = v
				}
			}
			res := c.do(m.method, u, body, hdr)
			require.False(t, res.code >= 200 && res.code < 400 && m.method != "GET" && m.method != "HEAD",
				"%s: %s accepted in read-only mode: %s", wr.name, m.method, res)
		}
	}
	require.Equal(t, before, r.snapshot(), "a write in read-only mode changed the database")
}

// TestGetNeverWrites: with every action allowed, "a GET never writes": not a
// preview, not a GET that carries the confirmation's fields, not HEAD, and
// PUT, PATCH and DELETE are not writes either.
func TestGetNeverWrites(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	w := r.world()
	writes := r.writes(w)
	c := r.client()
	c.get("/")
	token := c.cookie()
	before := r.snapshot()
	for _, wr := range writes {
		vals := url.Values{"csrf": {token}, "confirm": {"1"}}
		for k, v := range wr.vals {
			vals[k] = v
		}
		for _, method := range []string{"GET", "HEAD"} {
			res := c.do(method, c.url(wr.preview), nil, c.sameOrigin())
			require.Less(t, res.code, 500, "%s %s: %s", method, wr.preview, res)
			res = c.do(method, c.url(wr.post)+"?"+vals.Encode(), nil, c.sameOrigin())
			require.Less(t, res.code, 500, "%s %s: %s", method, wr.post, res)
		}
		for _, method := range []string{"PUT", "PATCH", "DELETE"} {
			res := c.do(method, c.url(wr.post), vals, c.sameOrigin())
			require.GreaterOrEqual(t, res.code, 400, "%s %s was accepted: %s", method, wr.post, res)
		}
	}
	require.Equal(t, before, r.snapshot(), "a GET, HEAD, PUT, PATCH or DELETE changed the database")
}

func randomHex() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// TestCSRFTokenAndOrigin: "Every write is a POST with a token that must equal
// the browser's sagaflow_csrf cookie … a POST whose Origin is not the
// request's host, or whose Sec-Fetch-Site is not same-origin, is refused."
func TestCSRFTokenAndOrigin(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "c1"}, "c1")
	path := "/sagas/" + id.String() + "/resume"
	a, b := r.client(), r.client()
	pa := a.get(path)
	pb := b.get(path)
	tokA := a.confirmForm(pa).vals.Get("csrf")
	tokB := b.confirmForm(pb).vals.Get("csrf")
	require.NotEqual(t, tokA, tokB, "two browsers get different tokens")
	require.Equal(t, tokA, a.cookie())
	version := strconv.FormatInt(r.get(id).Version, 10)
	origin := r.srv.URL
	u, _ := url.Parse(origin)
	otherPort := "http://" + u.Hostname() + ":1"
	fresh := func() *client { return r.client() }

	cases := []struct {
		name   string
		c      *client
		token  string
		cookie string // set on the request instead of the jar's, when not ""
		hdr    map[string]string
	}{
		{"no cookie and no token", fresh(), "", "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"cookie but no token", a, "", "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"wrong token", a, randomHex(), "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"empty cookie and empty token", fresh(), "", "sagaflow_csrf=", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"another browser's token", b, tokA, "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"token without its cookie", fresh(), tokA, "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"token with a prefix of it as cookie", fresh(), tokA, "sagaflow_csrf=" + tokA[:8], map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-origin"}},
		{"cross-site Origin", a, tokA, "", map[string]string{"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}},
		{"cross-site Origin, same-origin fetch site", a, tokA, "", map[string]string{"Origin": "https://evil.example", "Sec-Fetch-Site": "same-origin"}},
		{"Origin null", a, tokA, "", map[string]string{"Origin": "null"}},
		{"Origin on another port", a, tokA, "", map[string]string{"Origin": otherPort, "Sec-Fetch-Site": "same-site"}},
		{"same Origin, Sec-Fetch-Site cross-site", a, tokA, "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "cross-site"}},
		{"same Origin, Sec-Fetch-Site same-site", a, tokA, "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "same-site"}},
		{"same Origin, Sec-Fetch-Site none", a, tokA, "", map[string]string{"Origin": origin, "Sec-Fetch-Site": "none"}},
		{"no Origin, Sec-Fetch-Site cross-site", a, tokA, "", map[string]string{"Sec-Fetch-Site": "cross-site"}},
		{"Origin with a suffix", a, tokA, "", map[string]string{"Origin": origin + ".evil.example", "Sec-Fetch-Site": "same-origin"}},
		{"Referer same, Origin cross-site", a, tokA, "", map[string]string{"Origin": "https://evil.example", "Referer": origin + "/"}},
	}
	for _, tc := range cases {
		form := url.Values{"version": {version}, "reason": {tc.name}}
		if tc.token != "" {
			form.Set("csrf", tc.token)
		} else if tc.name == "empty cookie and empty token" {
			form.Set("csrf", "")
		}
		hdr := map[string]string{}
		for k, v := range tc.hdr {
			hdr[k] = v
		}
		c := tc.c
		if tc.cookie != "" {
			hdr["Cookie"] = tc.cookie
			c = &client{t: t, r: r, c: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
		}
		res := c.do("POST", c.url(path), form, hdr)
		require.True(t, res.code == http.StatusForbidden || res.code == http.StatusBadRequest,
			"%s: want 403 (or 400), got %s", tc.name, res)
		in := r.get(id)
		require.Equal(t, saga.StatusFailed, in.Status, tc.name)
		require.Zero(t, count(in, saga.EventSagaResumed), "%s: the saga was resumed", tc.name)
	}
	// The control: the same request, done right, is accepted.
	res := a.post(path, url.Values{"csrf": {tokA}, "version": {version}, "reason": {"control"}})
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	testkit.WaitFor(t, 10e9, "the resume", func() bool { return count(r.get(id), saga.EventSagaResumed) == 1 })
}

// TestPostWithoutOriginIsRefused: a POST that carries neither Origin nor
// Sec-Fetch-Site has no Sec-Fetch-Site of same-origin and no Origin that is
// the request's host.
func TestPostWithoutOriginIsRefused(t *testing.T) {
	t.Parallel()
	// F4 (fixed): such a POST was accepted.
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "o1"}, "o1")
	c := r.client()
	f := c.confirmForm(c.get("/sagas/" + id.String() + "/resume"))
	res := c.do("POST", c.r.srv.URL+f.action, f.vals, nil)
	require.Equal(t, http.StatusForbidden, res.code, "POST without Origin or Sec-Fetch-Site: %s", res)
	require.Zero(t, count(r.get(id), saga.EventSagaResumed))
}

// TestAuthorizeIsAskedPerAction: Authorize is called "with each request that
// would show an action's form or perform it, and the action"; one action
// refused does not refuse the others, and the refused one neither shows its
// form nor runs.
func TestAuthorizeIsAskedPerAction(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	asked := map[string]int{}
	r := newRig(t, &ui.Config{Authorize: func(_ *http.Request, action string) error {
		mu.Lock()
		asked[action]++
		mu.Unlock()
		if action == ui.ActionCancel {
			return errors.New("no cancels for you")
		}
		return nil
	}})
	w := r.world()
	c := r.client()
	for _, wr := range r.writes(w) {
		p := c.get(wr.preview)
		if wr.name == "cancel" {
			require.NotContains(t, p.body, `id="confirm-form"`, "a refused action shows its form")
			require.GreaterOrEqual(t, p.code, 400)
			res := c.post(wr.post, url.Values{"csrf": {c.cookie()}, "version": wr.vals["version"], "reason": {"x"}})
			require.Equal(t, http.StatusForbidden, res.code, res.String())
			continue
		}
		require.Equal(t, 200, p.code, "%s: %s", wr.name, p)
		c.confirmForm(p)
	}
	in := r.get(w.waiting)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.Zero(t, count(in, "cancel_requested"))
	res := c.confirm("/sagas/"+w.failed.String()+"/resume", nil)
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	mu.Lock()
	defer mu.Unlock()
	for _, a := range []string{ui.ActionResume, ui.ActionRerun, ui.ActionCancel, ui.ActionPause, ui.ActionUnpause, ui.ActionReplay, ui.ActionRequeue} {
		require.NotZero(t, asked[a], "Authorize never asked about %q (asked: %v)", a, asked)
	}
}

// only allows exactly one action.
func only(action string) func(*http.Request, string) error {
	return func(_ *http.Request, a string) error {
		if a == action {
			return nil
		}
		return errors.New("not allowed: " + a)
	}
}

// TestUnpauseDoesNotResumeAFailedSaga: an operator allowed to unpause, not
// to resume, cannot resume a failed saga through the unpause form (both are
// Engine.Resume underneath).
func TestUnpauseDoesNotResumeAFailedSaga(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: only(ui.ActionUnpause)})
	id := r.failed(order{ID: "u1"}, "u1")
	c := r.client()
	c.get("/sagas/" + id.String())
	res := c.post("/sagas/"+id.String()+"/unpause", url.Values{"csrf": {c.cookie()},
		"version": {strconv.FormatInt(r.get(id).Version, 10)}, "reason": {"sneaky"}})
	in := r.get(id)
	require.Zero(t, count(in, saga.EventSagaResumed), "unpause resumed a failed saga: %v", testkit.Timeline(in))
	require.Equal(t, saga.StatusFailed, in.Status)
	require.GreaterOrEqual(t, res.code, 400, res.String())
}

// TestResumeDoesNotLiftAPause: an operator allowed to resume failed sagas,
// not to unpause, cannot lift a running saga's pause through the resume form.
func TestResumeDoesNotLiftAPause(t *testing.T) {
	t.Parallel()
	// F2 (fixed): the resume form lifted the pause.
	r := newRig(t, &ui.Config{Authorize: only(ui.ActionResume)})
	id := r.waiting("r1")
	require.NoError(t, r.eng.Pause(context.Background(), id, "incident 7"))
	c := r.client()
	c.get("/sagas/" + id.String())
	res := c.post("/sagas/"+id.String()+"/resume", url.Values{"csrf": {c.cookie()},
		"version": {strconv.FormatInt(r.get(id).Version, 10)}, "reason": {"sneaky"}})
	in := r.get(id)
	require.NotNil(t, in.Paused, "the resume form (unpause refused) lifted the pause: %s: %v", res.code, testkit.Timeline(in))
	require.GreaterOrEqual(t, res.code, 400, res.String())
}

// TestResumeFormDoesNotRerun: an operator allowed to resume, not to rerun,
// cannot turn the resume form into a rerun with a "from" field.
func TestResumeFormDoesNotRerun(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: only(ui.ActionResume)})
	id := r.failed(order{ID: "rr1"}, "rr1")
	c := r.client()
	res := c.confirm("/sagas/"+id.String()+"/resume", url.Values{"from": {"charge"}, "action": {"rerun"}})
	require.Less(t, res.code, 500, res.String())
	in := testkit.WaitEnded(t, r.eng, id)
	require.Zero(t, count(in, saga.EventSagaRerun), "a rerun through the resume form: %v", testkit.Timeline(in))
	require.Zero(t, in.Epoch)
	// And rerun itself is refused.
	c2 := r.client()
	p := c2.get("/sagas/" + id.String() + "/rerun?from=charge")
	require.NotContains(t, p.body, `id="confirm-form"`)
	res = c2.post("/sagas/"+id.String()+"/rerun", url.Values{"csrf": {c2.cookie()}, "from": {"charge"},
		"version": {strconv.FormatInt(r.get(id).Version, 10)}})
	require.Equal(t, http.StatusForbidden, res.code, res.String())
}

// TestActorIsConfigActorNotTheRequest: "recorded in each saga's history with
// the name of who did them (Config.Actor)": the entry's reason reads
// "resume by alice in the web UI: <the reason typed>", whatever name the
// request itself carries.
func TestActorIsConfigActorNotTheRequest(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow, Actor: func(*http.Request) string { return "alice" }})
	failedA := r.failed(order{ID: "a1"}, "a1")
	failedB := r.failed(order{ID: "a2"}, "a2")
	waiting := r.waiting("a3")
	c := r.client()
	forged := url.Values{"actor": {"mallory"}, "user": {"mallory"}, "by": {"mallory"}, "Actor": {"mallory"}}
	hdr := map[string]string{"X-Actor": "mallory", "X-Forwarded-User": "mallory", "Remote-User": "mallory",
		"X-Remote-User": "mallory", "X-Forwarded-Email": "mallory@example", "Authorization": "Basic bWFsbG9yeTpw"}
	post := func(preview string, extra url.Values) {
		t.Helper()
		p := c.get(preview)
		f := c.confirmForm(p)
		for k, v := range forged {
			f.vals[k] = v
		}
		for k, v := range extra {
			f.vals[k] = v
		}
		h := c.sameOrigin()
		for k, v := range hdr {
			h[k] = v
		}
		res := c.do("POST", r.srv.URL+f.action+"?actor=mallory", f.vals, h)
		require.Equal(t, http.StatusSeeOther, res.code, "%s: %s", preview, res)
	}
	post("/sagas/"+failedA.String()+"/resume", url.Values{"reason": {"fix deployed"}})
	post("/sagas/"+failedB.String()+"/rerun?from=charge", url.Values{"reason": {"again"}})
	post("/sagas/"+waiting.String()+"/cancel", url.Values{"reason": {"customer asked"}})
	checks := map[uuid.UUID]string{
		failedA: "resume by alice in the web UI: fix deployed",
		failedB: "rerun by alice in the web UI: again",
		waiting: "cancel by alice in the web UI: customer asked",
	}
	for id, want := range checks {
		var rs []string
		testkit.WaitFor(t, 10e9, "the action in the history", func() bool {
			rs = reasons(r.get(id))
			if len(rs) > 0 && strings.Contains(strings.Join(rs, "\n"), want) {
				return true
			}
			return false
		})
		require.NotContains(t, strings.Join(rs, "\n"), "mallory", id)
	}
}

// TestActorDefaultsToAnonymous: "Actor … Defaults to \"anonymous\"."
func TestActorDefaultsToAnonymous(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "an1"}, "an1")
	c := r.client()
	res := c.confirm("/sagas/"+id.String()+"/resume", url.Values{"reason": {"r"}})
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	testkit.WaitFor(t, 10e9, "the resume by anonymous", func() bool {
		return strings.Contains(strings.Join(reasons(r.get(id)), "\n"), "resume by anonymous in the web UI: r")
	})
}

// TestBulkReplayRecordsTheActor: bulk replay is "recorded in the saga's
// history with who did them".
func TestBulkReplayRecordsTheActor(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow, Actor: func(*http.Request) string { return "bob" }})
	id := r.failed(order{ID: "b1"}, "b1")
	c := r.client()
	res := c.confirm("/replay?name=order&status=failed", url.Values{"actor": {"mallory"}})
	require.Contains(t, []int{200, 303}, res.code, res.String())
	testkit.WaitFor(t, 10e9, "the replay in the history", func() bool {
		return count(r.get(id), saga.EventSagaResumed) == 1
	})
	all := strings.Join(reasons(r.get(id)), "\n")
	require.Contains(t, all, "by bob")
	require.NotContains(t, all, "mallory")
}

// TestRequeueIsLoggedWithTheActor: "requeues are logged with it".
func TestRequeueIsLoggedWithTheActor(t *testing.T) {
	t.Parallel()
	var buf testkit.Buffer
	logger := slogJSON(&buf)
	r := newRig(t, &ui.Config{Authorize: allow, Actor: func(*http.Request) string { return "carol" }, Logger: logger})
	dead := r.deadRow("orders.events", "OrderPaid", "o-9", "broker refused", []byte(`{}`))
	c := r.client()
	res := c.confirm("/requeue?msg="+dead.String(), url.Values{"actor": {"mallory"}})
	require.Contains(t, []int{200, 303}, res.code, res.String())
	var status string
	require.NoError(t, r.db.Pool.QueryRow(context.Background(), `SELECT status FROM `+r.db.Table("outbox")+` WHERE id = $1`, dead).Scan(&status))
	require.Equal(t, "pending", status)
	require.Contains(t, buf.String(), "carol", "the requeue's log")
	require.NotContains(t, buf.String(), "mallory")
}
