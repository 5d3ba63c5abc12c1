package review18

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/wire"
)

// sameTx lists the sagas whose effect what was written in the transaction
// that wrote saga id's: the batch it ran in.
func (k *kmode) sameTx(t *testing.T, id uuid.UUID, what string) []uuid.UUID {
	t.Helper()
	rows, err := k.db.Pool.Query(context.Background(), `SELECT DISTINCT saga_id FROM `+k.fx.Table()+` WHERE txid IN
		(SELECT txid FROM `+k.fx.Table()+` WHERE saga_id = $1 AND what = $2) AND saga_id <> $1`, id, what)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	return out
}

// Kafka mode, a backlog of 20 sagas on one partition, one worker, BatchSize
// 16: the first saga's step a is held at a gate, so its batch, whose sagas
// were read and locked before any ran, waits. Meanwhile an operator cancels
// two sagas of the backlog, pauses one and signals one (the others were
// signalled before). saga/doc.go "Pause": a batch "looks at the pauses again
// before each step it has yet to run: a step whose saga is paused then
// waits"; guarantee 10: a cancel request "goes ahead of the saga's next
// command, whatever that is, so no step after it runs"; Cancel: "No later
// step runs". Every other saga completes with each effect once.
func TestKafkaModeOperatorsWhileABatchRuns(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r18kops", 1, true, nil)
	ids := k.backlog(t, "s", 20)
	cancelled := map[int]bool{2: true, 6: true, 13: true}
	const paused, lateSignal = 4, 9
	for i, id := range ids {
		if i != lateSignal {
			k.signal(t, context.Background(), id)
		}
	}
	gate, liveCtx := k.holdS0(t)
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	testkit.WaitFor(t, wait, "s0's step a at the gate", func() bool { return gate.Entered() == 1 })

	ctx := opCtx(t)
	for i := range cancelled {
		require.NoError(t, e.Cancel(ctx, ids[i], "review18: cancel while the batch runs"), "Cancel of s%d", i)
	}
	require.NoError(t, e.Pause(ctx, ids[paused], "review18: pause while the batch runs"))
	k.signal(t, ctx, ids[lateSignal])
	time.Sleep(300 * time.Millisecond) // the notifications reach the engine
	gate.Open()

	for i, id := range ids {
		if cancelled[i] || i == paused {
			continue
		}
		k.completedOnce(t, e, id, true)
	}
	for i := range cancelled {
		c := k.cancelledClean(t, e, ids[i])
		live, _ := liveCtx.Load(ids[i])
		// Whether step a ran at all is F1 (TestKafkaModeCancelOfSagasLaterInTheBatch).
		t.Logf("s%d cancelled while its command was in the batch: effects %v, a called %d times (ctx live at the call: %v)", i, c, k.callsOf(ids[i], "a"), live)
	}
	testkit.Hold(t, time.Second, "the paused saga starts no step", func() bool {
		in := get(t, e, ids[paused])
		return in.Paused != nil && in.Status == saga.StatusRunning && len(k.fx.Counts(t, ids[paused])) == 0
	})
	require.NoError(t, e.Resume(context.Background(), ids[paused], "review18: go on"))
	k.completedOnce(t, e, ids[paused], true)

	st := e.Stats()
	t.Logf("batched %d, deferred %d, stale %d, dedup %d, cancels %d; s0's batch: %d other sagas",
		st.BusBatched, st.Deferred, st.StaleDiscarded, st.Deduplicated, st.CancelsApplied, len(k.sameTx(t, ids[0], "a")))
	logBatched(t, "commands", st.BusBatched)
	require.Empty(t, k.deadLetters(t))
}

