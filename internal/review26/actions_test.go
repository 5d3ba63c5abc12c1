package review26_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// planRow is one row of a preview's runs or compensations table.
type planRow struct{ step, direction, key, marker string }

var (
	tableRE = regexp.MustCompile(`(?s)<table class="plan" id="(runs|compensations)">(.*?)</table>`)
	rowRE   = regexp.MustCompile(`(?s)<tr>(.*?)</tr>`)
	cellRE  = regexp.MustCompile(`(?s)<td>(.*?)</td>`)
	tagRE   = regexp.MustCompile(`<[^>]+>`)
)

// plan reads a preview's tables: "runs" and "compensations".
func plan(body string) map[string][]planRow {
	out := map[string][]planRow{}
	for _, t := range tableRE.FindAllStringSubmatch(body, -1) {
		for _, row := range rowRE.FindAllStringSubmatch(t[2], -1) {
			var cells []string
			for _, c := range cellRE.FindAllStringSubmatch(row[1], -1) {
				cells = append(cells, strings.TrimSpace(tagRE.ReplaceAllString(c[1], "")))
			}
			switch {
			case t[1] == "runs" && len(cells) == 5:
				out["runs"] = append(out["runs"], planRow{cells[1], cells[2], cells[3], cells[4]})
			case t[1] == "compensations" && len(cells) == 3:
				out["compensations"] = append(out["compensations"], planRow{strings.TrimSpace(strings.TrimPrefix(cells[0], "↶")), "compensate", cells[1], cells[2]})
			}
		}
	}
	return out
}

// ran is what a saga's history shows as executed after entry from: the step
// keys of its completed steps and compensations, in order.
func ran(in *saga.Instance, from int) []string {
	var out []string
	for _, ev := range in.History[from:] {
		if ev.Type == saga.EventStepCompleted || ev.Type == saga.EventCompensationCompleted {
			out = append(out, fmt.Sprintf("%s/%s/%s/%d", in.ID, ev.Step, ev.Direction, ev.Epoch))
		}
	}
	return out
}

func keys(rows []planRow) []string {
	var out []string
	for _, r := range rows {
		out = append(out, r.key)
	}
	return out
}

// TestResumePreviewSaysWhatItDoes: the resume preview shows "the step (or
// compensation) that gave up, which runs again under its reused key, and
// what follows it", and the confirmation then runs exactly that.
func TestResumePreviewSaysWhatItDoes(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "p1"}, "p1")
	c := r.client()
	p := c.get("/sagas/" + id.String() + "/resume")
	pl := plan(p.body)
	require.Equal(t, []planRow{{"reserve", "compensate", id.String() + "/reserve/compensate/0", "key reused"}}, pl["runs"], p.body)
	require.Contains(t, p.body, "ends <b>compensated</b>")
	n := len(r.get(id).History)
	r.k.fixed.Store(true)
	res := c.do("POST", r.srv.URL+c.confirmForm(p).action, c.confirmForm(p).vals, c.sameOrigin())
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	in := testkit.WaitEnded(t, r.eng, id)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, keys(pl["runs"]), ran(in, n))
}

// TestRerunPreviewSaysWhatItDoes: "the steps from the chosen one under a new
// epoch (new keys), the steps kept as they are".
func TestRerunPreviewSaysWhatItDoes(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	r.k.gate.Open()
	id := r.start(r.heldD, order{ID: "p2"}, "p2")
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, r.eng, id).Status)
	c := r.client()
	p := c.get("/sagas/" + id.String() + "/rerun?from=hold")
	pl := plan(p.body)
	require.Equal(t, []planRow{
		{"hold", "forward", id.String() + "/hold/forward/1", "new key"},
		{"last", "forward", id.String() + "/last/forward/1", "new key"},
	}, pl["runs"], p.body)
	require.Contains(t, p.body, "Kept as they are (not run again): first.")
	n := len(r.get(id).History)
	res := c.do("POST", r.srv.URL+c.confirmForm(p).action, c.confirmForm(p).vals, c.sameOrigin())
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	testkit.WaitFor(t, 20*time.Second, "the rerun to end", func() bool {
		in := r.get(id)
		return in.Epoch == 1 && in.Status.Terminal()
	})
	in := r.get(id)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, keys(pl["runs"]), ran(in, n))
}

