package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// await runs step idx of sg, a step that waits (see [Wait]), under
// savepoint sp. It looks, in the step's transaction and by the database's
// clock, at what the step waits for:
//
//   - it came (the signal is there, the child ended, the timer's time is
//     up): the wait ends, with its handler, as a step ends;
//   - its time limit passed: the timeout's outcome;
//   - the saga reached the step just now: the wait starts (a child saga is
//     started), and the step's command is written due at the wait's end;
//   - else the saga waits on, until the same end.
//
// woken says that a wake-up command (a signal arrived, a child ended)
// brought the saga here, not the step's own command: then, when nothing
// came that this step waits for, nothing is written.
//
// The saga's execution lock is held throughout, and a signal's or child's
// wake-up is a command that takes the same lock: whichever of the two
// commits second sees the other, so no wake-up is missed.
func (b *batch) await(ctx context.Context, sg *store.Saga, def *compiled, idx int, key steps.Key, sp string, last, woken bool) (err error) {
	e := b.e
	w := def.steps[idx].wait
	fwd := steps.Forward
	tx := b.tx.step()
	waiting := sg.WaitKind != nil && *sg.WaitKind == w.kind
	var now time.Time
	var sig *store.PendingSignal
	var child *store.Saga
	if w.kind == store.WaitSignal {
		now, sig, err = e.st.ProbeSignal(ctx, tx, sg.ID, w.signal)
	} else {
		now, err = e.st.Now(ctx, tx)
	}
	childGone := false
	if err == nil && w.kind == store.WaitChild && waiting {
		if id, perr := uuid.Parse(deref(sg.WaitFor)); perr == nil {
			child, err = e.st.GetSaga(ctx, tx, id, false)
		} else {
			err = store.ErrNotFound
		}
		if errors.Is(err, store.ErrNotFound) {
			child, err, childGone = nil, nil, true
		}
	}
	if err != nil {
		return fmt.Errorf("saga: wait of saga %s at step %q: %w", sg.ID, sg.StepName, err)
	}

	attempt := sg.Attempt + 1
	run := b.stepRun(sg, key, fwd, attempt)
	timeout := def.steps[idx].timeout
	// ended prepends event to a decision that ends the wait, and drops
	// the wait's timer command when a wake-up ended it.
	ended := func(event string, detail map[string]any) func(*decision) {
		return func(d *decision) {
			e.tel.traceWait(ctx, sg, event)
			det, _ := json.Marshal(detail)
			d.tr.History = append([]store.HistoryEntry{{SagaID: sg.ID, Event: event, StepName: sg.StepName,
				Direction: string(fwd), Epoch: sg.Epoch, Attempt: attempt, Detail: det}}, d.tr.History...)
			if woken && sg.CommandID != nil {
				d.tr.Supersede = append(d.tr.Supersede, *sg.CommandID)
			}
			b.waitEnded = true
		}
	}
	handler := func(call func(ctx context.Context) ([]byte, error), amend, final func(*decision)) error {
		started := time.Now()
		newState, herr := e.callHandler(ctx, b.tx, run, !def.pastPivot(idx), timeout, call)
		return b.outcome(ctx, sg, def, idx, fwd, key, sp, last, attempt, started, newState, herr, amend, final)
	}
	// write queues d; nothing ran that could need rolling back.
	write := func(d decision, done func()) error {
		b.tx.write(sg, e.transition(sg, d), sp, false, last, nil, done)
		return nil
	}

	// cont is the transition of a wait that ended and moved the saga on;
	// moved is set once it is written. The step it moved to then runs at
	// once, in this batch (see [batch.continueAt]); a local step, in the
	// same update as the wait's end (see [batch.thenRun]).
	var cont *store.Transition
	var moved bool
	keep := func(d *decision) {
		if b.runsNextLocal(sg, def, d) {
			d.thenRun = true
			return
		}
		cont = d.tr
		d.applied = func() { moved = true }
	}
	defer func() {
		if cont != nil && err == nil {
			err = b.continueAt(ctx, sg, def, cont, &moved, last)
		}
	}()

	switch {
	case sig != nil:
		return handler(func(ctx context.Context) ([]byte, error) { return w.onSignal(ctx, run, sg.State, sig.Payload) },
			func(d *decision) {
				ended(EventSignalReceived, map[string]any{"signal_id": safetext.Text(sig.SignalID, 200), "seq": sig.Seq})(d)
				d.tr.DeliverSignal, d.tr.DeliverStep = sig.Seq, sg.StepName
				keep(d)
			},
			// The step failed for good on this signal (its payload does
			// not decode, say): it is not kept for another await.
			func(d *decision) {
				d.tr.DeliverSignal, d.tr.DeliverStep = sig.Seq, sg.StepName
				d.tr.RejectSignal = "the step that took it failed for good: " + deref(d.tr.LastErrorCode) + ": " + deref(d.tr.LastError)
			})

	case w.kind == store.WaitChild && waiting && (childGone || Status(child.Status).Terminal()):
		detail := map[string]any{"child_id": deref(sg.WaitFor), "status": "deleted"}
		if child != nil {
			detail["status"] = child.Status
		}
		if child != nil && Status(child.Status) == StatusCompleted {
			return handler(func(ctx context.Context) ([]byte, error) { return w.childDone(ctx, run, sg.State, child.State) },
				func(d *decision) { ended(EventChildEnded, detail)(d); keep(d) }, nil)
		}
		why := fmt.Sprintf("child saga %s (%s) no longer exists", deref(sg.WaitFor), w.childName)
		if child != nil {
			why = fmt.Sprintf("child saga %s (%s) ended %s", child.ID, child.Name, child.Status)
			if child.LastError != nil {
				why += ": " + deref(child.LastErrorCode) + ": " + *child.LastError
			}
		}
		d := e.machine.failure(sg, def, idx, fwd, attempt, steps.Permanent(steps.WithCode(CodeChildFailed, errors.New(why))), 0)
		ended(EventChildEnded, detail)(&d)
		return write(d, func() { b.tx.stats.failed.Add(1) })

	case w.kind == store.WaitTimer && waiting && sg.WaitUntil != nil && !now.Before(*sg.WaitUntil):
		d := e.machine.success(sg, def, idx, fwd, nil, 0, key.String())
		ended(EventTimerFired, map[string]any{"late_ms": now.Sub(*sg.WaitUntil).Milliseconds()})(&d)
		keep(&d)
		succeeded := func() { b.tx.stats.succeeded.Add(1) }
		if d.thenRun {
			return b.thenRun(ctx, sg, def, sp, last, d, nil, succeeded)
		}
		return write(d, func() { succeeded(); moved = true })

	case waiting && w.kind != store.WaitTimer && sg.WaitUntil != nil && !now.Before(*sg.WaitUntil):
		// Nothing came in time.
		leave := func(d *decision) {
			ended(EventWaitTimedOut, map[string]any{"timeout_ms": w.timeout.Milliseconds()})(d)
			e.machine.leaveWait(d.tr, sg, def, idx, "its wait timed out", CodeWaitTimeout)
			d.tr.Supersede = nil // the command that found the time up is the wait's own
		}
		switch {
		case w.onTimeout != nil:
			return handler(func(ctx context.Context) ([]byte, error) { return w.onTimeout(ctx, run, sg.State) }, leave, nil)
		case w.goOn:
			d := e.machine.success(sg, def, idx, fwd, nil, 0, key.String())
			leave(&d)
			return write(d, func() { b.tx.stats.succeeded.Add(1) })
		}
		b.waitEnded = true
		return write(e.machine.waitTimedOut(sg, def, idx), func() { b.tx.stats.failed.Add(1) })

	case woken:
		// A wake-up for something else (another signal's name), or the
		// child has not ended: wait on, as before.
		b.tx.stats.stale.Add(1)
		b.tx.clean = sp
		return nil

	case !waiting:
		return b.startWait(ctx, sg, def, idx, key, sp, last, run, now, ended)
	}
	// The step's command came again (re-delivered, or re-driven by the
	// rescuer) while the saga waits: wait on, until the same end.
	delay := time.Duration(-1)
	if sg.WaitUntil != nil {
		delay = max(sg.WaitUntil.Sub(now), 0)
	}
	return write(e.machine.parked(sg, def, idx, w.kind, deref(sg.WaitFor), delay, false), nil)
}

