package review27_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// Replaying twice: "Without --from-step, resume a failed saga where it
// failed". The first replay resumes; the second finds the saga no longer
// failed and is refused (exit 1), writing nothing. Five operators replaying at
// the same moment: one wins, the others get exit 1.
func TestReplayTwiceAndConcurrently(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 2, nil)
	e := client(t, d)

	want(t, cli(t, d, "replay", ids[0].String(), "--reason", "first"), 0)
	r := cli(t, d, "replay", ids[0].String(), "--reason", "second")
	wantErr(t, r, 1)
	if n := events(get(t, e, ids[0]), saga.EventSagaResumed); n != 1 {
		t.Fatalf("two replays wrote %d saga_resumed entries", n)
	}

	var wg sync.WaitGroup
	res := make([]result, 5)
	for i := range res {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = cli(t, d, "replay", ids[1].String()) }()
	}
	wg.Wait()
	ok := 0
	for _, r := range res {
		switch r.code {
		case 0:
			ok++
		case 1:
		default:
			t.Fatalf("concurrent replay:\n%s", r)
		}
	}
	in := get(t, e, ids[1])
	if ok != 1 || events(in, saga.EventSagaResumed) != 1 {
		t.Fatalf("5 concurrent replays: %d succeeded, %d saga_resumed entries (want 1 and 1): %v", ok, events(in, saga.EventSagaResumed), testkit.Timeline(in))
	}
	// The engine then runs each resumed saga once to its end.
	p.broken.Store(false)
	e2, _ := testkit.StartEngine(t, d.Pool, d.Config(), p.def)
	for _, id := range ids {
		in := testkit.WaitEnded(t, e2, id)
		if in.Status != saga.StatusCompleted || p.runs.Get(id.String()) != 2 {
			t.Fatalf("saga %s: %s after %d runs of charge (want completed after 2): %v", id, in.Status, p.runs.Get(id.String()), testkit.Timeline(in))
		}
	}
}

// Two bulk replays at once over the same ten failed sagas: each saga is
// resumed once.
func TestConcurrentBulkReplaysResumeEachSagaOnce(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 10, nil)
	e := client(t, d)
	var wg sync.WaitGroup
	res := make([]result, 3)
	for i := range res {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = cli(t, d, "replay", "--bulk", "--rate", "50", "--json") }()
	}
	wg.Wait()
	total := 0
	for _, r := range res {
		if r.code != 0 && r.code != 1 {
			t.Fatalf("concurrent bulk:\n%s", r)
		}
		total += len(strs(jsonDoc(t, r)["replayed"]))
	}
	for _, id := range ids {
		if n := events(get(t, e, id), saga.EventSagaResumed); n != 1 {
			t.Fatalf("saga %s resumed %d times by 3 concurrent bulk replays", id, n)
		}
	}
	if total != 10 {
		t.Fatalf("the three runs report %d replays in all, want 10", total)
	}
}

// Cancelling twice while a step runs: one cancel is applied, compensation
// runs once; afterwards a cancel is refused with exit 1.
func TestCancelTwiceWhileStepRuns(t *testing.T) {
	t.Parallel()
	h := newHoldRig(t, false)
	id := h.start(t)
	var wg sync.WaitGroup
	res := make([]result, 3)
	for i := range res {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = cli(t, h.d, "cancel", id.String(), "--reason", "dup") }()
	}
	wg.Wait()
	for _, r := range res {
		if r.code != 0 && r.code != 1 {
			t.Fatalf("concurrent cancel:\n%s", r)
		}
	}
	in := testkit.WaitEnded(t, h.e, id)
	got := h.fx.Counts(t, id)
	if in.Status != saga.StatusCompensated || got["undo-reserve"] != 1 || events(in, saga.EventSagaCancelled) != 1 {
		t.Fatalf("three cancels: %s %v %v", in.Status, got, testkit.Timeline(in))
	}
	wantErr(t, cli(t, h.d, "cancel", id.String()), 1)
}

