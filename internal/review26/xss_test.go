package review26_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// The pieces of every hostile string: each sets window.__xss (and opens a
// dialog) if it ever runs.
const (
	hScript = `<script>window.__xss=1;alert("xss1")</script>`
	hAttr   = `"><img src=x onerror="window.__xss=2;alert(2)">`
	hSingle = `'><svg/onload=window.__xss=3;alert(3)>`
	hJS     = `javascript:window.__xss=4;alert(4)//`
	hStyle  = `<style>*{display:none}</style>`
	hCtl    = "\x1b[31m\x07\x08\x7f\u0085\u009b"
	hBidi   = "\u202egnp.exe\u202c\u2066\u2067\u2069"
)

// hostile is a storable hostile string (valid UTF-8, no NUL).
func hostile(tag string) string {
	return tag + " " + hScript + hAttr + hSingle + " " + hJS + " " + hStyle + hCtl + hBidi
}

// hostileBytes adds what only bytes can hold: a NUL and invalid UTF-8.
func hostileBytes(tag string) []byte {
	return append([]byte(hostile(tag)), 0, 0xff, 0xfe, 'x', 0xc3)
}

// xssWorld is a rig whose every stored string is hostile, and the pages
// that show them.
type xssWorld struct {
	r     *rig
	pages []string
}

func newXSSWorld(t *testing.T) *xssWorld {
	t.Helper()
	ctx := context.Background()
	actor := hostile("actor")
	r := newRig(t, &ui.Config{Authorize: allow, Actor: func(*http.Request) string { return actor },
		Redact:        func(_ string, state []byte) []byte { return state },
		RedactPayload: func(_ string, p []byte) []byte { return p }})
	x := &xssWorld{r: r}
	add := func(p ...string) { x.pages = append(x.pages, p...) }
	add("/", "/sagas", "/dead", "/sagas?status=failed",
		"/sagas?key="+url.QueryEscape(hostile("q")), "/sagas?name="+url.QueryEscape(hostile("q"))+"&code="+url.QueryEscape(hScript)+"&step="+url.QueryEscape(hAttr),
		"/sagas/"+url.PathEscape(hScript), "/sagas?after="+url.QueryEscape(hAttr),
		"/replay?status=failed&name="+url.QueryEscape(hostile("q")))

	// A failing saga: hostile business key, error, code and state.
	failed := r.failed(order{ID: "x1", Secret: hostile("state"), Msg: hostile("error"), RawTail: true, Code: hostile("code")}, hostile("key"))
	add("/sagas/"+failed.String(), "/sagas/"+failed.String()+"/resume", "/sagas/"+failed.String()+"/rerun",
		"/sagas/"+failed.String()+"/rerun?from=charge", "/sagas/"+failed.String()+"/rerun?from="+url.QueryEscape(hostile("from")))

	// A waiting saga that got a signal with a hostile id (an id from a
	// webhook), and one paused with a hostile reason.
	w := r.waiting("wx-" + hostile("k2"))
	_, err := r.eng.Signal(ctx, saga.Signal{SagaID: w, Name: "go", ID: hostile("signal-id"), Payload: map[string]string{"p": hostile("sig")}})
	require.NoError(t, err)
	testkit.WaitEnded(t, r.eng, w)
	p := r.waiting("px-" + hostile("k3"))
	require.NoError(t, r.eng.Pause(ctx, p, hostile("pause-reason")+"\x00"))
	add("/sagas/"+w.String(), "/sagas/"+p.String(), "/sagas/"+p.String()+"/unpause", "/sagas/"+p.String()+"/cancel")

	// A saga whose type, step and history were written straight into the
	// tables (the names a definition would refuse), with 10 kB strings.
	sqlID := uuid.New()
	long := strings.Repeat(hostile("long")+" ", 10240/len(hostile("long"))+1)
	random := testkit.RandomLetters(10240)
	_, err = r.db.Pool.Exec(ctx, `INSERT INTO `+r.db.Table("saga_instances")+`
		(id, saga_name, business_key, status, step_index, step_name, direction, state, version, last_error, last_error_code, failed_step, ended_at)
		VALUES ($1, $2, $3, 'failed', 1, $4, 'compensate', $5, 7, $6, $7, $8, now())`,
		sqlID, hostile("type"), long, hostile("step"), jsonOf(map[string]string{"secret": hostile("sqlstate")}), long+random, hostile("code2"), hostile("failed-step"))
	require.NoError(t, err)
	for i, ev := range []string{"saga_started", "step_completed", hostile("event"), "step_failed", "saga_failed"} {
		_, err = r.db.Pool.Exec(ctx, `INSERT INTO `+r.db.Table("saga_history")+`
			(saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail)
			VALUES ($1, $2, $3, 'forward', 0, $4, $5, $6, $7)`,
			sqlID, ev, hostile("hstep"), i, hostile("herr")+random, hostile("hcode"),
			jsonOf(map[string]string{"reason": hostile("hreason"), "child_id": hostile("child"), "signal_id": hostile("sid"), "for": hostile("for")}))
		require.NoError(t, err)
	}
	add("/sagas/"+sqlID.String(), "/sagas/"+sqlID.String()+"/resume", "/sagas/"+sqlID.String()+"/rerun",
		"/sagas?name="+url.QueryEscape(hostile("type")), "/sagas?status=failed&name="+url.QueryEscape(hostile("type")))

	// A saga whose definition has a hostile name, if a definition may have
	// one.
	hdef := r.k.failing(hostile("def"))
	e2, err := saga.New(r.db.Pool, r.db.Config())
	require.NoError(t, err)
	if err := e2.Register(hdef); err == nil {
		testkit.Start(t, e2)
		st, err := saga.Start(ctx, e2, hdef, order{ID: "h"}, nil)
		require.NoError(t, err)
		testkit.WaitEnded(t, e2, st.ID)
		add("/sagas/" + st.ID.String())
	} else {
		t.Logf("a definition may not have a hostile name: %v", err)
	}

	// Dead rows and letters, hostile in every column.
	dm := uuid.New()
	_, err = r.db.Pool.Exec(ctx, `INSERT INTO `+r.db.Table("outbox")+`
		(id, topic, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, status, attempts, last_error)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'dead', 5, $10)`,
		dm, hostile("topic"), hostile("aggtype"), hostile("aggid"), hostile("type"), hostileBytes("payload"),
		map[string]string{hostile("hname"): hostile("hval")}, failed, hostile("stepkey"), hostile("reason")+random)
	require.NoError(t, err)
	dl := r.deadLetter(hostile("consumer"), hostile("ltopic"), hostile("msgid"), hostile("lreason")+long,
		hostileBytes("lkey"), hostileBytes("lvalue"), map[string]string{hostile("lh"): hostile("lhv")})
	add("/requeue?msg="+dm.String(), "/requeue?letter="+strconv.FormatInt(dl, 10))

	// An operator's hostile reason, recorded by the hostile actor.
	c := r.client()
	res := c.confirm("/sagas/"+failed.String()+"/resume", url.Values{"reason": {hostile("typed") + "\x00"}})
	require.Less(t, res.code, 400, res.String())
	testkit.WaitEnded(t, r.eng, failed)
	return x
}

