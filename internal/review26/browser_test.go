package review26_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

const chromium = "/usr/bin/chromium"

// tab is a headless Chromium tab that records every JavaScript dialog the
// pages open (and dismisses it).
type tab struct {
	ctx     context.Context
	mu      sync.Mutex
	dialogs []string
}

// newBrowser starts Chromium for one test, or skips it when the browser is
// absent; each newTab of its context is a tab of that one browser.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	if _, err := os.Stat(chromium); err != nil {
		t.Skipf("no browser: %s is absent (%v)", chromium, err)
	}
	actx, cancelA := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.UserDataDir(t.TempDir()),
	)
	bctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelA() })
	require.NoError(t, chromedp.Do(bctx, chromedp.Navigate("about:blank")))
	return bctx
}

func newTab(t *testing.T, browser context.Context) *tab {
	t.Helper()
	ctx, cancel := chromedp.NewContext(browser)
	ctx, cancelT := context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(func() { cancelT(); cancel() })
	tb := &tab{ctx: ctx}
	// Subscribe before the first navigation: a dialog blocks the page until
	// someone answers it.
	dialogs := chromedp.Events(ctx, page.JavascriptDialogOpening)
	go func() {
		for ev, err := range dialogs {
			if err != nil {
				return
			}
			tb.mu.Lock()
			tb.dialogs = append(tb.dialogs, ev.Message)
			tb.mu.Unlock()
			go func() {
				_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: false})
			}()
		}
	}()
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate("about:blank")))
	return tb
}

// TestBrowser runs the browser tests in tabs of one Chromium: on a small
// machine several browsers at once take minutes.
func TestBrowser(t *testing.T) {
	t.Parallel()
	b := newBrowser(t)
	for name, f := range map[string]func(*testing.T, *tab){
		"NoStoredScriptRuns":     browserNoStoredScriptRuns,
		"OperatorResumes":        browserOperatorResumes,
		"CrossSiteFormIsRefused": browserCrossSiteFormIsRefused,
		"RefusesFraming":         browserRefusesFraming,
		"WorksWithoutJavaScript": browserWorksWithoutJavaScript,
	} {
		// One tab at a time: headless Chromium throttles the tabs it does
		// not show.
		t.Run(name, func(t *testing.T) { f(t, newTab(t, b)) })
	}
}

func (tb *tab) go_(t *testing.T, u string) {
	t.Helper()
	require.NoError(t, chromedp.Do(tb.ctx, chromedp.Navigate(u)), u)
	require.NoError(t, chromedp.Do(tb.ctx, chromedp.WaitReady("body")), u)
}

func eval[T any](t *testing.T, tb *tab, js string) T {
	t.Helper()
	v, err := chromedp.Run(tb.ctx, chromedp.Evaluate[T](js))
	require.NoError(t, err, js)
	return v
}

func (tb *tab) seen() []string {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return append([]string(nil), tb.dialogs...)
}

// browserNoStoredScriptRuns: in Chromium, none of the hostile strings
// stored in every field runs on any page (no dialog, the global the
// payloads set stays unset), every page still renders, the payloads' hidden
// details can be opened safely, and the CSP refuses an inline script.
func browserNoStoredScriptRuns(t *testing.T, tb *tab) {
	x := newXSSWorld(t)
	base := x.r.srv.URL
	for _, p := range x.pages {
		tb.go_(t, base+p)
		// Open every <details> (the payload previews), then look.
		eval[int](t, tb, `document.querySelectorAll('details').forEach(d => d.open = true), 0`)
		require.True(t, eval[bool](t, tb, `typeof window.__xss === 'undefined'`), "a stored script ran on %s", p)
		require.True(t, eval[bool](t, tb, `document.querySelector('main') !== null && document.title.length > 0`), "%s did not render", p)
		require.True(t, eval[bool](t, tb, `(function(){var s=document.createElement('script');s.textContent='window.__inline=1';document.head.appendChild(s);return typeof window.__inline==='undefined'})()`),
			"the CSP let an inline script run on %s", p)
		require.True(t, eval[bool](t, tb, `(function(){var i=document.createElement('img');i.setAttribute('onerror','window.__inline2=1');i.src='x:';document.body.appendChild(i);return true})()`))
	}
	time.Sleep(300 * time.Millisecond) // let any late handler fire
	require.True(t, eval[bool](t, tb, `typeof window.__xss === 'undefined' && typeof window.__inline2 === 'undefined'`))
	require.Empty(t, tb.seen(), "dialogs opened")
	// The control: without the UI's CSP the same inline script runs, so the
	// check above is not vacuous.
	tb.go_(t, "data:text/html,<p>no policy</p>")
	require.False(t, eval[bool](t, tb, `(function(){var s=document.createElement('script');s.textContent='window.__inline=1';document.head.appendChild(s);return typeof window.__inline==='undefined'})()`),
		"an inline script does not run even without a CSP: the check proves nothing")
	// The hostile text is there, as text.
	r := x.r
	list := func(q string) string {
		tb.go_(t, base+"/sagas?"+q)
		return eval[string](t, tb, `document.querySelector('#sagas').innerText`)
	}
	require.Contains(t, list("status=failed"), `<script>window.__xss=1;alert("xss1")</script>`)
	tb.go_(t, base+"/dead")
	rows := eval[int](t, tb, `document.querySelectorAll('#dead-messages tbody tr, #dead-letters tbody tr').length`)
	require.Equal(t, 2, rows)
	_ = r
}