// startWait starts the wait of step idx, which the saga has just reached:
// a timer computes its end from the state, a child saga is started, and
// the saga is parked (see [machine.parked]).
func (b *batch) startWait(ctx context.Context, sg *store.Saga, def *compiled, idx int, key steps.Key, sp string, last bool,
	run *StepRun, now time.Time, ended func(string, map[string]any) func(*decision)) error {
	e := b.e
	w := def.steps[idx].wait
	fwd := steps.Forward
	attempt := sg.Attempt + 1
	fail := func(herr error) error {
		d := e.machine.failure(sg, def, idx, fwd, attempt, herr, 0)
		b.tx.write(sg, e.transition(sg, d), sp, true, last, nil, func() { b.tx.stats.failed.Add(1) })
		return nil
	}
	delay := time.Duration(-1)
	if w.timeout > 0 {
		delay = w.timeout
	}
	waitFor := ""
	var history []store.HistoryEntry
	switch w.kind {
	case store.WaitTimer:
		out, err := recovered(func() ([]byte, error) {
			d, err := w.delay(sg.State, now)
			delay = d
			return nil, err
		})
		if err != nil {
			return fail(err)
		}
		if delay <= 0 {
			// Its time has come already.
			d := e.machine.success(sg, def, idx, fwd, out, 0, key.String())
			ended(EventTimerFired, map[string]any{"late_ms": 0})(&d)
			b.tx.write(sg, e.transition(sg, d), sp, false, last, nil, func() { b.tx.stats.succeeded.Add(1) })
			return nil
		}
	case store.WaitSignal:
		waitFor = w.signal
	case store.WaitChild:
		id := childID(key)
		var opts *StartOpts
		raw, err := recovered(func() ([]byte, error) {
			raw, o, err := w.childInput(ctx, run, sg.State)
			opts = o
			return raw, err
		})
		if err == nil {
			err = e.startChild(ctx, run.Tx, sg, w, id, raw, opts, key)
		}
		var dbErr *childStoreError
		if errors.As(err, &dbErr) {
			return dbErr.err
		}
		if err != nil {
			return fail(err)
		}
		waitFor = id.String()
		detail, _ := json.Marshal(map[string]string{"child_id": waitFor, "saga": w.childName})
		history = append(history, store.HistoryEntry{SagaID: sg.ID, Event: EventChildStarted, StepName: sg.StepName,
			Direction: string(fwd), Epoch: sg.Epoch, Attempt: attempt, Detail: detail})
	}
	d := e.machine.parked(sg, def, idx, w.kind, waitFor, delay, true)
	d.tr.History = append(d.tr.History, history...)
	b.tx.write(sg, e.transition(sg, d), sp, false, last, nil, nil)
	return nil
}

