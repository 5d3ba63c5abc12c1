package review26_test

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/ui"
)

var (
	tenK    = strings.Repeat("a", 10240)
	tenKEnc = url.QueryEscape(strings.Repeat("<x>\"'", 2048))
)

// badGets are requests with malformed or hostile query parameters and
// paths; each must get a clear answer: a 4xx, or a page (a filter that
// matches nothing), never a 500, a panic or a hang.
func badGets(id string) []string {
	return []string{
		"/sagas/not-a-uuid", "/sagas/%00", "/sagas/" + tenK, "/sagas/00000000-0000-0000-0000-000000000000",
		"/sagas/00000000-0000-0000-0000-000000000000/resume", "/sagas/" + id + "/bogus", "/sagas/" + id + "/resume/extra",
		"/sagas?cursor=garbage", "/sagas?cursor=%00", "/sagas?cursor=" + tenK, "/sagas?cursor=eyJ4IjoxfQ%3D%3D",
		"/sagas?status=bogus", "/sagas?status=failed&status=running", "/sagas?status=%00",
		"/sagas?after=notatime", "/sagas?after=9999999-01-01T00:00:00Z", "/sagas?before=0000-01-01T00:00:00Z", "/sagas?after=2026-01-01T00:00:00%2B99:99",
		"/sagas?limit=-1", "/sagas?limit=0", "/sagas?limit=99999999999999999999", "/sagas?limit=abc", "/sagas?page=99999999999", "/sagas?page=-3",
		"/sagas?name=" + tenK, "/sagas?key=" + tenK, "/sagas?code=" + tenK, "/sagas?step=" + tenK, "/sagas?key=" + tenKEnc,
		"/sagas?waiting=maybe", "/sagas?waiting=1&status=failed",
		"/dead?cursor=garbage", "/dead?cursor=%00", "/dead?limit=-5", "/dead?limit=99999999999999999999", "/dead?since=bad", "/dead?topic=" + tenK,
		"/requeue", "/requeue?msg=bad", "/requeue?msg=" + tenK, "/requeue?letter=-1", "/requeue?letter=abc", "/requeue?letter=999999999999999999999",
		"/requeue?letter=0", "/requeue?all=1&kind=bogus", "/requeue?all=1", "/requeue?all=1&kind=outbox&max=-1", "/requeue?all=1&kind=letters&max=99999999999",
		"/requeue?all=1&kind=outbox&since=bad",
		"/replay?from=" + tenK, "/replay?after=bad", "/replay?max=abc", "/replay?status=" + tenK,
		"/sagas/" + id + "/rerun?from=" + tenK, "/sagas/" + id + "/rerun?from=nope",
		"/static/../../../../etc/passwd", "/static/%2e%2e/%2e%2e/etc/passwd", "/static/..%2f..%2fgo.mod", "/static/nope.js", "/static/",
		"/" + tenK, "/sagas/" + id + "?" + strings.Repeat("x=1&", 2000),
	}
}

// badBytes are query parameters with a NUL, invalid UTF-8 or a control
// character, which PostgreSQL refuses as text.
func badBytes(id string) []string {
	var out []string
	for _, v := range []string{"%00", "%ff", "a%00b", "%c3%28", "%ed%a0%80"} {
		out = append(out,
			"/sagas?key="+v, "/sagas?name="+v, "/sagas?code="+v, "/sagas?step="+v, "/sagas?cursor="+v,
			"/dead?topic="+v, "/dead?consumer="+v, "/dead?cursor="+v,
			"/replay?name="+v, "/replay?step="+v, "/replay?code="+v, "/replay?from="+v,
			"/requeue?all=1&kind=outbox&topic="+v, "/requeue?all=1&kind=letters&consumer="+v,
			"/sagas/"+id+"/rerun?from="+v)
	}
	return out
}

// probe sends each request and reports those answered with a 5xx, or not
// within 5 seconds, or that the logger saw as an error.
func probe(t *testing.T, c *client, paths []string) []string {
	t.Helper()
	var bad []string
	for _, p := range paths {
		start := time.Now()
		res := c.get(p)
		took := time.Since(start)
		short := p
		if len(short) > 80 {
			short = short[:80] + "…"
		}
		if res.code >= 500 {
			bad = append(bad, fmt.Sprintf("GET %s: %d", short, res.code))
		}
		if took > hangBound {
			bad = append(bad, fmt.Sprintf("GET %s: took %v", short, took))
		}
	}
	return bad
}

