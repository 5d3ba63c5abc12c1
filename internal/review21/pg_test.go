package review21

import (
	"context"
	"errors"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// act has eng do op on saga id, noting first that its operator acted.
func (r *rig) act(t *testing.T, eng *saga.Engine, id uuid.UUID, op, reason string) error {
	t.Helper()
	r.actedOn(id)
	ctx := opCtx(t)
	switch op {
	case "cancel":
		return eng.Cancel(ctx, id, reason)
	case "request":
		return eng.RequestCancel(ctx, id, reason)
	case "pause":
		return eng.Pause(ctx, id, reason)
	}
	t.Fatalf("unknown op %q", op)
	return nil
}

// sharedWithHead fails the test unless at least one of ids ran its step
// gateStep in the head's transaction: the scenario (a batch held by its
// head, with these sagas later in it) happened.
func (r *rig) sharedWithHead(t *testing.T, ids []uuid.UUID) {
	t.Helper()
	n := 0
	for _, id := range ids {
		if r.sameTx(id, r.gateStep) {
			n++
		}
	}
	require.NotZero(t, n, "no untouched batch mate ran in the head's transaction: the batch was not what the test meant")
	t.Logf("%d of %d untouched sagas ran in the head's transaction", n, len(ids))
}

// Postgres-only, one worker, BatchSize 16: twelve sagas' step b commands
// are one batch, whose head is held. An operator tool (an engine with no
// definition) asks two of the others to cancel (RequestCancel) and pauses
// two; a second engine that knows the definition but runs nothing (a
// client) cancels two; the running engine itself cancels two more. Guarantee 10: a cancel request "goes ahead of the saga's next
// command, whatever that is, so no step after it runs"; "Pause": a paused
// saga starts no new step. No handler of those eight is called after its
// operator acted, the cancelled end compensated, the paused complete once
// after Resume (from the tool), the rest complete once.
func TestBatchMatesStoppedByAnOperatorTool(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21tool", "b", nil)
	ids := r.startN(t, 12, nil)
	e, head, m := r.run(t, ids)
	cancelled := []uuid.UUID{m[0], m[1], m[2], m[3], m[6], m[7]}
	paused := []uuid.UUID{m[4], m[5]}
	untouched := append([]uuid.UUID{head}, m[8:]...)
	require.NoError(t, r.act(t, r.client, m[0], "cancel", "review21: client cancel"))
	require.NoError(t, r.act(t, r.client, m[1], "cancel", "review21: client cancel"))
	require.NoError(t, r.act(t, r.ops, m[2], "request", "review21: tool request"))
	require.NoError(t, r.act(t, r.ops, m[3], "request", "review21: tool request"))
	require.NoError(t, r.act(t, r.ops, m[4], "pause", "review21: tool pause"))
	require.NoError(t, r.act(t, r.ops, m[5], "pause", "review21: tool pause"))
	require.NoError(t, r.act(t, e, m[6], "cancel", "review21: engine cancel"))
	require.NoError(t, r.act(t, e, m[7], "cancel", "review21: engine cancel"))
	r.openAged(t)

	for _, id := range untouched {
		r.completedOnce(t, e, id)
	}
	r.sharedWithHead(t, m[8:])
	for _, id := range cancelled {
		r.cancelledClean(t, e, id)
	}
	for _, id := range paused {
		r.heldPaused(t, e, id, 500*time.Millisecond)
		require.NoError(t, r.ops.Resume(context.Background(), id, "review21: go on"))
	}
	for _, id := range paused {
		r.completedOnce(t, e, id)
	}
	t.Logf("stats %+v", e.Stats())
}

// As above, but every cancel request and pause is a row written straight
// into the tables, with no notification: the engine hears of nothing and
// its poll is a minute away. The batch read its sagas more than 100 ms
// before their turn (the test holds the head for 300 ms after the writes),
// so, guarantee 10: it "reads its requests and pauses again, so a late
// notification does not let the step start". The head itself gets a cancel
// row too while its step runs: the step returns success unheard of, and
// the request goes ahead of its next command, so step c never runs and a,
// b are undone.
func TestBatchMatesStoppedWithNoNotification(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21quiet", "b", nil)
	ids := r.startN(t, 14, nil)
	e, head, m := r.run(t, ids)
	cancelled, paused, untouched := m[:5], m[5:10], m[10:]
	for _, id := range cancelled {
		r.sqlCancel(t, id, "review21: lost notification")
	}
	for _, id := range paused {
		r.sqlPause(t, &id, "review21: lost notification")
	}
	r.sqlCancel(t, head, "review21: the head, unheard of")
	r.openAged(t)

	for _, id := range untouched {
		r.completedOnce(t, e, id)
	}
	r.sharedWithHead(t, untouched)
	for _, id := range cancelled {
		r.cancelledClean(t, e, id)
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called", id)
	}
	r.cancelledClean(t, e, head)
	require.Equal(t, map[string]int{"a": 1, "a-undo": 1, "b": 1, "b-undo": 1}, r.fx.Counts(t, head))
	for _, id := range paused {
		r.heldPaused(t, e, id, 300*time.Millisecond)
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called", id)
		require.NoError(t, r.ops.Resume(context.Background(), id, "review21: go on"))
	}
	for _, id := range paused {
		r.completedOnce(t, e, id)
	}
	t.Logf("stats %+v", e.Stats())
}

// A pause of the whole saga type while a slow batch of its sagas runs,
// through PauseType (notified) and as a row written with no notification.
// "Pause": PauseType pauses "every saga named name that has not ended"; a
// batch "looks at the pauses again before each step it has yet to run".
// No batch mate's step b is called; the head's step finishes and its next
// command waits; in the "api" case a mate is also cancelled during the
// pause ("its compensations wait for the resume"). ResumeType releases
// everything: each saga completes (or compensates) once.
func TestTypePauseDuringASlowBatch(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"api", "sql"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, nil, "r21type"+how, "b", nil)
			ids := r.startN(t, 9, nil)
			e, head, m := r.run(t, ids)
			for _, id := range m {
				r.actedOn(id)
			}
			if how == "api" {
				fresh, err := r.ops.PauseType(opCtx(t), r.name, "review21: type pause")
				require.NoError(t, err)
				require.True(t, fresh)
				require.NoError(t, r.ops.RequestCancel(opCtx(t), m[0], "review21: cancel while type-paused"))
			} else {
				r.sqlPause(t, nil, "review21: type pause, unheard of")
			}
			r.openAged(t)

			testkit.WaitFor(t, within, "the head's step b to commit", func() bool { return r.fx.Count(t, head, "b") == 1 })
			testkit.Hold(t, time.Second, "no saga of the paused type starts a step", func() bool {
				for _, id := range ids {
					if r.afterOf(id, "b")+r.afterOf(id, "c") > 0 || r.callsOf(head, "c") > 0 {
						return false
					}
					if in := get(t, e, id); in.Paused == nil || !in.Paused.Type {
						return false
					}
				}
				return true
			})
			// The mates' step b must not have run at all, whatever the
			// after-marks say.
			for _, id := range m {
				require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called under a type pause", id)
			}
			ok, err := r.ops.ResumeType(context.Background(), r.name)
			require.NoError(t, err)
			require.True(t, ok)
			r.completedOnce(t, e, head)
			for i, id := range m {
				if how == "api" && i == 0 {
					r.cancelledClean(t, e, id)
					require.Equal(t, map[string]int{"a": 1, "a-undo": 1}, r.fx.Counts(t, id))
					continue
				}
				r.completedOnce(t, e, id)
			}
		})
	}
}