// Kafka mode with signing on: a backlog on one partition holding two
// genuine commands, then copies of the first (the same record; a new
// message id, which is not signed), and forgeries naming the second saga
// (unsigned; the second's record with its saga id header changed; with a
// wrong signature), then ten more sagas. security.md: "What is consumed is
// verified before any effect: a message without a valid signature is
// dead-lettered with the reason unverified"; a replay of a whole genuine
// message is made harmless by "step keys, version fences and the inbox".
func TestKafkaModeDuplicatesAndForgeriesInOneBatch(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r18kforge", 1, false, []byte("review18-shared-signing-key"))
	ids := k.backlog(t, "s", 2)
	msgs, err := k.kc.ReadAll(context.Background(), k.topic)
	require.NoError(t, err)
	byKey := map[string]kafka.Message{}
	for _, m := range msgs {
		byKey[string(m.Key)] = m
	}
	rec := func(m kafka.Message) *kgo.Record {
		r := &kgo.Record{Topic: k.topic, Partition: 0, Key: m.Key, Value: m.Value}
		for _, h := range m.Headers {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		return r
	}
	g0, g1 := byKey[ids[0].String()], byKey[ids[1].String()]
	exact := rec(g0)
	newID := rec(g0)
	setHeader(newID, wire.HeaderMessageID, []byte(uuid.NewString()))
	unsigned := rec(g1)
	var hs []kgo.RecordHeader
	for _, h := range unsigned.Headers {
		if h.Key != wire.HeaderSignature {
			hs = append(hs, h)
		}
	}
	unsigned.Headers = hs
	setHeader(unsigned, wire.HeaderMessageID, []byte(uuid.NewString()))
	otherSaga := rec(g1)
	setHeader(otherSaga, wire.HeaderSagaID, []byte(ids[0].String()))
	setHeader(otherSaga, wire.HeaderMessageID, []byte(uuid.NewString()))
	wrongSig := rec(g1)
	setHeader(wrongSig, wire.HeaderSignature, []byte("v1="+strings.Repeat("0", 64)))
	setHeader(wrongSig, wire.HeaderMessageID, []byte(uuid.NewString()))
	offsets := produce(t, k.kc, exact, unsigned, newID, otherSaga, wrongSig)
	more := k.backlog(t, "m", 10)

	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	for _, id := range append(ids, more...) {
		k.completedOnce(t, e, id, false)
	}
	time.Sleep(500 * time.Millisecond)
	letters := k.deadLetters(t)
	got := map[int64]string{}
	for _, l := range letters {
		require.NotNil(t, l.Offset)
		got[*l.Offset] = l.Reason
	}
	t.Logf("dead letters: %v; stats %+v", got, e.Stats())
	require.Len(t, letters, 3, "the three forgeries, once each")
	for _, off := range []int64{offsets[1], offsets[3], offsets[4]} {
		require.Contains(t, got[off], "unverified", "offset %d", off)
	}
	for i := range ids {
		require.Equal(t, 1, k.callsOf(ids[i], "a"), "s%d: its step a ran once", i)
	}
	logBatched(t, "commands", e.Stats().BusBatched)
}

// Kafka mode: an operator's transaction holds one saga of the backlog
// (CancelTx: "When no step of the saga runs at the call, tx holds the saga
// until it ends"), or locks its row. Guarantee 8: "In Kafka mode a command
// that cannot run yet (its saga busy ...) is moved back to the outbox rather
// than held in its partition. Workers keep serving everything else." The
// other sagas of the partition complete while the transaction is open; the
// held saga runs once it ends (rolled back), or is compensated with nothing
// to undo (committed: the cancel applies).
func TestKafkaModeSagaHeldByAnotherTransaction(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"canceltx-rollback", "canceltx-commit"} {
		t.Run(v, func(t *testing.T) {
			t.Parallel()
			k := newKmode(t, "r18kheld"+strings.ReplaceAll(v, "-", ""), 1, false, nil)
			ids := k.backlog(t, "s", 12)
			const heldIdx = 3
			ctx := context.Background()
			tx, err := k.db.Pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			require.NoError(t, k.client.CancelTx(ctx, tx, ids[heldIdx], "review18: an operator's transaction"))
			e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
			began := time.Now()
			for i, id := range ids {
				if i == heldIdx {
					continue
				}
				k.completedOnce(t, e, id, false)
			}
			t.Logf("%s: the other %d sagas completed in %s while the transaction was open; stats %+v", v, len(ids)-1,
				time.Since(began).Round(time.Millisecond), e.Stats())
			require.Empty(t, k.fx.Counts(t, ids[heldIdx]), "nothing of the held saga ran")
			if v == "canceltx-commit" {
				require.NoError(t, tx.Commit(ctx))
				in := testkit.WaitEnded(t, e, ids[heldIdx])
				require.Equal(t, saga.StatusCompensated, in.Status, "%v", timeline(in))
				require.Empty(t, k.fx.Counts(t, ids[heldIdx]), "%v", timeline(in))
				require.Zero(t, k.callsOf(ids[heldIdx], "a"))
			} else {
				require.NoError(t, tx.Rollback(ctx))
				k.completedOnce(t, e, ids[heldIdx], false)
			}
			require.Empty(t, k.deadLetters(t))
		})
	}
}