// TestCancelMidStep: a cancel confirmed while a step runs; the preview's
// compensations are what then runs, and the running step does not complete.
func TestCancelMidStep(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.midStep("m1")
	c := r.client()
	p := c.get("/sagas/" + id.String() + "/cancel")
	require.Equal(t, 200, p.code, p.String())
	pl := plan(p.body)
	require.Equal(t, []string{id.String() + "/first/compensate/0"}, keys(pl["compensations"]), p.body)
	f := c.confirmForm(p)
	n := len(r.get(id).History)
	res := c.do("POST", r.srv.URL+f.action, f.vals, c.sameOrigin())
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	in := testkit.WaitEnded(t, r.eng, id)
	require.Equal(t, saga.StatusCompensated, in.Status, testkit.Timeline(in))
	require.Equal(t, keys(pl["compensations"]), ran(in, n), testkit.Timeline(in))
	require.Equal(t, 1, count(in, "cancel_requested"))
	// The same confirmation again: no second cancel.
	res = c.do("POST", r.srv.URL+f.action, f.vals, c.sameOrigin())
	require.GreaterOrEqual(t, res.code, 400, res.String())
	require.Equal(t, 1, count(r.get(id), "cancel_requested"))
}

// TestResumeAndRerunRefusedMidStep: resume, rerun and unpause of a saga whose
// step runs are refused, even with a form built by hand with its current
// version; the saga finishes as it would have.
func TestResumeAndRerunRefusedMidStep(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.midStep("m2")
	c := r.client()
	for _, a := range []string{"resume", "rerun", "unpause"} {
		if a != "unpause" { // the unpause preview is offered for any saga (see O-items)
			p := c.get("/sagas/" + id.String() + "/" + a + "?from=first")
			require.NotContains(t, p.body, `id="confirm-form"`, "%s offered mid-step:\n%s", a, p)
		}
		res := c.post("/sagas/"+id.String()+"/"+a, url.Values{"csrf": {c.cookie()}, "from": {"first"},
			"version": {strconv.FormatInt(r.get(id).Version, 10)}})
		require.GreaterOrEqual(t, res.code, 400, "%s mid-step: %s", a, res)
		require.Less(t, res.code, 500, "%s mid-step: %s", a, res)
	}
	r.k.gate.Open()
	in := testkit.WaitEnded(t, r.eng, id)
	require.Equal(t, saga.StatusCompleted, in.Status, testkit.Timeline(in))
	require.Zero(t, count(in, saga.EventSagaResumed)+count(in, saga.EventSagaRerun))
}

// doubleSubmit posts one confirmation form n times at once, as an impatient
// operator's double click (or a retried request) would.
func doubleSubmit(t *testing.T, c *client, previewPath string, n int) []int {
	t.Helper()
	p := c.get(previewPath)
	require.Equal(t, 200, p.code, p.String())
	f := c.confirmForm(p)
	codes := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			codes[i] = c.do("POST", c.r.srv.URL+f.action, f.vals, c.sameOrigin()).code
		})
	}
	wg.Wait()
	return codes
}

// TestDoubleSubmittedConfirmationHasOneEffect: "The confirmation carries the
// saga's version: if the saga changed since the preview, the action is
// refused", so a form submitted several times at once acts once: pause and
// requeue here (resume, rerun and cancel: see
// TestDoubleSubmittedResumeRerunCancelActOnce).
func TestDoubleSubmittedConfirmationHasOneEffect(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	paused := r.waiting("d3")
	dl := r.deadLetter("billing", "orders.events", "m-d", "bad", []byte("k"), []byte("v"), nil)
	dm := r.deadRow("orders.events", "T", "k", "dead", []byte("x"))
	c := r.client()
	codes := map[string][]int{
		"pause":          doubleSubmit(t, c, "/sagas/"+paused.String()+"/pause", 6),
		"requeue letter": doubleSubmit(t, c, "/requeue?letter="+strconv.FormatInt(dl, 10), 6),
		"requeue msg":    doubleSubmit(t, c, "/requeue?msg="+dm.String(), 6),
	}
	for a, cs := range codes {
		for _, code := range cs {
			require.Less(t, code, 500, "%s: codes %v", a, cs)
		}
	}
	require.Equal(t, 1, count(r.get(paused), saga.EventSagaPaused), "pause: codes %v", codes["pause"])
	// A requeued letter goes out through one new outbox row.
	require.Equal(t, 1, r.db.Count(t, `SELECT count(*) FROM `+r.db.Table("outbox")+` WHERE topic = 'orders.events' AND id <> $1`, dm), "codes %v", codes["requeue letter"])
	require.Equal(t, 1, r.db.Count(t, `SELECT count(*) FROM `+r.db.Table("outbox")+` WHERE id = $1 AND status = 'pending'`, dm))
}