// Operators racing each other on sagas later in a held batch: pause then
// cancel then resume; cancel then pause then resume; pause then resume
// (no cancel: runs once); a cancel row with no notification then pause and
// resume; a pause row with no notification then Cancel (then Resume, as
// the compensations of a paused saga wait for it); Cancel twice and
// RequestCancel. Each cancelled saga is cancelled once ("Applying it is
// recorded"), none of their handlers is called after the first operator
// acted, and the others complete once.
func TestCancelPauseResumeRacesInAHeldBatch(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21race", "b", nil)
	ids := r.startN(t, 11, nil)
	e, head, m := r.run(t, ids)
	ctx := opCtx(t)
	bg := context.Background()

	// m0: pause, cancel, resume.
	require.NoError(t, r.act(t, r.ops, m[0], "pause", "review21: p"))
	require.NoError(t, e.Cancel(ctx, m[0], "review21: c after p"))
	require.NoError(t, r.ops.Resume(ctx, m[0], "review21: r"))
	// m1: cancel, pause, resume.
	require.NoError(t, r.act(t, e, m[1], "cancel", "review21: c"))
	if err := r.ops.Pause(ctx, m[1], "review21: p after c"); err == nil {
		require.NoError(t, r.ops.Resume(ctx, m[1], "review21: r"))
	} else {
		require.ErrorIs(t, err, saga.ErrNotRunning)
	}
	// m2: pause then resume, no cancel: its step runs, once.
	require.NoError(t, r.ops.Pause(ctx, m[2], "review21: p"))
	require.NoError(t, r.ops.Resume(ctx, m[2], "review21: r"))
	// m3: a cancel row unheard of, then pause and resume through the API.
	r.sqlCancel(t, m[3], "review21: quiet cancel")
	require.NoError(t, r.ops.Pause(ctx, m[3], "review21: p"))
	require.NoError(t, r.ops.Resume(ctx, m[3], "review21: r"))
	// m4: a pause row unheard of, then Cancel.
	r.sqlPause(t, &m[4], "review21: quiet pause")
	require.NoError(t, e.Cancel(ctx, m[4], "review21: c of a quietly paused saga"))
	// m5: Cancel twice, RequestCancel.
	require.NoError(t, r.act(t, e, m[5], "cancel", "review21: c1"))
	if err := e.Cancel(ctx, m[5], "review21: c2"); err != nil {
		require.ErrorIs(t, err, saga.ErrNotRunning)
	}
	if err := r.ops.RequestCancel(ctx, m[5], "review21: c3"); err != nil {
		require.ErrorIs(t, err, saga.ErrNotRunning)
	}
	r.openAged(t)

	untouched := append([]uuid.UUID{head, m[2]}, m[6:]...)
	for _, id := range untouched {
		r.completedOnce(t, e, id)
	}
	r.sharedWithHead(t, m[6:])
	for _, id := range []uuid.UUID{m[0], m[1], m[3], m[5]} {
		r.cancelledClean(t, e, id)
	}
	// m4's compensation waits for the resume of its pause.
	testkit.Hold(t, 500*time.Millisecond, "the quietly paused, cancelled saga compensates nothing before its resume", func() bool {
		return r.fx.Count(t, m[4], "a-undo") == 0 && r.afterOf(m[4], "b") == 0
	})
	err := r.ops.Resume(bg, m[4], "review21: r")
	if err != nil && !errors.Is(err, saga.ErrNotReplayable) {
		require.NoError(t, err)
	}
	r.cancelledClean(t, e, m[4])
	for _, id := range []uuid.UUID{m[0], m[1], m[3], m[4], m[5]} {
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called", id)
	}
}

