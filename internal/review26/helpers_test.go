package review26_test

import (
	"context"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/ui"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 8) }

// allow is an Authorize hook that allows every action.
func allow(*http.Request, string) error { return nil }

// order is the state of every saga of these tests. Msg and Code are what the
// failing step returns as its error; Secret stands for what must stay hidden.
type order struct {
	ID     string `json:"id"`
	Secret string `json:"secret,omitempty"`
	Msg    string `json:"msg,omitempty"`
	Code   string `json:"code,omitempty"`
	// RawTail appends a NUL and invalid UTF-8 to the error, which the state
	// cannot hold.
	RawTail bool `json:"raw_tail,omitempty"`
}

// kit holds the knobs of the definitions of one rig.
type kit struct {
	fixed atomic.Bool   // set: the failing saga's release compensation succeeds
	gate  *testkit.Gate // the held saga's "hold" step waits here
}

// failing ends failed: charge fails for good (with the state's Msg and
// Code), then reserve's compensation fails for good. Once k.fixed is set the
// compensation succeeds, so a resume ends the saga compensated.
func (k *kit) failing(name string) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "reserve",
			Action: func(context.Context, *saga.StepRun, *order) error { return nil },
			Compensate: func(context.Context, *saga.StepRun, *order) error {
				if k.fixed.Load() {
					return nil
				}
				return steps.Permanent(errors.New("release failed"))
			}},
		saga.Step[order]{Name: "charge",
			Action: func(_ context.Context, _ *saga.StepRun, o *order) error {
				msg, code := o.Msg, o.Code
				if msg == "" {
					msg = "card declined"
				}
				if code == "" {
					code = "card_declined"
				}
				if o.RawTail {
					msg += "\x00\xfe\xff"
				}
				return steps.Permanent(steps.WithCode(code, errors.New(msg)))
			}},
	)
}

// held runs "first", then waits in "hold" for k.gate, then "last"; every step
// has a compensation that succeeds.
func (k *kit) held(name string) *saga.Definition[order] {
	ok := func(context.Context, *saga.StepRun, *order) error { return nil }
	return saga.Define(name,
		saga.Step[order]{Name: "first", Action: ok, Compensate: ok},
		saga.Step[order]{Name: "hold", Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			return k.gate.Pass(ctx)
		}, Compensate: ok, Timeout: time.Minute},
		saga.Step[order]{Name: "last", Action: ok},
	)
}

