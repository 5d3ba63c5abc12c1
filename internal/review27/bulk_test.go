package review27_test

import (
	"context"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// `sagaflow help replay`: "With --bulk, replay every saga that matches the
// filters (failed ones unless --status says otherwise), at most --max, at most
// --rate per second, and print each result. --dry-run lists what would be
// replayed and changes nothing."
//
// Six failed sagas, --max 3: the dry run changes no row of any table, the
// real run touches exactly three sagas, and they are the three the dry run
// listed.
func TestBulkReplayCapAndDryRunListExactlyWhatARealRunDoes(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 6, nil)
	e := client(t, d)

	before := tableDigest(t, d)
	dry := cli(t, d, "replay", "--bulk", "--failed-step", "charge", "--max", "3", "--dry-run", "--json")
	want(t, dry, 0)
	if after := tableDigest(t, d); after != before {
		t.Fatalf("--dry-run changed the database:\nbefore %s\nafter  %s\n%s", before, after, dry)
	}
	dryDoc := jsonDoc(t, dry)
	listed := strs(dryDoc["matched"])
	if len(listed) != 3 || dryDoc["dry_run"] != true || len(strs(dryDoc["replayed"])) != 0 {
		t.Fatalf("dry run over 6 failed sagas with --max 3 should list 3 and replay none:\n%s", dry)
	}
	// Human dry run: it lists the same three ids.
	hum := cli(t, d, "replay", "--bulk", "--failed-step", "charge", "--max", "3", "--dry-run")
	want(t, hum, 0)
	for _, id := range listed {
		if !strings.Contains(hum.stdout, id) {
			t.Fatalf("human dry run does not list %s that --json listed:\n%s", id, hum)
		}
	}

	real := cli(t, d, "replay", "--bulk", "--failed-step", "charge", "--max", "3", "--rate", "1000", "--json")
	want(t, real, 0)
	doc := jsonDoc(t, real)
	replayed := strs(doc["replayed"])
	got := idStrings(touched(t, e, ids))
	sort.Strings(listed)
	sort.Strings(replayed)
	sort.Strings(got)
	if len(got) != 3 {
		t.Fatalf("a bulk replay with --max 3 over 6 failed sagas touched %d: %v\n%s", len(got), got, real)
	}
	if !slices.Equal(got, replayed) {
		t.Fatalf("--json says it replayed %v, the database says %v", replayed, got)
	}
	if !slices.Equal(got, listed) {
		t.Fatalf("the dry run listed %v, the real run replayed %v", listed, got)
	}
	// Newest first: the three replayed are the three started last.
	newest := idStrings(ids[3:])
	sort.Strings(newest)
	if !slices.Equal(got, newest) {
		t.Fatalf("replayed %v, want the three newest %v (docs: newest first)", got, newest)
	}
	for _, id := range ids {
		st := get(t, e, id).Status
		isReplayed := slices.Contains(got, id.String())
		if isReplayed == (st == saga.StatusFailed) {
			t.Fatalf("saga %s: status %s, replayed %v", id, st, isReplayed)
		}
	}
}

// "--max n  --bulk: replay at most n sagas (default 100, at most 10000)":
// 105 failed sagas and no --max touch exactly 100.
func TestBulkReplayDefaultCapIs100(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 105, nil)
	e := client(t, d)
	r := cli(t, d, "replay", "--bulk", "--rate", "100000", "--json")
	want(t, r, 0)
	if n := len(touched(t, e, ids)); n != 100 {
		t.Fatalf("a bulk replay without --max over 105 failed sagas touched %d, want the default cap 100:\n%s", n, r)
	}
	if n := len(strs(jsonDoc(t, r)["replayed"])); n != 100 {
		t.Fatalf("--json reports %d replayed, want 100", n)
	}
}