// TestBadQueryParameters: malformed UUIDs, huge numbers, negative limits,
// 10 kB filters: a clear 4xx or a page, never a 500 or a hang.
func TestBadQueryParameters(t *testing.T) {
	t.Parallel()
	var logs testkit.Buffer
	r := newRig(t, &ui.Config{Authorize: allow, Logger: slogJSON(&logs)})
	id := r.failed(order{ID: "b1"}, "b1").String()
	c := r.client()
	require.Empty(t, probe(t, c, badGets(id)))
	for _, p := range []string{"/sagas/not-a-uuid", "/sagas/%00", "/sagas?status=bogus", "/sagas?after=notatime", "/requeue?msg=bad",
		"/requeue?letter=abc", "/replay?max=abc"} {
		require.Equal(t, http.StatusBadRequest, c.get(p).code, p)
	}
	require.Equal(t, http.StatusNotFound, c.get("/sagas/00000000-0000-0000-0000-000000000000").code)
	res := c.get("/static/..%2f..%2fgo.mod")
	require.NotContains(t, res.body, "module github.com/sagaflow/sagaflow")
	require.NotContains(t, logs.String(), `"level":"ERROR"`)
}

// TestNULAndInvalidUTF8InFilters: a NUL byte or invalid UTF-8 in a filter is
// bad input (PostgreSQL refuses it as text): a 4xx, not a 500.
func TestNULAndInvalidUTF8InFilters(t *testing.T) {
	t.Parallel()
	var logs testkit.Buffer
	r := newRig(t, &ui.Config{Authorize: allow, Logger: slogJSON(&logs)})
	id := r.failed(order{ID: "n1"}, "n1").String()
	c := r.client()
	require.Empty(t, probe(t, c, badBytes(id)), "logged: %s", logs.String())
	require.NotContains(t, logs.String(), `"level":"ERROR"`)
}

// TestBadForms: forms built by hand with malformed fields get a clear 4xx,
// never a 500 or a hang, and change nothing.
func TestBadForms(t *testing.T) {
	t.Parallel()
	var logs testkit.Buffer
	r := newRig(t, &ui.Config{Authorize: allow, Logger: slogJSON(&logs)})
	id := r.failed(order{ID: "f1"}, "f1")
	done := r.start(r.doneD, order{ID: "f2"}, "f2")
	testkit.WaitEnded(t, r.eng, done)
	c := r.client()
	c.get("/")
	tok := c.cookie()
	version := strconv.FormatInt(r.get(id).Version, 10)
	before := r.snapshot()
	resume := "/sagas/" + id.String() + "/resume"
	rerun := "/sagas/" + id.String() + "/rerun"
	var many []string
	for range 5000 {
		many = append(many, "00000000-0000-0000-0000-000000000001")
	}
	cases := []struct {
		path string
		vals url.Values
	}{
		{resume, url.Values{"version": {"abc"}}},
		{resume, url.Values{"version": {"-1"}}},
		{resume, url.Values{"version": {"99999999999999999999"}}},
		{resume, url.Values{}},
		{resume, url.Values{"version": {""}}},
		{"/sagas/not-a-uuid/resume", url.Values{"version": {version}}},
		{"/sagas/00000000-0000-0000-0000-000000000000/resume", url.Values{"version": {"1"}}},
		{rerun, url.Values{"version": {version}, "from": {"\x00"}}},
		{rerun, url.Values{"version": {version}, "from": {"\xff"}}},
		{rerun, url.Values{"version": {version}, "from": {tenK}}},
		{rerun, url.Values{"version": {version}, "from": {"nope"}}},
		{"/sagas/" + id.String() + "/bogus", url.Values{"version": {version}}},
		{"/requeue", url.Values{"msg": {"bad"}}},
		{"/requeue", url.Values{"letter": {"abc"}}},
		{"/requeue", url.Values{"letter": {"-1"}}},
		{"/requeue", url.Values{}},
		{"/requeue", url.Values{"all": {"1"}, "kind": {"bogus"}}},
		{"/replay", url.Values{"status": {"bogus"}}},
		{"/replay", url.Values{"after": {"bad"}}},
		{"/replay", url.Values{"status": {"completed"}, "from": {"\x00"}}},
		{"/replay", url.Values{"name": {"\x00"}}},
	}
	var bad []string
	for _, tc := range cases {
		tc.vals.Set("csrf", tok)
		start := time.Now()
		res := c.post(tc.path, tc.vals)
		if res.code >= 500 || res.code < 400 || time.Since(start) > hangBound {
			v := tc.vals.Encode()
			if len(v) > 100 {
				v = v[:100] + "…"
			}
			bad = append(bad, fmt.Sprintf("POST %s %s: %d in %v", tc.path, v, res.code, time.Since(start)))
		}
	}
	// 5000 ids of rows that do not exist: a result page that says so, fast.
	start := time.Now()
	res := c.post("/requeue", url.Values{"csrf": {tok}, "msg": many})
	if res.code >= 500 || time.Since(start) > hangBound {
		bad = append(bad, fmt.Sprintf("POST /requeue with 5000 ids: %d in %v", res.code, time.Since(start)))
	}
	// A body past net/http's 10 MB limit on forms (11 MB: larger only costs
	// time, which CI's race detector multiplies), and a body that is not a form.
	big := url.Values{"csrf": {tok}, "version": {version}, "reason": {strings.Repeat("r", 11<<20)}}
	start = time.Now()
	res = c.post(resume, big)
	if res.code < 400 || res.code >= 500 || time.Since(start) > hangBound {
		bad = append(bad, fmt.Sprintf("POST 11 MB reason: %d in %v", res.code, time.Since(start)))
	}
	h := c.sameOrigin()
	h["Content-Type"] = "application/json"
	res = c.do("POST", c.url(resume), nil, h)
	if res.code < 400 || res.code >= 500 {
		bad = append(bad, fmt.Sprintf("POST JSON: %d", res.code))
	}
	require.Empty(t, bad)
	require.Equal(t, before, r.snapshot(), "a malformed form changed the database")
	require.NotContains(t, logs.String(), `"level":"ERROR"`)
}

