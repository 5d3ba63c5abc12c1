package review19_test

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/wire"
)

var signingKey = []byte("review19-shared-signing-key")

// Kafka mode, signing on, one worker, BatchSize 16: a backlog of 20 sagas
// on one partition and exact copies of three of their commands behind it
// (a producer's retry; "step keys, version fences and the inbox make a
// replay harmless"). Nothing in it is busy, poison, overran or failed, so
// no batch is given up: Stats.BusBatchesRerun ("bus batches given up and
// run one message at a time (a message could not simply run)") stays at
// zero, and every step's action is called once (a rerun would call each
// once more).
func TestKafkaModeNothingGivenUpNothingRerun(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r19kzero", false, signingKey)
	ids := k.backlog(t, "s", 20)
	m := k.onTopic(t)
	produce(t, k.kc, rec(k.topic, m[ids[2].String()]), rec(k.topic, m[ids[7].String()]), rec(k.topic, m[ids[11].String()]))
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	for _, id := range ids {
		k.completedOnce(t, e, id, false, wait)
	}
	time.Sleep(300 * time.Millisecond) // the copies behind the last commands
	st := e.Stats()
	t.Logf("batched %d, rerun %d, dedup %d, stale %d; transactions shared by several sagas' steps: %d", st.BusBatched,
		st.BusBatchesRerun, st.Deduplicated, st.StaleDiscarded, len(k.calls.shared()))
	require.Empty(t, k.calls.twice(), "steps called more than once with nothing to give up")
	require.Zero(t, st.BusBatchesRerun, "batches given up with nothing busy, poison, overran or failing")
	require.Empty(t, k.deadByOffset(t), "exact copies are not malformed")
}

// Kafka mode, one worker, BatchSize 16, a backlog of 16 sagas on one
// partition: s5's step a fails once (200 ms backoff). Stats:
// BusBatchesRerun counts "bus batches given up and run one message at a
// time (a message could not simply run)", and such a batch "runs its steps
// once more": if another saga's step ran twice, a batch was given up and
// the counter must say so. (CHANGELOG: "if any of them is poison, busy or
// fails, nothing of the batch is committed"; a failing step does not give
// its batch up: logged, F2.) The
// retry, a relay row due after its backoff, is published although the relay
// polls once a minute; every saga completes with each effect once.
func TestKafkaModeFailingStepInABatch(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r19kfail", false, nil)
	ids := k.backlog(t, "s", 16)
	var failed atomic.Bool
	k.setHook(func(_ context.Context, run *saga.StepRun, o *ord) error {
		if o.ID == "s5" && run.Step == "a" && failed.CompareAndSwap(false, true) {
			return errFlaky{1}
		}
		return nil
	})
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	for _, id := range ids {
		k.completedOnce(t, e, id, false, wait)
	}
	in := get(t, e, ids[5])
	require.Equal(t, 1, testkit.Events(in, saga.EventStepFailed, "a"), "%v", testkit.Timeline(in))
	st := e.Stats()
	var withS5 []string
	for tx, ks := range k.calls.shared() {
		for _, key := range ks {
			if key == "s5/a" {
				withS5 = append(withS5, tx)
			}
		}
	}
	twice := k.calls.twice()
	t.Logf("batched %d, rerun %d, retries %d; steps run twice %v; s5's a in a shared transaction: %v", st.BusBatched,
		st.BusBatchesRerun, st.Retries, twice, withS5)
	var others []string
	for _, s := range twice {
		if !strings.HasPrefix(s, "s5/a") {
			others = append(others, s)
		}
	}
	if len(others) > 0 {
		require.Positive(t, st.BusBatchesRerun, "a batch was given up (steps ran again: %v) and not counted", others)
	}
	// The CHANGELOG's "or fails": a batch in which s5's step failed and
	// other sagas' effects committed was not given up (F2, documentation).
	if len(withS5) > 0 {
		n := k.db.Count(t, "SELECT count(*) FROM "+k.fx.Table()+" WHERE txid::text = ANY($1)", withS5)
		t.Logf("s5's failure shared a transaction in which %d effects of other sagas committed; rerun %d (F2)", n, st.BusBatchesRerun)
	}
	require.Empty(t, k.deadByOffset(t))
}