// Kafka mode, two engines in one consumer group over a topic of four
// partitions, two workers each, BatchSize 8, a backlog of 40 sagas: an
// operator cancels one saga while its step b is held and pauses another
// while its step b is held (then resumes it). Every saga ends as documented,
// each effect once.
func TestKafkaModeTwoEnginesOneGroup(t *testing.T) {
	t.Parallel()
	k := newKmode(t, "r18k2e", 4, false, nil)
	ids := k.backlog(t, "s", 40)
	const cancelIdx, pauseIdx = 5, 7
	gates := map[string]*testkit.Gate{"s5": testkit.NewGate(), "s7": testkit.NewGate()}
	var n5, n7 atomic.Int32
	k.setHook(func(ctx context.Context, run *saga.StepRun, o *ord) error {
		if run.Step != "b" {
			return nil
		}
		if (o.ID == "s5" && n5.Add(1) == 1) || (o.ID == "s7" && n7.Add(1) == 1) {
			if err := gates[o.ID].Pass(ctx); err != nil {
				return err
			}
			if err := ctx.Err(); err != nil {
				return errors.Join(err, errors.New("review18: cancelled"))
			}
		}
		return nil
	})
	for _, g := range gates {
		t.Cleanup(g.Open)
	}
	e1, _ := testkit.StartEngine(t, k.db.Pool, k.config(2, 8), k.def)
	e2, _ := testkit.StartEngine(t, k.db.Pool, k.config(2, 8), k.def)
	// s5's and s7's commands may share a partition, and then the one behind
	// waits for the other's gate: act on whichever is held first.
	acts := []struct {
		e   *saga.Engine
		idx int
		op  string
		g   *testkit.Gate
	}{{e2, cancelIdx, "cancel", gates["s5"]}, {e1, pauseIdx, "pause", gates["s7"]}}
	for len(acts) > 0 {
		next := -1
		testkit.WaitFor(t, wait, "step b of s5 or s7 at its gate", func() bool {
			for i, a := range acts {
				if a.g.Entered() >= 1 {
					next = i
					return true
				}
			}
			return false
		})
		a := acts[next]
		testkit.ActWhileHeld(t, a.e, ids[a.idx], a.op, a.g, wait)
		acts = append(acts[:next], acts[next+1:]...)
	}

	for i, id := range ids {
		if i == cancelIdx || i == pauseIdx {
			continue
		}
		k.completedOnce(t, e1, id, false)
	}
	in := testkit.WaitEnded(t, e1, ids[cancelIdx])
	require.Equal(t, saga.StatusCompensated, in.Status, "%v", timeline(in))
	c := k.fx.Counts(t, ids[cancelIdx])
	require.Equal(t, 1, c["a"], "%v", c)
	require.Equal(t, 1, c["a-undo"], "%v", c)
	require.Equal(t, c["b"], c["b-undo"], "b kept only if it returned success anyway, then compensated: %v", c)
	require.Zero(t, c["c"], "%v", c)

	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(testkit.Poll) {
		in := get(t, e1, ids[pauseIdx])
		if in.Paused == nil || k.fx.Count(t, ids[pauseIdx], "c") != 0 {
			t.Fatalf("the paused saga started a step after b, or is not paused: paused %+v, effects %v, b called %d times; %v",
				in.Paused, k.fx.Counts(t, ids[pauseIdx]), k.callsOf(ids[pauseIdx], "b"), timeline(in))
		}
	}
	require.Equal(t, 1, k.fx.Count(t, ids[pauseIdx], "b"), "the step that ran when the pause committed finished")
	require.NoError(t, e2.Resume(context.Background(), ids[pauseIdx], "review18: go on"))
	k.completedOnce(t, e1, ids[pauseIdx], false)
	s1, s2 := e1.Stats(), e2.Stats()
	t.Logf("engine 1: succeeded %d batched %d; engine 2: succeeded %d batched %d", s1.StepsSucceeded, s1.BusBatched, s2.StepsSucceeded, s2.BusBatched)
	require.Empty(t, k.deadLetters(t))
}