func jsonOf(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

var (
	rawHostile = []*regexp.Regexp{
		regexp.MustCompile(`(?i)<script>window`),
		regexp.MustCompile(`(?i)<img src=x`),
		regexp.MustCompile(`(?i)<svg/onload`),
		regexp.MustCompile(`(?i)onerror="window`),
		regexp.MustCompile(`(?i)<style>\*`),
		regexp.MustCompile(`(?i)(href|src|action)\s*=\s*"?\s*javascript:`),
	}
)

// unsafeRunes reports the characters the docs say are shown as escapes:
// control characters, bidirectional overrides and isolates, invalid UTF-8.
func unsafeRunes(body string) []string {
	var bad []string
	if !utf8.ValidString(body) {
		bad = append(bad, "invalid UTF-8")
	}
	for i, r := range body {
		switch {
		case r == '\n' || r == '\r' || r == '\t':
		case r < 0x20, r == 0x7f, r >= 0x80 && r <= 0x9f, r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069:
			lo := max(0, i-40)
			bad = append(bad, fmt.Sprintf("%U at %d: %q", r, i, body[lo:i]))
		}
		if len(bad) > 5 {
			break
		}
	}
	return bad
}

// TestStoredStringsAreEscaped: "Every stored string is escaped, control
// characters are shown as escapes", in the HTML every page serves.
func TestStoredStringsAreEscaped(t *testing.T) {
	t.Parallel()
	x := newXSSWorld(t)
	c := x.r.client()
	shown := 0
	for _, p := range x.pages {
		res := c.get(p)
		require.Less(t, res.code, 500, "%s: %s", p, res)
		require.Contains(t, res.body, "</html>", "%s does not render", p)
		for _, re := range rawHostile {
			require.NotRegexp(t, re, res.body, "%s serves hostile markup", p)
		}
		require.Empty(t, unsafeRunes(res.body), "%s serves unescaped control, bidi or invalid bytes", p)
		if strings.Contains(res.body, "&lt;script&gt;window.__xss=1") {
			shown++
		}
	}
	// Not vacuous: the hostile strings are on the pages, as text.
	require.Greater(t, shown, len(x.pages)/2, "the hostile strings are not shown")
	t.Logf("%d pages checked, %d of them show the hostile text", len(x.pages), shown)
}

// TestContentSecurityPolicy: the pages carry "a Content-Security-Policy that
// runs no inline script", and the documented companion headers.
func TestContentSecurityPolicy(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "csp"}, "csp")
	c := r.client()
	for _, p := range []string{"/", "/sagas", "/sagas/" + id.String(), "/sagas/" + id.String() + "/resume", "/dead", "/nope", "/sagas/bad"} {
		res := c.get(p)
		csp := res.hdr.Get("Content-Security-Policy")
		require.NotEmpty(t, csp, p)
		directives := map[string]string{}
		for _, d := range strings.Split(csp, ";") {
			f := strings.Fields(d)
			if len(f) > 0 {
				directives[f[0]] = strings.Join(f[1:], " ")
			}
		}
		require.Equal(t, "'none'", directives["default-src"], p)
		require.Equal(t, "'self'", directives["script-src"], p)
		require.Equal(t, "'self'", directives["style-src"], p)
		require.Equal(t, "'none'", directives["frame-ancestors"], p)
		require.NotContains(t, csp, "unsafe-inline", p)
		require.NotContains(t, csp, "unsafe-eval", p)
		require.Equal(t, "nosniff", res.hdr.Get("X-Content-Type-Options"), p)
		require.Equal(t, "same-origin", res.hdr.Get("Referrer-Policy"), p)
		require.Equal(t, "DENY", res.hdr.Get("X-Frame-Options"), p)
		require.NotRegexp(t, `(?i)<script>|<script\s+[^>]*>[^<]+</script>|\son[a-z]+=`, res.body, "%s has inline script", p)
	}
}