// Kafka mode, one worker, BatchSize 16, signing on and off: 8 genuine
// commands, then hostile and duplicate records, then 8 more genuine ones,
// all on one partition before the engine starts, so that the reader holds
// several ready at once. protocol.md "Malformed input": "a repeated
// sagaflow- header, a bad signature, a command that does not decode, a step
// command without a valid message id" go to dead_letters, "Bad input never
// stops a partition and is never lost"; saga/doc.go guarantee 8: bytes
// PostgreSQL refuses (a NUL, invalid UTF-8) "in any field of a message ...
// are made storable or dead-lettered, never retried"; security.md: a replay
// of a whole genuine message is harmless. The doc on Kafka mode: a poison
// message in a batch gives the batch up (BusBatchesRerun).
func TestKafkaModeHostileMessagesInBatches(t *testing.T) {
	t.Parallel()
	for _, signed := range []bool{true, false} {
		t.Run(fmt.Sprintf("signed=%v", signed), func(t *testing.T) {
			t.Parallel()
			hostileInBatches(t, signed)
		})
	}
}

func hostileInBatches(t *testing.T, signed bool) {
	var key []byte
	name := "r19khostile"
	if signed {
		key, name = signingKey, name+"s"
	}
	k := newKmode(t, name, false, key)
	ids := k.backlog(t, "s", 8)
	m := k.onTopic(t)
	g := func(i int) *kgo.Record { return rec(k.topic, m[ids[i].String()]) }
	newID := func(r *kgo.Record) *kgo.Record {
		setHeader(r, wire.HeaderMessageID, []byte(uuid.NewString()))
		return r
	}
	type hostile struct {
		what string
		r    *kgo.Record
		dead string // "yes": must be dead-lettered; "no": must not; "": either
	}
	hs := []hostile{
		{"no headers, key with NUL and invalid UTF-8", &kgo.Record{Topic: k.topic, Key: []byte("k\x00\xff\xfe"), Value: []byte("{}")}, "yes"},
		{"saga id header with a NUL", func() *kgo.Record {
			r := newID(g(0))
			setHeader(r, wire.HeaderSagaID, append([]byte{0}, ids[0].String()...))
			return r
		}(), "yes"},
		{"step key header of invalid UTF-8", func() *kgo.Record {
			r := newID(g(1))
			setHeader(r, wire.HeaderStepKey, []byte("\xff\xfe\xfd"+ids[1].String()))
			return r
		}(), map[bool]string{true: "yes", false: ""}[signed]}, // unsigned: a step command's step key header is not read (O2)
		{"type header of 10 kB", func() *kgo.Record {
			r := newID(g(2))
			setHeader(r, wire.HeaderType, []byte(testkit.RandomLetters(10000)))
			return r
		}(), "yes"},
		{"message id of 10 kB of NULs", func() *kgo.Record {
			r := g(3)
			setHeader(r, wire.HeaderMessageID, make([]byte, 10000))
			return r
		}(), "yes"},
		{"value of 10 kB of NULs", func() *kgo.Record { r := newID(g(4)); r.Value = make([]byte, 10000); return r }(), "yes"},
		{"value with invalid UTF-8 in a JSON string", func() *kgo.Record {
			r := newID(g(5))
			r.Value = []byte(`{"id":"\xff\xfe"}`)
			return r
		}(), map[bool]string{true: "yes", false: ""}[signed]},
		{"a repeated sagaflow-type header", func() *kgo.Record {
			r := newID(g(6))
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: wire.HeaderType, Value: []byte("sagaflow.step")})
			return r
		}(), "yes"},
		{"an exact copy", g(6), "no"},
		{"a copy under a new message id", newID(g(7)), "no"},
		{"a copy with a 10 kB header of NULs and invalid UTF-8", func() *kgo.Record {
			r := newID(g(0))
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: "x-\x00\xff", Value: append(make([]byte, 5000), bytes.Repeat([]byte{0xff}, 5000)...)})
			return r
		}(), ""},
	}
	recs := make([]*kgo.Record, len(hs))
	for i, h := range hs {
		recs[i] = h.r
	}
	offsets := produce(t, k.kc, recs...)
	more := k.backlog(t, "m", 8)

	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	all := append(append([]uuid.UUID(nil), ids...), more...)
	for _, id := range all {
		k.completedOnce(t, e, id, false, wait)
	}
	var dead map[int64][]string
	for end := time.Now().Add(within); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		dead = k.deadByOffset(t)
		judged := true
		for i, h := range hs {
			if h.dead == "yes" && len(dead[offsets[i]]) == 0 {
				judged = false
			}
		}
		if judged {
			break
		}
	}
	time.Sleep(300 * time.Millisecond)
	dead = k.deadByOffset(t)
	byOffset := map[int64]string{}
	for i, h := range hs {
		byOffset[offsets[i]] = h.what
		t.Logf("offset %d %q: dead-lettered %v", offsets[i], h.what, shortAll(dead[offsets[i]]))
	}
	for off, rs := range dead {
		what, ok := byOffset[off]
		require.True(t, ok, "a genuine command at offset %d was dead-lettered: %v", off, rs)
		require.Len(t, rs, 1, "%q dead-lettered more than once: %v", what, rs)
	}
	for i, h := range hs {
		switch h.dead {
		case "yes":
			require.NotEmpty(t, dead[offsets[i]], "%q was not dead-lettered", h.what)
		case "no":
			require.Empty(t, dead[offsets[i]], "%q was dead-lettered", h.what)
		}
	}
	st := e.Stats()
	t.Logf("signed %v: batched %d, rerun %d, dedup %d, stale %d; steps run twice %v", signed, st.BusBatched, st.BusBatchesRerun,
		st.Deduplicated, st.StaleDiscarded, k.calls.twice())
	require.Empty(t, k.calls.twice(), "a step ran twice")
	t.Logf("a batch spanning the hostile records committed: %v", spanning(k, "s", "m"))
}