// `help dead`: "What cannot be requeued is printed with the reason and the
// rest go on; the exit code is then 1." A dead outbox row and a dead letter,
// each requeued twice (and three times at once): one effect each.
func TestRequeueDeadTwice(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	ctx := context.Background()
	msg := outboxRow(t, d, "orders", "k1", "dead", "broker refused")
	letter := deadLetter(t, d, "payments", "orders", "m-1", "handler refused")
	rowsOf := func(topic string) int {
		return d.Count(t, `SELECT count(*) FROM `+d.Table("outbox")+` WHERE topic = $1`, topic)
	}
	before := rowsOf("orders")

	r := cli(t, d, "dead", "requeue", "--id", msg.String())
	want(t, r, 0)
	if st := outboxStatus(t, d, msg); st != "pending" {
		t.Fatalf("requeued dead message is %s", st)
	}
	r = cli(t, d, "dead", "requeue", "--id", msg.String())
	want(t, r, 1)
	if !strings.Contains(r.stdout+r.stderr, msg.String()) {
		t.Fatalf("the second requeue does not name what it could not requeue:\n%s", r)
	}

	var wg sync.WaitGroup
	res := make([]result, 3)
	for i := range res {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = cli(t, d, "dead", "requeue", "--id", itoa64(letter), "--json") }()
	}
	wg.Wait()
	ok := 0
	for _, r := range res {
		switch r.code {
		case 0:
			ok++
		case 1:
			jsonDoc(t, r)
		default:
			t.Fatalf("concurrent requeue:\n%s", r)
		}
	}
	if ok != 1 {
		t.Fatalf("3 concurrent requeues of one dead letter: %d succeeded", ok)
	}
	if n := rowsOf("orders") - before; n != 1 {
		t.Fatalf("one dead letter requeued three times wrote %d outbox rows", n)
	}
	var requeued *time.Time
	if err := d.Pool.QueryRow(ctx, `SELECT requeued_at FROM `+d.Table("dead_letters")+` WHERE id = $1`, letter).Scan(&requeued); err != nil || requeued == nil {
		t.Fatalf("requeued_at of the dead letter: %v %v", requeued, err)
	}
	// The same id twice in one run: one requeue, the repeat reported.
	letter2 := deadLetter(t, d, "payments", "orders", "m-2", "handler refused")
	r = cli(t, d, "dead", "requeue", "--id", itoa64(letter2)+","+itoa64(letter2))
	want(t, r, 1)
	if n := rowsOf("orders") - before; n != 2 || !strings.Contains(r.stdout, "requeued already") {
		t.Fatalf("--id X,X: %d outbox rows in all (want 2):\n%s", n, r)
	}
	// Dry run on what is left: nothing to do, exit 0, nothing changes.
	dg := tableDigest(t, d)
	want(t, cli(t, d, "dead", "requeue", "--all", "--kind", "outbox", "--dry-run"), 0)
	want(t, cli(t, d, "dead", "requeue", "--all", "--kind", "letters", "--dry-run"), 0)
	if tableDigest(t, d) != dg {
		t.Fatalf("a requeue dry run changed the database")
	}
}

// "--id deduplicates: the same id again reports a duplicate and writes
// nothing" (README). The same signal id twice, and five times at once, to a
// waiting saga: the step takes it once, one signal is recorded, and the
// repeat says "duplicate" with exit 0.
func TestSignalSameIDTwice(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	def := newWait("r27wait", fx)
	ids := waiting(t, d, def, 2, nil)
	e := client(t, d)

	want(t, cli(t, d, "signal", ids[0].String(), "picked", "--payload", `{"bin":"A1"}`, "--id", "wh-123"), 0)
	r := cli(t, d, "signal", ids[0].String(), "picked", "--payload", `{"bin":"ZZ"}`, "--id", "wh-123")
	want(t, r, 0)
	if low := strings.ToLower(r.stdout + r.stderr); !strings.Contains(low, "duplicate") && !strings.Contains(low, "recorded before") {
		t.Fatalf("the repeated signal is not reported as a duplicate:\n%s", r)
	}
	rj := cli(t, d, "signal", ids[0].String(), "picked", "--id", "wh-123", "--json")
	want(t, rj, 0)
	if doc := jsonDoc(t, rj); doc["duplicate"] != true {
		t.Fatalf("--json of a duplicate signal does not say duplicate:\n%s", rj)
	}

	var wg sync.WaitGroup
	res := make([]result, 5)
	for i := range res {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i] = cli(t, d, "signal", ids[1].String(), "picked", "--payload", `{"bin":"B`+itoa64(int64(i))+`"}`, "--id", "same")
		}()
	}
	wg.Wait()
	for _, r := range res {
		want(t, r, 0)
	}
	for _, id := range ids {
		sigs, err := e.Signals(context.Background(), id)
		if err != nil || len(sigs) != 1 {
			t.Fatalf("saga %s has %d signals after repeats of one id: %v", id, len(sigs), err)
		}
	}
	// `show` lists the signals (seq, time, name, id, status), and `list
	// --waiting` has the WAIT column "signal:picked".
	sr := cli(t, d, "show", ids[0].String())
	want(t, sr, 0)
	if !strings.Contains(sr.stdout, "wh-123") || !strings.Contains(sr.stdout, "pending") || !strings.Contains(sr.stdout, "signal:picked") {
		t.Fatalf("show does not print the signal and the wait:\n%s", sr)
	}
	lr := cli(t, d, "list", "--waiting")
	want(t, lr, 0)
	if strings.Count(lr.stdout, "signal:picked") != 2 {
		t.Fatalf("list --waiting does not show both waits:\n%s", lr)
	}
	// Without --id the CLI makes one up and prints it.
	gen := cli(t, d, "signal", ids[1].String(), "other", "--json")
	want(t, gen, 0)
	genID, _ := jsonDoc(t, gen)["id"].(string)
	if genID == "" {
		t.Fatalf("signal without --id does not print the id it used:\n%s", gen)
	}
	if sigs, _ := e.Signals(context.Background(), ids[1]); len(sigs) != 2 || sigs[1].ID != genID {
		t.Fatalf("the printed id %q is not the stored one: %+v", genID, sigs)
	}
	testkit.StartEngine(t, d.Pool, d.Config(), def)
	for _, id := range ids {
		in := testkit.WaitEnded(t, e, id)
		picks := 0
		for what, n := range fx.Counts(t, id) {
			if strings.HasPrefix(what, "picked:") {
				picks += n
			}
		}
		if in.Status != saga.StatusCompleted || picks != 1 {
			t.Fatalf("saga %s: %s, %d picks: %v", id, in.Status, picks, fx.List(t, id))
		}
	}
	if fx.Count(t, ids[0], "picked:A1") != 1 {
		t.Fatalf("the first signal's payload was not the one taken: %v", fx.List(t, ids[0]))
	}
}