// TestDoubleSubmittedResumeRerunCancelActOnce: a resume, rerun or cancel confirmation
// submitted several times at once (a double click) acts once; the
// submissions that come after the first find the saga changed since the
// preview and are refused.
func TestDoubleSubmittedResumeRerunCancelActOnce(t *testing.T) {
	t.Parallel()
	// F3 (fixed): such a confirmation acted several times.
	r := newRig(t, &ui.Config{Authorize: allow})
	c := r.client()
	var problems []string
	for i := range 6 {
		action, preview, event := "resume", "/resume", saga.EventSagaResumed
		if i%2 == 1 {
			action, preview, event = "rerun", "/rerun?from=charge", saga.EventSagaRerun
		}
		id := r.failed(order{ID: fmt.Sprint("dr", i)}, fmt.Sprint("dr", i))
		codes := doubleSubmit(t, c, "/sagas/"+id.String()+preview, 6)
		var in *saga.Instance
		testkit.WaitFor(t, 10*time.Second, "the saga to settle", func() bool {
			in = r.get(id)
			return in.Status == saga.StatusFailed
		})
		time.Sleep(100 * time.Millisecond)
		in = r.get(id)
		if n := count(in, event); n != 1 {
			problems = append(problems, fmt.Sprintf("one %s confirmation, submitted 6 times at once (codes %v), acted %d times: %v",
				action, codes, n, testkit.Timeline(in)))
		}
	}
	id := r.waiting("dc")
	codes := doubleSubmit(t, c, "/sagas/"+id.String()+"/cancel", 6)
	testkit.WaitEnded(t, r.eng, id)
	time.Sleep(200 * time.Millisecond)
	in := r.get(id)
	ok := 0
	for _, code := range codes {
		if code < 400 {
			ok++
		}
	}
	if n := count(in, "cancel_requested"); n != 1 || ok != 1 {
		problems = append(problems, fmt.Sprintf("one cancel confirmation, submitted 6 times at once (codes %v), recorded %d cancel requests: %v",
			codes, n, testkit.Timeline(in)))
	}
	require.Empty(t, problems)
}

// TestStalePreviewIsRefused: "if the saga changed since the preview, the
// action is refused and the operator looks again".
func TestStalePreviewIsRefused(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "st"}, "st")
	c := r.client()
	p := c.get("/sagas/" + id.String() + "/rerun?from=charge")
	f := c.confirmForm(p)
	// Someone else resumes it meanwhile; it fails again.
	require.NoError(t, r.eng.Resume(context.Background(), id, "other operator"))
	testkit.WaitFor(t, 20*time.Second, "the saga to fail again", func() bool {
		in := r.get(id)
		return in.Status == saga.StatusFailed && count(in, saga.EventSagaResumed) == 1
	})
	res := c.do("POST", r.srv.URL+f.action, f.vals, c.sameOrigin())
	require.Equal(t, http.StatusConflict, res.code, res.String())
	require.Zero(t, count(r.get(id), saga.EventSagaRerun))
}

// copyFailed makes n more failed sagas of type name, copies of saga id made
// in SQL: a bulk replay's selection needs many, not their history.
func copyFailed(t *testing.T, r *rig, id uuid.UUID, n int) {
	t.Helper()
	ctx := context.Background()
	rows, err := r.db.Pool.Query(ctx, `SELECT column_name FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'saga_instances' AND column_name NOT IN ('id', 'business_key')`, r.db.Schema)
	require.NoError(t, err)
	var cols []string
	for rows.Next() {
		var c string
		require.NoError(t, rows.Scan(&c))
		cols = append(cols, `"`+c+`"`)
	}
	require.NoError(t, rows.Err())
	list := strings.Join(cols, ", ")
	_, err = r.db.Pool.Exec(ctx, `INSERT INTO `+r.db.Table("saga_instances")+` (id, `+list+`)
		SELECT gen_random_uuid(), `+list+` FROM `+r.db.Table("saga_instances")+`, generate_series(1, $2) WHERE id = $1`, id, n)
	require.NoError(t, err)
}

