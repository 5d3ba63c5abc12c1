package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

type batchResult struct {
	claimed      int
	readyCreated bool // a command that is due now was written
	// one is the command claimed, when the batch claimed exactly one
	// (also when it then failed).
	one uuid.UUID
}

// batch is the work of one transaction: it dispatches each command it was
// given (see [batch.handle]) and writes what the state machine decides
// ([machine]) in its transaction.
type batch struct {
	e *Engine
	// tx is the batch's transaction, which queues the commands' writes.
	tx        *batchTx
	delivered []uuid.UUID
	deferred  []deferral
	// abandoned is set when a handler overran; the transaction is lost.
	abandoned *abandonedStep
	// msg is the Kafka message being run, in Kafka mode; nil when commands
	// come straight from the outbox.
	msg *kafka.Message
	// waitEnded is set when a wait of a saga in the batch ended (a timer
	// fired, a signal was delivered, a child's end seen, a time limit
	// passed).
	waitEnded bool
	// announce is how many more workers to wake after the commit (a
	// parallel step's branches, one each).
	announce int
	// ranAtOnce holds the sagas whose step this batch ran at once after a
	// reply or a wait's end; unchained, those whose step it must not (see
	// [batch.mayChain]).
	ranAtOnce, unchained map[uuid.UUID]bool
	// judged holds the sagas whose cancel request and pauses this batch
	// has considered reading again (see [batch.rereadOperators]).
	judged map[uuid.UUID]bool
}

// mayChain reports whether the step of saga id that a reply or a wait's
// end moved it to may run at once, in the same batch. Not when such a step
// of the saga was abandoned since (see [Engine.unchain]): its attempt was
// then lost with the transaction, the reply or the wait's end with it, and
// only its history entry was recorded; run at once again, a step that never
// returns would be abandoned again and again, its attempts never counted and
// its saga never moving. Written with its command instead, the step is
// claimed on its own, and an abandoned attempt counts. The answer holds for
// the rest of the batch.
func (b *batch) mayChain(id uuid.UUID) bool {
	if b.unchained[id] {
		return false
	}
	if _, ok := b.e.unchain.LoadAndDelete(id); ok {
		if b.unchained == nil {
			b.unchained = map[uuid.UUID]bool{}
		}
		b.unchained[id] = true
		return false
	}
	return true
}

// runsAtOnce notes that the step of saga id runs at once after a reply or
// a wait's end (see [batch.mayChain]).
func (b *batch) runsAtOnce(id uuid.UUID) {
	if b.ranAtOnce == nil {
		b.ranAtOnce = map[uuid.UUID]bool{}
	}
	b.ranAtOnce[id] = true
}

// newBatch returns a batch in tx; msg is the Kafka message it runs, or nil
// for commands claimed from the outbox.
func (e *Engine) newBatch(tx *batchTx, msg *kafka.Message) *batch {
	return &batch{e: e, tx: tx, msg: msg}
}

// transition is the fenced update that applies d to sg, with the command of
// the saga's next position, written for its next version.
func (e *Engine) transition(sg *store.Saga, d decision) *store.Transition {
	if c := d.tr.CancelChild; c != nil {
		if m, ok := e.childCancel(sg, c); ok {
			d.tr.Messages = append([]store.Message{m}, d.tr.Messages...)
		}
	}
	if Status(d.tr.Status).Terminal() && sg.ParentID != nil {
		// A child saga ends: its parent waits for that.
		if m, ok := e.parentWake(sg); ok {
			d.tr.Messages = append([]store.Message{m}, d.tr.Messages...)
		}
	}
	if c := d.next; c != nil {
		ver := sg.DefVersion
		if d.tr.DefVersion != 0 {
			ver = d.tr.DefVersion // a migration moves the saga to another version
		}
		d.tr.Messages = append(d.tr.Messages, e.commandMessage(sg.ID, sg.Name, ver, c.step, c.dir, c.epoch, sg.Version+1, c.delay))
	}
	stampAll(d.tr, sg.TraceContext)
	return d.tr
}

type deferral struct {
	id     uuid.UUID
	reason string
}

// runBatchOn claims up to limit commands of topic, runs their steps in one
// transaction (each under its own savepoint) and commits once.
func (e *Engine) runBatchOn(fetchCtx, ctx context.Context, topic string, limit int) (res batchResult, err error) {
	// Begin, claim, read the sagas and try their locks in one round trip:
	// the sagas are found by the rows' saga_id, which handle checks against
	// the payload before it uses them.
	var (
		claimed []store.Claimed
		sagas   map[uuid.UUID]*store.LockedSaga
	)
	bt, err := e.beginBatchWith(fetchCtx, ctx, func(q *pgx.Batch) {
		e.st.QueueClaimAndLock(q, topic, limit, e.knownAggregates(), e.cfg.UnknownSagaGrace, &claimed, &sagas)
	})
	if err != nil {
		return res, err
	}
	defer bt.end(ctx)
	res.claimed = len(claimed)
	if len(claimed) == 0 {
		return res, nil
	}
	if len(claimed) == 1 {
		res.one = claimed[0].ID
	}
	held := heldSagas(sagas)
	e.running.claim(held...)
	defer e.running.release(held...)

	b := e.newBatch(bt, nil)
	cmds := make([]command, len(claimed))
	derrs := make([]error, len(claimed))
	for i := range claimed {
		cmds[i], derrs[i] = decodeCommand(&claimed[i])
	}
	fault.At(ctx, fault.EngineAfterClaim)
	for i := range claimed {
		err := b.handle(ctx, &claimed[i], cmds[i], derrs[i], sagas, i == len(claimed)-1)
		if errors.Is(err, errAbandoned) {
			return res, e.abandon(ctx, bt, b)
		}
		if err != nil {
			return res, err
		}
	}

	if err := e.finish(ctx, b); err != nil {
		return res, err
	}
	res.readyCreated = bt.readyDirect()
	return res, nil
}