func itoa64(n int64) string { return strconv.FormatInt(n, 10) }

// `help dead`: "--all every item of --kind that matches --consumer, --topic
// and --since, oldest first, at most --max ... --dry-run does the same in a
// transaction that is rolled back". Four dead letters of one consumer and one
// of another, --max 2: the dry run and the real run pick the same two, the
// oldest of that consumer.
func TestRequeueAllCapAndDryRun(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	var mine []int64
	for i := range 4 {
		mine = append(mine, deadLetter(t, d, "payments", "orders", "m-"+itoa64(int64(i)), "refused"))
	}
	other := deadLetter(t, d, "shipping", "orders", "s-1", "refused")
	before := tableDigest(t, d)
	dry := cli(t, d, "dead", "requeue", "--all", "--kind", "letters", "--consumer", "payments", "--max", "2", "--dry-run", "--json")
	want(t, dry, 0)
	if tableDigest(t, d) != before {
		t.Fatalf("requeue --dry-run changed the database")
	}
	r := cli(t, d, "dead", "requeue", "--all", "--kind", "letters", "--consumer", "payments", "--max", "2", "--json")
	want(t, r, 0)
	requeued := func(id int64) bool {
		return d.Count(t, `SELECT count(*) FROM `+d.Table("dead_letters")+` WHERE id = $1 AND requeued_at IS NOT NULL`, id) == 1
	}
	for i, id := range mine {
		if requeued(id) != (i < 2) {
			t.Fatalf("dead letter %d (the %d. oldest): requeued=%v; want the 2 oldest only\n%s", id, i+1, requeued(id), r)
		}
		if strings.Contains(dry.stdout, `"id": `+itoa64(id)) != (i < 2) {
			t.Fatalf("the dry run does not list what the real run requeued:\n%s\n%s", dry, r)
		}
	}
	if requeued(other) {
		t.Fatalf("another consumer's dead letter was requeued")
	}
}

// README: "sagaflow replay $ID --from-step charge  # re-run an ended saga under
// a new epoch". The engine then runs charge again under the new epoch's key.
func TestRerunFromStepUnderNewEpoch(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	p := newPay("r27pay")
	ids := failed(t, d, p, 1, nil)
	e := client(t, d)
	want(t, cli(t, d, "replay", ids[0].String(), "--from-step", "charge", "--reason", "provider fixed"), 0)
	in := get(t, e, ids[0])
	if in.Epoch != 1 || events(in, saga.EventSagaRerun) != 1 || in.Status != saga.StatusRunning {
		t.Fatalf("after --from-step: epoch %d, status %s: %v", in.Epoch, in.Status, testkit.Timeline(in))
	}
	p.broken.Store(false)
	e2, _ := testkit.StartEngine(t, d.Pool, d.Config(), p.def)
	in = testkit.WaitEnded(t, e2, ids[0])
	if in.Status != saga.StatusCompleted || p.runs.Get(ids[0].String()) != 2 {
		t.Fatalf("rerun: %s after %d runs of charge: %v", in.Status, p.runs.Get(ids[0].String()), testkit.Timeline(in))
	}
	// A completed saga resumes no more; it can be re-run.
	wantErr(t, cli(t, d, "replay", ids[0].String()), 1)
}