var matchedRE = regexp.MustCompile(`(?s)<ul id="matched">(.*?)</ul>`)

func matched(body string) []string {
	m := matchedRE.FindStringSubmatch(body)
	if m == nil {
		return nil
	}
	return regexp.MustCompile(`/sagas/([0-9a-f-]{36})"`).FindAllString(m[1], -1)
}

// TestBulkReplayCaps: "capped" (saga.BulkReplayOpts.Max: "Defaults to
// BulkReplayMaxDefault; at most BulkReplayMaxLimit").
func TestBulkReplayCaps(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	id := r.failed(order{ID: "cap"}, "cap")
	copyFailed(t, r, id, saga.BulkReplayMaxDefault+20)
	c := r.client()
	p := c.get("/replay?status=failed")
	require.Equal(t, 200, p.code)
	require.Len(t, matched(p.body), saga.BulkReplayMaxDefault, "the dry run selects at most the default cap")
	require.Contains(t, p.body, fmt.Sprintf("%d saga(s) would be replayed", saga.BulkReplayMaxDefault))
	p = c.get("/replay?status=failed&max=7")
	require.Len(t, matched(p.body), 7)
	require.Equal(t, "7", c.confirmForm(p).vals.Get("max"), "the confirmation keeps the cap")
	for _, m := range []string{"0", "-1", strconv.Itoa(saga.BulkReplayMaxLimit + 1), "1e9", "99999999999999999999", "abc", "7.5"} {
		p = c.get("/replay?status=failed&max=" + url.QueryEscape(m))
		require.Equal(t, 400, p.code, "max=%s: %s", m, p)
		res := c.post("/replay", url.Values{"csrf": {c.cookie()}, "status": {"failed"}, "max": {m}})
		require.Equal(t, 400, res.code, "POST max=%s: %s", m, res)
	}
	p = c.get("/replay?status=failed&max=" + strconv.Itoa(saga.BulkReplayMaxLimit))
	require.Len(t, matched(p.body), saga.BulkReplayMaxDefault+21)
	require.Equal(t, 0, r.db.Count(t, `SELECT count(*) FROM `+r.db.Table("saga_history")+` WHERE event = 'saga_resumed'`))
}

// TestBulkReplayLinkKeepsTheFilter: "The filter is in the URL … With
// Authorize allowing replay, the filter can be replayed in bulk, after a dry
// run": the list's bulk replay link previews, and so replays, what the
// list's filter selects.
func TestBulkReplayLinkKeepsTheFilter(t *testing.T) {
	t.Parallel()
	// F1 (fixed): the link dropped the filter and replayed every failed saga.
	r := newRig(t, &ui.Config{Authorize: allow})
	mine := r.failedOf(r.order2, order{ID: "mine"}, "mine")
	other := r.failedOf(r.orderD, order{ID: "other"}, "other")
	c := r.client()
	list := c.get("/sagas?name=order2&status=failed")
	require.Contains(t, list.body, mine.String())
	require.NotContains(t, list.body, other.String())
	var bulk string
	for _, m := range regexp.MustCompile(`<a class="action" id="bulk" href="([^"]*)"`).FindAllStringSubmatch(list.body, -1) {
		bulk = strings.ReplaceAll(m[1], "&amp;", "&")
	}
	require.NotEmpty(t, bulk)
	p := c.do("GET", r.srv.URL+bulk, nil, nil)
	require.Equal(t, 200, p.code, p.String())
	got := matched(p.body)
	res := c.do("POST", r.srv.URL+c.confirmForm(p).action, c.confirmForm(p).vals, c.sameOrigin())
	require.Less(t, res.code, 400, res.String())
	testkit.WaitFor(t, 10*time.Second, "the replay of the listed saga", func() bool { return count(r.get(mine), saga.EventSagaResumed) == 1 })
	require.Zero(t, count(r.get(other), saga.EventSagaResumed),
		"the bulk link %q previewed %d sagas for a filter that lists 1, and its confirmation replayed a saga of type \"order\", outside the filter", bulk, len(got))
}