// finish ends a batch: it sends the queued outcomes; then, in one round
// trip, it leaves the steps' savepoints, deletes the consumed direct
// commands, defers the ones whose saga was busy, and commits; and it
// announces new commands (see [Engine.announce]).
//
// The commands are deleted outside every savepoint: a row locked by the
// transaction (the claim) and deleted by one of its subtransactions gets a
// MultiXact as its deleter, and index scans never mark such a row's entries
// dead, so every claim would step over every consumed command until vacuum
// removed it.
func (e *Engine) finish(ctx context.Context, b *batch) error {
	t := b.tx
	if err := t.flush(); err != nil {
		return fmt.Errorf("saga: finish batch: %w", err)
	}
	tail := func(end *pgx.Batch) {
		if t.outer != "" {
			end.Queue("RELEASE SAVEPOINT " + t.outer)
		}
		if len(b.delivered) > 0 && b.msg == nil {
			e.st.QueueDeleteDelivered(end, b.delivered)
		}
		for _, d := range b.deferred {
			e.st.QueueDefer(end, []uuid.UUID{d.id}, deferDelay, deferDelayMax, d.reason, func(due time.Duration) { t.later(due, false) })
		}
	}
	if h := e.hooks.beforeCommit; h != nil {
		if err := h(ctx, t.tx); err != nil {
			return err
		}
	}
	fault.At(ctx, fault.EngineBeforeCommit)
	if b.waitEnded {
		fault.At(ctx, fault.EngineWaitBeforeCommit)
	}
	// Counted just before the commit, so that whoever sees the commit sees
	// its counts too; taken back if the commit fails. The tail and the
	// COMMIT go in one round trip: a tail statement that fails leaves the
	// COMMIT unrun, and the batch is rolled back by end.
	e.stats.add(&t.stats, 1)
	if err := t.flushWith(func(end *pgx.Batch) {
		tail(end)
		store.QueueCommit(end, func() { t.committed = true })
	}); err != nil {
		e.stats.add(&t.stats, -1)
		return fmt.Errorf("saga: commit batch: %w", err)
	}
	fault.At(ctx, fault.EngineAfterCommit)
	if b.waitEnded {
		fault.At(ctx, fault.EngineWaitAfterCommit)
	}
	e.wakeIn(t.soonest)
	e.notifyIn(t.soonestRelay)
	if t.ready() {
		// Wakes direct workers, or the relay that publishes Kafka commands
		// and remote steps' commands: only the relay when only it has work.
		if t.readyDirect() {
			e.announce()
		} else {
			e.notifier.request(e)
		}
		for range b.announce {
			e.announce()
		}
	}
	return nil
}

// A command whose saga another transaction holds waits deferDelay, doubling
// per deferral up to deferDelayMax. The first wait is short because the usual
// holder is a transaction that has just committed: PostgreSQL makes a commit
// visible a moment before it releases the committer's locks.
const (
	deferDelay    = 5 * time.Millisecond
	deferDelayMax = 2 * time.Second
)

// park marks a command dead with its reason and, when its saga exists, says so
// in the saga's history. Nothing is dropped: the row stays for an operator.
func (b *batch) park(ctx context.Context, c *store.Claimed, sagaID *uuid.UUID, code, reason string) error {
	reason = safetext.Text(reason, 2000)
	if err := b.tx.flush(); err != nil {
		return err
	}
	// What follows is written after the clean savepoint, if there is one:
	// the next command must not roll back to it.
	b.tx.clean = ""
	b.tx.stats.parked.Add(1)
	b.e.log.WarnContext(ctx, "sagaflow parked a command", slog.String("message_id", safetext.Text(c.IDText(), 200)),
		slog.String("code", code), slog.String("reason", reason))
	if b.msg != nil {
		// From Kafka: the command's bytes go to the dead letters.
		if err := b.e.st.InsertDeadLetter(ctx, b.tx.tx, kafkaDeadLetter(b.msg, c.IDText(), code+": "+reason)); err != nil {
			return err
		}
	} else if err := b.e.st.MarkDead(ctx, b.tx.tx, c.ID, reason); err != nil {
		return err
	}
	if sagaID == nil {
		return nil
	}
	detail, _ := json.Marshal(map[string]string{"message_id": safetext.Text(c.IDText(), 200)})
	return b.e.st.InsertHistory(ctx, b.tx.tx, &store.HistoryEntry{
		SagaID: *sagaID, Event: EventCommandParked, Error: reason, ErrorCode: code, Detail: detail,
	})
}