// "--rate r  --bulk: at most r replays per second (default 10)": five
// replays at --rate 4 are spread over at least a second, in the database's
// clock (the saga_resumed entries) and in the CLI's run time.
func TestBulkReplayRateSpacesReplays(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 5, nil)
	e := client(t, d)
	r := cli(t, d, "replay", "--bulk", "--rate", "4")
	want(t, r, 0)
	var at []time.Time
	for _, id := range ids {
		for _, ev := range get(t, e, id).History {
			if ev.Type == saga.EventSagaResumed {
				at = append(at, ev.At)
			}
		}
	}
	if len(at) != 5 {
		t.Fatalf("want 5 saga_resumed entries, got %d:\n%s", len(at), r)
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	t.Logf("saga_resumed at %v", at)
	// At most 4 per second: any window of 1 s holds at most 4 (+1 at its
	// edge), so 5 replays span at least (5-1)/4 s = 1 s. The entries carry
	// the time of their insert, which a busy machine delays by up to a few
	// hundred milliseconds after the limiter let the replay go: allow 300 ms.
	// (Without a limit the five take a few milliseconds.)
	if span := at[4].Sub(at[0]); span < 700*time.Millisecond {
		t.Fatalf("5 replays at --rate 4 spanned %v in database time, want ~1s: %v", span, at)
	}
	if r.took < 900*time.Millisecond {
		t.Fatalf("the run took %v for 5 replays at 4/s", r.took)
	}
}

// Rates that are not a positive number: --rate -1 is refused ("is
// negative"), but NaN, +Inf and 0 are accepted; the docs do not say what
// they mean (see O-items). A dry run with each must not crash or replay.
func TestBulkReplayOddRates(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 2, nil)
	e := client(t, d)
	for _, rate := range []string{"NaN", "+Inf", "0", "1e400"} {
		r := cli(t, d, "replay", "--bulk", "--rate", rate, "--dry-run")
		t.Logf("--rate %q: exit %d %s%s", rate, r.code, r.stdout, r.stderr)
		if r.code != 0 && r.code != 2 {
			t.Fatalf("--rate %q: want 0 or 2:\n%s", rate, r)
		}
	}
	wantErr(t, cli(t, d, "replay", "--bulk", "--rate", "-1", "--dry-run"), 2)
	if n := len(touched(t, e, ids)); n != 0 {
		t.Fatalf("dry runs replayed %d sagas", n)
	}
}

// "0 success, including a command that found nothing to do (a listing, a bulk
// or outbox replay or a dry run that matches nothing)". Filters that match
// nothing: exit 0, nothing changed, --json lists nothing.
func TestBulkReplayFiltersMatchingNothing(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	failed(t, d, p, 2, nil)
	before := tableDigest(t, d)
	future := time.Now().Add(48 * time.Hour).UTC().Format(time.RFC3339)
	for _, f := range [][]string{
		{"--name", "nosuch"},
		{"--failed-step", "ship"},
		{"--error-code", "nosuch"},
		{"--created-after", future},
		{"--ended-before", "2001-01-01T00:00:00Z"},
		{"--status", "compensated", "--from-step", "charge"},
	} {
		args := append([]string{"replay", "--bulk"}, f...)
		r := cli(t, d, append(args, "--dry-run")...)
		want(t, r, 0)
		if r.stdout == "" {
			t.Fatalf("a bulk replay that matches nothing prints nothing:\n%s", r)
		}
		rj := cli(t, d, append(args, "--json", "--rate", "1000")...)
		want(t, rj, 0)
		doc := jsonDoc(t, rj)
		if len(strs(doc["matched"])) != 0 || len(strs(doc["replayed"])) != 0 {
			t.Fatalf("filters %v matched something:\n%s", f, rj)
		}
	}
	if after := tableDigest(t, d); after != before {
		t.Fatalf("bulk replays that matched nothing changed the database")
	}
}