// spanning lists the transactions in which step a of a saga of the first
// backlog (prefix first) and of the second (prefix second) both ran: a batch
// that held every record produced between them.
func spanning(k *kmode, first, second string) []string {
	var out []string
	for tx, ks := range k.calls.shared() {
		var f, s bool
		for _, key := range ks {
			f = f || (strings.HasPrefix(key, first) && strings.HasSuffix(key, "/a"))
			s = s || (strings.HasPrefix(key, second) && strings.HasSuffix(key, "/a"))
		}
		if f && s {
			out = append(out, tx)
		}
	}
	return out
}

// Kafka mode, one worker, BatchSize 16: 6 genuine commands, a record that is
// not a command (no headers), 6 more. The review found (F2) that the docs
// said a poison message gives its batch up ("nothing of the batch is
// committed and they run one at a time", counted in BusBatchesRerun) while
// the engine dead-letters it inside the batch, which commits. The docs now
// say so (saga/doc.go: "a poison message is dead-lettered, and a step's
// failure recorded, within the batch"). When step a of a saga before the
// poison and of one after it ran in one transaction, that batch held the
// poison: it committed, and no batch was given up.
func TestKafkaModePoisonIsDeadLetteredInsideItsBatch(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r19kpoison", false, nil)
	ids := k.backlog(t, "s", 6)
	off := produce(t, k.kc, &kgo.Record{Topic: k.topic, Key: []byte("poison"), Value: []byte("not a command")})
	ids = append(ids, k.backlog(t, "m", 6)...)
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	for _, id := range ids {
		k.completedOnce(t, e, id, false, wait)
	}
	require.NotEmpty(t, k.deadByOffset(t)[off[0]], "the poison was not dead-lettered")
	st := e.Stats()
	across := spanning(k, "s", "m")
	t.Logf("batched %d, rerun %d; transactions holding steps from both sides of the poison: %v; steps run twice %v",
		st.BusBatched, st.BusBatchesRerun, across, k.calls.twice())
	require.Zero(t, st.BusBatchesRerun, "no batch was given up: nothing in it was busy, held or failing")
	if len(across) == 0 {
		t.Skip("the reader never held the poison with messages on both sides of it: nothing to judge in this run")
	}
	committed := k.db.Count(t, "SELECT count(*) FROM "+k.fx.Table()+" WHERE txid::text = ANY($1)", across)
	require.Positive(t, committed, "the batch that held the poison committed its other messages' steps")
}

func shortAll(rs []string) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = short(r)
	}
	sort.Strings(out)
	return out
}

