package review26_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// TestMountedUnderAPrefix: "Mount the handler at Prefix+"/" either as it is
// or inside http.StripPrefix(Prefix, …): both work", and "links and forms
// start with it": every link, form and asset of every page stays under the
// prefix and answers, and an action confirmed there lands there.
func TestMountedUnderAPrefix(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, prefix string
		strip        bool
	}{
		{"as it is", "/ops/sagas", false},
		{"StripPrefix", "/ops/sagas", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			prefix := tc.prefix
			mount := func(h http.Handler) http.Handler {
				mux := http.NewServeMux()
				if tc.strip {
					h = http.StripPrefix(prefix, h)
				}
				mux.Handle(prefix+"/", h)
				mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
					http.Error(w, "outside the prefix: "+r.URL.Path, http.StatusTeapot)
				})
				return mux
			}
			r := newRigOn(t, testkit.NewDB(t), &ui.Config{Authorize: allow, Prefix: prefix}, mount)
			failed := r.failed(order{ID: "p1"}, "p1")
			w := r.waiting("p2")
			r.deadRow("orders.events", "T", "k", "dead", []byte("x"))
			r.deadLetter("billing", "orders.events", "m", "bad", []byte("k"), []byte("v"), nil)
			c := r.client()
			pages := crawl(t, c, "/sagas/"+failed.String()+"/resume", "/sagas/"+failed.String()+"/rerun?from=charge",
				"/sagas/"+w.String()+"/cancel", "/sagas/"+w.String()+"/pause", "/replay?status=failed", "/sagas?status=failed")
			require.Greater(t, len(pages), 10)
			t.Logf("%d pages crawled under %s", len(pages), prefix)
			for p, res := range pages {
				// Form actions fetched as GET, and reruns from a step the
				// saga cannot rerun from, answer 4xx; none may be a 404,
				// nor reach the server outside the prefix (418).
				require.Less(t, res.code, 500, "%s%s: %s", prefix, p, res)
				require.NotContains(t, []int{404, 418}, res.code, "%s%s: %s", prefix, p, res)
				for _, h := range hrefs(res.body) {
					if strings.HasPrefix(h, "#") || strings.HasPrefix(h, "?") {
						continue
					}
					u, err := url.Parse(h)
					require.NoError(t, err, h)
					require.True(t, u.Host == "" && strings.HasPrefix(u.Path, prefix+"/"),
						"%s%s links outside the prefix: %q", prefix, p, h)
				}
			}
			for _, asset := range []string{"/static/style.css", "/static/app.js"} {
				res := c.get(asset)
				require.Equal(t, 200, res.code, asset)
			}
			res := c.confirm("/sagas/"+failed.String()+"/resume", url.Values{"reason": {"under a prefix"}})
			require.Equal(t, http.StatusSeeOther, res.code, res.String())
			loc := res.hdr.Get("Location")
			lu, err := url.Parse(loc)
			require.NoError(t, err)
			require.True(t, strings.HasPrefix(lu.Path, prefix+"/"), "redirect to %q", loc)
			require.Equal(t, 1, count(r.get(failed), saga.EventSagaResumed))
			after := c.do("GET", r.srv.URL+loc, nil, nil)
			require.Equal(t, 200, after.code, after.String())
			require.NotEqual(t, 418, c.confirm("/sagas/"+w.String()+"/cancel", nil).code)
		})
	}
}

// TestNonASCIIPrefix: New accepted the prefix "/ops/sägas", under which the
// CSRF cookie's Path lost the letter (no write worked) and, with
// StripPrefix, no link answered (F6). New now refuses a prefix that a
// cookie path and a link would spell differently, with an error naming it.
func TestNonASCIIPrefix(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	eng, err := saga.New(d.Pool, &saga.Config{Schema: d.Schema, Logger: testkit.Discard})
	require.NoError(t, err)
	for _, prefix := range []string{"/ops/sägas", "/ops/s%C3%A4gas", "/ops/a b"} {
		_, err := ui.New(d.Pool, eng, &ui.Config{Schema: d.Schema, Prefix: prefix})
		require.ErrorContains(t, err, "Prefix", prefix)
	}
}