// Hostile filter values: SQL metacharacters match literally, and bytes that
// PostgreSQL cannot compare (invalid UTF-8) or a 10 kB value are refused
// cleanly or match nothing; nothing is replayed and every table is still
// there. (A NUL byte cannot be passed at all: exec refuses an argv string
// holding one, so no operator can send it; see FINDINGS.md.)
func TestBulkReplayHostileFilterValues(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 2, nil)
	e := client(t, d)
	values := []string{
		"'; DROP TABLE " + d.Schema + ".saga_instances; --",
		`"; DROP SCHEMA ` + d.Schema + ` CASCADE; --`,
		"%", "_", "ch%", "c_arge", `charge\`,
		"charge' OR '1'='1",
		strings.Repeat("x", 10_000),
		"\xff\xfe",
		"char\xc3ge",
		"\u202echarge",
	}
	flags := []string{"--name", "--failed-step", "--error-code"}
	var odd []string
	for i, v := range values {
		// The injections against every filter, the rest against one each.
		fs := flags[i%3 : i%3+1]
		if i < 2 {
			fs = flags
		}
		for _, f := range fs {
			args := []string{"replay", "--bulk", "--rate", "1000", "--json", f, v}
			if i%4 == 0 {
				args = append(args, "--dry-run")
			}
			r := cli(t, d, args...)
			switch r.code {
			case 0:
				doc := jsonDoc(t, r)
				if len(strs(doc["matched"])) != 0 {
					t.Fatalf("%s %q matched sagas (metacharacters must match literally):\n%s", f, v, r)
				}
			case 2:
				// Refused as bad usage: the message is logged (see O-items).
				t.Logf("%s %s: %s", f, short(v), jsonErr(t, r, 2))
			default:
				odd = append(odd, f+" "+short(v)+": exit "+strconv.Itoa(r.code)+": "+r.stdout)
			}
		}
	}
	if n := len(touched(t, e, ids)); n != 0 {
		t.Fatalf("hostile filters replayed %d sagas", n)
	}
	var n int
	if err := d.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+d.Table("saga_instances")).Scan(&n); err != nil || n != 2 {
		t.Fatalf("saga_instances after hostile filters: %d rows, %v", n, err)
	}
	if len(odd) > 0 {
		t.Fatalf("hostile filter values got neither a clean refusal nor no match:\n%s", strings.Join(odd, "\n"))
	}
}

func short(s string) string {
	if len(s) > 24 {
		return strings.ToValidUTF8(s[:24], "?") + "..."
	}
	return strings.ToValidUTF8(s, "?")
}

// `help replay`: "--dry-run lists what would be replayed and changes
// nothing"; "Exit code 0 when every matched saga was replayed ... 1 when some
// saga could not be replayed (each is listed)". The dry run must list what
// the real run with the same flags then replays: a re-run from a step the
// sagas never had is listed as "would re-run" by the dry run, and every one
// of them fails in the real run. (`replay <id> --from-step nosuch --plan`
// does see it: "saga has no step".)
func TestBulkDryRunAgreesWithRealRunOnUnknownStep(t *testing.T) {
	// F3 (fixed): `replay --bulk --from-step S --dry-run` lists sagas as "would re-run from S" (exit 0) when S is a step they never had; the real run replays none of them (exit 1)
	t.Parallel()
	d := testkit.NewDB(t)
	ids := failed(t, d, newPay("r27pay"), 3, nil)
	e := client(t, d)
	dry := cli(t, d, "replay", "--bulk", "--from-step", "nosuch", "--dry-run", "--json")
	want(t, dry, 0)
	wouldReplay := strs(jsonDoc(t, dry)["matched"])
	real := cli(t, d, "replay", "--bulk", "--from-step", "nosuch", "--rate", "1000", "--json")
	doc := jsonDoc(t, real)
	replayed := strs(doc["replayed"])
	if got := touched(t, e, ids); len(got) != len(replayed) {
		t.Fatalf("the real run reports %d replays, the database has %d", len(replayed), len(got))
	}
	if real.code != 1 || len(strs(doc["errors"])) != 3 {
		t.Fatalf("want exit 1 and the 3 sagas listed as errors:\n%s", real)
	}
	slices.Sort(wouldReplay)
	slices.Sort(replayed)
	if !slices.Equal(wouldReplay, replayed) {
		t.Fatalf("the dry run said it would re-run %v; the real run re-ran %v:\n%s\n%s", wouldReplay, replayed, dry, real)
	}
}

// A bulk replay stopped early (--timeout here; Ctrl-C the same) exits 1 and
// must say which sagas it did replay: "print each result", "1 when ... the
// run stopped early". The human output lists them; --json must too, since
// it is the output a script reads to resume the job.
func TestBulkReplayStoppedEarlyReportsWhatItDid(t *testing.T) {
	// F4 (fixed): a bulk replay stopped early (--timeout, Ctrl-C) prints with --json only {"error": "... stopped after replaying N of M ...", "code": 1}: the sagas it did replay are not listed, unlike the human output
	t.Parallel()
	d := testkit.NewDB(t)
	ids := failed(t, d, newPay("r27pay"), 10, nil)
	e := client(t, d)

	hum := cli(t, d, "--timeout", "2500ms", "replay", "--bulk", "--rate", "1", "--max", "5")
	wantErr(t, hum, 1)
	done := touched(t, e, ids)
	if len(done) == 0 || len(done) == 5 {
		t.Fatalf("want the run stopped part way (%d replayed):\n%s", len(done), hum)
	}
	for _, id := range done {
		if !strings.Contains(hum.stdout, id.String()) {
			t.Fatalf("the human output does not list %s, which it replayed:\n%s", id, hum)
		}
	}

	js := cli(t, d, "--timeout", "2500ms", "replay", "--bulk", "--rate", "1", "--max", "5", "--json")
	want(t, js, 1)
	doc := jsonDoc(t, js)
	var now []string
	for _, id := range touched(t, e, ids) {
		if !slices.Contains(done, id) {
			now = append(now, id.String())
		}
	}
	if len(now) == 0 {
		t.Fatalf("the second run replayed nothing:\n%s", js)
	}
	listed := strs(doc["replayed"])
	slices.Sort(now)
	slices.Sort(listed)
	if !slices.Equal(now, listed) {
		t.Fatalf("--json run replayed %v but lists %v:\n%s", now, listed, js)
	}
}

// Ctrl-C in the middle of a bulk replay: exit 1, "interrupted", and the human
// output lists exactly the sagas that were replayed.
func TestBulkReplayInterruptedListsExactlyWhatItDid(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	ids := failed(t, d, newPay("r27pay"), 5, nil)
	e := client(t, d)
	cmd := exec.Command(bin, "--database-url", connString(t), "--schema", d.Schema, "replay", "--bulk", "--rate", "2")
	cmd.Env = baseEnv()
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "the first replay", func() bool { return len(touched(t, e, ids)) > 0 })
	_ = cmd.Process.Signal(syscall.SIGINT)
	_ = cmd.Wait()
	if c := cmd.ProcessState.ExitCode(); c != 1 || !strings.Contains(errb.String(), "interrupted") {
		t.Fatalf("SIGINT in a bulk replay: exit %d, stderr %q", c, errb.String())
	}
	done := touched(t, e, ids)
	if len(done) == 0 || len(done) == 5 {
		t.Fatalf("want an interrupted run part way, replayed %d:\n%s", len(done), out.String())
	}
	if n := strings.Count(out.String(), "replayed  "); n != len(done) {
		t.Fatalf("the output lists %d replays, the database has %d:\n%s", n, len(done), out.String())
	}
	for _, id := range done {
		if !strings.Contains(out.String(), id.String()) {
			t.Fatalf("replayed %s is not listed:\n%s", id, out.String())
		}
	}
}
