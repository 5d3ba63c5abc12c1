package review27_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// "--max n  replay at most n" (replay --bulk), "--max n  requeue --all: at
// most n items" (dead requeue), "--max n  replay at most n messages" (outbox
// replay). Each accepts 0 (its range is 0..10000), so "at most 0" must do
// nothing; a 0 read as "the default" acts on up to 100 items.
func TestMaxZeroDoesNothing(t *testing.T) {
	// F1 (fixed): --max 0 is accepted and means the default cap (100), not "at most 0", in replay --bulk, dead requeue --all and outbox replay
	t.Parallel()
	d := testkit.NewDB(t)
	ids := failed(t, d, newPay("r27pay"), 3, nil)
	var dead, pub []uuid.UUID
	for range 3 {
		dead = append(dead, outboxRow(t, d, "orders", "k", "dead", "refused"))
		pub = append(pub, outboxRow(t, d, "events", "k", "published", ""))
	}
	e := client(t, d)
	var broken []string
	r := cli(t, d, "replay", "--bulk", "--max", "0", "--rate", "1000")
	if r.code != 2 {
		if n := len(touched(t, e, ids)); n != 0 {
			broken = append(broken, "replay --bulk --max 0 replayed "+itoa64(int64(n))+" of 3 failed sagas")
		}
	}
	r = cli(t, d, "dead", "requeue", "--all", "--kind", "outbox", "--max", "0")
	if r.code != 2 {
		n := 0
		for _, id := range dead {
			if outboxStatus(t, d, id) != "dead" {
				n++
			}
		}
		if n != 0 {
			broken = append(broken, "dead requeue --all --max 0 requeued "+itoa64(int64(n))+" of 3 dead messages")
		}
	}
	r = cli(t, d, "outbox", "replay", "--max", "0", "--rate", "1000")
	if r.code != 2 {
		n := 0
		for _, id := range pub {
			if outboxStatus(t, d, id) != "published" {
				n++
			}
		}
		if n != 0 {
			broken = append(broken, "outbox replay --max 0 made "+itoa64(int64(n))+" of 3 published messages pending again")
		}
	}
	if len(broken) > 0 {
		t.Fatalf("--max 0:\n%s", strings.Join(broken, "\n"))
	}
}

// The documented defaults: "--schema NAME (default $SAGAFLOW_SCHEMA, else
// sagaflow)", "--database-url URL (default $DATABASE_URL)", and exit 2 for
// "an invalid schema name, no database URL". An operator's script that passes
// an unset variable (--schema "$TENANT", --database-url "$STAGING_URL")
// gives the CLI an explicit empty value: it must be refused, not replaced by
// the default schema or the default database, which may be another
// tenant's or production.
//
// The test makes its own database, with sagaflow's tables in the default
// schema "sagaflow" there, so that the default schema exists and nothing
// outside the test is touched.
func TestEmptySchemaOrURLIsNotTheDefault(t *testing.T) {
	// F2 (fixed): an explicit empty --schema or --database-url silently means the default schema "sagaflow" or $DATABASE_URL, and the command acts there
	t.Parallel()
	ctx := context.Background()
	admin := connString(t)
	dbname := "r27_" + strings.ReplaceAll(uuid.NewString()[:13], "-", "")
	apool, err := pgxpool.New(ctx, admin)
	if err != nil {
		t.Fatal(err)
	}
	defer apool.Close()
	if _, err := apool.Exec(ctx, `CREATE DATABASE `+dbname); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p, err := pgxpool.New(context.Background(), admin)
		if err == nil {
			_, _ = p.Exec(context.Background(), `DROP DATABASE IF EXISTS `+dbname+` WITH (FORCE)`)
			p.Close()
		}
	})
	u, _ := url.Parse(admin)
	u.Path = "/" + dbname
	dbURL := u.String()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := migrations.Migrate(ctx, pool, migrations.SchemaDefault); err != nil {
		t.Fatal(err)
	}
	d := &testkit.DB{Pool: pool, Schema: migrations.SchemaDefault}
	ids := failed(t, d, newPay("r27pay"), 2, nil)
	e := client(t, d)

	var broken []string
	r := runEnv(t, nil, 30*time.Second, "--database-url", dbURL, "--schema", "", "replay", ids[0].String())
	if r.code != 2 {
		broken = append(broken, "--schema \"\": exit "+itoa64(int64(r.code))+", want 2: "+strings.TrimSpace(r.stdout+r.stderr))
	}
	r = runEnv(t, []string{"DATABASE_URL=" + dbURL}, 30*time.Second, "--database-url", "", "--schema", migrations.SchemaDefault, "replay", ids[1].String())
	if r.code != 2 {
		broken = append(broken, "--database-url \"\" with $DATABASE_URL set: exit "+itoa64(int64(r.code))+", want 2: "+strings.TrimSpace(r.stdout+r.stderr))
	}
	got := touched(t, e, ids)
	for _, id := range got {
		broken = append(broken, "saga "+id.String()+" in the default schema of the default database was replayed")
	}
	if len(broken) > 0 {
		t.Fatalf("%s", strings.Join(broken, "\n"))
	}
}