// childStoreError is a database error while starting a child saga: the
// batch is lost, not the step.
type childStoreError struct{ err error }

func (e *childStoreError) Error() string { return e.err.Error() }

// startChild starts the child saga id of parent's step with key, in db
// (the step's transaction). Starting it again finds it.
func (e *Engine) startChild(ctx context.Context, db store.DBTX, parent *store.Saga, w *compiledWait, id uuid.UUID, raw []byte,
	opts *StartOpts, key steps.Key) error {
	cdef, err := e.lookupOwner(w.childDef, w.childName)
	if err != nil {
		return steps.Permanent(steps.WithCode(CodeChildStart, fmt.Errorf("start child saga %q: %w", w.childName, err)))
	}
	if err := e.checkState(cdef.name, raw); err != nil {
		return steps.Permanent(steps.WithCode(CodeChildStart, err))
	}
	o := StartOpts{}
	if opts != nil {
		o = *opts
	}
	o.ID = id
	keyText := key.String()
	pv := max(parent.DefVersion, 1)
	st, err := e.startRaw(ctx, db, false, cdef, raw, o, &store.Saga{ParentID: &parent.ID, ParentName: &parent.Name, ParentKey: &keyText,
		ParentVersion: &pv})
	switch {
	case err == nil && st.ID != id:
		return steps.Permanent(steps.WithCode(CodeChildStart, fmt.Errorf("start child saga %q: business key %q belongs to saga %s",
			cdef.name, o.BusinessKey, st.ID)))
	case err == nil:
		return nil
	case errors.Is(err, ErrInvalidInput), errors.Is(err, ErrSagaIDTaken):
		return steps.Permanent(steps.WithCode(CodeChildStart, err))
	}
	return &childStoreError{err: err}
}

