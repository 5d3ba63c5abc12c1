// Package review27_test is an outside reviewer's black-box tests of the
// operator CLI (cmd/sagaflow), written from its documentation only: README.md,
// `go doc -all ./cmd/sagaflow`, `sagaflow help [command]`, docs/*.md,
// `go doc -all ./saga` and CHANGELOG.md. The CLI's own source and tests were
// not read. The tests build the binary once and run it as an operator does,
// against a real PostgreSQL, each test on schemas of its own.
//
// A test that finds a break of a documented promise is skipped with
// "FINDING F<n>: ..." unless REVIEW27_FINDINGS=1; see FINDINGS.md.
package review27_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// bin is the sagaflow binary built once for the package.
var bin string

func TestMain(m *testing.M) {
	// The tests mostly wait on subprocesses and PostgreSQL, not the CPU:
	// run five at once unless -parallel says otherwise.
	flag.Parse()
	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "test.parallel" })
	if !explicit {
		_ = flag.Set("test.parallel", "5")
	}
	dir, err := os.MkdirTemp("", "review27-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "review27:", err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "sagaflow")
	build := exec.Command("go", "build", "-o", bin, "github.com/sagaflow/sagaflow/cmd/sagaflow")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "review27: build sagaflow:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// result is one run of the CLI.
type result struct {
	args           []string
	code           int
	stdout, stderr string
	took           time.Duration
}

func (r result) String() string {
	return fmt.Sprintf("sagaflow %q\nexit %d after %v\n--- stdout:\n%s\n--- stderr:\n%s", r.args, r.code, r.took.Round(time.Millisecond), r.stdout, r.stderr)
}

// baseEnv is the environment every run starts from: no DATABASE_URL,
// no SAGAFLOW_SCHEMA, no PG* variables of the test's environment.
func baseEnv() []string {
	return []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir(), "USER=review27", "LANG=C.UTF-8"}
}

// runEnv runs the CLI with env (added to baseEnv) and args, with a hard
// limit of limit (the test fails if the CLI is still running then). A run
// the server refused to connect, having no connection slot left (SQLSTATE
// 53300: the suite's other packages held them for a moment), did nothing
// and is run again, for up to 30 s, as pgtest does with its own connects.
func runEnv(t testing.TB, env []string, limit time.Duration, args ...string) result {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for attempt := 1; ; attempt++ {
		r := runOnce(t, env, limit, args...)
		full := r.code == 4 && strings.Contains(r.stdout+r.stderr, "SQLSTATE 53300")
		if !full || time.Now().After(deadline) {
			return r
		}
		time.Sleep(time.Duration(min(attempt, 10)) * 100 * time.Millisecond)
	}
}

// runOnce is one run of runEnv.
func runOnce(t testing.TB, env []string, limit time.Duration, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(baseEnv(), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	err := cmd.Run()
	r := result{args: args, stdout: out.String(), stderr: errb.String(), took: time.Since(start)}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case ctx.Err() != nil:
		t.Fatalf("the CLI still ran after %v (it hangs):\n%s", limit, r)
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		t.Fatalf("run sagaflow: %v", err)
	}
	noCrash(t, r)
	return r
}

// connString is the test database's URL.
func connString(t testing.TB) string { return pgtest.ConnString(t) }

// cli runs the CLI on schema d with the documented global flags.
func cli(t testing.TB, d *testkit.DB, args ...string) result {
	t.Helper()
	full := append([]string{"--database-url", connString(t), "--schema", d.Schema}, args...)
	return runEnv(t, nil, 60*time.Second, full...)
}

// noCrash fails the test when the CLI panicked or printed a Go stack trace.
func noCrash(t testing.TB, r result) {
	t.Helper()
	for _, s := range []string{r.stdout, r.stderr} {
		if strings.Contains(s, "panic:") || strings.Contains(s, "goroutine ") && strings.Contains(s, ".go:") {
			t.Fatalf("the CLI crashed with a Go stack trace:\n%s", r)
		}
	}
	if r.code < 0 || r.code > 4 {
		t.Fatalf("exit code %d is not one of the documented 0..4:\n%s", r.code, r)
	}
}

// want checks the exit code.
func want(t testing.TB, r result, code int) {
	t.Helper()
	if r.code != code {
		t.Fatalf("want exit code %d:\n%s", code, r)
	}
}

// wantErr checks an error run: the code, nothing on stdout (human mode), and
// one "sagaflow: " line on stderr.
func wantErr(t testing.TB, r result, code int) {
	t.Helper()
	want(t, r, code)
	if !strings.HasPrefix(r.stderr, "sagaflow: ") {
		t.Fatalf("want an error on stderr as \"sagaflow: <what>: <why>\":\n%s", r)
	}
}