// Kafka mode, one worker, BatchSize 16, a backlog of 12 sagas, one of
// which an operator's transaction holds with CancelTx. docs/reliability.md:
// "The engine's own holds (Engine.CancelTx and the like) are skipped as a
// busy saga instead"; saga/doc.go: "If any of them cannot run now (its saga
// is busy ...), nothing of the batch is committed and they run one at a
// time ... [Stats].BusBatchesRerun counts such batches". The 11 others
// complete while the transaction is open, the batch that met the held saga
// is counted as given up, and once the transaction rolls back the held
// saga completes within 15 s (its command was moved back to the outbox: a
// relay row due later, the relay polling once a minute).
func TestKafkaModeCancelTxHoldIsABusySaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k := newKmode(t, "r19kheld", false, nil)
	ids := k.backlog(t, "s", 12)
	const held = 3
	tx, err := k.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	require.NoError(t, k.client.CancelTx(ctx, tx, ids[held], "review19: an operator's transaction"))
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	for i, id := range ids {
		if i != held {
			k.completedOnce(t, e, id, false, wait)
		}
	}
	require.Empty(t, k.fx.Counts(t, ids[held]))
	st := e.Stats()
	t.Logf("while held: batched %d, rerun %d, deferred %d; steps run twice %v", st.BusBatched, st.BusBatchesRerun, st.Deferred, k.calls.twice())
	require.Positive(t, st.Deferred, "the held saga's command was not moved back")
	require.Positive(t, st.BusBatchesRerun, "the batch that met the held saga (s3 of a backlog of 12, read 16 at a time) was not counted as given up")
	require.NoError(t, tx.Rollback(ctx))
	released := time.Now()
	k.completedOnce(t, e, ids[held], false, within)
	t.Logf("the held saga completed %s after the rollback", time.Since(released).Round(time.Millisecond))
}

// Kafka mode, one worker, BatchSize 16: a backlog of 10 sagas that await a
// signal after step a, with a malformed record (no headers) after the third
// and the seventh saga held by an operator's CancelTx until a batch was
// given up (BusBatchesRerun), so their batch is run one message at a time. Their sagas
// were read ahead and "count as running on this engine from then on": once
// each waits for its signal, nothing runs, and an operator's Cancel must be
// applied at once ("when no step of the saga runs, it is applied at once")
// and a Pause must hold the saga until Resume. All within 15 s, the relay
// and engine polling once a minute.
func TestKafkaModeOperatorsAfterAGivenUpBatch(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r19kops", true, nil)
	ids := k.backlog(t, "s", 3)
	off := produce(t, k.kc, &kgo.Record{Topic: k.topic, Key: []byte("poison"), Value: []byte("not a command")})
	ids = append(ids, k.backlog(t, "t", 7)...)
	// An operator's transaction holds s6 (CancelTx): a busy saga, which
	// gives the batch up (TestKafkaModeCancelTxHoldIsABusySaga).
	hctx := context.Background()
	htx, err := k.db.Pool.Begin(hctx)
	require.NoError(t, err)
	defer func() { _ = htx.Rollback(hctx) }()
	require.NoError(t, k.client.CancelTx(hctx, htx, ids[6], "review19: hold it a moment"))
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	testkit.WaitFor(t, wait, "a batch given up", func() bool { return e.Stats().BusBatchesRerun > 0 })
	require.NoError(t, htx.Rollback(hctx))
	for _, id := range ids {
		testkit.WaitFor(t, wait, "every saga at its await", func() bool {
			in := get(t, e, id)
			return in.Wait != nil && k.fx.Count(t, id, "a") == 1
		})
	}
	dead := k.deadByOffset(t)
	require.NotEmpty(t, dead[off[0]], "the malformed record was not dead-lettered")
	st := e.Stats()
	t.Logf("batched %d, rerun %d; steps run twice %v", st.BusBatched, st.BusBatchesRerun, k.calls.twice())

	ctx := context.Background()
	acted := time.Now()
	for _, i := range []int{0, 2, 5} {
		require.NoError(t, e.Cancel(ctx, ids[i], "review19: cancel a waiting saga"))
	}
	for _, i := range []int{1, 4} {
		require.NoError(t, e.Pause(ctx, ids[i], "review19: hold it"))
		k.signal(t, ids[i])
	}
	for i, id := range ids {
		switch i {
		case 0, 2, 5:
			in := endedWithin(t, e, id, within-time.Since(acted))
			require.Equal(t, saga.StatusCompensated, in.Status, "s%d %v", i, testkit.Timeline(in))
			require.Equal(t, map[string]int{"a": 1, "a-undo": 1}, k.fx.Counts(t, id), "s%d", i)
		case 1, 4:
		default:
			k.signal(t, id)
		}
	}
	for i, id := range ids {
		if i != 0 && i != 2 && i != 5 && i != 1 && i != 4 {
			k.completedOnce(t, e, id, true, within)
		}
	}
	testkit.Hold(t, time.Second, "the paused sagas do not go on", func() bool {
		return k.fx.Count(t, ids[1], "go") == 0 && k.fx.Count(t, ids[4], "go") == 0
	})
	resumed := time.Now()
	for _, i := range []int{1, 4} {
		require.NoError(t, e.Resume(ctx, ids[i], "review19: go on"))
	}
	for _, i := range []int{1, 4} {
		k.completedOnce(t, e, ids[i], true, within-time.Since(resumed))
	}
}