// Kafka mode, one worker, BatchSize 16, a backlog of 10 sagas on one
// partition: s0's step a is held at a gate, and while its batch waits an
// operator cancels s1 to s5, whose commands are in the batch behind s0's,
// then waits 300 ms (for the engine to hear of it) and lets s0 go. Guarantee
// 10: a cancel request "goes ahead of the saga's next command, whatever that
// is, so no step after it runs": s1 to s5 end compensated without their step
// a having committed (a cancelled step is rolled back).
func TestKafkaModeCancelOfSagasLaterInTheBatch(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"kafka", "postgres-only"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			cancelLaterInTheBatch(t, mode)
		})
	}
}

// cancelLaterInTheBatch is TestKafkaModeCancelOfSagasLaterInTheBatch in
// Kafka mode, or (the control) in the Postgres-only mode, whose worker claims
// up to BatchSize due commands and runs them in one transaction.
func cancelLaterInTheBatch(t *testing.T, mode string) {
	k := newKmode(t, "r18kcancel"+strings.ReplaceAll(mode, "-", ""), 1, false, nil)
	cfg := k.config(1, 16)
	var ids []uuid.UUID
	if mode == "kafka" {
		ids = k.backlog(t, "s", 10)
	} else {
		cfg.Kafka = nil
		k.client = testkit.NewEngine(t, k.db.Pool, cfg, k.def)
		for i := range 10 {
			st, err := saga.Start(context.Background(), k.client, k.def, ord{ID: "s" + string(rune('0'+i))}, nil)
			require.NoError(t, err)
			ids = append(ids, st.ID)
		}
	}
	gate, liveCtx := k.holdS0(t)
	e, _ := testkit.StartEngine(t, k.db.Pool, cfg, k.def)
	testkit.WaitFor(t, wait, "s0's step a at the gate", func() bool { return gate.Entered() == 1 })
	ctx := opCtx(t)
	for i := 1; i <= 5; i++ {
		require.NoError(t, e.Cancel(ctx, ids[i], "review18: cancel while the batch runs"), "Cancel of s%d", i)
	}
	time.Sleep(300 * time.Millisecond)
	gate.Open()
	for i := range ids {
		if i >= 1 && i <= 5 {
			continue
		}
		k.completedOnce(t, e, ids[i], false)
	}
	var ran []string
	for i := 1; i <= 5; i++ {
		c := k.cancelledClean(t, e, ids[i])
		live, _ := liveCtx.Load(ids[i])
		t.Logf("%s s%d: effects %v, a called %d times (ctx live at the call: %v); in s0's transaction: %v", mode, i, c,
			k.callsOf(ids[i], "a"), live, contains(k.sameTx(t, ids[0], "a"), ids[i]))
		if k.callsOf(ids[i], "a") > 0 {
			ran = append(ran, "s"+string(rune('0'+i)))
			if len(ran) == 1 {
				t.Logf("%s s%d: %v", mode, i, timeline(get(t, e, ids[i])))
			}
		}
	}
	t.Logf("%s: stats %+v", mode, e.Stats())
	require.Empty(t, ran, "%s: sagas whose step a ran after Cancel had returned", mode)
}