// unknown defers a command that this engine cannot run (another engine,
// newer or older, may know its saga or step), and parks it once it is older
// than UnknownSagaGrace.
func (b *batch) unknown(ctx context.Context, c *store.Claimed, sagaID *uuid.UUID, code, reason string) (parked bool, err error) {
	if c.Age < b.e.cfg.UnknownSagaGrace {
		b.tx.stats.deferred.Add(1)
		b.deferred = append(b.deferred, deferral{id: c.ID, reason: reason})
		return false, nil
	}
	return true, b.park(ctx, c, sagaID, code, fmt.Sprintf("%s; no engine ran it within UnknownSagaGrace (%s)", reason, b.e.cfg.UnknownSagaGrace))
}

// handle runs one claimed command. A returned error aborts the batch.
func (b *batch) handle(ctx context.Context, c *store.Claimed, cmd command, derr error, sagas map[uuid.UUID]*store.LockedSaga, last bool) error {
	e := b.e
	if derr != nil {
		return b.park(ctx, c, c.SagaID, CodeMalformed, "malformed command: "+derr.Error())
	}
	if c.SagaID == nil || *c.SagaID != cmd.SagaID {
		return b.park(ctx, c, nil, CodeMalformed, fmt.Sprintf("malformed command: payload names saga %s but the row's saga_id is %v", cmd.SagaID, c.SagaID))
	}
	ls := sagas[cmd.SagaID]
	if ls == nil {
		return b.park(ctx, c, nil, CodeUnknownSaga, fmt.Sprintf("saga %s does not exist", cmd.SagaID))
	}
	if ls.Name != cmd.Saga {
		return b.park(ctx, c, &ls.ID, CodeMalformed, fmt.Sprintf("command names saga %q but saga %s is a %q", cmd.Saga, ls.ID, ls.Name))
	}
	def := e.lookup(&ls.Saga)
	if def == nil {
		_, err := b.unknown(ctx, c, &ls.ID, CodeUnknownSaga,
			fmt.Sprintf("no definition named %q at version %d is registered with this engine (registered: %s)", ls.Name,
				max(ls.DefVersion, 1), e.registeredNames()))
		return err
	}
	recording, err := b.recorded(ctx, ls)
	if err != nil {
		return err
	}
	if !ls.Locked || recording {
		// Another transaction runs a step of this saga right now, or an
		// abandoned attempt of it is being recorded (see [Engine.abandon]).
		// A cancel command waits too: the engine running the step was told
		// of the request, and applies it in the step's place.
		b.tx.stats.deferred.Add(1)
		b.deferred = append(b.deferred, deferral{id: c.ID})
		return nil
	}
	if c.Type == wakeType || c.Type == cancelType {
		// Written by another transaction than the saga's last step: judge
		// it against the saga as it is now, this batch's own writes
		// included (see [batch.refresh]).
		if gone, err := b.refresh(ctx, ls); err != nil || gone {
			if gone {
				b.tx.stats.stale.Add(1)
				b.delivered = append(b.delivered, c.ID)
			}
			return err
		}
	}
	if err := b.rereadOperators(ctx, ls); err != nil {
		return err
	}
	// A branch runs beside the others of its group (it holds its own lock,
	// not the saga's), and a branch finds the group gone when the saga's
	// own commands ended it. A paused saga's branch is held; a pending
	// cancel request goes ahead of it as of any command (a branch re-sent by
	// the rescuer, or requeued by an operator, can find a request whose own
	// message was lost: found by review11).
	if c.Type == branchType && ls.Paused && !Status(ls.Status).Terminal() {
		return b.hold(ctx, c, ls)
	}
	if ls.CancelRequest == nil {
		// A request recorded since the claim, heard of while earlier
		// commands of the batch ran.
		ls.CancelRequest = e.running.pending(ls.ID)
	}
	if ls.CancelRequest != nil {
		// A pending cancel request goes ahead of whatever this command is.
		handled, err := b.applyCancel(ctx, c, ls, def, last)
		if err != nil || handled {
			return err
		}
	}
	if c.Type == branchType {
		return b.branch(b.traceStep(ctx, c, &ls.Saga, steps.Forward), c, cmd, ls, def, last)
	}
	if !ls.Paused && (c.Type == wakeType || c.Type == commandType) && b.tx.pauseHeard() {
		// A pause was announced since the batch claimed its commands:
		// this one may be covered by it (found by a docs-only review,
		// whose paused sagas' steps started up to a batch's time after
		// Pause returned).
		paused, err := e.st.SagaPaused(ctx, b.tx.step(), ls.ID, ls.Name)
		if err != nil {
			return err
		}
		ls.Paused = paused
	}
	if ls.Paused && (c.Type == wakeType || c.Type == commandType) && !Status(ls.Status).Terminal() {
		// Paused since the command was written: it waits for the pause to
		// be lifted (see [Engine.Pause]).
		return b.hold(ctx, c, ls)
	}
	if c.Type == wakeType {
		b.delivered = append(b.delivered, c.ID)
		return b.wake(b.traceWake(ctx, c, &ls.Saga), ls, def, last)
	}
	if c.Type == cancelType {
		// Applied or refused already, or forged: the request in the
		// database is what counts, and there is none.
		b.tx.stats.stale.Add(1)
		b.delivered = append(b.delivered, c.ID)
		return nil
	}
	if ls.Version != cmd.Version || Status(ls.Status).Terminal() {
		b.tx.stats.stale.Add(1)
		b.delivered = append(b.delivered, c.ID)
		return nil
	}
	idx, known := def.byName[ls.StepName]
	dir := steps.Direction(ls.Direction)
	if !known || !dir.Valid() {
		reason := fmt.Sprintf("saga %q has no step %q (direction %q)", ls.Name, ls.StepName, ls.Direction)
		parked, err := b.unknown(ctx, c, &ls.ID, CodeUnknownStep, reason)
		if err != nil || !parked {
			return err
		}
		sp := b.tx.savepoint()
		b.tx.write(&ls.Saga, e.transition(&ls.Saga, unknownStep(&ls.Saga, reason)), sp, false, last, nil, nil)
		return nil
	}
	if !cmd.current(c, ls) {
		b.tx.stats.stale.Add(1)
		b.delivered = append(b.delivered, c.ID)
		e.log.WarnContext(ctx, "sagaflow refused a command that is not the saga's current one",
			slog.String("saga_id", ls.ID.String()), slog.String("step", safetext.Text(cmd.Step, 200)), slog.String("saga_step", ls.StepName))
		return nil
	}
	b.delivered = append(b.delivered, c.ID)
	ls.StepIndex = idx // a tool that re-ran the saga without its definition may have left -1
	processed := ls.Processed
	ls.Processed = false // only true for the state it was read in
	return b.execute(b.traceStep(ctx, c, &ls.Saga, dir), &ls.Saga, def, idx, dir, processed, last)
}