// list pages: "When there are more, the next page's --cursor is printed at
// the end." Following the cursors lists every saga once, newest first.
func TestListPagesCoverEverySagaOnce(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	ids := failed(t, d, newPay("r27pay"), 7, nil)
	var seen []string
	cursor := ""
	for page := 0; page < 10; page++ {
		args := []string{"list", "--limit", "3", "--json"}
		if cursor != "" {
			args = append(args, "--cursor", cursor)
		}
		r := cli(t, d, args...)
		want(t, r, 0)
		doc := jsonDoc(t, r)
		seen = append(seen, strs(doc["sagas"])...)
		cursor, _ = doc["next_cursor"].(string)
		if cursor == "" {
			break
		}
	}
	wantIDs := idStrings(ids)
	slices.Reverse(wantIDs)
	if !slices.Equal(seen, wantIDs) {
		t.Fatalf("pages listed %v, want every saga once, newest first: %v", seen, wantIDs)
	}
	// The human listing prints the cursor to follow.
	r := cli(t, d, "list", "--limit", "3")
	want(t, r, 0)
	if !strings.Contains(r.stdout, "--cursor") {
		t.Fatalf("the human listing does not print the next page's cursor:\n%s", r)
	}
}

// `help outbox replay`: "Make already published relay messages pending again,
// oldest first, at most --max ... --dry-run lists what would be replayed and
// changes nothing." Five published messages, --max 2: the dry run changes
// nothing and lists the two the real run then replays, the oldest.
func TestOutboxReplayCapAndDryRun(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	var pub []uuid.UUID
	for range 5 {
		pub = append(pub, outboxRow(t, d, "orders", "k", "published", ""))
	}
	outboxRow(t, d, "other", "k", "published", "")
	before := tableDigest(t, d)
	dry := cli(t, d, "outbox", "replay", "--topic", "orders", "--max", "2", "--dry-run", "--json")
	want(t, dry, 0)
	if tableDigest(t, d) != before {
		t.Fatalf("outbox replay --dry-run changed the database")
	}
	listed := strs(jsonDoc(t, dry)["matched"])
	r := cli(t, d, "outbox", "replay", "--topic", "orders", "--max", "2", "--rate", "1000")
	want(t, r, 0)
	var pending []string
	for _, id := range pub {
		if outboxStatus(t, d, id) == "pending" {
			pending = append(pending, id.String())
		}
	}
	slices.Sort(listed)
	slices.Sort(pending)
	oldest := idStrings(pub[:2])
	slices.Sort(oldest)
	if !slices.Equal(pending, listed) || !slices.Equal(pending, oldest) {
		t.Fatalf("dry run listed %v, the real run made %v pending; want the two oldest %v\n%s", listed, pending, oldest, r)
	}
	// Filters that match nothing, and hostile ones.
	for _, args := range [][]string{
		{"--topic", "nosuch"}, {"--type", "'; DROP TABLE x; --"}, {"--aggregate-id", "%"}, {"--topic", "o_ders"},
		{"--published-after", "2999-01-01T00:00:00Z"}, {"--aggregate-id", strings.Repeat("a", 10_000)},
	} {
		r := cli(t, d, append([]string{"outbox", "replay", "--json"}, args...)...)
		if r.code == 2 {
			continue
		}
		want(t, r, 0)
		if n := len(strs(jsonDoc(t, r)["matched"])); n != 0 {
			t.Fatalf("outbox replay %v matched %d:\n%s", args, n, r)
		}
	}
}