// jsonDoc decodes the one JSON document the CLI printed with --json.
func jsonDoc(t testing.TB, r result) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(r.stdout))
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("--json output is not JSON: %v\n%s", err, r)
	}
	doc, ok := v.(map[string]any)
	if !ok {
		doc = map[string]any{"_value": v} // an array (versions)
	}
	var extra any
	if err := dec.Decode(&extra); err == nil {
		t.Fatalf("--json output has more than one JSON document:\n%s", r)
	}
	return doc
}

// jsonErr checks a --json error: exit code, {"error": ..., "code": N} on stdout.
func jsonErr(t testing.TB, r result, code int) string {
	t.Helper()
	want(t, r, code)
	doc := jsonDoc(t, r)
	msg, _ := doc["error"].(string)
	if msg == "" || doc["code"] != float64(code) {
		t.Fatalf("want {\"error\": ..., \"code\": %d} on stdout:\n%s", code, r)
	}
	return msg
}

// ---- sagas ---------------------------------------------------------------

// payState is the state of the pay saga.
type payState struct {
	N    int    `json:"n"`
	Note string `json:"note,omitempty"`
}

// payDef is a saga whose step "charge", after the pivot "open", fails for
// good (code card_declined) while *broken is set: the saga then ends failed,
// for an operator to replay. Runs of charge are counted in runs.
type payDef struct {
	def    *saga.Definition[payState]
	broken atomic.Bool
	runs   testkit.Counter
	// errMsg and errCode, when set, are the failure's message and code.
	errMsg, errCode string
}

func newPay(name string) *payDef {
	p := &payDef{errMsg: "card declined", errCode: "card_declined"}
	p.broken.Store(true)
	p.def = saga.Define(name,
		saga.Step[payState]{Name: "open", Pivot: true, Action: func(context.Context, *saga.StepRun, *payState) error { return nil }},
		saga.Step[payState]{Name: "charge", Retriable: true, Action: func(_ context.Context, run *saga.StepRun, _ *payState) error {
			p.runs.Add(run.SagaID.String())
			if p.broken.Load() {
				return steps.Permanent(steps.WithCode(p.errCode, errors.New(p.errMsg)))
			}
			return nil
		}},
		saga.Step[payState]{Name: "ship", Retriable: true, Action: func(context.Context, *saga.StepRun, *payState) error { return nil }},
	)
	return p
}

// failed starts n sagas of p on d with an engine, waits until all have
// failed, stops the engine, and returns their ids in start order.
func failed(t *testing.T, d *testkit.DB, p *payDef, n int, key func(i int) string) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	e, stop := testkit.StartEngine(t, d.Pool, d.Config(), p.def)
	ids := make([]uuid.UUID, n)
	for i := range n {
		var opts *saga.StartOpts
		if key != nil {
			opts = &saga.StartOpts{BusinessKey: key(i)}
		}
		st, err := saga.Start(ctx, e, p.def, payState{N: i}, opts)
		if err != nil {
			t.Fatalf("start: %v", err)
		}
		ids[i] = st.ID
	}
	for _, id := range ids {
		in := testkit.WaitEnded(t, e, id)
		if in.Status != saga.StatusFailed {
			t.Fatalf("saga %s ended %s, want failed: %v", id, in.Status, testkit.Timeline(in))
		}
	}
	stop()
	return ids
}

// client is an engine on d that is never started: it reads sagas.
func client(t testing.TB, d *testkit.DB) *saga.Engine {
	return testkit.NewEngine(t, d.Pool, d.Config())
}

func get(t testing.TB, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	if err != nil {
		t.Fatalf("get %s: %v", id, err)
	}
	return in
}

// events counts the entries of type typ in a saga's history, any step.
func events(in *saga.Instance, typ string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Type == typ {
			n++
		}
	}
	return n
}

// touched is the sagas among ids that were resumed or re-run (a
// saga_resumed or saga_rerun entry in their history).
func touched(t testing.TB, e *saga.Engine, ids []uuid.UUID) []uuid.UUID {
	t.Helper()
	var out []uuid.UUID
	for _, id := range ids {
		in := get(t, e, id)
		if events(in, saga.EventSagaResumed)+events(in, saga.EventSagaRerun) > 0 {
			out = append(out, id)
		}
	}
	return out
}

// tableDigest is a fingerprint of every sagaflow table of d's schema: the
// row count and an md5 of the rows of each, to show that nothing changed.
func tableDigest(t testing.TB, d *testkit.DB) string {
	t.Helper()
	ctx := context.Background()
	rows, err := d.Pool.Query(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = $1 AND table_type = 'BASE TABLE' ORDER BY 1`, d.Schema)
	if err != nil {
		t.Fatal(err)
	}
	var tables []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		tables = append(tables, n)
	}
	rows.Close()
	var b strings.Builder
	for _, tb := range tables {
		var sum string
		q := fmt.Sprintf(`SELECT count(*)::text || ':' || coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') FROM %s x`, d.Table(tb))
		if err := d.Pool.QueryRow(ctx, q).Scan(&sum); err != nil {
			t.Fatalf("digest %s: %v", tb, err)
		}
		fmt.Fprintf(&b, "%s=%s\n", tb, sum)
	}
	return b.String()
}