// wake runs a wake-up command: when the saga waits at a step for a signal
// or a child saga, the step looks again (see [batch.await]); otherwise
// there is nothing to do.
func (b *batch) wake(ctx context.Context, ls *store.LockedSaga, def *compiled, last bool) error {
	sg := &ls.Saga
	idx, known := def.byName[sg.StepName]
	if Status(sg.Status) != StatusRunning || sg.WaitKind == nil || *sg.WaitKind == store.WaitTimer || !known ||
		def.steps[idx].wait == nil || sg.Direction != string(steps.Forward) {
		b.tx.stats.stale.Add(1)
		return nil
	}
	key := steps.Key{SagaID: sg.ID, Step: sg.StepName, Direction: steps.Forward, Epoch: sg.Epoch}
	return b.await(ctx, sg, def, idx, key, b.tx.savepoint(), last, true)
}

// childCancel is the command that makes an engine that knows the child
// saga c asks to cancel look at the request: the child's name and first
// step come from the definition of sg's step that waits for it.
func (e *Engine) childCancel(sg *store.Saga, c *store.ChildCancel) (store.Message, bool) {
	if def := e.lookup(sg); def != nil {
		if idx, ok := def.byName[sg.StepName]; ok && def.steps[idx].wait != nil && def.steps[idx].wait.childName != "" {
			w := def.steps[idx].wait
			return e.nudgeAt(c.ID, w.childName, w.childDef.Version(), w.childFirst, steps.Forward, 0, 1, cancelType), true
		}
	}
	// Only a step that waits for a child names one; the request alone
	// still lands at the child's next command.
	return store.Message{}, false
}

// parentWake is the wake-up of the parent of sg, a child saga that ends,
// addressed to the parent's step that waits for it.
func (e *Engine) parentWake(sg *store.Saga) (store.Message, bool) {
	if sg.ParentName == nil || sg.ParentKey == nil {
		return store.Message{}, false
	}
	k, err := wire.ParseKey(*sg.ParentKey)
	if err != nil || uuid.UUID(k.SagaID) != *sg.ParentID {
		e.log.Error("sagaflow could not wake the parent of a child saga: its parent key does not parse",
			"saga_id", sg.ID.String(), "parent_key", safetext.Text(*sg.ParentKey, 300))
		return store.Message{}, false
	}
	return e.nudgeAt(*sg.ParentID, *sg.ParentName, deref(sg.ParentVersion), k.Step, k.Direction, k.Epoch, 1, wakeType), true
}