// execute runs step idx of the saga in direction dir under a savepoint and
// writes its outcome.
func (b *batch) execute(ctx context.Context, sg *store.Saga, def *compiled, idx int, dir steps.Direction, processed, last bool) error {
	e := b.e
	sp := b.tx.savepoint()
	key := steps.Key{SagaID: sg.ID, Step: sg.StepName, Direction: dir, Epoch: sg.Epoch}
	if processed {
		// The key is in the inbox: this step's effects were committed before.
		// Move on without running it twice.
		tr := e.transition(sg, e.machine.deduplicated(sg, def, idx, dir))
		b.tx.write(sg, tr, sp, false, last, nil, func() { b.tx.stats.dedup.Add(1) })
		return nil
	}
	if topic, typ, ok := def.remote(idx, dir); ok {
		return b.send(ctx, sg, def, idx, dir, key, sp, topic, typ, last)
	}
	if def.steps[idx].wait != nil && dir == steps.Forward {
		return b.await(ctx, sg, def, idx, key, sp, last, false)
	}
	if def.steps[idx].parallel != nil && dir == steps.Forward {
		return b.enterGroup(ctx, sg, def, idx, sp, last)
	}
	attempt := sg.Attempt + 1
	run := b.stepRun(sg, key, dir, attempt)
	if def.steps[idx].parallel != nil {
		// Compensating a parallel step undoes its completed branches.
		var err error
		if run.group, err = b.groupResults(ctx, sg, def, idx); err != nil {
			return err
		}
	}
	started := time.Now()
	cancellable := dir == steps.Forward && !def.pastPivot(idx)
	newState, herr := e.callHandler(ctx, b.tx, run, cancellable, def.steps[idx].timeout, func(ctx context.Context) ([]byte, error) {
		return def.run(ctx, run, idx, dir, sg.State)
	})
	return b.outcome(ctx, sg, def, idx, dir, key, sp, last, attempt, started, newState, herr, nil, nil)
}

// stepRun is the StepRun of attempt of sg's current step, in direction dir.
func (b *batch) stepRun(sg *store.Saga, key steps.Key, dir steps.Direction, attempt int) *StepRun {
	run := &StepRun{
		Tx: b.tx.step(), Key: key, SagaID: sg.ID, SagaName: sg.Name, Step: sg.StepName, Direction: dir,
		Epoch: sg.Epoch, Attempt: attempt,
	}
	if sg.BusinessKey != nil {
		run.BusinessKey = *sg.BusinessKey
	}
	return run
}