func strs(v any) []string {
	arr, _ := v.([]any)
	out := make([]string, 0, len(arr))
	for _, x := range arr {
		switch x := x.(type) {
		case string:
			out = append(out, x)
		case map[string]any:
			if id, ok := x["id"].(string); ok {
				out = append(out, id)
			} else {
				out = append(out, fmt.Sprint(x))
			}
		default:
			out = append(out, fmt.Sprint(x))
		}
	}
	return out
}

func idStrings(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

// pickPayload is the payload of the "picked" signal.
type pickPayload struct {
	Bin string `json:"bin"`
}

// newWait is a saga that reserves, waits for the signal "picked" (recording
// its bin), then ships. Its steps record themselves in fx.
func newWait(name string, fx *testkit.Effects) *saga.Definition[payState] {
	return saga.Define(name,
		saga.Step[payState]{Name: "reserve",
			Action: func(ctx context.Context, run *saga.StepRun, _ *payState) error {
				return fx.Record(ctx, run, "reserve")
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *payState) error {
				return fx.Record(ctx, run, "undo-reserve")
			}},
		saga.Step[payState]{Name: "pick", Wait: saga.OnSignal("picked",
			func(ctx context.Context, run *saga.StepRun, s *payState, p pickPayload) error {
				s.Note = p.Bin
				return fx.Record(ctx, run, "picked:"+p.Bin)
			})},
		saga.Step[payState]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *payState) error {
			return fx.Record(ctx, run, "ship")
		}},
	)
}

// waiting starts n sagas of def on d with an engine, waits until each waits
// for its signal, stops the engine and returns the ids.
func waiting(t *testing.T, d *testkit.DB, def *saga.Definition[payState], n int, key func(int) string) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	e, stop := testkit.StartEngine(t, d.Pool, d.Config(), def)
	ids := make([]uuid.UUID, n)
	for i := range n {
		var opts *saga.StartOpts
		if key != nil {
			opts = &saga.StartOpts{BusinessKey: key(i)}
		}
		st, err := saga.Start(ctx, e, def, payState{N: i}, opts)
		if err != nil {
			t.Fatalf("start: %v", err)
		}
		ids[i] = st.ID
	}
	for _, id := range ids {
		testkit.WaitFor(t, 20*time.Second, "saga waits for its signal", func() bool {
			in := get(t, e, id)
			return in.Wait != nil && in.Wait.Kind == "signal"
		})
	}
	stop()
	return ids
}

// outboxRow writes a message with outbox.InsertTx and then sets its status
// (dead, with lastError, or published) as the relay would have. It returns
// the message id.
func outboxRow(t testing.TB, d *testkit.DB, topic, key, status, lastError string) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	ob, err := outbox.New(d.Pool, d.Schema)
	if err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	err = pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
		return ob.InsertTx(ctx, tx, outbox.Message{ID: id, Topic: topic, Key: key, Type: "Evt", Payload: []byte(`{"x":1}`)})
	})
	if err != nil {
		t.Fatalf("insert outbox row: %v", err)
	}
	switch status {
	case "dead":
		_, err = d.Pool.Exec(ctx, `UPDATE `+d.Table("outbox")+` SET status = 'dead', attempts = 9, last_error = $2 WHERE id = $1`, id, lastError)
	case "published":
		_, err = d.Pool.Exec(ctx, `UPDATE `+d.Table("outbox")+` SET status = 'published', attempts = 1, published_at = now() WHERE id = $1`, id)
	}
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// deadLetter writes a consumer's dead letter as an inbox consumer would have,
// and returns its id.
func deadLetter(t testing.TB, d *testkit.DB, consumer, topic, msgID, reason string) int64 {
	t.Helper()
	var id int64
	headers, _ := json.Marshal(map[string]string{"sagaflow-message-id": msgID, "note": reason})
	err := d.Pool.QueryRow(context.Background(), `INSERT INTO `+d.Table("dead_letters")+
		` (consumer, message_id, topic, kafka_partition, kafka_offset, msg_key, msg_value, headers, reason)
		  VALUES ($1, $2, $3, 0, (SELECT coalesce(max(kafka_offset), 0) + 1 FROM `+d.Table("dead_letters")+`), 'k'::bytea, '{"v":1}'::bytea, $4::jsonb, $5) RETURNING id`,
		consumer, msgID, topic, string(headers), reason).Scan(&id)
	if err != nil {
		t.Fatalf("insert dead letter: %v", err)
	}
	return id
}

// outboxStatus reads a row's status.
func outboxStatus(t testing.TB, d *testkit.DB, id uuid.UUID) string {
	t.Helper()
	var s string
	if err := d.Pool.QueryRow(context.Background(), `SELECT status FROM `+d.Table("outbox")+` WHERE id = $1`, id).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}