// continueAt runs, in this batch, the step that tr (a wait's end or a
// reply) moved sg to, when it runs forward now and is a local action or a
// remote step's send: that step then costs no second claim and commit of
// its own. tr is sent first, and the step runs only when its fence held
// (moved): a step that tr failed instead (its writes refused) must not run
// on top of that failure. The command tr wrote for the step is deleted by
// the step's own transition; it stays, to be claimed later as stale, when
// that transition is replaced by a failure. A command that a pause
// committed since the claim holds (see [Engine.Pause]) is left to wait, as
// are a local step of a paused saga and one whose cancel was asked for.
// After a local step, [batch.successThenSend] sends a remote step instead;
// after a reply or a wait's end, [batch.thenRun] runs a local step in the
// same update.
func (b *batch) continueAt(ctx context.Context, sg *store.Saga, def *compiled, tr *store.Transition, moved *bool, last bool) error {
	idx := tr.StepIndex
	if Status(tr.Status) != StatusRunning || steps.Direction(tr.Direction) != steps.Forward || idx < 0 || idx >= len(def.steps) ||
		len(tr.Messages) == 0 {
		return nil
	}
	s := def.steps[idx]
	if s.wait != nil || s.name != tr.StepName {
		return nil
	}
	id := tr.Messages[len(tr.Messages)-1].ID
	// A local step must not start once a pause has committed: the command
	// tr wrote tells, as the pause's trigger held it or not. The question
	// goes in the round trip that writes tr.
	var held bool
	var ask func(*pgx.Batch)
	if s.remoteTopic == "" {
		ask = func(q *pgx.Batch) { b.e.st.QueueCommandHeld(q, id, &held) }
	}
	if err := b.tx.flushWith(ask); err != nil {
		return err
	}
	if !*moved || b.abandoned != nil || b.e.running.pending(sg.ID) != nil || held || !b.mayChain(sg.ID) {
		// Not written, a cancel request was heard, a pause holds the
		// command, or such a step of the saga was abandoned: the step's
		// command takes the usual way, and the request goes ahead of it.
		return nil
	}
	// The step's span links to the attempt that wrote its command, as a
	// claimed command's does.
	b.tx.supersede(sg.ID, id)
	return b.runNext(ctx, sg, def, tr, id, telemetry.FromMap(tr.Messages[len(tr.Messages)-1].Headers), last)
}

// sendsNext reports whether the step that d, a local step's success, moves
// sg to is a remote step whose command is sent at once, in the same update
// (see [batch.successThenSend]). Not when the saga's cancel was asked for
// (the request goes ahead of the step), nor when d does more than move to
// the next step.
func (b *batch) sendsNext(sg *store.Saga, def *compiled, d *decision) bool {
	tr, c := d.tr, d.next
	if c == nil || c.dir != steps.Forward || c.delay != 0 || c.step != tr.StepName || len(tr.Messages) > 0 ||
		Status(tr.Status) != StatusRunning || steps.Direction(tr.Direction) != steps.Forward || tr.Pause != nil ||
		tr.StepIndex < 0 || tr.StepIndex >= len(def.steps) || def.steps[tr.StepIndex].name != tr.StepName {
		return false
	}
	if _, _, ok := def.remote(tr.StepIndex, steps.Forward); !ok {
		return false
	}
	// Not when the step left the transaction aborted: its failure is
	// written instead. Nor, on a reply worker, when its Command ran past
	// the worker's limit lately.
	return b.abandoned == nil && b.e.running.pending(sg.ID) == nil && !b.tx.aborted() && !b.handsOff(def, tr.StepIndex)
}