// Hostile reasons on operators while a batch runs: a NUL, invalid UTF-8,
// 10 kB of letters, all of them at once. Pause: "The reason is stored as
// text PostgreSQL accepts: a NUL becomes the two characters \0, invalid
// UTF-8 becomes U+FFFD, and it is cut to at most 2000 bytes." The batch
// reads those requests and pauses again; none of it may cost the batch its
// transaction (the untouched mates complete once) or let a stopped saga's
// step run.
func TestHostileReasonsWhileABatchRuns(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil, "r21hostile", "b", nil)
	ids := r.startN(t, 10, nil)
	e, head, m := r.run(t, ids)
	big := testkit.RandomLetters(10 << 10)
	all := "x\x00y\xff\xfe" + big + "\x00"
	require.NoError(t, r.act(t, e, m[0], "cancel", "stop\x00now"))
	require.NoError(t, r.act(t, r.ops, m[1], "request", "bad \xff\xfe utf8"))
	require.NoError(t, r.act(t, r.client, m[2], "cancel", big))
	require.NoError(t, r.act(t, e, m[3], "cancel", all))
	require.NoError(t, r.act(t, r.ops, m[4], "pause", all))
	require.NoError(t, r.act(t, e, m[5], "pause", "\x00"))
	r.sqlCancel(t, m[6], big) // a long reason the API would have cut, unheard of
	r.openAged(t)

	untouched := append([]uuid.UUID{head}, m[7:]...)
	for _, id := range untouched {
		r.completedOnce(t, e, id)
	}
	r.sharedWithHead(t, m[7:])
	for _, id := range []uuid.UUID{m[0], m[1], m[2], m[3], m[6]} {
		r.cancelledClean(t, e, id)
		require.Zero(t, r.callsOf(id, "b"), "%s: step b's handler was called", id)
	}
	for _, id := range []uuid.UUID{m[4], m[5]} {
		r.heldPaused(t, e, id, 300*time.Millisecond)
		in := get(t, e, id)
		require.LessOrEqual(t, len(in.Paused.Reason), 2000, "%s: reason cut to 2000 bytes", id)
		require.True(t, utf8.ValidString(in.Paused.Reason), "%s: reason valid UTF-8", id)
		require.NotContains(t, in.Paused.Reason, "\x00")
		require.NoError(t, r.ops.Resume(context.Background(), id, all))
	}
	for _, id := range []uuid.UUID{m[4], m[5]} {
		r.completedOnce(t, e, id)
	}
}