// outcome writes what a step's handler returned: newState and herr, after
// it started at started. amend, when set, adds to the decision of a
// success (what a wait's end writes with it); final, to that of a failure
// that is not retried.
func (b *batch) outcome(ctx context.Context, sg *store.Saga, def *compiled, idx int, dir steps.Direction, key steps.Key, sp string,
	last bool, attempt int, started time.Time, newState []byte, herr error, amend, final func(*decision)) error {
	e := b.e
	elapsed := time.Since(started)
	fault.At(ctx, fault.EngineAfterHandler)
	var ab *abandonedError
	if errors.As(herr, &ab) {
		// Run at once after a reply or a wait's end (written with the step,
		// or before it in this batch), the attempt lost what brought it with
		// the transaction: only its history entry is written.
		_, chained := b.tx.superseded[sg.ID]
		atOnce := b.tx.takeHead(sg.ID) != nil || chained
		return b.abandon(abandonedStep{saga: *sg, def: def, idx: idx, dir: dir, attempt: attempt, elapsed: elapsed, historyOnly: atOnce},
			fmt.Sprintf("step %q", sg.StepName), "", ab)
	}
	if reason, code, ok := interruptedBy(herr, sg, dir); ok && !def.pastPivot(idx) {
		// A cancel request interrupted the step: its writes are rolled back
		// and the request applied in its place.
		b.interrupted(sg, def, idx, sp, last, reason, code)
		return nil
	}
	if herr == nil {
		herr = e.machine.checkState(sg.StepName, newState)
	}
	fail := func(herr error) (*store.Transition, func()) {
		d := e.machine.failure(sg, def, idx, dir, attempt, herr, elapsed)
		if final != nil && !d.retry {
			final(&d)
		}
		return e.transition(sg, d), func() {
			b.tx.stats.failed.Add(1)
			if d.retry {
				b.tx.stats.retries.Add(1)
			}
		}
	}
	if herr == nil {
		d := e.machine.success(sg, def, idx, dir, newState, elapsed, key.String())
		if amend != nil {
			amend(&d)
		}
		// If the step's own writes or ours fail inside the transaction (the
		// handler left it aborted, say), the step is undone and a failure
		// recorded instead.
		onFailure := func(err error) (*store.Transition, func()) {
			return fail(steps.WithCode(CodeTxAborted, fmt.Errorf("commit step: %w", err)))
		}
		done := func() {
			b.tx.stats.succeeded.Add(1)
			if d.applied != nil {
				d.applied()
			}
		}
		// A remote step right after this local one sends its command in
		// the same update (see [batch.successThenSend]); a wait's end
		// chains on its own (amend): a local step after it runs in the
		// same update.
		if d.thenRun {
			return b.thenRun(ctx, sg, def, sp, last, d, onFailure, done)
		}
		if amend == nil && dir == steps.Forward && b.sendsNext(sg, def, &d) {
			return b.successThenSend(ctx, sg, def, sp, last, d, onFailure, done, &localAttempt{idx: idx, attempt: attempt, elapsed: elapsed})
		}
		b.tx.write(sg, e.transition(sg, d), sp, false, last, onFailure, done)
		return nil
	}
	tr, done := fail(herr)
	b.tx.write(sg, tr, sp, true, last, nil, done)
	return nil
}

// send runs a remote step: it builds the command, writes it to the outbox
// for the participant, and leaves the saga waiting for the reply, whose
// deadline is the step's Timeout.
func (b *batch) send(ctx context.Context, sg *store.Saga, def *compiled, idx int, dir steps.Direction, key steps.Key, sp, topic, typ string, last bool) error {
	e := b.e
	started := time.Now()
	msg, err := b.command(ctx, sg, def, idx, dir, key, topic, typ)
	var ab *abandonedError
	if errors.As(err, &ab) {
		return b.abandon(abandonedStep{saga: *sg, def: def, idx: idx, dir: dir, attempt: sg.Attempt + 1, elapsed: time.Since(started)},
			fmt.Sprintf("the Command of step %q", sg.StepName), "", ab)
	}
	if reason, code, ok := interruptedBy(err, sg, dir); ok && !def.pastPivot(idx) {
		// A cancel request interrupted the Command: the request is applied
		// in the step's place.
		b.interrupted(sg, def, idx, sp, last, reason, code)
		return nil
	}
	if err == nil && dir == steps.Forward && !def.pastPivot(idx) && Status(sg.Status) == StatusRunning {
		// A cancel asked for while the Command ran, which returned anyway
		// (or which this engine has not heard of yet): nothing is sent, and
		// the request is applied in the step's place, as when it
		// interrupts the Command. One read, after the Command.
		req, rerr := b.cancelAsked(sg.ID)
		if rerr != nil {
			return rerr
		}
		if req != nil && req.Epoch == sg.Epoch {
			b.interrupted(sg, def, idx, sp, last, safetext.Text(req.Reason, MaxReasonBytes), req.Code)
			return nil
		}
	}
	if err != nil {
		tr := e.transition(sg, e.machine.failure(sg, def, idx, dir, sg.Attempt+1, err, 0))
		b.tx.write(sg, tr, sp, true, last, nil, func() { b.tx.stats.failed.Add(1) })
		return nil
	}
	tr := e.transition(sg, e.machine.sent(sg, def, idx, dir, msg))
	b.tx.write(sg, tr, sp, false, last, nil, func() { sg.AwaitingReply = true })
	return nil
}