// successThenSend writes d, a local step's success (or a reply's, local
// nil) under savepoint sp, and the send of the remote step it moves sg to
// (see [batch.sendsNext]), as one fenced update: d's history and inbox
// key, the send's history, the command for the participant, and the saga
// waiting for the reply (or, when the command cannot be built, the remote
// step's failure). No command is written for a worker to claim, and the
// saga's row is updated once. onFailure and done are d's.
//
// When the remote step's Command uses the transaction, the local step is
// written on its own first, as a step's queued writes go before a step's
// statements; the send then follows under a savepoint of its own, as a
// claimed remote step's would, and only if the local step's fence held.
// The Command runs as a handler (see [batch.command]); one that ignores its
// context past HandlerGrace loses the local step's success with the
// transaction, and is recorded as the local step's attempt (local).
//
// A pause that committed since the claim holds the command as the pause's
// trigger holds any (see [Engine.Pause]). A cancel request recorded before
// the Command returned keeps the command from being sent: it is asked for in
// one round trip after the Command, and the local step is then written with
// the remote step's command for a worker, which the request goes ahead of.
func (b *batch) successThenSend(ctx context.Context, sg *store.Saga, def *compiled, sp string, last bool, d decision,
	onFailure func(error) (*store.Transition, func()), done func(), local *localAttempt) error {
	e := b.e
	before := *sg // as the claim found it: what a lost transaction leaves
	idx := d.tr.StepIndex
	topic, typ, _ := def.remote(idx, steps.Forward)
	nextCmd := d.next
	d.next = nil // the send's command replaces it
	next := movedTo(sg, d.tr)
	next.Version, next.Status = sg.Version+1, d.tr.Status
	key := steps.Key{SagaID: sg.ID, Step: next.StepName, Direction: steps.Forward, Epoch: next.Epoch}

	// apart is set when the Command used the transaction: the local step
	// was then written alone, before its statements, and moved says
	// whether its fence held; sendSP is the send's savepoint.
	apart, moved := false, false
	var sendSP string
	b.tx.before = func() error {
		apart = true
		b.tx.write(sg, e.transition(sg, d), sp, false, last, onFailure, func() { done(); moved = true })
		sendSP = b.tx.savepoint()
		if err := b.tx.flush(); err != nil {
			return err
		}
		if !moved {
			return errors.New("saga: the step before this remote step was not written (the saga moved on, or the step failed)")
		}
		b.tx.stats.chained.Add(1)
		e.tel.beginStep(ctx, b.tx, &next, steps.Forward, e.tel.lastStamped(b.tx), "")
		return nil
	}
	started := time.Now()
	msg, err := b.command(ctx, &next, def, idx, steps.Forward, key, topic, typ)
	var ab *abandonedError
	if errors.As(err, &ab) {
		// (before is left alone: the Command given up may still be
		// running, and its transaction is gone.)
		what := fmt.Sprintf("the Command of remote step %q, run after step %q in its transaction,", next.StepName, before.StepName)
		if local == nil {
			// After a reply: the reply goes with the transaction, and the
			// saga still waits for it. The attempt is the remote step's,
			// recorded against the saga as the reply would have left it,
			// which it is not: only its history entry is written, and the
			// saga's next reply is written on its own (see
			// [batch.mayChain]).
			b.runsAtOnce(sg.ID)
			return b.abandon(abandonedStep{saga: next, def: def, idx: idx, dir: steps.Forward, attempt: next.Attempt + 1,
				elapsed: time.Since(started), historyOnly: true}, what, ", and the reply's transaction with it", ab)
		}
		if ab.cut {
			// Given up on a reply worker (after a reply and the local
			// step): nothing is recorded, and it is the Command that is
			// handed to a worker from now on.
			return b.abandon(abandonedStep{saga: before, def: def, idx: idx, dir: steps.Forward}, what, "", ab)
		}
		// The Command ignored its context: its worker gives the connection
		// up, and the local step's success goes with the transaction. The
		// attempt is recorded as the local step's, which runs again (or
		// fails for good once its attempts are spent).
		return b.abandon(abandonedStep{saga: before, def: def, idx: local.idx, dir: steps.Forward, attempt: local.attempt,
			elapsed: local.elapsed + time.Since(started)}, what, ", and the step's transaction with it", ab)
	}
	b.tx.before = nil
	if apart && !moved {
		return b.tx.broken // nothing to send on top of what was written instead
	}
	// A cancel asked for while the local step or the Command ran, which
	// this engine may not have heard of yet: the request goes first.
	// (Not when the Command left the transaction aborted: its failure is
	// written with its rollback.)
	req, rerr := b.cancelAsked(sg.ID)
	if rerr != nil {
		return rerr
	}
	cancel := req != nil
	if apart {
		switch {
		case cancel:
			// The local step is written without a command for the remote
			// one: write it now, for the worker that meets the request.
			c := decision{tr: transitionFrom(&next), next: nextCmd}
			c.tr.CheckAfter = d.tr.CheckAfter
			b.tx.write(&next, e.transition(&next, c), sendSP, true, last, nil, nil)
		case err != nil:
			tr := e.transition(&next, e.machine.failure(&next, def, idx, steps.Forward, next.Attempt+1, err, 0))
			b.tx.write(&next, tr, sendSP, true, last, nil, func() { b.tx.stats.failed.Add(1) })
		default:
			tr := e.transition(&next, e.machine.sent(&next, def, idx, steps.Forward, msg))
			b.tx.write(&next, tr, sendSP, false, last, nil, nil)
		}
		return nil
	}

	if cancel {
		d.next = nextCmd
		b.tx.write(sg, e.transition(sg, d), sp, false, last, onFailure, done)
		return nil
	}
	// One update. The local step's attempt ends with its own outcome, and
	// the send's begins, linked to it, as a claimed command's attempt links
	// to the attempt that wrote it.
	view := *d.tr
	prev := e.tel.endStepWith(b.tx, sg, &view)
	e.tel.beginStep(ctx, b.tx, &next, steps.Forward, prev, "")
	var then decision
	failed := err != nil
	if failed {
		then = e.machine.failure(&next, def, idx, steps.Forward, next.Attempt+1, err, 0)
	} else {
		then = e.machine.sent(&next, def, idx, steps.Forward, msg)
	}
	b.tx.write(sg, e.transition(sg, successThen(d, then)), sp, false, last, onFailure, func() {
		done()
		b.tx.stats.chained.Add(1)
		if failed {
			b.tx.stats.failed.Add(1)
		}
	})
	return nil
}

