// Package review32_test is an outside reviewer's black-box tests of the
// review31 F1 fix: a step's statements on run.Tx run with the batch's
// context, and the end of the step's context (its Timeout, a cancel
// request) cancels the running statement on the server (SQLSTATE 57014)
// instead of closing the batch's connection. Written from the docs only
// (README.md, CHANGELOG.md, docs/architecture.md, go doc ./saga); the
// non-test sources of ./saga were not read.
//
// A test that shows a break of a documented promise is skipped unless
// REVIEW32_FINDINGS=1; see FINDINGS.md.
package review32_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 2) }

// finding skips a test that shows a finding unless REVIEW32_FINDINGS=1.
func finding(t *testing.T, id, what string) {
	t.Helper()
	if os.Getenv("REVIEW32_FINDINGS") != "1" {
		t.Skipf("FINDING %s: %s (set REVIEW32_FINDINGS=1 to run)", id, what)
	}
}

// ---- logs -------------------------------------------------------------------

// logs records the records at Warn and above of a logger.
type logs struct {
	mu   sync.Mutex
	recs []string
}

func (l *logs) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelWarn }
func (l *logs) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", r.Level, r.Message)
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	l.mu.Lock()
	l.recs = append(l.recs, b.String())
	l.mu.Unlock()
	return nil
}
func (l *logs) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logs) WithGroup(string) slog.Handler      { return l }

// errors returns the records at Error level.
func (l *logs) errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, r := range l.recs {
		if strings.HasPrefix(r, "ERROR") {
			out = append(out, r)
		}
	}
	return out
}

// ---- rig ---------------------------------------------------------------------

type order struct {
	ID string `json:"id"`
	N  int    `json:"n,omitempty"`
}

// rig is a migrated schema with the tables the tests write: fx (effects
// written in run.Tx), slow (a table whose inserts sleep, for CopyFrom), lk
// (a row to lock) and the sequence probe (non-transactional: it shows
// whether a statement was sent at all).
type rig struct {
	pool   *pgxpool.Pool
	schema string
	log    *logs

	mu   sync.Mutex
	runs map[string]int // "<saga>/<step>" -> handler runs
	errs map[string][]error
}

func newRig(t *testing.T) *rig {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	r := &rig{pool: pool, schema: schema, log: &logs{}, runs: map[string]int{}, errs: map[string][]error{}}
	q := func(s string) string { return strings.ReplaceAll(s, "S.", pgx.Identifier{schema}.Sanitize()+".") }
	for _, s := range []string{
		`CREATE TABLE S.r32_fx (saga uuid NOT NULL, step text NOT NULL, attempt int NOT NULL, tag text NOT NULL DEFAULT '')`,
		`CREATE TABLE S.r32_slow (x int)`,
		`CREATE FUNCTION S.r32_slow_trg() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(5); RETURN NEW; END $$`,
		`CREATE TRIGGER r32_slow_trg BEFORE INSERT ON S.r32_slow FOR EACH ROW EXECUTE FUNCTION S.r32_slow_trg()`,
		`CREATE TABLE S.r32_lk (id int PRIMARY KEY, v int NOT NULL DEFAULT 0)`,
		`INSERT INTO S.r32_lk (id) VALUES (1)`,
		`CREATE SEQUENCE S.r32_probe`,
	} {
		if _, err := pool.Exec(context.Background(), q(s)); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	return r
}

// q puts the rig's schema in place of "S." in s.
func (r *rig) q(s string) string {
	return strings.ReplaceAll(s, "S.", pgx.Identifier{r.schema}.Sanitize()+".")
}

// cfg is an engine config for the rig's schema.
func (r *rig) cfg(c saga.Config) *saga.Config {
	c.Schema = r.schema
	c.Logger = slog.New(r.log)
	if c.PollInterval == 0 {
		c.PollInterval = 20 * time.Millisecond
	}
	return &c
}

// engine builds, registers and starts an engine on the rig's pool.
func (r *rig) engine(t *testing.T, c saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e := r.engineNotStarted(t, c, defs...)
	r.startEngine(t, e)
	return e
}

func (r *rig) engineNotStarted(t *testing.T, c saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e, err := saga.New(r.pool, r.cfg(c))
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	if err := e.Register(defs...); err != nil {
		t.Fatalf("register: %v", err)
	}
	return e
}

func (r *rig) startEngine(t *testing.T, e *saga.Engine) {
	t.Helper()
	if err := e.Start(context.Background()); err != nil {
		t.Fatalf("start engine: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := e.Stop(ctx); err != nil {
			t.Errorf("stop engine: %v", err)
		}
	})
}