// cancelAsked returns the cancel request of saga id that came while a
// handler of it ran, after the claim read the saga: one this engine has
// heard of, or else one in the database, read with the batch's queued
// writes in one round trip. It reads nothing when the transaction is
// aborted (a Command that used it failed: its failure is written with the
// rollback).
func (b *batch) cancelAsked(id uuid.UUID) (*store.CancelRequest, error) {
	if req := b.e.running.pending(id); req != nil || b.tx.aborted() {
		return req, nil
	}
	var req *store.CancelRequest
	if err := b.tx.flushWith(func(q *pgx.Batch) { b.e.st.QueueCancelRequest(q, id, &req) }); err != nil {
		return nil, err
	}
	return req, nil
}

// abandon records that a's handler (what, for the error) ignored its
// context past HandlerGrace, as ab says: the batch gives its connection
// up, and a is recorded on its own (see [Engine.abandon]). tail ends the
// error's text.
func (b *batch) abandon(a abandonedStep, what, tail string, ab *abandonedError) error {
	if a.cut = ab.cut; !a.cut {
		a.err = steps.WithCode(CodeAbandonedRunOn, fmt.Errorf("%s ignored its context, cancelled by %s, for %s; its worker abandoned it%s",
			what, ab.why, b.e.cfg.HandlerGrace, tail))
	} else {
		// Run at once on a reply worker past its limit: nothing of the
		// attempt is recorded; the reply comes again, and is written with
		// the step's command for a worker. That step is not run at once
		// after a reply for a while (see [batch.handsOff]).
		b.e.handOff.Store(stepRef{def: a.def, idx: a.idx}, time.Now().Add(handOffFor))
		b.e.log.Warn("sagaflow handed a step run at once after a reply to an engine worker: it ran past "+
			"KafkaConfig.ReplyStepLimit; after replies it runs on a worker for a while",
			slog.String("saga", safetext.Text(a.saga.Name, 200)), slog.String("step", safetext.Text(a.def.steps[a.idx].name, 200)),
			slog.Duration("limit", b.tx.cut), slog.Duration("for", handOffFor))
	}
	b.abandoned = &a
	if b.ranAtOnce[a.saga.ID] {
		b.e.unchain.Store(a.saga.ID, struct{}{})
	}
	return errAbandoned
}

// recorded reports whether an abandoned attempt of ls's saga is being
// recorded by this engine (its commands then wait: see [Engine.abandon]).
// When one was recorded lately and ls is locked, it reads the saga again:
// the claim may have read it as it was before the record committed (its
// statement began before the commit, and took the lock after it), and the
// command of the abandoned attempt would then look current, and run the
// attempt once more.
func (b *batch) recorded(ctx context.Context, ls *store.LockedSaga) (bool, error) {
	v, ok := b.e.recording.Load(ls.ID)
	if !ok {
		return false, nil
	}
	at, done := v.(time.Time)
	switch {
	case !done:
		return true, nil
	case time.Since(at) > recordedFresh:
		b.e.recording.CompareAndDelete(ls.ID, v)
		return false, nil
	case !ls.Locked:
		return false, nil
	}
	_, err := b.refresh(ctx, ls)
	return false, err
}

// operatorReadAge is how old a batch's read of a saga's cancel request and
// pauses may be when the batch comes to run its command; an older one is
// read again (see [batch.rereadOperators]). Within it, the engine's
// notifications tell the batch of a cancel or pause.
const operatorReadAge = 100 * time.Millisecond

// rereadOperators reads saga ls's cancel request and pauses again when the
// batch read them more than operatorReadAge ago (a slow step of the batch
// ran since) and has run nothing of the saga yet: a cancel or pause that
// committed meanwhile then goes ahead of the command even if its
// notification has not come (a loaded machine delivered one more than
// 300 ms late, and a step's handler was called after Cancel had returned).
//
// The read is made in the batch's transaction ahead of the batch's queued
// writes, which it leaves unsent: sent, they lock rows (the outcome of an
// earlier saga of the batch) that a handler of this batch might wait for
// from another connection. Only when a handler left the transaction
// aborted are they sent first, as any step's first statement sends them,
// which undoes that handler's step. (A read on a connection of its own was
// skipped when the pool had none to spare: found by review21.) Once the
// batch has run something of the saga, its own writes say what the saga
// is.
func (b *batch) rereadOperators(ctx context.Context, ls *store.LockedSaga) error {
	if b.judged[ls.ID] {
		return nil
	}
	if b.judged == nil {
		b.judged = map[uuid.UUID]bool{}
	}
	b.judged[ls.ID] = true
	if ls.CancelRequest != nil || time.Since(ls.ReadAt) <= operatorReadAge {
		return nil
	}
	var db store.DBTX = b.tx.tx
	if b.tx.tx.Conn().PgConn().TxStatus() != 'T' {
		db = b.tx.step()
	}
	req, paused, err := b.e.st.OperatorState(ctx, db, ls.ID, ls.Name)
	if err != nil {
		return err
	}
	ls.CancelRequest, ls.Paused, ls.ReadAt = req, ls.Paused || paused, time.Now()
	return nil
}

// handOffFor is how long a step that ran past KafkaConfig.ReplyStepLimit
// after a reply is not run at once after a reply again, on this engine.
const handOffFor = time.Minute

// stepRef names step idx of a registered definition.
type stepRef struct {
	def *compiled
	idx int
}

