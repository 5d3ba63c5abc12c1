package ui_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/ui"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// hostile is stored in every field a test can reach: a script that would
// mark the page if it ran, an attribute breakout, quotes and control
// characters.
const hostile = `<script>window.__xss=1;document.title="pwned"</script>"'><img src=x onerror="window.__xss=2">` + "\x01\x1b[31m\u202e"

// order is the test saga's state.
type order struct {
	ID   string `json:"id"`
	Note string `json:"note"`
}

// fixture is a migrated schema, a started engine with the checkout
// definition, and sagas in known states.
type fixture struct {
	pool   *pgxpool.Pool
	schema string
	engine *saga.Engine
	// failCharge and failRelease make those steps fail for good while set.
	failCharge, failRelease atomic.Bool
	def                     *saga.Definition[order]
	// hold's step "wait" runs until its context is cancelled.
	hold *saga.Definition[order]
	// approve waits for the signal "approved".
	approve *saga.Definition[order]
	// failed ended failed (release gave up while compensating), with the
	// hostile text as business key and error; completed ended completed.
	failed, completed uuid.UUID
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.Migrated(t)
	f := &fixture{pool: pool, schema: schema}
	nop := func(context.Context, *saga.StepRun, *order) error { return nil }
	f.def = saga.Define("checkout",
		saga.Step[order]{Name: "reserve", Action: nop, Compensate: func(context.Context, *saga.StepRun, *order) error {
			if f.failRelease.Load() {
				return steps.Permanent(steps.WithCode("stock_locked", errors.New("release refused: "+hostile)))
			}
			return nil
		}, CompensateRetry: &saga.RetryPolicy{MaxAttempts: 1}},
		saga.Step[order]{Name: "charge", Action: func(context.Context, *saga.StepRun, *order) error {
			if f.failCharge.Load() {
				return steps.Permanent(steps.WithCode("card_declined", errors.New("declined: "+hostile)))
			}
			return nil
		}, Compensate: nop},
		saga.Step[order]{Name: "ship", Action: nop},
	)
	f.hold = saga.Define("hold",
		saga.Step[order]{Name: "first", Action: nop, Compensate: nop},
		saga.Step[order]{Name: "wait", Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			<-ctx.Done()
			return ctx.Err()
		}, Timeout: time.Hour},
	)
	f.approve = saga.Define("approve", saga.Step[order]{Name: "approval",
		Wait: saga.OnSignal("approved", func(context.Context, *saga.StepRun, *order, string) error { return nil })})
	var err error
	f.engine, err = saga.New(pool, &saga.Config{Schema: schema, PollInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, f.engine.Register(f.def, f.hold, f.approve))
	require.NoError(t, f.engine.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, f.engine.Stop(ctx))
	})

	f.failCharge.Store(true)
	f.failRelease.Store(true)
	f.failed = f.start(t, hostile, hostile)
	f.waitStatus(t, f.failed, saga.StatusFailed)
	f.failCharge.Store(false)
	f.failRelease.Store(false)
	f.completed = f.start(t, "order-ok", "fine")
	f.waitStatus(t, f.completed, saga.StatusCompleted)

	// A dead outbox row and a dead letter, with hostile text and bytes.
	_, err = pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %[1]s.outbox (id, topic, aggregateid, type, payload, status, last_error)
		VALUES ($1, $2, $2, $2, $3, 'dead', $2)`, f.q()), uuid.New(), hostile, []byte("<script>alert(1)</script>\x00\xff"))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %[1]s.dead_letters (consumer, message_id, topic, msg_key, msg_value, reason)
		VALUES ($1, $1, $1, $2, $2, $1)`, f.q()), hostile, []byte("<b>\x00\xfe"))
	require.NoError(t, err)
	// A saga written by SQL, as an older version or another tool could
	// have: the hostile text in every column, names, codes and history
	// included, which the engine's own checks would refuse.
	_, err = pool.Exec(ctx, fmt.Sprintf(`WITH s AS (
		INSERT INTO %[1]s.saga_instances (id, saga_name, business_key, status, step_index, step_name, direction, state,
			last_error, last_error_code, failed_step, ended_at)
		VALUES ($1, $2, $2, 'compensated', 0, $2, 'compensate', jsonb_build_object($2::text, $2::text), $2, $2, $2, now()) RETURNING id)
		INSERT INTO %[1]s.saga_history (saga_id, event, step_name, direction, epoch, error, error_code, detail)
		SELECT id, $2, $2, 'forward', 0, $2, $2, jsonb_build_object('reason', $2::text) FROM s`, f.q()), hostileID, hostile)
	require.NoError(t, err)
	// One that can be requeued (the hostile one's key has a NUL byte, which
	// the outbox cannot carry).
	_, err = pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %[1]s.dead_letters (consumer, message_id, topic, msg_key, msg_value, reason)
		VALUES ('billing', 'm-1', 'payments', 'k', '{}', 'unknown type')`, f.q()))
	require.NoError(t, err)
	return f
}

// hostileID is the saga whose every column holds the hostile text.
var hostileID = uuid.MustParse("00000000-0000-4000-8000-00000000bad0")

func (f *fixture) q() string { return pgx.Identifier{f.schema}.Sanitize() }

func (f *fixture) start(t *testing.T, key, note string) uuid.UUID {
	t.Helper()
	s, err := saga.Start(context.Background(), f.engine, f.def, order{ID: key, Note: note}, &saga.StartOpts{BusinessKey: key})
	require.NoError(t, err)
	return s.ID
}

// waitStatus polls the saga until it has status, for at most 30 seconds.
func (f *fixture) waitStatus(t *testing.T, id uuid.UUID, status saga.Status) *saga.Instance {
	t.Helper()
	return f.waitUntil(t, id, func(in *saga.Instance) bool { return in.Status == status }, "status "+string(status))
}

// waitStep waits until saga id is at step: its version no longer moves
// while a step that holds runs.
func (f *fixture) waitStep(t *testing.T, id uuid.UUID, step string) *saga.Instance {
	t.Helper()
	return f.waitUntil(t, id, func(in *saga.Instance) bool { return in.Step == step }, "step "+step)
}

func (f *fixture) waitUntil(t *testing.T, id uuid.UUID, done func(*saga.Instance) bool, what string) *saga.Instance {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		inst, err := f.engine.Get(context.Background(), id)
		require.NoError(t, err)
		if done(inst) {
			return inst
		}
		if time.Now().After(deadline) {
			t.Fatalf("saga %s is %s at step %s, not at %s, after 30s; last error %+v", id, inst.Status, inst.Step, what, inst.LastError)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// server serves a UI on the fixture with cfg (nil: read-only) under prefix.
func (f *fixture) server(t *testing.T, cfg *ui.Config) *httptest.Server {
	t.Helper()
	c := ui.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.Schema = f.schema
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	h, err := ui.New(f.pool, f.engine, &c)
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle(c.Prefix+"/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// writable is a config that allows every action, done by alice, and shows
// state and payloads.
func writable() *ui.Config {
	return &ui.Config{
		Authorize:     func(*http.Request, string) error { return nil },
		Actor:         func(*http.Request) string { return "alice" },
		Redact:        func(_ string, s []byte) []byte { return s },
		RedactPayload: func(_ string, p []byte) []byte { return p },
	}
}

// client is a browser-like client: it keeps cookies and does not follow
// redirects.
func client(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func get(t *testing.T, c *http.Client, u string) (int, string, http.Header) {
	t.Helper()
	resp, err := c.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b), resp.Header
}

// post sends form as a same-origin browser would, unless headers say
// otherwise.
func post(t *testing.T, c *http.Client, u string, form url.Values, headers map[string]string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	pu, _ := url.Parse(u)
	req.Header.Set("Origin", pu.Scheme+"://"+pu.Host)
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	for k, v := range headers {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := c.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b), resp.Header
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]{64})"`)

