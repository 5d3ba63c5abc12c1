package review18

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/wire"
)

// The participant's promise (participant/doc.go, Handle): "The handler
// runs in the service's own transaction, which records the step-scoped key
// first ... A permanent error is sent back as a refusal, and the handler's
// writes are undone"; "The handler may open savepoints in tx (tx.Begin)
// but not end it: tx.Commit and tx.Rollback return an error, since the
// transaction is the consumer's and may carry other commands too". And
// inbox.ConsumerConfig.BatchSize: "each message gets its own key and its
// handler runs as it would alone". These tests put several commands in one
// transaction with Inbox.ProcessTx, as a batching consumer does.

// checkBatch checks every command of a committed batch: it ran once, kept
// exactly its mode's moves (none when refused), and has one reply, its
// mode's.
func (r *participantRig) checkBatch(t *testing.T, label string, cmds []command) {
	t.Helper()
	for i, c := range cmds {
		m := modes[c.cmd.Mode]
		want := m.moves
		if !m.ok {
			want = nil
		}
		require.Equal(t, want, nilIfEmpty(r.moves(t, c.cmd.ID)), "%s: command %d (%s): its moves", label, i, c.cmd.Mode)
		require.Equal(t, 1, r.runsOf(c.key), "%s: command %d (%s): its handler ran once", label, i, c.cmd.Mode)
		rs := replies(t, r.db, c.key.String())
		require.Equal(t, []string{m.reply()}, replyShape(rs), "%s: command %d (%s): its reply", label, i, c.cmd.Mode)
		require.Equal(t, c.msgID, rs[0].InReplyTo, "%s: command %d: the reply names its command", label, i)
		require.Equal(t, r.replyTo, rs[0].topic)
	}
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// redeliver sends every command of a committed batch again, in one new
// transaction (a batch of duplicates): a step that ran is not run again and
// its reply is sent again, naming the new command; a refused one is not
// recorded, so it runs again (and, its mode unchanged, is refused again).
func (r *participantRig) redeliver(t *testing.T, label string, cmds []command) {
	t.Helper()
	again := make([]command, len(cmds))
	for i, c := range cmds {
		again[i] = c.again()
	}
	for i, fresh := range r.batch(t, again...) {
		require.True(t, fresh, "%s: redelivery %d has a new message id", label, i)
	}
	for i, c := range again {
		m := modes[c.cmd.Mode]
		rs := replies(t, r.db, c.key.String())
		require.Equal(t, []string{m.reply(), m.reply()}, replyShape(rs), "%s: redelivery %d (%s): replies", label, i, c.cmd.Mode)
		require.Equal(t, c.msgID, rs[1].InReplyTo, "%s: redelivery %d (%s): the second reply answers the second command", label, i, c.cmd.Mode)
		runs := 1
		if !m.ok {
			runs = 2
		}
		require.Equal(t, runs, r.runsOf(c.key), "%s: redelivery %d (%s): handler runs", label, i, c.cmd.Mode)
		if m.ok {
			require.Equal(t, m.moves, r.moves(t, c.cmd.ID), "%s: redelivery %d (%s): nothing more kept", label, i, c.cmd.Mode)
			require.JSONEq(t, string(rs[0].Result), string(rs[1].Result), "%s: redelivery %d: the same result", label, i)
		} else {
			require.Empty(t, r.moves(t, c.cmd.ID), "%s: redelivery %d (%s)", label, i, c.cmd.Mode)
		}
	}
}

func (r *participantRig) runSequence(t *testing.T, label string, ms []string) {
	t.Helper()
	cmds := make([]command, len(ms))
	for i, m := range ms {
		cmds[i] = newCommand(m)
	}
	for i, fresh := range r.batch(t, cmds...) {
		require.True(t, fresh, "%s: command %d", label, i)
	}
	r.checkBatch(t, label, cmds)
	r.redeliver(t, label, cmds)
}

// Every sequence of three of {success, refusal, panic} (27) in one
// transaction, then the same commands again in a second one.
func TestParticipantEveryOrderOfThreeOutcomesInOneTransaction(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	kinds := []string{"ok", "refuse", "panic"}
	for a := range kinds {
		for b := range kinds {
			for c := range kinds {
				ms := []string{kinds[a], kinds[b], kinds[c]}
				r.runSequence(t, kinds[a]+","+kinds[b]+","+kinds[c], ms)
			}
		}
	}
}

// Every order (24) of a success, a refusal, a panic and a refusal after a
// statement that failed and left the transaction aborted.
func TestParticipantEveryOrderWithAnAbortedHandlerInOneTransaction(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	var perm func(prefix, rest []string)
	perm = func(prefix, rest []string) {
		if len(rest) == 0 {
			r.runSequence(t, join(prefix), prefix)
			return
		}
		for i := range rest {
			next := append(append([]string(nil), rest[:i]...), rest[i+1:]...)
			perm(append(append([]string(nil), prefix...), rest[i]), next)
		}
	}
	perm(nil, []string{"ok", "refuse", "panic", "sqlrefuse"})
}

// Every worst-user handler (nested savepoints committed, rolled back, left
// open; a statement failing inside one; tx.Commit and tx.Rollback called),
// shuffled, 16 times, each in one transaction with the others.
func TestParticipantHostileHandlersShuffledInOneTransaction(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	var all []string
	for m := range modes {
		if m != "refuseonce" {
			all = append(all, m)
		}
	}
	all = sorted(all)
	rng := rand.New(rand.NewPCG(18, 18))
	for i := range 16 {
		ms := append([]string(nil), all...)
		rng.Shuffle(len(ms), func(a, b int) { ms[a], ms[b] = ms[b], ms[a] })
		r.runSequence(t, "shuffle "+join(ms), ms)
		_ = i
	}
	// Every tx.Commit and tx.Rollback a handler called returned an error.
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NotEmpty(t, r.endErrs)
	for k, errs := range r.endErrs {
		for _, err := range errs {
			require.Error(t, err, "%s: a handler ended the consumer's transaction", k)
		}
	}
}

func join(s []string) string {
	out := ""
	for i, x := range s {
		if i > 0 {
			out += ","
		}
		out += x
	}
	return out
}

// Duplicates of one step key inside one transaction: the step runs once, a
// copy under another message id gets the reply again, the same message id
// again is an inbox duplicate. A refused step is refused again by its copy
// (a refusal is not recorded); one refused first and then carried out by
// its copy in the same transaction keeps one effect, and later copies get
// the success. Then all of them again in a second transaction.
func TestParticipantDuplicatesInOneTransaction(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	ok := newCommand("ok")
	ref := newCommand("refuse")
	once := newCommand("refuseonce")
	end := newCommand("endtx")
	okCopy, refCopy, onceCopy, endCopy := ok.again(), ref.again(), once.again(), end.again()
	fresh := r.batch(t, ok, okCopy, ok, ref, once, refCopy, onceCopy, end, endCopy, once, end)
	require.Equal(t, []bool{true, true, false, true, true, true, true, true, true, false, false}, fresh,
		"a message id seen before in the same transaction is a duplicate")

	require.Equal(t, 1, r.runsOf(ok.key))
	require.Equal(t, []string{"do"}, r.moves(t, ok.cmd.ID))
	rs := replies(t, r.db, ok.key.String())
	require.Equal(t, []string{"ok", "ok"}, replyShape(rs), "the copy got the reply again")
	require.Equal(t, []string{ok.msgID, okCopy.msgID}, []string{rs[0].InReplyTo, rs[1].InReplyTo})

	require.Equal(t, 2, r.runsOf(ref.key), "a refusal is not recorded: its copy runs again")
	require.Empty(t, r.moves(t, ref.cmd.ID))
	require.Equal(t, []string{"refused:no_stock", "refused:no_stock"}, replyShape(replies(t, r.db, ref.key.String())))

	require.Equal(t, 2, r.runsOf(once.key))
	require.Equal(t, []string{"do"}, r.moves(t, once.cmd.ID), "refused, then carried out by its copy: one effect")
	require.Equal(t, []string{"refused:no_stock", "ok"}, replyShape(replies(t, r.db, once.key.String())))

	require.Equal(t, 1, r.runsOf(end.key), "a handler that tried to end the transaction ran once")
	require.Equal(t, []string{"do", "after"}, r.moves(t, end.cmd.ID))
	require.Equal(t, []string{"ok", "ok"}, replyShape(replies(t, r.db, end.key.String())))

	// Across batches.
	r.batch(t, ok.again(), ref.again(), once.again(), end.again())
	require.Equal(t, 1, r.runsOf(ok.key))
	require.Equal(t, 3, r.runsOf(ref.key))
	require.Equal(t, 2, r.runsOf(once.key))
	require.Equal(t, 1, r.runsOf(end.key))
	require.Equal(t, []string{"do"}, r.moves(t, ok.cmd.ID))
	require.Equal(t, []string{"do"}, r.moves(t, once.cmd.ID))
	require.Equal(t, []string{"do", "after"}, r.moves(t, end.cmd.ID))
	require.Equal(t, []string{"ok", "ok", "ok"}, replyShape(replies(t, r.db, ok.key.String())))
	require.Equal(t, []string{"refused:no_stock", "ok", "ok"}, replyShape(replies(t, r.db, once.key.String())))
	require.Equal(t, []string{"ok", "ok", "ok"}, replyShape(replies(t, r.db, end.key.String())))
}

// A compensation before its forward step in the same transaction closes
// the step: the forward is refused with compensated_before_run at once and
// again when it comes, and never runs; a forward before its compensation
// in the same transaction runs, and so does the compensation. Mixed with
// other commands, and duplicated in the same transaction and the next.
func TestParticipantCompensationBeforeItsForwardInOneTransaction(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	early := newCommand("ok")    // its compensation comes first
	normal := newCommand("ok")   // forward, then compensation
	other := newCommand("panic") // a neighbour refused in between
	earlyComp := early.compensation("ok")
	normalComp := normal.compensation("ok")
	r.batch(t, earlyComp, other, normal, early, earlyComp.again(), normalComp, early.again())

	fwd, comp := early.key.String(), earlyComp.key.String()
	require.Equal(t, 0, r.runsOf(early.key), "the forward never runs after its compensation")
	require.Equal(t, 1, r.runsOf(earlyComp.key), "the compensation ran once")
	require.Equal(t, []string{"undo"}, r.moves(t, early.cmd.ID))
	for _, s := range replyShape(replies(t, r.db, fwd)) {
		require.Equal(t, "refused:"+participant.CodeCompensatedBeforeRun, s)
	}
	require.Len(t, replies(t, r.db, fwd), 3, "refused at the compensation, and at each of the two forward commands")
	require.Equal(t, []string{"ok", "ok"}, replyShape(replies(t, r.db, comp)), "the compensation's copy got its reply again")

	require.Equal(t, []string{"do", "undo"}, r.moves(t, normal.cmd.ID))
	require.Equal(t, []string{"ok"}, replyShape(replies(t, r.db, normal.key.String())))
	require.Equal(t, []string{"ok"}, replyShape(replies(t, r.db, normalComp.key.String())))
	require.Empty(t, r.moves(t, other.cmd.ID))

	// The next transaction: the forward again, still refused, still not run.
	r.batch(t, early.again())
	require.Equal(t, 0, r.runsOf(early.key))
	require.Equal(t, []string{"undo"}, r.moves(t, early.cmd.ID))
	require.Len(t, replies(t, r.db, fwd), 4)
}

// A compensation refused before its forward (the warehouse is closed) in
// one transaction with the forward: what happens to the forward is not
// said in so many words; what must hold is that no effect of the forward is
// left standing after its compensation has been carried out. The
// compensation is then carried out (its cause fixed, as after
// Engine.Resume), and the forward comes once more.
func TestParticipantRefusedCompensationBeforeItsForward(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	c := newCommand("ok")
	comp := c.compensation("refuse")
	r.batch(t, comp, c)
	fwdReplies := replyShape(replies(t, r.db, c.key.String()))
	t.Logf("after a refused compensation and then its forward in one transaction: forward runs %d, forward replies %v, moves %v",
		r.runsOf(c.key), fwdReplies, r.moves(t, c.cmd.ID))
	require.Equal(t, []string{"refused:no_stock"}, replyShape(replies(t, r.db, comp.key.String())))

	fixed := comp.again()
	fixed.cmd.Mode = "ok"
	r.batch(t, fixed, c.again())
	moves := r.moves(t, c.cmd.ID)
	t.Logf("after the compensation was carried out and the forward came again: moves %v, forward replies %v", moves,
		replyShape(replies(t, r.db, c.key.String())))
	do, undo := 0, 0
	for _, m := range moves {
		switch m {
		case "do":
			do++
		case "undo":
			undo++
		}
	}
	require.Equal(t, 1, undo, "the compensation was carried out once")
	require.LessOrEqual(t, do, 1, "the forward ran at most once")
	if do == 1 {
		require.Equal(t, []string{"do", "undo"}, moves, "a forward that ran, ran before its compensation")
	}
	require.Equal(t, 2, r.runsOf(comp.key), "the refused compensation ran again once its cause was fixed")
}

// Step keys of the longest step name (64 bytes, wire.MaxNameBytes) share
// their first 63 bytes (PostgreSQL's identifier length) across epochs and
// directions: a step's savepoint is "opened with its step key" (CHANGELOG).
// Steps of one saga under such keys, successes and refusals interleaved in
// one transaction, each undo their own writes only.
func TestParticipantLongStepKeysInOneTransaction(t *testing.T) {
	t.Parallel()
	r := newParticipantRig(t, "svc", "sagaflow.commands.r18.replies", "")
	long := strings.Repeat("s", wire.MaxNameBytes)
	base := newCommand("ok")
	base.key.Step = long
	mk := func(epoch int, mode string) command {
		c := base.again()
		c.key.Epoch = epoch
		c.cmd.Mode = mode
		c.cmd.ID = fmt.Sprintf("%s-e%d", base.cmd.ID, epoch)
		return c
	}
	cmds := []command{mk(0, "ok"), mk(1, "refuse"), mk(2, "nestcommit"), mk(3, "panic"), mk(4, "sqlrefuse"), mk(5, "endtx"),
		mk(6, "nestleakref"), mk(7, "ok")}
	comp := mk(0, "ok").compensation("refuse")
	all := append(append([]command(nil), cmds...), comp)
	for i, fresh := range r.batch(t, all...) {
		require.True(t, fresh, "command %d", i)
	}
	r.checkBatch(t, "long keys", cmds)
	require.Equal(t, []string{"do"}, r.moves(t, cmds[0].cmd.ID), "the refused compensation undid only its own writes")
	require.Equal(t, []string{"refused:no_stock"}, replyShape(replies(t, r.db, comp.key.String())))
	r.redeliver(t, "long keys", cmds)
}