// ran counts a run of step of saga and returns its number (1 for the first).
func (r *rig) ran(run *saga.StepRun) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := run.SagaID.String() + "/" + run.Step
	r.runs[k]++
	return r.runs[k]
}

func (r *rig) runsOf(id uuid.UUID, step string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[id.String()+"/"+step]
}

// sawErr records an error a handler saw.
func (r *rig) sawErr(run *saga.StepRun, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := run.SagaID.String() + "/" + run.Step
	r.errs[k] = append(r.errs[k], err)
}

func (r *rig) errsOf(id uuid.UUID, step string) []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs[id.String()+"/"+step]...)
}

// effect writes an effect row of the step in run.Tx.
func (r *rig) effect(ctx context.Context, run *saga.StepRun, tag string) error {
	_, err := run.Tx.Exec(ctx, r.q(`INSERT INTO S.r32_fx (saga, step, attempt, tag) VALUES ($1, $2, $3, $4)`),
		run.SagaID, run.Step+"/"+string(run.Direction), run.Attempt, tag)
	return err
}

// effects counts the committed effect rows of a saga's step/direction
// (and tag, when not "").
func (r *rig) effects(t testing.TB, id uuid.UUID, stepDir, tag string) int {
	t.Helper()
	var n int
	err := r.pool.QueryRow(context.Background(), r.q(`SELECT count(*) FROM S.r32_fx WHERE saga = $1 AND step = $2 AND ($3 = '' OR tag = $3)`),
		id, stepDir, tag).Scan(&n)
	if err != nil {
		t.Fatalf("count effects: %v", err)
	}
	return n
}

// probes is how many times nextval(r32_probe) ran, whatever transaction ran it.
func (r *rig) probes(t testing.TB) int64 {
	t.Helper()
	var last int64
	var called bool
	if err := r.pool.QueryRow(context.Background(), r.q(`SELECT last_value, is_called FROM S.r32_probe`)).Scan(&last, &called); err != nil {
		t.Fatalf("read probe: %v", err)
	}
	if !called {
		return 0
	}
	return last
}

// noErrors fails the test when the engine logged an error.
func (r *rig) noErrors(t testing.TB) {
	t.Helper()
	if errs := r.log.errors(); len(errs) > 0 {
		t.Errorf("%d errors logged, the first: %q", len(errs), errs[0])
	}
}

// ---- sagas -------------------------------------------------------------------

func get(t testing.TB, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	return in
}

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitEnded waits up to d for saga id to end and returns it.
func waitEnded(t testing.TB, e *saga.Engine, id uuid.UUID, d time.Duration) *saga.Instance {
	t.Helper()
	var in *saga.Instance
	deadline := time.Now().Add(d)
	for {
		in = get(t, e, id)
		if in.Status.Terminal() {
			return in
		}
		if time.Now().After(deadline) {
			t.Fatalf("saga %s has not ended after %v: %s\n%s", id, d, in.Status, timeline(in))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// events counts the history entries of type typ (and step, when not "").
func events(in *saga.Instance, typ, step string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Type == typ && (step == "" || ev.Step == step) {
			n++
		}
	}
	return n
}

// attempts is the recorded forward attempts of step: its step_failed and
// step_completed entries.
func attempts(in *saga.Instance, step string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Step == step && ev.Direction == "forward" && (ev.Type == saga.EventStepFailed || ev.Type == saga.EventStepCompleted) {
			n++
		}
	}
	return n
}

func timeline(in *saga.Instance) string {
	var b strings.Builder
	for _, ev := range in.History {
		fmt.Fprintf(&b, "  %s %s/%s attempt=%d code=%s err=%q\n", ev.Type, ev.Step, ev.Direction, ev.Attempt, ev.ErrorCode, ev.Error)
	}
	return b.String()
}

// is57014 reports whether err is a statement cancelled on the server.
func is57014(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "57014"
}

func noop(context.Context, *saga.StepRun, *order) error { return nil }

// fixed is a backoff of d.
func fixed(d time.Duration) saga.BackoffFunc { return func(int) time.Duration { return d } }
