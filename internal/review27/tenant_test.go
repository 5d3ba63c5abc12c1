package review27_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// README: the CLI "connects with --database-url (default $DATABASE_URL) to
// --schema (default $SAGAFLOW_SCHEMA, else sagaflow)". Two tenants in one
// database, one schema each: every command run with --schema A touches only
// A, and a saga id of B is "not found" (exit 3) in A, never acted on.
func TestSecondTenantIsNeverTouched(t *testing.T) {
	t.Parallel()
	a, b := testkit.NewDB(t), testkit.NewDB(t)
	fxA, fxB := testkit.NewEffects(t, a), testkit.NewEffects(t, b)
	payA, payB := newPay("r27pay"), newPay("r27pay")
	failedA := failed(t, a, payA, 2, func(i int) string { return "order-" + strconv.Itoa(i) })
	failedB := failed(t, b, payB, 2, func(i int) string { return "order-" + strconv.Itoa(i) })
	waitA := waiting(t, a, newWait("r27wait", fxA), 1, func(int) string { return "w-1" })
	waitB := waiting(t, b, newWait("r27wait", fxB), 1, func(int) string { return "w-1" })
	deadB := outboxRow(t, b, "orders", "k1", "dead", "broker refused")
	pubB := outboxRow(t, b, "orders", "k2", "published", "")
	letterB := deadLetter(t, b, "payments", "orders", "m-1", "handler refused")
	deadA := outboxRow(t, a, "orders", "k1", "dead", "broker refused")
	outboxRow(t, a, "orders", "k2", "published", "")
	letterA := deadLetter(t, a, "payments", "orders", "m-1", "handler refused")
	_, _ = deadA, letterA

	before := tableDigest(t, b)

	// B's ids, asked of A: not found, exit 3, in human and JSON output.
	bID := failedB[0].String()
	bWait := waitB[0].String()
	for i, args := range [][]string{
		{"show", bID},
		{"replay", bID},
		{"replay", bID, "--from-step", "charge"},
		{"replay", bID, "--plan"},
		{"cancel", bWait, "--reason", "wrong tenant"},
		{"cancel", bWait, "--plan"},
		{"pause", bWait, "--reason", "wrong tenant"},
		{"unpause", bWait},
		{"signal", bWait, "picked", "--payload", `{"bin":"B9"}`, "--id", "x-1"},
	} {
		r := cli(t, a, args...)
		wantErr(t, r, 3)
		if !strings.Contains(r.stderr, a.Schema) && !strings.Contains(r.stderr, "no such saga") && !strings.Contains(r.stderr, "not found") {
			t.Errorf("%v: the not-found error does not say what was not found:\n%s", args, r)
		}
		if i%3 == 0 {
			jsonErr(t, cli(t, a, append(args, "--json")...), 3)
		}
	}
	// Addressed by name and key, which both tenants use: the signal goes to
	// A's saga only.
	r := cli(t, a, "signal", "--saga", "r27wait", "--key", "w-1", "picked", "--payload", `{"bin":"A1"}`)
	want(t, r, 0)
	// Requeue B's dead row and dead letter by id, in A: nothing of B moves.
	r = cli(t, a, "dead", "requeue", "--id", deadB.String())
	if r.code == 0 {
		t.Fatalf("requeue of the other tenant's dead message by id succeeded in A:\n%s", r)
	}
	_ = letterB
	// Everything by filter, in A.
	for _, args := range [][]string{
		{"replay", "--bulk", "--rate", "1000"},
		{"replay", "--bulk", "--status", "failed,completed,compensated", "--from-step", "open", "--rate", "1000", "--dry-run"},
		{"dead", "requeue", "--all", "--kind", "outbox"},
		{"dead", "requeue", "--all", "--kind", "letters", "--consumer", "payments"},
		{"outbox", "replay", "--topic", "orders", "--rate", "1000"},
		{"pause", "--type", "r27pay", "--reason", "A only"},
		{"unpause", "--type", "r27pay"},
		{"pause", "--type", "r27wait"},
	} {
		r := cli(t, a, args...)
		if r.code != 0 {
			t.Fatalf("in tenant A:\n%s", r)
		}
	}
	// What A lists, shows and counts is A's.
	r = cli(t, a, "list", "--json", "--limit", "1000")
	want(t, r, 0)
	for _, id := range append(append([]string{}, idStrings(failedB)...), idStrings(waitB)...) {
		if strings.Contains(r.stdout, id) {
			t.Fatalf("A's list shows B's saga %s:\n%s", id, r)
		}
	}
	for _, id := range append(idStrings(failedA), idStrings(waitA)...) {
		if !strings.Contains(r.stdout, id) {
			t.Fatalf("A's list misses A's saga %s:\n%s", id, r)
		}
	}
	r = cli(t, a, "dead", "list", "--json")
	want(t, r, 0)
	if strings.Contains(r.stdout, deadB.String()) {
		t.Fatalf("A's dead list shows B's dead message:\n%s", r)
	}

	if after := tableDigest(t, b); after != before {
		t.Fatalf("commands run with --schema %s changed tenant %s:\nbefore:\n%s\nafter:\n%s", a.Schema, b.Schema, before, after)
	}
	if st := outboxStatus(t, b, pubB); st != "published" {
		t.Fatalf("B's published message is %s after A's outbox replay", st)
	}
	// And A did change: its sagas were replayed, its types paused.
	eA := client(t, a)
	if n := len(touched(t, eA, failedA)); n != 2 {
		t.Fatalf("A's bulk replay touched %d of A's 2 failed sagas", n)
	}
	if types, err := eA.PausedTypes(context.Background()); err != nil || types["r27wait"].Code == "" {
		t.Fatalf("A's type r27wait is not paused: %v %v", types, err)
	}
	sigs, err := eA.Signals(context.Background(), waitA[0])
	if err != nil || len(sigs) != 1 {
		t.Fatalf("A's waiting saga has signals %v, %v; want the one sent by name and key", sigs, err)
	}
	eB := client(t, b)
	if types, _ := eB.PausedTypes(context.Background()); len(types) != 0 {
		t.Fatalf("B has paused types after A paused its own: %v", types)
	}
	if in := get(t, eB, failedB[0]); in.Status != saga.StatusFailed {
		t.Fatalf("B's failed saga is %s", in.Status)
	}
}