// Two tenants whose schema names differ only in case, with the same saga
// name and the same saga ids, each with its batch held. Tenant A's engine
// cancels every one of its sagas (its head's running step included, which
// the notification interrupts) and pauses nothing; tenant B is left alone.
// Guarantee 10's notification and the batch's read again must stay in
// their schema: every saga of B completes once, its head's step is not
// interrupted (its context stays live), and every saga of A ends
// compensated with no step after the cancel.
func TestTwoCaseTenantsSameSagaIDs(t *testing.T) {
	t.Parallel()
	da, db := caseTenants(t)
	a := newRig(t, da, "r21tenant", "b", nil)
	b := newRig(t, db, "r21tenant", "b", nil)
	ids := make([]uuid.UUID, 8)
	for i := range ids {
		ids[i] = uuid.New()
	}
	a.startN(t, len(ids), ids)
	b.startN(t, len(ids), ids)
	ea, headA, matesA := a.run(t, ids)
	eb, headB, _ := b.run(t, ids)
	t.Logf("head of A's batch %s, of B's %s", headA, headB)
	for _, id := range matesA {
		require.NoError(t, a.act(t, ea, id, "cancel", "review21: tenant A only"))
	}
	a.sqlPause(t, nil, "review21: tenant A's type, unheard of")
	// A's head's cancel: a notification in A (its step is interrupted).
	a.actedOn(headA)
	require.NoError(t, ea.Cancel(opCtx(t), headA, "review21: tenant A's head"))
	time.Sleep(aged)
	require.Zero(t, b.gate.Left(), "B's head step was interrupted by tenant A's cancel")
	b.gate.Open()
	a.gate.Open()

	for _, id := range ids {
		b.completedOnce(t, eb, id)
	}
	require.Zero(t, b.gate.Left(), "B's head step was interrupted")
	ok, err := a.ops.ResumeType(context.Background(), a.name)
	require.NoError(t, err)
	require.True(t, ok)
	for _, id := range ids {
		a.cancelledClean(t, ea, id)
		require.Zero(t, a.fx.Count(t, id, "c"))
	}
	require.Zero(t, a.fx.Count(t, headA, "b"), "A's head's step b committed despite its cancel")
}