// handsOff reports whether step idx of def, about to run at once on this
// reply worker (after a reply, or after the local step run so), is handed
// to an engine worker instead: it ran past KafkaConfig.ReplyStepLimit on a
// reply worker lately (see [batch.abandon]).
func (b *batch) handsOff(def *compiled, idx int) bool {
	if b.tx.cut <= 0 {
		return false
	}
	ref := stepRef{def: def, idx: idx}
	until, ok := b.e.handOff.Load(ref)
	if !ok {
		return false
	}
	if time.Now().Before(until.(time.Time)) {
		return true
	}
	b.e.handOff.CompareAndDelete(ref, until)
	return false
}

// interrupted writes, under savepoint sp and in place of step idx's
// outcome, the cancel request (reason, code) that interrupted the step: the
// step's writes are rolled back.
func (b *batch) interrupted(sg *store.Saga, def *compiled, idx int, sp string, last bool, reason, code string) {
	b.e.running.forget(sg.ID)
	tr := b.e.transition(sg, b.e.machine.cancel(sg, def, idx, reason, code))
	b.tx.write(sg, tr, sp, true, last, nil, func() { b.tx.stats.cancelled.Add(1) })
}

// command builds the command of remote step idx of sg in direction dir,
// for topic as type typ, with the step's Command (run as attempt
// sg.Attempt+1, as a handler is: see [Engine.callHandler]), and signs it.
func (b *batch) command(ctx context.Context, sg *store.Saga, def *compiled, idx int, dir steps.Direction, key steps.Key, topic, typ string) (store.Message, error) {
	e := b.e
	run := b.stepRun(sg, key, dir, sg.Attempt+1)
	// As a handler: bounded by the step's Timeout, interrupted by a cancel
	// request (forward, before the pivot), abandoned when it ignores its
	// context past HandlerGrace (an *abandonedError).
	payload, err := e.callHandler(ctx, b.tx, run, dir == steps.Forward && !def.pastPivot(idx), def.steps[idx].timeout,
		func(ctx context.Context) ([]byte, error) { return def.send(ctx, run, idx, dir, sg.State) })
	if err != nil {
		return store.Message{}, err
	}
	return e.remoteCommand(sg, key, topic, typ, payload)
}

// remoteCommand is the message of a remote step's (or branch's) command
// for its participant, with payload, signed: or, for a payload over
// Config.MaxCommandBytes, an error that fails the step for good
// (CodeTooLarge), since the relay would park the message and the saga
// would wait its Timeout for a reply that cannot come.
func (e *Engine) remoteCommand(sg *store.Saga, key steps.Key, topic, typ string, payload []byte) (store.Message, error) {
	if len(payload) > e.cfg.MaxCommandBytes {
		return store.Message{}, steps.Permanent(steps.WithCode(CodeTooLarge, fmt.Errorf(
			"the command of step %q is %d bytes, more than Config.MaxCommandBytes (%d)", key.Step, len(payload), e.cfg.MaxCommandBytes)))
	}
	id := uuid.Must(uuid.NewV7())
	keyText := key.String()
	msg := store.Message{
		ID: id, Topic: topic, Delivery: store.DeliveryRelay, AggregateType: aggregateType(sg.Name, sg.DefVersion),
		AggregateID: sg.ID.String(), Type: typ, Payload: payload, SagaID: &sg.ID, StepKey: &keyText,
		Headers: map[string]string{
			wire.HeaderMessageID: id.String(), wire.HeaderType: typ, wire.HeaderSagaID: sg.ID.String(),
			wire.HeaderStepKey: keyText, wire.HeaderReplyTo: e.replyTopic(sg.Name), wire.HeaderDirection: string(key.Direction),
		},
	}
	e.sign(&msg)
	return msg, nil
}