// formToken returns the CSRF token of the form on page.
func formToken(t *testing.T, page string) string {
	t.Helper()
	m := csrfField.FindStringSubmatch(page)
	require.NotNil(t, m, "the page has a CSRF field")
	return m[1]
}

var versionField = regexp.MustCompile(`name="version" value="(\d+)"`)

func formVersion(t *testing.T, page string) string {
	t.Helper()
	m := versionField.FindStringSubmatch(page)
	require.NotNil(t, m, "the page has a version field")
	return m[1]
}

// snapshot sums up every table the UI could write to, to prove a request
// wrote nothing.
func (f *fixture) snapshot(t *testing.T) string {
	t.Helper()
	var s string
	err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`SELECT concat_ws(' ',
		(SELECT count(*) || ':' || coalesce(sum(version), 0) || ':' || coalesce(max(updated_at)::text, '') FROM %[1]s.saga_instances),
		(SELECT count(*) || ':' || coalesce(max(id), 0) FROM %[1]s.saga_history),
		(SELECT count(*) || ':' || count(*) FILTER (WHERE status = 'dead') FROM %[1]s.outbox),
		(SELECT count(*) || ':' || count(requeued_at) FROM %[1]s.dead_letters),
		(SELECT count(*) FROM %[1]s.saga_cancel_requests),
		(SELECT count(*) FROM %[1]s.inbox))`, f.q())).Scan(&s)
	require.NoError(t, err)
	return s
}