// saga/doc.go (Pivots): "a cancel request recorded without the definition (the
// operator CLI) is refused and recorded (EventCancelRefused) when an engine
// applies it, and never interrupts the running step". The CLI's cancel of a
// saga whose post-pivot step runs: the step is not interrupted, the saga
// completes, and the refusal is in its history.
func TestCancelPastPivotFromCLIIsRefusedLater(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	def := saga.Define("r27pivot",
		saga.Step[payState]{Name: "open", Pivot: true, Action: func(context.Context, *saga.StepRun, *payState) error { return nil }},
		saga.Step[payState]{Name: "ship", Retriable: true, Timeout: 30 * time.Second, Action: func(ctx context.Context, _ *saga.StepRun, _ *payState) error {
			if err := gate.Pass(ctx); err != nil {
				return steps.Permanent(err)
			}
			return nil
		}},
	)
	e, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
	st, err := saga.Start(context.Background(), e, def, payState{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "ship runs", func() bool { return gate.Entered() == 1 })
	r := cli(t, d, "cancel", st.ID.String(), "--reason", "too late")
	t.Logf("cancel past the pivot: exit %d: %s%s", r.code, r.stdout, r.stderr)
	time.Sleep(300 * time.Millisecond)
	gate.Open()
	in := testkit.WaitEnded(t, e, st.ID)
	if gate.Left() != 0 || in.Status != saga.StatusCompleted {
		t.Fatalf("a CLI cancel past the pivot interrupted the step (left=%d) or stopped the saga (%s): %v", gate.Left(), in.Status, testkit.Timeline(in))
	}
	if r.code == 0 {
		testkit.WaitFor(t, 10*time.Second, "cancel_refused in the history", func() bool {
			in = get(t, e, st.ID)
			return events(in, saga.EventCancelRefused) == 1
		})
	}
	if r.code == 0 && events(in, saga.EventCancelRefused) != 1 {
		t.Fatalf("the accepted request was not recorded as refused: %v", testkit.Timeline(in))
	}
}

// `help ui`: "Serve the web UI on --listen until interrupted ... It is
// read-only unless --allow-writes ... --timeout bounds connecting to the
// database, not serving." The UI outlives --timeout, refuses a write, never
// shows the connection string, and stops on SIGINT.
func TestUIReadOnlyOutlivesTimeoutAndStops(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	ids := waiting(t, d, newWait("r27wait", fx), 1, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	const pw = "UiS3cret"
	u, _ := url.Parse(connString(t))
	u.User = url.UserPassword(u.User.Username(), pw) // trust auth ignores it
	cmd := exec.Command(bin, "--database-url", u.String(), "--schema", d.Schema, "--timeout", "1s", "ui", "--listen", addr)
	cmd.Env = baseEnv()
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
		}
	})
	base := "http://" + addr
	testkit.WaitFor(t, 10*time.Second, "the UI answers", func() bool {
		resp, err := http.Get(base + "/")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	time.Sleep(1500 * time.Millisecond) // past --timeout
	for _, path := range []string{"/", "/sagas", "/sagas/" + ids[0].String()} {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatalf("GET %s after --timeout: %v (stderr %s)", path, err, errb.String())
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("GET %s: %d", path, resp.StatusCode)
		}
		if strings.Contains(string(body), pw) || strings.Contains(string(body), "postgres://") {
			t.Fatalf("GET %s shows the connection string", path)
		}
	}
	for _, path := range []string{"/sagas/" + ids[0].String() + "/cancel", "/sagas/" + ids[0].String() + "/pause", "/actions/cancel"} {
		resp, err := http.PostForm(base+path, url.Values{"id": {ids[0].String()}, "reason": {"ui"}})
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode < 400 {
				t.Fatalf("POST %s on a read-only UI: %d", path, resp.StatusCode)
			}
		}
	}
	in := get(t, client(t, d), ids[0])
	if in.Status != saga.StatusRunning || in.Paused != nil || events(in, saga.EventCancelRequested) != 0 {
		t.Fatalf("a read-only UI changed the saga: %v", testkit.Timeline(in))
	}
	_ = cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("the UI did not stop on SIGINT")
	}
	t.Logf("ui after SIGINT: exit %d, stdout %q, stderr %q", cmd.ProcessState.ExitCode(), out.String(), errb.String())
	if strings.Contains(out.String()+errb.String(), pw) {
		t.Fatalf("the UI printed the password")
	}
	if c := cmd.ProcessState.ExitCode(); c != 0 && c != 1 {
		t.Fatalf("ui exit code %d after SIGINT", c)
	}
}