// reply applies a participant's reply to the saga waiting for it: the step
// completes, or, refused, fails for good. A reply for a step the saga is not
// waiting on (late, duplicate, after a cancel) is dropped.
func (b *batch) reply(ctx context.Context, c *store.Claimed, ls *store.LockedSaga, key steps.Key, last bool) error {
	e := b.e
	b.delivered = append(b.delivered, c.ID)
	sg := &ls.Saga
	def := e.lookup(sg)
	idx, known := 0, false
	if def != nil {
		idx, known = def.byName[sg.StepName]
	}
	if known && def.steps[idx].parallel != nil && strings.HasPrefix(key.Step, sg.StepName+".") {
		return b.branchReply(ctx, c, ls, def, idx, key, last)
	}
	if !known || !sg.AwaitingReply || sg.StepName != key.Step || sg.Direction != string(key.Direction) || sg.Epoch != key.Epoch {
		b.tx.stats.stale.Add(1)
		return nil
	}
	r, err := wire.DecodeReply(c.Payload)
	if err != nil {
		return b.park(ctx, c, &sg.ID, CodeMalformed, "malformed reply: "+err.Error())
	}
	if !r.OK && answersAnother(r.InReplyTo, sg.CommandID) {
		// A refusal of an earlier command under the same key: a copy sent
		// before the saga was resumed, or the answer to a command sent again
		// since. The command the saga waits for gets its own answer.
		b.tx.stats.stale.Add(1)
		return nil
	}
	if !r.OK && r.InReplyTo == "" {
		e.warnUnaddressed(ctx, sg.Name, key.Step)
	}
	sp := b.tx.savepoint()
	dir := key.Direction
	attempt := sg.Attempt + 1
	if !r.OK {
		tr := e.transition(sg, e.machine.refused(sg, def, idx, dir, r))
		sg.AwaitingReply = false // refused: the participant did nothing to undo
		b.tx.write(sg, tr, sp, false, last, nil, func() { b.tx.stats.failed.Add(1) })
		return nil
	}
	run := &StepRun{Tx: b.tx.step(), Key: key, SagaID: sg.ID, SagaName: sg.Name, Step: sg.StepName, Direction: dir,
		Epoch: sg.Epoch, Attempt: attempt}
	newState, herr := recovered(func() ([]byte, error) { return def.reply(ctx, run, idx, sg.State, r.Result) })
	if herr == nil {
		herr = e.machine.checkState(sg.StepName, newState)
	}
	fail := func(herr error) (*store.Transition, func()) {
		tr := e.transition(sg, e.machine.failure(sg, def, idx, dir, attempt, steps.Permanent(herr), 0))
		return tr, func() { b.tx.stats.failed.Add(1) }
	}
	if herr == nil {
		d := e.machine.replied(sg, def, idx, dir, newState, key.String())
		// If OnReply left the transaction unusable, it is undone and a
		// failure recorded instead.
		onFailure := func(err error) (*store.Transition, func()) {
			return fail(steps.WithCode(CodeTxAborted, fmt.Errorf("apply reply: %w", err)))
		}
		done := func() { b.tx.stats.succeeded.Add(1) }
		if !e.allKafka() && b.msg != nil && e.cfg.Kafka.ReplyStepLimit > 0 {
			// On a Kafka reply worker in the hybrid mode, the step run at
			// once after the reply holds up the replies behind it: it may
			// run so for a while only.
			b.tx.cut = e.cfg.Kafka.ReplyStepLimit
			defer func() { b.tx.cut = 0 }()
		}
		if ls.Paused || ls.CancelRequest != nil || (d.next != nil && b.handsOff(def, d.tr.StepIndex)) {
			// The next step's command waits, or the cancel goes first, or
			// the step runs on an engine worker. (mayChain is asked so
			// that an abandonment it remembers is spent.)
			b.mayChain(sg.ID)
			b.tx.write(sg, e.transition(sg, d), sp, false, last, onFailure, done)
			return nil
		}
		// The next step runs at once, in the reply's transaction: a local
		// step in the same update as the reply, when it can.
		if b.runsNextLocal(sg, def, &d) {
			return b.thenRun(ctx, sg, def, sp, last, d, onFailure, done)
		}
		// A remote step next: its command is sent in the same update.
		if b.sendsNext(sg, def, &d) && b.mayChain(sg.ID) {
			return b.successThenSend(ctx, sg, def, sp, last, d, onFailure, done, nil)
		}
		tr := e.transition(sg, d)
		moved := false
		b.tx.write(sg, tr, sp, false, last, onFailure, func() { done(); moved = true })
		return b.continueAt(ctx, sg, def, tr, &moved, last)
	}
	// OnReply failed: its writes are rolled back with the savepoint.
	tr, done := fail(herr)
	b.tx.write(sg, tr, sp, true, last, nil, done)
	return nil
}

// answersAnother reports whether a reply that names the command it answers,
// inReplyTo (wire.Reply.InReplyTo), answers another command than commandID,
// the one its saga waits for. A reply that names none, or a saga that
// records none, cannot tell: false. Every command the engine writes has a
// UUID for its id, so a reply naming anything else answers another.
func answersAnother(inReplyTo string, commandID *uuid.UUID) bool {
	if inReplyTo == "" || commandID == nil {
		return false
	}
	id, err := uuid.Parse(inReplyTo)
	return err != nil || id != *commandID
}

// warnUnaddressed logs, once per remote step of a saga type, that its
// participant refuses without naming the command it answers: such a refusal
// is applied whatever command it answers, so a copy of one sent before a
// resume can fail the step the resume sent again (see wire.Reply.InReplyTo).
func (e *Engine) warnUnaddressed(ctx context.Context, sagaName, step string) {
	if _, seen := e.unaddressed.LoadOrStore(sagaName+"/"+step, true); seen {
		return
	}
	e.log.WarnContext(ctx, "sagaflow: a participant's refusal names no command (in_reply_to); a copy of a refusal sent before "+
		"a resume cannot be told from the answer to the command sent again, and would fail the resumed step",
		slog.String("saga", safetext.Text(sagaName, 200)), slog.String("step", safetext.Text(step, 200)))
}

// heldSagas lists the sagas whose execution lock a batch holds.
func heldSagas(sagas map[uuid.UUID]*store.LockedSaga) []uuid.UUID {
	out := make([]uuid.UUID, 0, len(sagas))
	for id, ls := range sagas {
		if ls.Locked {
			out = append(out, id)
		}
	}
	return out
}
