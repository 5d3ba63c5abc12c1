package ui_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// TestUI runs the handler tests on one fixture (starting sagas takes the
// longest); each subtest that writes makes its own sagas.
func TestUI(t *testing.T) {
	f := newFixture(t)
	ro := f.server(t, nil)
	rw := f.server(t, writable())

	t.Run("pages", func(t *testing.T) {
		c := client(t)
		for _, tc := range []struct{ path, want string }{
			{"/", "Sagas by type and status"},
			{"/sagas", f.failed.String()},
			{"/sagas?status=failed", f.failed.String()},
			{"/sagas?name=checkout&status=failed&code=stock_locked", f.failed.String()},
			{"/sagas/" + f.failed.String(), "saga_failed"},
			{"/dead", "Dead outbox rows"},
		} {
			code, body, hdr := get(t, c, ro.URL+tc.path)
			require.Equal(t, http.StatusOK, code, tc.path)
			require.Contains(t, body, tc.want, tc.path)
			require.Contains(t, hdr.Get("Content-Security-Policy"), "script-src 'self'", tc.path)
			require.NotContains(t, hdr.Get("Content-Security-Policy"), "unsafe-inline", tc.path)
			require.Equal(t, "nosniff", hdr.Get("X-Content-Type-Options"))
		}
		// The overview counts the sagas and names the failure.
		_, body, _ := get(t, c, ro.URL+"/")
		require.Contains(t, body, "stock_locked")
		// A filter that matches nothing, and the filter kept in the next link.
		_, body, _ = get(t, c, ro.URL+"/sagas?status=completed")
		require.NotContains(t, body, f.failed.String())
		require.Contains(t, body, f.completed.String())
		_, body, _ = get(t, c, ro.URL+"/sagas?status=failed&limit=1")
		require.NotContains(t, body, `id="next"`, "one failed saga: no next page")
		_, body, _ = get(t, c, ro.URL+"/sagas?limit=1")
		require.Contains(t, body, `id="next" href="?cursor=`)
		require.Contains(t, body, "limit=1")
		// The saga page draws the definition and the timeline with step keys.
		_, body, _ = get(t, c, ro.URL+"/sagas/"+f.failed.String())
		require.Contains(t, body, `class="box comp stopped"`, "the compensation that gave up is marked")
		require.Contains(t, body, `<span class="box done" title="action">reserve</span>`)
		require.Contains(t, body, f.failed.String()+"/charge/forward/0")
		require.Contains(t, body, "card_declined")
		require.Contains(t, body, `id="state-hidden"`, "no redaction hook: state hidden")
		// Bad input is a clear 4xx, not a 500.
		for _, p := range []string{"/sagas/not-a-uuid", "/sagas?status=bogus", "/sagas?after=yesterday", "/sagas?limit=0",
			"/sagas?cursor=garbage", "/dead?mcursor=garbage", "/dead?lcursor=garbage", "/sagas?key=a%00b"} {
			code, _, _ := get(t, c, ro.URL+p)
			require.Equal(t, http.StatusBadRequest, code, p)
		}
		code, _, _ := get(t, c, ro.URL+"/sagas/00000000-0000-0000-0000-000000000000")
		require.Equal(t, http.StatusNotFound, code)
		code, body, hdr := get(t, c, ro.URL+"/static/app.js")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, "DOMContentLoaded")
		require.Contains(t, hdr.Get("Content-Type"), "javascript")
	})

	t.Run("escaping", func(t *testing.T) {
		c := client(t)
		var key string
		require.NoError(t, f.pool.QueryRow(context.Background(), "SELECT business_key FROM "+f.q()+".saga_instances WHERE id = $1",
			f.failed).Scan(&key))
		require.Equal(t, hostile, key, "the hostile business key is stored as it is")
		for _, p := range []string{"/", "/sagas", "/sagas?status=failed", "/sagas/" + f.failed.String(), "/dead",
			"/sagas/" + hostileID.String(), "/sagas/" + hostileID.String() + "/rerun", "/sagas?status=compensated",
			"/replay?status=compensated&from=x",
			"/sagas/" + f.failed.String() + "/resume", "/sagas/" + f.failed.String() + "/rerun",
			"/sagas/" + f.failed.String() + "/rerun?from=charge", "/sagas?key=" + url.QueryEscape(hostile),
			"/replay?status=failed", "/sagas/" + url.PathEscape(hostile)} {
			_, body, _ := get(t, c, rw.URL+p)
			for _, raw := range []string{"<script>window", "<img src=x", `"pwned"`, "\x01", "\x1b", "\u202e", "<script>alert", "<b>\x00"} {
				require.NotContains(t, body, raw, "%s shows %q unescaped", p, raw)
			}
		}
		code, body, _ := get(t, c, rw.URL+"/sagas/"+hostileID.String())
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, `<dd id="step">&lt;script&gt;window.__xss=1`, "the hostile step name is shown as text")
		_, body, _ = get(t, c, rw.URL+"/")
		require.Contains(t, body, `href="/sagas?name=%3Cscript%3Ewindow`, "the hostile saga name is a link's query, escaped")
		_, body, _ = get(t, c, rw.URL+"/sagas/"+f.failed.String())
		require.Contains(t, body, "&lt;script&gt;window.__xss=1;document.title=&#34;pwned&#34;&lt;/script&gt;")
		require.Contains(t, body, `\x01\x1b[31m\u202e`, "control characters are shown as escapes")
		require.Contains(t, body, `id="state"`, "the redaction hook lets the state show")
		_, body, _ = get(t, c, rw.URL+"/dead")
		require.Contains(t, body, `&lt;script&gt;alert(1)&lt;/script&gt;\x00\xff`, "payload escaped")
		require.Contains(t, body, "3c 73 63 72", "payload in hex")
		_, body, _ = get(t, c, ro.URL+"/dead")
		require.NotContains(t, body, "3c 73 63 72", "no payload hook: payloads hidden")
	})

	t.Run("read-only", func(t *testing.T) {
		c := client(t)
		before := f.snapshot(t)
		_, body, _ := get(t, c, ro.URL+"/sagas/"+f.failed.String())
		require.NotContains(t, body, `id="action-resume"`)
		require.Contains(t, body, "read-only")
		for _, p := range []string{"/sagas/" + f.failed.String() + "/resume", "/replay?status=failed", "/requeue?letter=1"} {
			code, body, _ := get(t, c, ro.URL+p)
			require.Equal(t, http.StatusForbidden, code, p)
			require.Contains(t, body, "read-only")
		}
		// Even with a valid token, a POST is refused.
		_, page, _ := get(t, c, ro.URL+"/sagas")
		_ = page
		tok := cookieToken(t, c, ro.URL)
		code, _, _ := post(t, c, ro.URL+"/sagas/"+f.failed.String()+"/resume", url.Values{"csrf": {tok}, "version": {"1"}}, nil)
		require.Equal(t, http.StatusForbidden, code)
		require.Equal(t, before, f.snapshot(t))
	})

	t.Run("authorize per action", func(t *testing.T) {
		cfg := writable()
		cfg.Authorize = func(_ *http.Request, action string) error {
			if action == ui.ActionResume {
				return nil
			}
			return errDenied
		}
		srv := f.server(t, cfg)
		c := client(t)
		_, body, _ := get(t, c, srv.URL+"/sagas/"+f.failed.String())
		require.Contains(t, body, `id="action-resume"`)
		require.NotContains(t, body, `id="action-rerun"`)
		code, _, _ := get(t, c, srv.URL+"/sagas/"+f.failed.String()+"/rerun?from=charge")
		require.Equal(t, http.StatusForbidden, code)
	})

	t.Run("GET never writes", func(t *testing.T) {
		c := client(t)
		before := f.snapshot(t)
		for _, p := range []string{"/", "/sagas", "/sagas/" + f.failed.String(), "/dead",
			"/sagas/" + f.failed.String() + "/resume", "/sagas/" + f.failed.String() + "/rerun?from=charge",
			"/sagas/" + f.completed.String() + "/rerun?from=reserve", "/replay?status=failed", "/replay?status=completed&from=ship",
			"/requeue?letter=1&letter=2", "/sagas/" + f.failed.String() + "/cancel"} {
			code, _, _ := get(t, c, rw.URL+p)
			require.Less(t, code, 500, p)
		}
		require.Equal(t, before, f.snapshot(t))
	})

	t.Run("CSRF and origin", func(t *testing.T) {
		c := client(t)
		target := rw.URL + "/sagas/" + f.completed.String() + "/rerun"
		_, page, _ := get(t, c, target+"?from=ship")
		tok, version := formToken(t, page), formVersion(t, page)
		require.Equal(t, tok, cookieToken(t, c, rw.URL), "the form carries the cookie's token")
		good := url.Values{"csrf": {tok}, "version": {version}, "from": {"ship"}}
		before := f.snapshot(t)
		for name, tc := range map[string]struct {
			form    url.Values
			headers map[string]string
			client  *http.Client
		}{
			"no token":         {url.Values{"version": {version}, "from": {"ship"}}, nil, c},
			"wrong token":      {url.Values{"csrf": {strings.Repeat("a", 64)}, "version": {version}, "from": {"ship"}}, nil, c},
			"no cookie":        {good, nil, client(t)},
			"cross-site fetch": {good, map[string]string{"Sec-Fetch-Site": "cross-site"}, c},
			"other origin":     {good, map[string]string{"Origin": "https://evil.example"}, c},
			"null origin":      {good, map[string]string{"Origin": "null"}, c},
			// A browser sends at least one of them with a form's POST.
			"neither origin nor fetch site": {good, map[string]string{"Origin": "", "Sec-Fetch-Site": ""}, c},
		} {
			code, body, _ := post(t, tc.client, target, tc.form, tc.headers)
			require.Equal(t, http.StatusForbidden, code, name)
			require.NotContains(t, body, "<script>window", name)
		}
		require.Equal(t, before, f.snapshot(t), "refused writes changed nothing")
		// A stale version is refused too.
		stale := url.Values{"csrf": {tok}, "version": {"1"}, "from": {"ship"}}
		code, body, _ := post(t, c, target, stale, nil)
		require.Equal(t, http.StatusConflict, code)
		require.Contains(t, body, "changed since the preview")
		// The good one goes through, with either header alone too.
		code, _, _ = post(t, c, target, good, map[string]string{"Sec-Fetch-Site": "", "Origin": "http://127.0.0.1:1"})
		require.Equal(t, http.StatusForbidden, code, "an Origin of another port")
		code, _, hdr := post(t, c, target, good, map[string]string{"Sec-Fetch-Site": ""})
		require.Equal(t, http.StatusSeeOther, code)
		require.Equal(t, "/sagas/"+f.completed.String()+"?done=rerun", hdr.Get("Location"))
		inst := f.waitStatus(t, f.completed, saga.StatusCompleted)
		require.Equal(t, 1, inst.Epoch)
		require.True(t, hasReason(inst, saga.EventSagaRerun, "rerun by alice in the web UI"), "history: %+v", inst.History)
	})

	t.Run("resume", func(t *testing.T) {
		f.failCharge.Store(true)
		f.failRelease.Store(true)
		id := f.start(t, "resume-me", "x")
		f.waitStatus(t, id, saga.StatusFailed)
		f.failCharge.Store(false)
		f.failRelease.Store(false)
		c := client(t)
		code, page, _ := get(t, c, rw.URL+"/sagas/"+id.String()+"/resume")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, page, id.String()+"/reserve/compensate/0</code></td>\n<td><span class=\"reused\">key reused</span>")
		form := url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}, "reason": {"stock unlocked " + hostile}}
		code, _, _ = post(t, c, rw.URL+"/sagas/"+id.String()+"/resume", form, nil)
		require.Equal(t, http.StatusSeeOther, code)
		inst := f.waitStatus(t, id, saga.StatusCompensated)
		require.True(t, hasReason(inst, saga.EventSagaResumed, "resume by alice in the web UI: stock unlocked <script>"))
		// A second confirmation of the same preview is refused.
		code, _, _ = post(t, c, rw.URL+"/sagas/"+id.String()+"/resume", form, nil)
		require.Equal(t, http.StatusConflict, code)
	})

	t.Run("cancel", func(t *testing.T) {
		// A saga of a type this engine does not run stays running.
		id := uuid7(t, f.pool, f.q())
		c := client(t)
		code, page, _ := get(t, c, rw.URL+"/sagas/"+id+"/cancel")
		require.Equal(t, http.StatusOK, code, page)
		require.Contains(t, page, "plan lists only the steps the timeline shows")
		form := url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}}
		code, _, _ = post(t, c, rw.URL+"/sagas/"+id+"/cancel", form, nil)
		require.Equal(t, http.StatusSeeOther, code)
		_, body, _ := get(t, c, rw.URL+"/sagas/"+id)
		require.Contains(t, body, "cancel_requested")
		require.Contains(t, body, "cancel by alice in the web UI")
	})

	t.Run("cancel a running step", func(t *testing.T) {
		s, err := saga.Start(context.Background(), f.engine, f.hold, order{ID: "h"}, &saga.StartOpts{BusinessKey: "hold-1"})
		require.NoError(t, err)
		id := s.ID.String()
		f.waitStep(t, s.ID, "wait")
		c := client(t)
		code, page, _ := get(t, c, rw.URL+"/sagas/"+id+"/cancel")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, page, id+"/first/compensate/0")
		require.Contains(t, page, "the saga ends <b>compensated</b>")
		form := url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}, "reason": {"customer asked"}}
		code, _, _ = post(t, c, rw.URL+"/sagas/"+id+"/cancel", form, nil)
		require.Equal(t, http.StatusSeeOther, code)
		inst := f.waitStatus(t, s.ID, saga.StatusCompensated)
		require.True(t, hasReason(inst, saga.EventCancelRequested, "cancel by alice in the web UI: customer asked"), "%+v", inst.History)
	})

	t.Run("waiting", func(t *testing.T) {
		s, err := saga.Start(context.Background(), f.engine, f.approve, order{ID: "w"}, &saga.StartOpts{BusinessKey: "wait-1"})
		require.NoError(t, err)
		deadline := time.Now().Add(30 * time.Second)
		for {
			inst, err := f.engine.Get(context.Background(), s.ID)
			require.NoError(t, err)
			if inst.Wait != nil {
				break
			}
			require.True(t, time.Now().Before(deadline), "the saga did not start waiting")
			time.Sleep(20 * time.Millisecond)
		}
		c := client(t)
		_, body, _ := get(t, c, ro.URL+"/sagas?waiting=1")
		require.Contains(t, body, s.ID.String())
		require.NotContains(t, body, f.failed.String())
		require.Contains(t, body, "<td>signal approved</td>")
		_, body, _ = get(t, c, ro.URL+"/sagas/"+s.ID.String())
		require.Contains(t, body, `<dd id="wait">signal approved</dd>`)
		require.Contains(t, body, "wait_started")
		code, body, _ := get(t, c, rw.URL+"/replay?waiting=1")
		require.Equal(t, http.StatusBadRequest, code)
		require.Contains(t, body, "waiting sagas are running")
	})

	t.Run("bulk replay", func(t *testing.T) {
		c := client(t)
		code, page, _ := get(t, c, rw.URL+"/replay?status=completed&from=ship&name=checkout")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, page, "Dry run:")
		require.Contains(t, page, f.completed.String())
		inst, err := f.engine.Get(context.Background(), f.completed)
		require.NoError(t, err)
		form := url.Values{"csrf": {formToken(t, page)}, "status": {"completed"}, "from": {"ship"}, "name": {"checkout"}}
		code, body, _ := post(t, c, rw.URL+"/replay", form, nil)
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, "Replayed")
		after := f.waitStatus(t, f.completed, saga.StatusCompleted)
		require.Greater(t, after.Epoch, inst.Epoch)
		require.True(t, hasReason(after, saga.EventSagaRerun, "bulk replay by alice"))

		// The confirmation replays what its preview listed, not a saga that
		// came to match the filter in between (review26 O7).
		code, page, _ = get(t, c, rw.URL+"/replay?status=completed&from=ship&name=checkout&key=")
		require.Equal(t, http.StatusOK, code)
		ids := regexp.MustCompile(`name="id" value="([0-9a-f-]{36})"`).FindAllStringSubmatch(page, -1)
		require.NotEmpty(t, ids, page)
		late := f.start(t, "order-late", "")
		lateBefore := f.waitStatus(t, late, saga.StatusCompleted)
		form = url.Values{"csrf": {formToken(t, page)}, "status": {"completed"}, "from": {"ship"}, "name": {"checkout"}}
		for _, m := range ids {
			require.NotEqual(t, late.String(), m[1])
			form.Add("id", m[1])
		}
		code, body, _ = post(t, c, rw.URL+"/replay", form, nil)
		require.Equal(t, http.StatusOK, code, body)
		require.NotContains(t, body, late.String(), "the saga that completed after the preview was replayed")
		lateAfter, err := f.engine.Get(context.Background(), late)
		require.NoError(t, err)
		require.Equal(t, lateBefore.Epoch, lateAfter.Epoch)
		require.Equal(t, lateBefore.Version, lateAfter.Version)
	})

	t.Run("requeue", func(t *testing.T) {
		c := client(t)
		var letter string
		require.NoError(t, f.pool.QueryRow(context.Background(), "SELECT max(id)::text FROM "+f.q()+".dead_letters").Scan(&letter))
		_, dead, _ := get(t, c, rw.URL+"/dead")
		require.Contains(t, dead, "/requeue?letter="+letter)
		code, page, _ := get(t, c, rw.URL+"/requeue?letter="+letter)
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, page, "Dry run: would requeue 0 outbox row(s) and 1 dead letter(s)")
		code, body, _ := post(t, c, rw.URL+"/requeue", url.Values{"csrf": {formToken(t, page)}, "letter": {letter}}, nil)
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, "Requeued 0 outbox row(s) and 1 dead letter(s)")
		var requeued bool
		require.NoError(t, f.pool.QueryRow(context.Background(), "SELECT requeued_at IS NOT NULL FROM "+f.q()+".dead_letters WHERE id = $1::bigint",
			letter).Scan(&requeued))
		require.True(t, requeued)
	})

	t.Run("prefix", func(t *testing.T) {
		cfg := writable()
		cfg.Prefix = "/ops/sagas"
		srv := f.server(t, cfg)
		c := client(t)
		code, body, _ := get(t, c, srv.URL+"/ops/sagas/")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, `href="/ops/sagas/sagas"`)
		require.Contains(t, body, `src="/ops/sagas/static/app.js"`)
		code, _, _ = get(t, c, srv.URL+"/ops/sagas/static/style.css")
		require.Equal(t, http.StatusOK, code)
		// Mounted inside http.StripPrefix, the same links work.
		h, err := ui.New(f.pool, f.engine, &ui.Config{Schema: f.schema, Prefix: "/ops"})
		require.NoError(t, err)
		mux := http.NewServeMux()
		mux.Handle("/ops/", http.StripPrefix("/ops", h))
		s2 := newServer(t, mux)
		code, body, _ = get(t, c, s2+"/ops/sagas/"+f.failed.String())
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, `href="/ops/sagas"`)
		_, err = ui.New(f.pool, f.engine, &ui.Config{Prefix: "ops/"})
		require.Error(t, err)
		// A prefix a cookie path and a link would spell differently
		// (review26 F6), and another schema than the engine's (O5).
		for _, p := range []string{"/ops/s\u00e4gas", "/ops//x", "/o ps", "/ops/%41"} {
			_, err = ui.New(f.pool, f.engine, &ui.Config{Prefix: p})
			require.ErrorContains(t, err, "Prefix", p)
		}
		_, err = ui.New(f.pool, f.engine, &ui.Config{Schema: f.schema + "x"})
		require.ErrorContains(t, err, "is not the engine's")
		// Hosts: another Host header gets 421 (a DNS-rebinding page).
		h, err = ui.New(f.pool, f.engine, &ui.Config{Hosts: []string{"ops.example:8080"}})
		require.NoError(t, err)
		for host, want := range map[string]int{"ops.example:8080": http.StatusOK, "OPS.example:8080": http.StatusOK,
			"evil.example:8080": http.StatusMisdirectedRequest, "ops.example": http.StatusMisdirectedRequest} {
			rec := httptest.NewRecorder()
			req := httptest.NewRequest(http.MethodGet, "/sagas", nil)
			req.Host = host
			h.ServeHTTP(rec, req)
			require.Equal(t, want, rec.Code, host)
		}
	})

	t.Run("pause and unpause", func(t *testing.T) {
		// An operator pauses a running saga from its page and unpauses it.
		c := client(t)
		ctx := context.Background()
		st, err := saga.Start(ctx, f.engine, f.hold, order{ID: "o-ui-pause"}, nil)
		require.NoError(t, err)
		// At its holding step, so that its version does not move between
		// the page and the form's post (a 409 otherwise).
		f.waitStep(t, st.ID, "wait")
		id := st.ID.String()
		_, page, _ := get(t, c, rw.URL+"/sagas/"+id)
		require.Contains(t, page, `id="action-pause"`)
		require.NotContains(t, page, `id="action-unpause"`)
		code, page, _ := get(t, c, rw.URL+"/sagas/"+id+"/pause")
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, page, `id="simple"`)
		code, _, _ = post(t, c, rw.URL+"/sagas/"+id+"/pause",
			url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}, "reason": {"incident " + hostile}}, nil)
		require.Equal(t, http.StatusSeeOther, code)
		in, err := f.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		require.NotNil(t, in.Paused)
		require.Contains(t, in.Paused.Reason, "pause by alice in the web UI: incident")
		_, page, _ = get(t, c, rw.URL+"/sagas/"+id)
		require.Contains(t, page, `id="action-unpause"`)
		require.NotContains(t, page, `id="action-pause"`)
		for _, raw := range []string{"<script>window", "<img src=x"} {
			require.NotContains(t, page, raw, "the reason is escaped")
		}
		// Read-only refuses it.
		code, _, _ = get(t, c, ro.URL+"/sagas/"+id+"/unpause")
		require.Equal(t, http.StatusForbidden, code)
		code, page, _ = get(t, c, rw.URL+"/sagas/"+id+"/unpause")
		require.Equal(t, http.StatusOK, code)
		code, _, _ = post(t, c, rw.URL+"/sagas/"+id+"/unpause", url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}}, nil)
		require.Equal(t, http.StatusSeeOther, code)
		in, err = f.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		require.Nil(t, in.Paused)
		require.NoError(t, f.engine.Cancel(ctx, st.ID, "test over"))
		f.waitStatus(t, st.ID, saga.StatusCompensated)
	})

	t.Run("paused", func(t *testing.T) {
		// A paused saga shows its pause, the reason escaped, and its
		// definition version.
		c := client(t)
		ctx := context.Background()
		st, err := saga.Start(ctx, f.engine, f.hold, order{ID: "o-paused"}, nil)
		require.NoError(t, err)
		require.NoError(t, f.engine.Pause(ctx, st.ID, "<script>alert(2)</script> incident"))
		t.Cleanup(func() {
			// Unpaused and cancelled, so that nothing of it runs on when
			// the engine stops.
			require.NoError(t, f.engine.Resume(ctx, st.ID, "test over"))
			require.NoError(t, f.engine.Cancel(ctx, st.ID, "test over"))
			f.waitStatus(t, st.ID, saga.StatusCompensated)
		})
		_, body, _ := get(t, c, ro.URL+"/sagas/"+st.ID.String())
		require.Contains(t, body, `id="paused"`)
		require.Contains(t, body, "&lt;script&gt;alert(2)&lt;/script&gt; incident")
		require.Contains(t, body, `<span id="def-version">1</span>`)
		require.NotContains(t, body, "<script>alert(2)")
	})
}

