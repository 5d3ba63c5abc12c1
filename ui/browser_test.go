package ui_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// chromiumPath is the Debian chromium package's browser. The test never
// lets a tool download a browser of its own.
const chromiumPath = "/usr/bin/chromium"

// TestBrowser drives the UI in headless Chromium the way an operator at
// 2 a.m. would: overview, failed sagas, one saga's timeline, a resume
// previewed and confirmed, the saga compensated. Every page it sees holds
// a business key and errors with a script in them, which must not run.
//
// With SAGAFLOW_UI_SCREENSHOTS set to a directory, it saves a screenshot of
// each page there (docs/ui.md's pictures).
func TestBrowser(t *testing.T) {
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Skipf("no browser at %s (install Debian's chromium package to run this test): %v", chromiumPath, err)
	}
	f := newFixture(t)
	// A few more sagas, so the pages have something to show.
	f.failCharge.Store(true)
	compensated := f.start(t, "order-1002", "declined")
	f.waitStatus(t, compensated, saga.StatusCompensated)
	f.failCharge.Store(false)
	srv := f.server(t, writable())

	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromiumPath),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	ctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()

	shots := os.Getenv("SAGAFLOW_UI_SCREENSHOTS")
	do := func(steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		require.NoError(t, chromedp.Do(ctx, steps...))
	}
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
		require.NoError(t, err)
		return s
	}
	// waitJS polls expr until it is true, through page loads (an
	// evaluation during a navigation fails and is tried again).
	waitJS := func(expr string) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](expr))
			if err == nil && ok {
				return
			}
			require.True(t, time.Now().Before(deadline), "%s is not true after 30s (last error: %v)", expr, err)
			time.Sleep(50 * time.Millisecond)
		}
	}
	// look checks a page once it is ready: no stored script ran, and,
	// when asked, a screenshot of the pages docs/ui.md shows is saved.
	documented := map[string]bool{"overview": true, "list": true, "saga": true, "preview": true, "dead": true}
	look := func(page string) {
		t.Helper()
		do(chromedp.WaitVisible(chromedp.CSS(`body[data-ready="1"]`)))
		ran, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`window.__xss !== undefined`))
		require.NoError(t, err)
		require.False(t, ran, "a stored script ran on the %s page", page)
		title, err := chromedp.Run(ctx, chromedp.Title())
		require.NoError(t, err)
		require.NotEqual(t, "pwned", title, "a stored script ran on the %s page", page)
		if shots != "" && documented[page] {
			png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(shots, page+".png"), png, 0o644))
		}
	}

	// The overview.
	do(chromedp.Navigate(srv.URL + "/"))
	look("overview")
	require.Contains(t, text("#counts"), "checkout")

	// Filter to failed sagas with the list's form.
	do(chromedp.Navigate(srv.URL + "/sagas"))
	look("list-all")
	do(chromedp.SetValue(chromedp.CSS(`select[name=status]`), "failed"),
		chromedp.Click(chromedp.CSS(`#apply`)),
	)
	waitJS(`location.search.includes("status=failed") && document.body.dataset.ready === "1"`)
	look("list")
	loc, err := chromedp.Run(ctx, chromedp.Location())
	require.NoError(t, err)
	require.Contains(t, loc, "status=failed", "the filter is in the URL")
	require.NotContains(t, loc, "key=", "empty filters are left out of the URL")
	rows := text("#sagas tbody")
	require.Contains(t, rows, f.failed.String())
	require.NotContains(t, rows, compensated.String())
	require.Contains(t, rows, `<script>window.__xss=1`, "the hostile key is shown as text")

	// Open it and read its timeline.
	do(chromedp.Click(chromedp.CSS(`#sagas a.saga`)), chromedp.WaitVisible(chromedp.CSS(`#timeline`)))
	look("saga")
	require.Equal(t, "failed", strings.TrimSpace(text("#status")))
	timeline := text("#timeline")
	for _, want := range []string{"saga_started", "step_failed", "card_declined", "stock_locked", "saga_failed",
		f.failed.String() + "/charge/forward/0"} {
		require.Contains(t, timeline, want)
	}

	// Preview the resume: the compensation that gave up runs again under
	// its key.
	do(chromedp.Click(chromedp.CSS(`#action-resume`)), chromedp.WaitVisible(chromedp.CSS(`#plan`)))
	look("preview")
	plan := text("#plan")
	require.Contains(t, plan, f.failed.String()+"/reserve/compensate/0")
	require.Contains(t, plan, "key reused")

	// Confirm, and watch the saga end compensated.
	do(chromedp.SetValue(chromedp.CSS(`input[name=reason]`), "stock service fixed"),
		chromedp.Click(chromedp.CSS(`#confirm`)),
		chromedp.WaitVisible(chromedp.CSS(`#done`)))
	deadline := time.Now().Add(30 * time.Second)
	for {
		do(chromedp.Navigate(srv.URL+"/sagas/"+f.failed.String()), chromedp.WaitVisible(chromedp.CSS(`#status`)))
		status := strings.TrimSpace(text("#status"))
		if status == string(saga.StatusCompensated) {
			break
		}
		require.True(t, time.Now().Before(deadline), "the saga is %s, not compensated, 30s after the resume", status)
		time.Sleep(100 * time.Millisecond)
	}
	look("saga-after")
	timeline = text("#timeline")
	require.Contains(t, timeline, "saga_resumed")
	require.Contains(t, timeline, "resume by alice in the web UI: stock service fixed")
	require.Contains(t, timeline, "saga_compensated")

	// The dead page, with hostile reasons and bytes.
	do(chromedp.Navigate(srv.URL + "/dead"))
	look("dead")
	require.Contains(t, text("#dead-messages"), "<script>window.__xss=1")
}