func contains(ids []uuid.UUID, id uuid.UUID) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// Kafka mode, two messages of one saga next to each other in one batch
// ("unless two messages name one saga (the second reads what the first
// wrote)"): for each of 8 sagas, its first command, an exact copy of it, and
// the wake-up of a signal sent before the saga reaches its await. The copy
// finds the step done; the wake-up finds the saga not yet waiting, and the
// await then takes the kept signal. Every saga completes, each effect once.
func TestKafkaModeTwoMessagesOfOneSagaInOneBatch(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"wake", "copy-newid", "copy", "both"} {
		t.Run(v, func(t *testing.T) {
			t.Parallel()
			twoMessagesOfOneSaga(t, v)
		})
	}
}

func twoMessagesOfOneSaga(t *testing.T, v string) {
	k := newKmode(t, "r18kpair"+strings.ReplaceAll(v, "-", ""), 1, true, nil)
	ctx := context.Background()
	var ids []uuid.UUID
	for i := range 8 {
		st, err := saga.Start(ctx, k.client, k.def, ord{ID: "s" + string(rune('0'+i))}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
		k.waitOnTopic(t, st.ID)
		msgs, err := k.kc.ReadAll(ctx, k.topic)
		require.NoError(t, err)
		m := msgs[len(msgs)-1]
		require.Equal(t, st.ID.String(), string(m.Key))
		cp := &kgo.Record{Topic: k.topic, Partition: 0, Key: m.Key, Value: m.Value}
		for _, h := range m.Headers {
			cp.Headers = append(cp.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		if v == "copy-newid" {
			setHeader(cp, wire.HeaderMessageID, []byte(uuid.NewString()))
		}
		if v != "wake" {
			produce(t, k.kc, cp)
		}
		if !strings.HasPrefix(v, "copy") {
			k.signal(t, ctx, st.ID)
		}
	}
	per := 3
	if v != "both" {
		per = 2
	}
	testkit.WaitFor(t, wait, "every saga's messages on the topic", func() bool {
		msgs, err := k.kc.ReadAll(ctx, k.topic)
		require.NoError(t, err)
		return len(msgs) >= per*len(ids)
	})
	if strings.HasPrefix(v, "copy") {
		for _, id := range ids {
			k.signal(t, ctx, id)
		}
	}
	e, _ := testkit.StartEngine(t, k.db.Pool, k.config(1, 16), k.def)
	var calls []int
	for _, id := range ids {
		k.completedOnce(t, e, id, true)
		calls = append(calls, k.callsOf(id, "a"), k.callsOf(id, "b"), k.callsOf(id, "c"))
	}
	st := e.Stats()
	t.Logf("%s: batched %d, stale %d, dedup %d, deferred %d; calls of a, b, c per saga %v", v, st.BusBatched, st.StaleDiscarded, st.Deduplicated, st.Deferred, calls)
	for i, n := range calls {
		require.Equal(t, 1, n, "s%d's step %c ran once", i/3, "abc"[i%3])
	}
	logBatched(t, "commands", st.BusBatched)
	require.Empty(t, k.deadLetters(t))
}

// holdS0 holds s0's first run of step a at a gate, opened when the test
// ends at the latest, and records per saga whether a's ctx was live when a
// was called.
func (k *kmode) holdS0(t *testing.T) (*testkit.Gate, *sync.Map) {
	t.Helper()
	gate := testkit.NewGate()
	var held atomic.Int32
	liveCtx := &sync.Map{} // saga id -> whether a's ctx was live when a was called
	k.setHook(func(ctx context.Context, run *saga.StepRun, o *ord) error {
		if run.Step == "a" {
			liveCtx.Store(run.SagaID, ctx.Err() == nil)
		}
		if o.ID == "s0" && run.Step == "a" && held.Add(1) == 1 {
			return gate.Pass(ctx)
		}
		return nil
	})
	t.Cleanup(gate.Open)
	return gate, liveCtx
}
