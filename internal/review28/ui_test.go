package review28_test

import (
	"context"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

var (
	formRE  = regexp.MustCompile(`(?s)<form\b([^>]*)>(.*?)</form>`)
	attrRE  = regexp.MustCompile(`(\w[\w-]*)="([^"]*)"`)
	inputRE = regexp.MustCompile(`<input\b[^>]*>`)
)

// confirmForm returns the action and values of the page's confirm-form.
func confirmForm(body string) (string, url.Values, bool) {
	for _, m := range formRE.FindAllStringSubmatch(body, -1) {
		var id, action string
		for _, a := range attrRE.FindAllStringSubmatch(m[1], -1) {
			switch a[1] {
			case "id":
				id = a[2]
			case "action":
				action = html.UnescapeString(a[2])
			}
		}
		if id != "confirm-form" {
			continue
		}
		vals := url.Values{}
		for _, in := range inputRE.FindAllString(m[2], -1) {
			at := map[string]string{}
			for _, a := range attrRE.FindAllStringSubmatch(in, -1) {
				at[a[1]] = html.UnescapeString(a[2])
			}
			if at["name"] != "" {
				vals.Add(at["name"], at["value"])
			}
		}
		return action, vals, true
	}
	return "", nil, false
}

// The UI's unpause and resume on a pool of one connection: each answers
// (no hang), acts once, and two confirmations of one unpause posted at once
// act once.
func TestUIActionsOnAOneConnectionPool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	w := prepare(t, d, waitDef("r28uiw"), 1, isWaiting)[0]
	f := prepare(t, d, failDef("r28uif"), 1, isFailed)[0]
	e0 := client(t, d)
	if err := e0.Pause(ctx, w, "p"); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e := testkit.NewEngine(t, pool, d.Config())
	h, err := ui.New(pool, e, &ui.Config{Schema: d.Schema, Logger: testkit.Discard,
		Authorize: func(*http.Request, string) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar, Timeout: 30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	do := func(method, u string, form url.Values) (int, string) {
		var body io.Reader
		if form != nil {
			body = strings.NewReader(form.Encode())
		}
		req, _ := http.NewRequest(method, u, body)
		if form != nil {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Origin", srv.URL)
			req.Header.Set("Sec-Fetch-Site", "same-origin")
		}
		res, err := hc.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	preview := func(path string) (string, url.Values) {
		code, body := do("GET", srv.URL+path, nil)
		action, vals, ok := confirmForm(body)
		if code != 200 || !ok {
			t.Fatalf("preview %s: %d, confirm form %v\n%.2000s", path, code, ok, body)
		}
		return action, vals
	}

	// two confirmations of one unpause at once
	action, vals := preview("/sagas/" + w.String() + "/unpause")
	var mu sync.Mutex
	var codes []int
	_ = together(2, func(int) error {
		c, body := do("POST", srv.URL+action, vals)
		mu.Lock()
		codes = append(codes, c)
		mu.Unlock()
		if c == 0 {
			return fmt.Errorf("%s", body)
		}
		return nil
	})
	for _, c := range codes {
		if c == 0 || c >= 500 {
			t.Fatalf("an unpause confirmation on a one-connection pool failed or hung: %v", codes)
		}
	}
	in := get(t, e0, w)
	if in.Paused != nil || events(in, saga.EventSagaUnpaused) != 1 {
		t.Fatalf("after two unpause confirmations: paused %+v, %d saga_unpaused (codes %v)", in.Paused, events(in, saga.EventSagaUnpaused), codes)
	}

	action, vals = preview("/sagas/" + f.String() + "/resume")
	if c, body := do("POST", srv.URL+action, vals); c == 0 || c >= 400 {
		t.Fatalf("resume on a one-connection pool: %d %.500s", c, body)
	}
	if in := get(t, e0, f); events(in, saga.EventSagaResumed) != 1 {
		t.Fatalf("resume did not act once: %d saga_resumed", events(in, saga.EventSagaResumed))
	}
	// the pool's only connection came back
	if st := pool.Stat(); st.AcquiredConns() != 0 {
		t.Fatalf("%d connections still held after the actions", st.AcquiredConns())
	}
}