// $SAGAFLOW_SCHEMA is the default, --schema wins over it, and a search_path
// in the connection URL does not redirect the CLI to another schema.
func TestSchemaSelectionByFlagEnvAndURL(t *testing.T) {
	t.Parallel()
	a, b := testkit.NewDB(t), testkit.NewDB(t)
	idsA := failed(t, a, newPay("r27pay"), 1, nil)
	idsB := failed(t, b, newPay("r27pay"), 1, nil)
	url := connString(t)
	// The URL's own query, if any, goes on (TEST_DATABASE_URL may have none).
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	cases := []struct {
		name string
		env  []string
		args []string
		want string // the schema whose saga the listing must show
	}{
		{"env", []string{"DATABASE_URL=" + url, "SAGAFLOW_SCHEMA=" + b.Schema}, []string{"list"}, "b"},
		{"flag beats env", []string{"DATABASE_URL=" + url, "SAGAFLOW_SCHEMA=" + b.Schema}, []string{"--schema", a.Schema, "list"}, "a"},
		{"flag after command", []string{"DATABASE_URL=" + url}, []string{"list", "--schema", a.Schema}, "a"},
		{"search_path in URL", nil, []string{"--database-url", url + sep + "search_path=" + b.Schema, "--schema", a.Schema, "list"}, "a"},
		{"options in URL", nil, []string{"--database-url", url + sep + "options=-c%20search_path%3D" + b.Schema, "--schema", a.Schema, "list"}, "a"},
	}
	for _, c := range cases {
		r := runEnv(t, c.env, 30e9, c.args...)
		want(t, r, 0)
		inA, inB := strings.Contains(r.stdout, idsA[0].String()), strings.Contains(r.stdout, idsB[0].String())
		if (c.want == "a") != inA || (c.want == "b") != inB {
			t.Fatalf("%s: listed A=%v B=%v, want %s only:\n%s", c.name, inA, inB, c.want, r)
		}
	}
	// A schema that exists but was never migrated, and an invalid name.
	r := runEnv(t, nil, 30e9, "--database-url", url, "--schema", "r27_never_created", "list")
	if r.code == 0 {
		t.Fatalf("listing a schema that does not exist succeeded:\n%s", r)
	}
	t.Logf("unmigrated schema: exit %d: %s", r.code, r.stderr)
	for _, bad := range []string{"a;drop", "pg_catalog", `a"b`, strings.Repeat("s", 64), "1abc", "ab-c"} {
		r := runEnv(t, nil, 30e9, "--database-url", url, "--schema", bad, "list")
		wantErr(t, r, 2)
	}
}