// hasReason reports whether the saga's history has an event of typ whose
// detail's reason contains want.
func hasReason(inst *saga.Instance, typ, want string) bool {
	for _, ev := range inst.History {
		if ev.Type != typ {
			continue
		}
		var d struct {
			Reason string `json:"reason"`
		}
		if json.Unmarshal(ev.Detail, &d) == nil && strings.Contains(d.Reason, want) {
			return true
		}
		if strings.Contains(ev.Error, want) {
			return true
		}
	}
	return false
}

// cookieToken returns the CSRF cookie the client holds for base.
func cookieToken(t *testing.T, c *http.Client, base string) string {
	t.Helper()
	u, err := url.Parse(base + "/")
	require.NoError(t, err)
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == "sagaflow_csrf" {
			return ck.Value
		}
	}
	t.Fatal("no CSRF cookie")
	return ""
}

// uuid7 starts a running saga of a type no engine here knows, by SQL, with
// a history of one step, and returns its id.
func uuid7(t *testing.T, pool *pgxpool.Pool, q string) string {
	t.Helper()
	var id string
	require.NoError(t, pool.QueryRow(context.Background(), `WITH s AS (
		INSERT INTO `+q+`.saga_instances (id, saga_name, business_key, status, step_index, step_name, direction, state, next_check_at)
		VALUES (gen_random_uuid(), 'elsewhere', 'e-1', 'running', 1, 'two', 'forward', '{}', now() + interval '1 hour') RETURNING id),
		h AS (INSERT INTO `+q+`.saga_history (saga_id, event, step_name, direction, epoch)
			SELECT id, 'step_completed', 'one', 'forward', 0 FROM s)
		SELECT id::text FROM s`).Scan(&id))
	return id
}

var errDenied = errors.New("denied by the test")

func newServer(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}