// browserOperatorResumes: an operator previews and confirms a resume in
// the browser; the CSRF and origin checks let the UI's own form through.
func browserOperatorResumes(t *testing.T, tb *tab) {
	r := newRig(t, &ui.Config{Authorize: allow, Actor: func(*http.Request) string { return "dora" }})
	id := r.failed(order{ID: "br"}, "br")
	r.k.fixed.Store(true)
	tb.go_(t, r.srv.URL+"/sagas/"+id.String())
	require.NoError(t, chromedp.Do(tb.ctx, chromedp.Click("#action-resume"), chromedp.WaitVisible("#confirm")))
	require.NoError(t, chromedp.Do(tb.ctx, chromedp.SendKeys(`input[name="reason"]`, "from the browser"), chromedp.Click("#confirm"), chromedp.WaitReady("#status")))
	in := testkit.WaitEnded(t, r.eng, id)
	testkit.WaitFor(t, 10*time.Second, "the resumed saga to end", func() bool {
		in = r.get(id)
		return in.Status == saga.StatusCompensated
	})
	require.Equal(t, 1, count(in, saga.EventSagaResumed))
	require.Contains(t, strings.Join(reasons(in), "\n"), "resume by dora in the web UI: from the browser")
	require.Empty(t, tb.seen())
}

// browserCrossSiteFormIsRefused: a page on another origin (cross-site,
// and same-site on another port) that posts the UI's confirmation form, with
// every field but the token right, in the operator's browser, acts on
// nothing.
func browserCrossSiteFormIsRefused(t *testing.T, tb *tab) {
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "cs"}, "cs")
	version := strconv.FormatInt(r.get(id).Version, 10)
	target := r.srv.URL + "/sagas/" + id.String() + "/resume"
	// The operator has the UI open: the browser holds its cookie.
	tb.go_(t, r.srv.URL+"/sagas/"+id.String()+"/resume")
	var mu sync.Mutex
	hits := 0
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		hits++
		mu.Unlock()
		w.Header().Set("Content-Type", "text/html")
		method := req.URL.Query().Get("m")
		fmt.Fprintf(w, `<!doctype html><form id=f method=%s action=%q>
<input name=version value=%q><input name=reason value="evil"><input name=csrf value="%s">
</form><script>document.getElementById('f').submit()</script>`, method, target, version, randomHex())
	}))
	t.Cleanup(evil.Close)
	eu, _ := url.Parse(evil.URL)
	for _, origin := range []string{
		evil.URL,                        // 127.0.0.1 on another port: same site, another origin
		"http://localhost:" + eu.Port(), // another site
	} {
		for _, m := range []string{"post", "get"} {
			tb.go_(t, origin+"/?m="+m)
			time.Sleep(300 * time.Millisecond)
		}
	}
	mu.Lock()
	require.Equal(t, 4, hits, "the attacker's pages were opened")
	mu.Unlock()
	in := r.get(id)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Zero(t, count(in, saga.EventSagaResumed), "a cross-origin form acted: %v", testkit.Timeline(in))
}

// browserRefusesFraming: "frame-ancestors 'none'" and X-Frame-Options
// DENY: another origin cannot frame the UI (clickjacking an action).
func browserRefusesFraming(t *testing.T, tb *tab) {
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "fr"}, "fr")
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(w, `<!doctype html><iframe id=f src=%q width=800 height=600></iframe>`, r.srv.URL+"/sagas/"+id.String()+"/resume")
	}))
	t.Cleanup(evil.Close)
	tb.go_(t, evil.URL)
	time.Sleep(500 * time.Millisecond)
	// A framed page that loaded would have a document the parent cannot read
	// (cross-origin) but a blocked one is replaced: ask the browser's frame
	// tree whether the UI's document loaded in it.
	frames, err := chromedp.Call(tb.ctx, page.GetFrameTree, cdp.Empty{})
	require.NoError(t, err)
	require.Len(t, frames.FrameTree.ChildFrames, 1)
	child := frames.FrameTree.ChildFrames[0].Frame
	t.Logf("the framed UI: url %q, unreachable %q", child.URL, child.UnreachableURL)
	require.False(t, strings.HasPrefix(child.URL, r.srv.URL), "the UI loaded inside another origin's frame: %q", child.URL)
}

// browserWorksWithoutJavaScript: "the pages work without JavaScript": with
// scripts off, an operator filters the list, opens a saga, previews and
// confirms a cancel.
func browserWorksWithoutJavaScript(t *testing.T, tb *tab) {
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.waiting("nojs")
	_, err := chromedp.Call(tb.ctx, emulation.SetScriptExecutionDisabled, emulation.SetScriptExecutionDisabledParams{Value: true})
	require.NoError(t, err)
	tb.go_(t, "data:text/html,<title>off</title><script>document.title='ran'</script>")
	require.Equal(t, "off", eval[string](t, tb, `document.title`), "scripts are not off")
	tb.go_(t, r.srv.URL+"/sagas")
	require.NoError(t, chromedp.Do(tb.ctx,
		chromedp.SendKeys(`#filter input[name="key"]`, "nojs"),
		chromedp.Click("#apply"),
		chromedp.WaitVisible(`a.saga`),
		chromedp.Click(`a.saga`),
		chromedp.WaitVisible("#action-cancel"),
		chromedp.Click("#action-cancel"),
		chromedp.WaitVisible("#confirm"),
		chromedp.Click("#confirm"),
		chromedp.WaitReady("#status"),
	))
	in := testkit.WaitEnded(t, r.eng, id)
	require.Equal(t, saga.StatusCompensated, in.Status, testkit.Timeline(in))
}