// runsNextLocal reports whether the step that d, a reply's success or a
// wait's end, moves sg to is a local action that runs at once in the same
// update (see [batch.thenRun]): not when the saga's cancel was asked for,
// nor when d does more than move to the next step, nor when the
// transaction is already unusable (OnReply or the wait's handler left it
// aborted: its failure is written instead).
func (b *batch) runsNextLocal(sg *store.Saga, def *compiled, d *decision) bool {
	tr, c := d.tr, d.next
	if c == nil || c.dir != steps.Forward || c.delay != 0 || c.step != tr.StepName || len(tr.Messages) > 0 ||
		Status(tr.Status) != StatusRunning || steps.Direction(tr.Direction) != steps.Forward || tr.Pause != nil ||
		tr.StepIndex < 0 || tr.StepIndex >= len(def.steps) {
		return false
	}
	s := def.steps[tr.StepIndex]
	if s.name != tr.StepName || s.remoteTopic != "" || s.wait != nil || s.parallel != nil {
		return false
	}
	return b.abandoned == nil && b.e.running.pending(sg.ID) == nil && !b.tx.aborted() && b.mayChain(sg.ID)
}

// thenRun runs the local step that d, a reply's success or a wait's end
// under savepoint sp, moves sg to (see [batch.runsNextLocal]), and writes
// both in one fenced update: d's history, state, inbox key and signal
// delivery go with the step's outcome, whatever it is (see
// [batchTx.head]), and no command is written for the step. The step's
// savepoint is its own, so that its failure undoes only its writes; a fence
// that fails undoes d's too.
//
// Before the step starts, it asks in one round trip whether a pause
// committed, or a cancel was asked for, since the claim (this engine may not
// have heard of either yet). If so the step does not run: d is written with
// the step's command, which the pause holds or the request goes ahead of.
func (b *batch) thenRun(ctx context.Context, sg *store.Saga, def *compiled, sp string, last bool, d decision,
	onFailure func(error) (*store.Transition, func()), done func()) error {
	e := b.e
	var paused, cancel bool
	if err := b.tx.flushWith(func(q *pgx.Batch) { e.st.QueueSagaStopped(q, sg.ID, sg.Name, &paused, &cancel) }); err != nil {
		return err
	}
	if paused || cancel || e.running.pending(sg.ID) != nil {
		b.tx.write(sg, e.transition(sg, d), sp, false, last, onFailure, done)
		return nil
	}
	d.next = nil // the step's outcome writes its next command
	next := movedTo(sg, d.tr)
	// The version stays: the update that carries the reply is fenced on it.
	next.Status = d.tr.Status
	b.tx.head = &chainHead{sagaID: sg.ID, tr: d.tr, sp: sp, done: func() {
		done()
		b.tx.stats.chained.Add(1)
	}}
	// d's span ends with its own outcome; the step's links to it, as a
	// claimed command's links to the attempt that wrote it.
	ended := *d.tr
	prev := e.tel.endStepWith(b.tx, sg, &ended)
	b.runsAtOnce(sg.ID)
	err := b.execute(e.tel.beginStep(ctx, b.tx, &next, steps.Forward, prev, ""), &next, def, d.tr.StepIndex, steps.Forward, false, last)
	if h := b.tx.takeHead(sg.ID); h != nil && err == nil {
		// Every outcome of a local step writes; a batch that lost one is
		// lost, and the reply comes again.
		err = fmt.Errorf("saga: the step run at once after step %q of saga %s wrote no outcome", d.tr.StepName, sg.ID)
	}
	return err
}