// waiter runs "first", then waits (no step running) for the signal "go".
func waiter(name string) *saga.Definition[order] {
	ok := func(context.Context, *saga.StepRun, *order) error { return nil }
	return saga.Define(name,
		saga.Step[order]{Name: "first", Action: ok, Compensate: ok},
		saga.Step[order]{Name: "await", Wait: saga.OnSignal("go",
			func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
		saga.Step[order]{Name: "last", Action: ok},
	)
}

// completes runs one step and completes.
func completes(name string) *saga.Definition[order] {
	ok := func(context.Context, *saga.StepRun, *order) error { return nil }
	return saga.Define(name, saga.Step[order]{Name: "only", Action: ok, Compensate: ok})
}

// rig is one tenant: a migrated schema, a started engine that knows the
// definitions "order" and "order2" (failing), "held", "wait" and "done", and the UI
// mounted on an httptest server.
type rig struct {
	t      *testing.T
	db     *testkit.DB
	k      *kit
	eng    *saga.Engine
	stop   func()
	orderD *saga.Definition[order]
	order2 *saga.Definition[order]
	heldD  *saga.Definition[order]
	waitD  *saga.Definition[order]
	doneD  *saga.Definition[order]
	cfg    *ui.Config
	h      *ui.Handler
	srv    *httptest.Server
	prefix string
}

// newRig builds a rig whose UI has cfg (Schema is filled in). mount, when
// set, wraps the handler (for a prefix).
func newRig(t *testing.T, cfg *ui.Config) *rig {
	t.Helper()
	return newRigOn(t, testkit.NewDB(t), cfg, nil)
}

func newRigOn(t *testing.T, d *testkit.DB, cfg *ui.Config, mount func(h http.Handler) http.Handler) *rig {
	t.Helper()
	k := &kit{gate: testkit.NewGate()}
	r := &rig{t: t, db: d, k: k,
		orderD: k.failing("order"), order2: k.failing("order2"), heldD: k.held("held"), waitD: waiter("wait"), doneD: completes("done")}
	ecfg := d.Config()
	ecfg.Workers = 2
	r.eng, r.stop = testkit.StartEngine(t, d.Pool, ecfg, r.orderD, r.order2, r.heldD, r.waitD, r.doneD)
	t.Cleanup(k.gate.Open) // before the engine stops (cleanups run last first)
	if cfg == nil {
		cfg = &ui.Config{}
	}
	cfg.Schema = d.Schema
	if cfg.Logger == nil {
		cfg.Logger = testkit.Discard
	}
	r.cfg = cfg
	h, err := ui.New(d.Pool, r.eng, cfg)
	require.NoError(t, err)
	r.h = h
	r.prefix = cfg.Prefix
	var hh http.Handler = h
	if mount != nil {
		hh = mount(h)
	}
	r.srv = httptest.NewServer(hh)
	t.Cleanup(r.srv.Close)
	return r
}

// start starts a saga of def with st and waits for it to satisfy until.
func (r *rig) start(def *saga.Definition[order], st order, key string) uuid.UUID {
	r.t.Helper()
	var opts *saga.StartOpts
	if key != "" {
		opts = &saga.StartOpts{BusinessKey: key}
	}
	s, err := saga.Start(context.Background(), r.eng, def, st, opts)
	require.NoError(r.t, err)
	return s.ID
}

// failed starts a failing saga and waits for it to fail.
func (r *rig) failed(st order, key string) uuid.UUID {
	r.t.Helper()
	return r.failedOf(r.orderD, st, key)
}

func (r *rig) failedOf(def *saga.Definition[order], st order, key string) uuid.UUID {
	r.t.Helper()
	id := r.start(def, st, key)
	in := testkit.WaitEnded(r.t, r.eng, id)
	require.Equal(r.t, saga.StatusFailed, in.Status, testkit.Timeline(in))
	return id
}

// waiting starts a waiter saga and waits until it waits for its signal.
func (r *rig) waiting(key string) uuid.UUID {
	r.t.Helper()
	id := r.start(r.waitD, order{ID: key}, key)
	testkit.WaitFor(r.t, 20*time.Second, "the saga to wait", func() bool {
		in := r.get(id)
		return in.Wait != nil
	})
	return id
}

// midStep starts a held saga and waits until its "hold" step runs.
func (r *rig) midStep(key string) uuid.UUID {
	r.t.Helper()
	before := r.k.gate.Entered()
	id := r.start(r.heldD, order{ID: key}, key)
	testkit.WaitFor(r.t, 20*time.Second, "the hold step to run", func() bool { return r.k.gate.Entered() > before })
	return id
}

func (r *rig) get(id uuid.UUID) *saga.Instance {
	r.t.Helper()
	in, err := r.eng.Get(context.Background(), id)
	require.NoError(r.t, err)
	return in
}

// deadRow inserts an outbox row parked as dead, and returns its id.
func (r *rig) deadRow(topic, typ, key, lastError string, payload []byte) uuid.UUID {
	r.t.Helper()
	id := uuid.New()
	_, err := r.db.Pool.Exec(context.Background(), `INSERT INTO `+r.db.Table("outbox")+
		` (id, topic, aggregateid, type, payload, status, attempts, last_error) VALUES ($1, $2, $3, $4, $5, 'dead', 3, $6)`,
		id, topic, key, typ, payload, lastError)
	require.NoError(r.t, err)
	return id
}

// deadLetter inserts a consumer's dead letter, and returns its id.
func (r *rig) deadLetter(consumer, topic, msgID, reason string, key, value []byte, headers map[string]string) int64 {
	r.t.Helper()
	if headers == nil {
		headers = map[string]string{}
	}
	var id int64
	err := r.db.Pool.QueryRow(context.Background(), `INSERT INTO `+r.db.Table("dead_letters")+
		` (consumer, message_id, topic, kafka_partition, kafka_offset, msg_key, msg_value, headers, reason)
		 VALUES ($1, $2, $3, 0, (SELECT coalesce(max(id), 0) + 1 FROM `+r.db.Table("dead_letters")+`), $4, $5, $6, $7) RETURNING id`,
		consumer, msgID, topic, key, value, headers, reason).Scan(&id)
	require.NoError(r.t, err)
	return id
}

// snapshot is a digest of every table of the schema, to compare before and
// after requests that must not write.
func (r *rig) snapshot() map[string]string {
	r.t.Helper()
	return snapshotOf(r.t, r.db)
}

func snapshotOf(t *testing.T, d *testkit.DB) map[string]string {
	t.Helper()
	ctx := context.Background()
	rows, err := d.Pool.Query(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = $1 AND table_type = 'BASE TABLE'`, d.Schema)
	require.NoError(t, err)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	sort.Strings(tables)
	out := map[string]string{}
	for _, tb := range tables {
		var sum string
		q := fmt.Sprintf(`SELECT md5(coalesce(string_agg(x::text, E'\n' ORDER BY x::text), '')) FROM %s x`, d.Table(tb))
		require.NoError(t, d.Pool.QueryRow(ctx, q).Scan(&sum))
		out[tb] = sum
	}
	return out
}

// client is one browser: a cookie jar, no redirects followed.
type client struct {
	t   *testing.T
	r   *rig
	c   *http.Client
	jar *cookiejar.Jar
}

func (r *rig) client() *client {
	jar, _ := cookiejar.New(nil)
	return &client{t: r.t, r: r, jar: jar, c: &http.Client{Jar: jar, Timeout: 2 * hangBound,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

type resp struct {
	code int
	body string
	hdr  http.Header
}

func (p resp) String() string {
	b := p.body
	if len(b) > 3000 {
		b = b[:3000] + "…"
	}
	return fmt.Sprintf("%d %v\n%s", p.code, p.hdr, b)
}

// url is the server's address of path under the rig's prefix.
func (c *client) url(path string) string { return c.r.srv.URL + c.r.prefix + path }

func (c *client) get(path string) resp { return c.do("GET", c.url(path), nil, nil) }

// do sends a request; form, when set, is the body; hdr adds headers.
func (c *client) do(method, u string, form url.Values, hdr map[string]string) resp {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, u, body)
	require.NoError(c.t, err)
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range hdr {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	res, err := c.c.Do(req)
	require.NoError(c.t, err, "%s %s", method, u)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(c.t, err)
	return resp{code: res.StatusCode, body: string(b), hdr: res.Header}
}

// sameOrigin is what a browser sends with a form posted from the UI's page.
func (c *client) sameOrigin() map[string]string {
	return map[string]string{"Origin": c.r.srv.URL, "Sec-Fetch-Site": "same-origin"}
}

// post posts form to path as the UI's own page would.
func (c *client) post(path string, form url.Values) resp {
	c.t.Helper()
	return c.do("POST", c.url(path), form, c.sameOrigin())
}

// cookie is the browser's CSRF cookie, "" when it has none.
func (c *client) cookie() string {
	u, _ := url.Parse(c.r.srv.URL + "/")
	for _, k := range c.jar.Cookies(u) {
		if k.Name == "sagaflow_csrf" {
			return k.Value
		}
	}
	return ""
}

var (
	formRE  = regexp.MustCompile(`(?s)<form\b([^>]*)>(.*?)</form>`)
	attrRE  = regexp.MustCompile(`(\w[\w-]*)="([^"]*)"`)
	inputRE = regexp.MustCompile(`<input\b[^>]*>`)
)

type form struct {
	method, action, id string
	vals               url.Values
}

// forms parses the forms of a page: their attributes and the named inputs
// that carry a value.
func forms(body string) []form {
	var out []form
	for _, m := range formRE.FindAllStringSubmatch(body, -1) {
		f := form{vals: url.Values{}}
		for _, a := range attrRE.FindAllStringSubmatch(m[1], -1) {
			switch a[1] {
			case "method":
				f.method = a[2]
			case "action":
				f.action = html.UnescapeString(a[2])
			case "id":
				f.id = a[2]
			}
		}
		for _, in := range inputRE.FindAllString(m[2], -1) {
			at := map[string]string{}
			for _, a := range attrRE.FindAllStringSubmatch(in, -1) {
				at[a[1]] = html.UnescapeString(a[2])
			}
			if at["name"] == "" {
				continue
			}
			if at["type"] == "checkbox" && !strings.Contains(in, " checked") {
				continue
			}
			f.vals.Add(at["name"], at["value"])
		}
		out = append(out, f)
	}
	return out
}

// confirmForm is the preview's confirmation form, or fails the test.
func (c *client) confirmForm(preview resp) form {
	c.t.Helper()
	for _, f := range forms(preview.body) {
		if f.id == "confirm-form" {
			return f
		}
	}
	c.t.Fatalf("no confirmation form in the preview:\n%s", preview)
	return form{}
}

// confirm opens a preview, and posts its confirmation form as the browser
// would, with extra values set.
func (c *client) confirm(previewPath string, extra url.Values) resp {
	c.t.Helper()
	p := c.get(previewPath)
	require.Equal(c.t, http.StatusOK, p.code, "preview %s:\n%s", previewPath, p)
	f := c.confirmForm(p)
	for k, v := range extra {
		f.vals[k] = v
	}
	return c.do("POST", c.r.srv.URL+f.action, f.vals, c.sameOrigin())
}

// hrefs are the links, form actions and sources of a page, unescaped.
var linkRE = regexp.MustCompile(`\b(href|action|src)="([^"]*)"`)

func hrefs(body string) []string {
	var out []string
	for _, m := range linkRE.FindAllStringSubmatch(body, -1) {
		out = append(out, html.UnescapeString(m[2]))
	}
	return out
}

// reasons are the "reason" entries of the history details of a saga, and
// the errors of its cancel entries (where a cancel's reason is kept).
func reasons(in *saga.Instance) []string {
	var out []string
	for _, ev := range in.History {
		if strings.Contains(ev.Type, "cancel") && ev.Error != "" {
			out = append(out, ev.Type+": "+ev.Error)
		}
		if len(ev.Detail) == 0 {
			continue
		}
		m := regexp.MustCompile(`"reason":\s*"((?:[^"\\]|\\.)*)"`).FindSubmatch(ev.Detail)
		if m != nil {
			out = append(out, ev.Type+": "+string(m[1]))
		}
	}
	return out
}

func count(in *saga.Instance, typ string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Type == typ {
			n++
		}
	}
	return n
}

// slogJSON is a logger that writes JSON records to w.
func slogJSON(w io.Writer) *slog.Logger { return slog.New(slog.NewJSONHandler(w, nil)) }

func newServer(t *testing.T, h http.Handler) *httptest.Server {
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	return s
}