// TestOddReasonsAreStored: the reason an operator types (10 kB, a NUL,
// invalid UTF-8, control characters) is recorded or refused cleanly.
func TestOddReasonsAreStored(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	c := r.client()
	for i, reason := range []string{tenK, "a\x00b", "bad \xff utf8", "\x1b[31mred\u202e"} {
		id := r.failed(order{ID: fmt.Sprint("o", i)}, fmt.Sprint("o", i))
		res := c.confirm("/sagas/"+id.String()+"/resume", url.Values{"reason": {reason}})
		require.Contains(t, []int{303, 400}, res.code, "reason %q…: %s", reason[:min(10, len(reason))], res)
		if res.code == 303 {
			testkit.WaitFor(t, 10*time.Second, "the resume", func() bool { return len(reasons(r.get(id))) > 0 })
		}
		p := c.get("/sagas/" + id.String())
		require.Equal(t, 200, p.code)
		require.Empty(t, unsafeRunes(p.body))
	}
}

// TestRerunFormWithoutStep: a rerun form without its step ("from" missing
// or empty, as a hand-made or truncated form has it) is bad input: a 4xx
// that says so, not a 500 whose cause only the server's log has.
func TestRerunFormWithoutStep(t *testing.T) {
	t.Parallel()
	// F5 (fixed): such a form got a 500.
	var logs testkit.Buffer
	r := newRig(t, &ui.Config{Authorize: allow, Logger: slogJSON(&logs)})
	id := r.failed(order{ID: "nf"}, "nf")
	c := r.client()
	c.get("/")
	for _, vals := range []url.Values{
		{"csrf": {c.cookie()}, "version": {strconv.FormatInt(r.get(id).Version, 10)}},
		{"csrf": {c.cookie()}, "version": {strconv.FormatInt(r.get(id).Version, 10)}, "from": {""}},
	} {
		res := c.post("/sagas/"+id.String()+"/rerun", vals)
		require.GreaterOrEqual(t, res.code, 400, res.String())
		require.Less(t, res.code, 500, "POST rerun %s: %s\nlog: %s", vals.Encode(), res, logs.String())
	}
}

// hangBound is how long a request may take before it counts as hung: far
// above what any takes on an idle machine (well under a second), so that a
// loaded CI machine (a 20 MB form took 7 s beside other test runs) does not
// fail it.
const hangBound = 30 * time.Second