// TestBulkReplayDoesWhatItsDryRunSaid: with nothing changing between the
// preview and the confirmation, exactly the previewed sagas are replayed.
func TestBulkReplayDoesWhatItsDryRunSaid(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	a := r.failedOf(r.order2, order{ID: "a"}, "a")
	b := r.failedOf(r.order2, order{ID: "b"}, "b")
	other := r.failedOf(r.orderD, order{ID: "o"}, "o")
	c := r.client()
	p := c.get("/replay?name=order2&status=failed")
	got := matched(p.body)
	require.Len(t, got, 2, p.body)
	require.Contains(t, strings.Join(got, " "), a.String())
	require.Contains(t, strings.Join(got, " "), b.String())
	res := c.do("POST", r.srv.URL+c.confirmForm(p).action, c.confirmForm(p).vals, c.sameOrigin())
	require.Less(t, res.code, 400, res.String())
	testkit.WaitFor(t, 20*time.Second, "both replays", func() bool {
		return count(r.get(a), saga.EventSagaResumed) == 1 && count(r.get(b), saga.EventSagaResumed) == 1
	})
	require.Zero(t, count(r.get(other), saga.EventSagaResumed))
}

// TestPagingKeepsTheFilter: "paging is by cursor ("next page" keeps the
// filter)", and the pages of a filter together list each saga it selects
// once.
func TestPagingKeepsTheFilter(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{})
	id := r.failed(order{ID: "pg"}, "pg")
	copyFailed(t, r, id, 2*ui.PageSizeDefault+5)
	done := r.start(r.doneD, order{ID: "pd"}, "pd")
	testkit.WaitEnded(t, r.eng, done)
	c := r.client()
	seen := map[string]bool{}
	next := "/sagas?status=failed&name=order"
	for pages := 0; next != ""; pages++ {
		require.Less(t, pages, 5)
		res := c.get(next)
		require.Equal(t, 200, res.code)
		rows := regexp.MustCompile(`(?s)<tr>\s*<td class="id"><a class="saga" href="[^"]*/sagas/([0-9a-f-]{36})">.*?<td class="(status-[a-z]+)">`).FindAllStringSubmatch(res.body, -1)
		require.NotEmpty(t, rows)
		require.LessOrEqual(t, len(rows), ui.PageSizeDefault)
		for _, row := range rows {
			require.Equal(t, "status-failed", row[2])
			require.False(t, seen[row[1]], "saga %s listed twice", row[1])
			seen[row[1]] = true
		}
		next = ""
		if m := regexp.MustCompile(`<a id="next" href="([^"]*)"`).FindStringSubmatch(res.body); m != nil {
			next = "/sagas" + strings.ReplaceAll(m[1], "&amp;", "&")
		}
	}
	require.Len(t, seen, 2*ui.PageSizeDefault+6)
}

// TestWithoutDefinitionsAsTheCLI: "When the handler's engine has registered
// the saga's definition, the drawing and the previews use it; otherwise (the
// CLI) they use the steps the timeline shows, and say so", and a cancel "is
// recorded as a request that an engine which knows the saga carries out".
func TestWithoutDefinitionsAsTheCLI(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	id := r.waiting("cli")
	failed := r.failed(order{ID: "cli2"}, "cli2")
	client, err := saga.New(r.db.Pool, r.db.Config()) // registers nothing, never started
	require.NoError(t, err)
	h, err := ui.New(r.db.Pool, client, &ui.Config{Schema: r.db.Schema, Authorize: allow, Actor: func(*http.Request) string { return "cli-user" }, Logger: testkit.Discard})
	require.NoError(t, err)
	cli := &rig{t: t, db: r.db, eng: client, srv: newServer(t, h)}
	c := cli.client()
	page := c.get("/sagas/" + id.String())
	require.Equal(t, 200, page.code)
	require.Contains(t, page.body, "no definition", "the saga page says it draws from the timeline")
	p := c.get("/sagas/" + failed.String() + "/resume")
	require.Equal(t, 200, p.code, p.String())
	require.Equal(t, []string{failed.String() + "/reserve/compensate/0"}, keys(plan(p.body)["runs"]))
	res := c.confirm("/sagas/"+id.String()+"/cancel", url.Values{"reason": {"from the CLI"}})
	require.Equal(t, http.StatusSeeOther, res.code, res.String())
	in := testkit.WaitEnded(t, r.eng, id)
	require.Equal(t, saga.StatusCompensated, in.Status, testkit.Timeline(in))
	require.Contains(t, strings.Join(reasons(in), "\n"), "cancel by cli-user in the web UI: from the CLI")
}