// localAttempt is the local step's attempt that a remote step's send is
// chained to (see [batch.successThenSend]); nil when the send follows a
// reply.
type localAttempt struct {
	idx, attempt int
	elapsed      time.Duration
}

// movedTo is sg as tr leaves it at its step, but for its version and
// status, which move with the write.
func movedTo(sg *store.Saga, tr *store.Transition) store.Saga {
	next := *sg
	next.StepIndex, next.StepName, next.Direction, next.Attempt = tr.StepIndex, tr.StepName, tr.Direction, tr.Attempt
	next.WaitKind, next.WaitFor, next.WaitUntil, next.AwaitingReply = nil, nil, nil, false
	next.LastError, next.LastErrorCode, next.FailedStep = tr.LastError, tr.LastErrorCode, tr.FailedStep
	if tr.State != nil {
		next.State = tr.State
	}
	next.CommandID = nil
	return next
}

// runNext runs the step that tr moved sg to, as a claimed command whose
// id is cmd and whose trace context is prev.
func (b *batch) runNext(ctx context.Context, sg *store.Saga, def *compiled, tr *store.Transition, cmd uuid.UUID, prev trace.SpanContext, last bool) error {
	idx := tr.StepIndex
	next := movedTo(sg, tr) // its version and status moved with the write
	next.CommandID = &cmd
	b.tx.stats.chained.Add(1)
	b.runsAtOnce(sg.ID)
	return b.execute(b.e.tel.beginStep(ctx, b.tx, &next, steps.Forward, prev, ""), &next, def, idx, steps.Forward, false, last)
}

// refresh reads ls's saga again, in the batch's transaction, once its lock
// is held. The claim read it in the snapshot of its statement, which can
// predate the commit of the transaction that held the lock a moment
// before; and a command of this batch may have moved it since (the read
// sends the batch's queued writes first, so it sees them, and no queued
// write is left to restore the row it replaces). A step command does not mind (it was written with the saga's
// version, and a stale read only fails the fence), but a wake-up or a
// cancel command, written by another transaction, would be judged against
// the older row: a wake-up would find the saga "not waiting" just as it
// starts to, and be lost.
func (b *batch) refresh(ctx context.Context, ls *store.LockedSaga) (gone bool, err error) {
	fresh, err := b.e.st.GetSaga(ctx, b.tx.step(), ls.ID, false)
	if errors.Is(err, store.ErrNotFound) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("saga: read saga %s: %w", ls.ID, err)
	}
	ls.Saga = *fresh
	return false, nil
}
