package saga

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// Outbox types of the engine's commands.
const (
	// commandType runs a saga's current step.
	commandType = "sagaflow.step"
	// cancelType asks an engine that knows the saga to cancel it.
	cancelType = "sagaflow.cancel"
)

// command is the payload of a step command. It points at the saga row, which
// holds the state; Version is the saga's version when the command was
// written, so a command is current exactly while the saga still has it.
type command struct {
	SagaID    uuid.UUID       `json:"saga_id"`
	Saga      string          `json:"saga"`
	Step      string          `json:"step"`
	Direction steps.Direction `json:"direction"`
	Epoch     int             `json:"epoch"`
	Version   int64           `json:"version"`
}

func decodeCommand(c *store.Claimed) (command, error) {
	var cmd command
	if c.Type != commandType && c.Type != cancelType {
		return cmd, fmt.Errorf("message type %q is neither %q nor %q", c.Type, commandType, cancelType)
	}
	dec := json.NewDecoder(bytes.NewReader(c.Payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cmd); err != nil {
		return cmd, fmt.Errorf("decode payload: %w", err)
	}
	switch {
	case cmd.SagaID == uuid.Nil:
		return cmd, errors.New("saga_id is missing")
	case cmd.Saga == "" || cmd.Step == "":
		return cmd, errors.New("saga or step is missing")
	case !cmd.Direction.Valid():
		return cmd, fmt.Errorf("direction %q is neither %q nor %q", cmd.Direction, steps.Forward, steps.Compensate)
	case cmd.Version <= 0:
		return cmd, fmt.Errorf("version %d is not positive", cmd.Version)
	}
	return cmd, nil
}

// cancelMessage builds the command that makes an engine that knows sg look
// at its pending cancel request. It carries no authority of its own: an
// engine that finds no request in the database does nothing with it.
func (e *Engine) cancelMessage(sg *store.Saga) store.Message {
	cmd := command{SagaID: sg.ID, Saga: sg.Name, Step: sg.StepName, Direction: steps.Direction(sg.Direction),
		Epoch: sg.Epoch, Version: sg.Version}
	payload, _ := json.Marshal(cmd)
	id := uuid.Must(uuid.NewV7())
	m := store.Message{
		ID: id, Topic: e.commandTopic(sg.Name), Delivery: e.commandDelivery(),
		AggregateType: aggregateType(sg.Name), AggregateID: sg.ID.String(), Type: cancelType, Payload: payload,
		Headers: map[string]string{store.HeaderMessageID: id.String(), store.HeaderSagaID: sg.ID.String(), store.HeaderType: cancelType},
		SagaID:  &sg.ID,
	}
	e.sign(&m)
	return m
}

// commandMessage builds the outbox row of the command for a saga's step.
func (e *Engine) commandMessage(sagaID uuid.UUID, name, step string, dir steps.Direction, epoch int, version int64, delay time.Duration) store.Message {
	cmd := command{SagaID: sagaID, Saga: name, Step: step, Direction: dir, Epoch: epoch, Version: version}
	payload, _ := json.Marshal(cmd) // plain fields: cannot fail
	key := steps.Key{SagaID: sagaID, Step: step, Direction: dir, Epoch: epoch}.String()
	id := uuid.Must(uuid.NewV7())
	m := store.Message{
		ID: id, Topic: e.commandTopic(name), Delivery: e.commandDelivery(),
		AggregateType: aggregateType(name), AggregateID: sagaID.String(), Type: commandType, Payload: payload,
		Headers: map[string]string{
			store.HeaderMessageID: id.String(),
			store.HeaderSagaID:    sagaID.String(),
			store.HeaderStepKey:   key,
			store.HeaderType:      commandType,
		},
		SagaID: &sagaID, StepKey: &key, Delay: delay,
	}
	e.sign(&m)
	return m
}

type batchResult struct {
	claimed      int
	readyCreated bool // a command that is due now was written
}

// batch is the work of one transaction.
type batch struct {
	e  *Engine
	tx pgx.Tx
	// ctx is the batch's context: the queued writes are sent with it, also
	// when a step's statement is what sends them. A step's own context ends
	// with its timeout; the batch's writes must not.
	ctx       context.Context
	delivered []uuid.UUID
	deferred  []deferral
	ready     bool
	// clean names a savepoint with nothing written after it, ready for the
	// next command, or is "" when there is none.
	clean string
	seq   int
	// outer is the batch's first savepoint, which every later one is
	// nested in, or "" when none was opened.
	outer string
	// abandoned is set when a handler overran; the transaction is lost.
	abandoned *abandonedStep
	// msg is the Kafka message being run, in Kafka mode; nil when commands
	// come straight from the outbox.
	msg *kafka.Message
	// pending are the writes queued on tx but not sent yet: they go out in
	// one round trip when something needs the transaction (a step's first
	// statement) or when the batch ends. See [batch.flush].
	pending []pendingOp
	// broken is set when a flush failed where no error could be returned
	// (a step took the bare connection); the batch is then lost.
	broken error
	// clock is the running step's clock, stopped while the step waits for
	// the batch's earlier writes to be sent; nil between steps. Atomic: an
	// abandoned handler may still use the transaction.
	clock atomic.Pointer[stepClock]
}

// pendingOp is what a batch queued and has not sent: a savepoint to open,
// or a command's outcome.
type pendingOp struct {
	open string        // a savepoint to open, or ""
	w    *pendingWrite // a command's outcome, or nil
}

// pendingWrite is a command's fenced transition, queued. The savepoints of
// the writes queued after the first one of a flush have nothing of their
// handlers behind them: a handler that uses the transaction sends the
// queue first.
type pendingWrite struct {
	sg *store.Saga
	tr *store.Transition
	// sp is the savepoint taken before the command's writes, its handler's
	// included; rollback says to roll back to it before writing (the
	// handler failed).
	sp       string
	rollback bool
	// next is the savepoint opened after the writes for the next command,
	// or "" after the batch's last command.
	next string
	// onFailure, for a step that succeeded, gives the failure to record
	// instead when the writes fail inside the transaction (the handler left
	// it aborted); nil when there is nothing to fall back to.
	onFailure func(err error) (*store.Transition, func())
	// done runs once the fence held.
	done func()
	// The saga's version and status before the write, which moved them.
	version int64
	status  string
	// last marks the last resort for a saga whose outcome could not be
	// stored (see [Engine.invalidOutcome]): if it fails too, the batch is
	// lost.
	last bool
	// Filled while sending: how many statements, which one is the update,
	// and whether it matched the saga.
	n, update int
	fenced    bool
}

type deferral struct {
	id     uuid.UUID
	reason string
}

// abandonedStep is what is needed to record an abandoned attempt after its
// transaction is gone.
type abandonedStep struct {
	saga    store.Saga
	def     *compiled
	idx     int
	dir     steps.Direction
	attempt int
	err     error
	elapsed time.Duration
}

// beginQuery starts a batch transaction. READ COMMITTED whatever the
// server's default; the lease in database time (a worker that stops talking
// to PostgreSQL while it holds claims, paused or partitioned, loses its
// session and with it the claims and the uncommitted steps); and a check
// that notices a vanished client while a statement runs.
func (e *Engine) beginQuery() string {
	lease := e.maxStepTimeout() + e.cfg.HandlerGrace + 5*time.Second
	return "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idle_in_transaction_session_timeout = " +
		strconv.FormatInt(lease.Milliseconds(), 10) + "; SET LOCAL client_connection_check_interval = 1000"
}

// batchTx is a batch's transaction on a connection of its own, which can be
// given up to a handler that will not let go of it.
type batchTx struct {
	conn      *pgxpool.Conn
	tx        pgx.Tx
	abandoned bool
}

// beginBatch acquires a connection (waiting at most as long as acquire
// allows) and begins a batch transaction on it.
func (e *Engine) beginBatch(acquire, ctx context.Context) (*batchTx, error) {
	conn, err := e.pool.Acquire(acquire)
	if err != nil {
		return nil, fmt.Errorf("saga: acquire connection: %w", err)
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: e.beginQuery()})
	if err != nil {
		conn.Release()
		return nil, fmt.Errorf("saga: begin batch: %w", err)
	}
	return &batchTx{conn: conn, tx: tx}, nil
}

// end rolls back what was not committed and releases the connection,
// unless it was abandoned.
func (t *batchTx) end(ctx context.Context) {
	if t.abandoned {
		return
	}
	_ = t.tx.Rollback(context.WithoutCancel(ctx))
	t.conn.Release()
}

// abandon gives the connection up to a handler that ignored its cancelled
// context: it is closed, which ends the transaction on the server, and never
// touched again (the handler may still be using it). The abandoned attempt
// is then recorded, with its retry, in a transaction of its own.
func (e *Engine) abandon(ctx context.Context, t *batchTx, b *batch) error {
	t.abandoned = true
	_ = t.conn.Hijack().PgConn().Conn().Close()
	if err := e.recordAbandoned(context.WithoutCancel(ctx), b.abandoned); !errors.Is(err, errAbandoned) {
		return err
	}
	return nil
}

// runBatch claims up to BatchSize commands, runs their steps in one
// transaction (each under its own savepoint) and commits once.
func (e *Engine) runBatch(fetchCtx, ctx context.Context) (res batchResult, err error) {
	bt, err := e.beginBatch(fetchCtx, ctx)
	if err != nil {
		return res, err
	}
	defer bt.end(ctx)
	tx := bt.tx
	// Claim, read the sagas and try their locks in one statement: the
	// sagas are found by the rows' saga_id, which handle checks against the
	// payload before it uses them.
	claimed, sagas, err := e.st.ClaimAndLock(ctx, tx, e.cfg.CommandTopic, e.cfg.BatchSize, e.knownAggregates(), e.cfg.UnknownSagaGrace)
	if err != nil {
		return res, err
	}
	res.claimed = len(claimed)
	if len(claimed) == 0 {
		return res, nil
	}
	held := heldSagas(sagas)
	e.running.claim(held...)
	defer e.running.release(held...)

	b := &batch{e: e, tx: tx, ctx: ctx}
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

	if err := e.finish(ctx, tx, b); err != nil {
		return res, err
	}
	res.readyCreated = b.ready
	return res, nil
}

// finish ends a batch: it sends the queued outcomes; then, in one round
// trip, it leaves the steps' savepoints, deletes the consumed direct
// commands and defers the ones whose saga was busy; it commits; and it
// announces new commands (see [Engine.announce]).
//
// The commands are deleted outside every savepoint: a row locked by the
// transaction (the claim) and deleted by one of its subtransactions gets a
// MultiXact as its deleter, and index scans never mark such a row's entries
// dead, so every claim would step over every consumed command until vacuum
// removed it.
func (e *Engine) finish(ctx context.Context, tx pgx.Tx, b *batch) error {
	if err := b.flush(); err != nil {
		return fmt.Errorf("saga: finish batch: %w", err)
	}
	tail := func(end *pgx.Batch) {
		if b.outer != "" {
			end.Queue("RELEASE SAVEPOINT " + b.outer)
		}
		if len(b.delivered) > 0 && b.msg == nil {
			e.st.QueueDeleteDelivered(end, b.delivered)
		}
		for _, d := range b.deferred {
			e.st.QueueDefer(end, []uuid.UUID{d.id}, deferDelay, deferDelayMax, d.reason)
		}
	}
	if err := b.flushWith(tail); err != nil {
		return fmt.Errorf("saga: finish batch: %w", err)
	}
	if h := e.hooks.beforeCommit; h != nil {
		if err := h(ctx, tx); err != nil {
			return err
		}
	}
	fault.At(ctx, fault.EngineBeforeCommit)
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("saga: commit batch: %w", err)
	}
	fault.At(ctx, fault.EngineAfterCommit)
	if b.ready {
		// Wakes direct workers, or the relay that publishes Kafka commands.
		e.announce()
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
	if err := b.flush(); err != nil {
		return err
	}
	// What follows is written after the clean savepoint, if there is one:
	// the next command must not roll back to it.
	b.clean = ""
	b.e.stats.parked.Add(1)
	b.e.log.WarnContext(ctx, "sagaflow parked a command", slog.String("message_id", safetext.Text(c.IDText(), 200)),
		slog.String("code", code), slog.String("reason", reason))
	if b.msg != nil {
		// From Kafka: the command's bytes go to the dead letters.
		if err := b.e.st.InsertDeadLetter(ctx, b.tx, kafkaDeadLetter(b.msg, c.IDText(), code+": "+reason)); err != nil {
			return err
		}
	} else if err := b.e.st.MarkDead(ctx, b.tx, c.ID, reason); err != nil {
		return err
	}
	if sagaID == nil {
		return nil
	}
	detail, _ := json.Marshal(map[string]string{"message_id": safetext.Text(c.IDText(), 200)})
	return b.e.st.InsertHistory(ctx, b.tx, &store.HistoryEntry{
		SagaID: *sagaID, Event: EventCommandParked, Error: reason, ErrorCode: code, Detail: detail,
	})
}

// unknown defers a command that this engine cannot run (another engine,
// newer or older, may know its saga or step), and parks it once it is older
// than UnknownSagaGrace.
func (b *batch) unknown(ctx context.Context, c *store.Claimed, sagaID *uuid.UUID, code, reason string) (parked bool, err error) {
	if c.Age < b.e.cfg.UnknownSagaGrace {
		b.e.stats.deferred.Add(1)
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
	def := e.lookupName(ls.Name)
	if def == nil {
		_, err := b.unknown(ctx, c, &ls.ID, CodeUnknownSaga,
			fmt.Sprintf("no definition named %q is registered with this engine (registered: %s)", ls.Name, e.registeredNames()))
		return err
	}
	if !ls.Locked {
		// Another transaction runs a step of this saga right now. A cancel
		// command waits too: the engine running the step was told of the
		// request, and applies it in the step's place.
		e.stats.deferred.Add(1)
		b.deferred = append(b.deferred, deferral{id: c.ID})
		return nil
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
	if c.Type == cancelType {
		// Applied or refused already, or forged: the request in the
		// database is what counts, and there is none.
		e.stats.stale.Add(1)
		b.delivered = append(b.delivered, c.ID)
		return nil
	}
	if ls.Version != cmd.Version || Status(ls.Status).Terminal() {
		e.stats.stale.Add(1)
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
		sp := b.savepoint()
		tr := failTransition(&ls.Saga, ls.StepName, CodeUnknownStep, reason)
		tr.History = []store.HistoryEntry{{SagaID: ls.ID, Event: EventSagaFailed, StepName: ls.StepName,
			Direction: ls.Direction, Epoch: ls.Epoch, Error: reason, ErrorCode: CodeUnknownStep}}
		b.write(&ls.Saga, tr, sp, false, last, nil, nil)
		return nil
	}
	if !cmd.current(c, ls) {
		e.stats.stale.Add(1)
		b.delivered = append(b.delivered, c.ID)
		e.log.WarnContext(ctx, "sagaflow refused a command that is not the saga's current one",
			slog.String("saga_id", ls.ID.String()), slog.String("step", safetext.Text(cmd.Step, 200)), slog.String("saga_step", ls.StepName))
		return nil
	}
	b.delivered = append(b.delivered, c.ID)
	ls.StepIndex = idx // a tool that re-ran the saga without its definition may have left -1
	processed := ls.Processed
	ls.Processed = false // only true for the state it was read in
	return b.execute(ctx, &ls.Saga, def, idx, dir, processed, last)
}

// savepoint returns a savepoint with nothing written after it, opening one
// (queued, sent with the next flush) if needed.
func (b *batch) savepoint() string {
	if b.clean != "" {
		sp := b.clean
		b.clean = ""
		return sp
	}
	sp := b.nextSavepoint()
	if b.outer == "" {
		b.outer = sp
	}
	b.pending = append(b.pending, pendingOp{open: sp})
	return sp
}

func (b *batch) nextSavepoint() string {
	b.seq++
	return "sagaflow_step_" + strconv.Itoa(b.seq)
}

// execute runs step idx of the saga in direction dir under a savepoint and
// writes its outcome.
func (b *batch) execute(ctx context.Context, sg *store.Saga, def *compiled, idx int, dir steps.Direction, processed, last bool) error {
	e := b.e
	sp := b.savepoint()
	key := steps.Key{SagaID: sg.ID, Step: sg.StepName, Direction: dir, Epoch: sg.Epoch}
	if processed {
		// The key is in the inbox: this step's effects were committed before.
		// Move on without running it twice.
		tr := e.successTransition(sg, def, idx, dir, nil, 0, "")
		tr.History = append([]store.HistoryEntry{{SagaID: sg.ID, Event: EventStepDeduplicated, StepName: sg.StepName,
			Direction: string(dir), Epoch: sg.Epoch, Attempt: sg.Attempt + 1}}, tr.History...)
		b.write(sg, tr, sp, false, last, nil, func() { e.stats.dedup.Add(1) })
		return nil
	}
	if topic, typ, ok := def.remote(idx, dir); ok {
		return b.send(ctx, sg, def, idx, dir, key, sp, topic, typ, last)
	}
	attempt := sg.Attempt + 1
	timeout := def.steps[idx].timeout
	run := &StepRun{
		Tx: b.stepTx(), Key: key, SagaID: sg.ID, SagaName: sg.Name, Step: sg.StepName, Direction: dir,
		Epoch: sg.Epoch, Attempt: attempt,
	}
	if sg.BusinessKey != nil {
		run.BusinessKey = *sg.BusinessKey
	}
	started := time.Now()
	newState, herr := e.callHandler(ctx, b, def, run, idx, dir, sg.State, timeout)
	elapsed := time.Since(started)
	fault.At(ctx, fault.EngineAfterHandler)
	var ab *abandonedError
	if errors.As(herr, &ab) {
		b.abandoned = &abandonedStep{saga: *sg, def: def, idx: idx, dir: dir, attempt: attempt, elapsed: elapsed,
			err: steps.WithCode(CodeAbandonedRunOn, fmt.Errorf("step %q ignored its context, cancelled by %s, for %s; its worker abandoned it",
				sg.StepName, ab.why, e.cfg.HandlerGrace))}
		return errAbandoned
	}
	var cr *cancelRequested
	if errors.As(herr, &cr) && dir == steps.Forward && Status(sg.Status) == StatusRunning && cr.epoch == sg.Epoch {
		// A cancel request interrupted the step: its writes are rolled back
		// and the request applied in its place.
		e.running.forget(sg.ID)
		tr := e.cancelTransition(sg, def, idx, safetext.Text(cr.reason, maxReasonBytes))
		b.write(sg, tr, sp, true, last, nil, func() { e.stats.cancelled.Add(1) })
		return nil
	}
	if herr == nil {
		herr = e.checkNewState(sg.StepName, newState)
	}
	fail := func(herr error) (*store.Transition, func()) {
		tr := e.failureTransition(sg, def, idx, dir, attempt, herr, elapsed)
		retry := tr.StepName == sg.StepName && tr.Direction == string(dir) && len(tr.Messages) > 0
		return tr, func() {
			e.stats.failed.Add(1)
			if retry {
				e.stats.retries.Add(1)
			}
		}
	}
	if herr == nil {
		tr := e.successTransition(sg, def, idx, dir, newState, elapsed, key.String())
		// If the step's own writes or ours fail inside the transaction (the
		// handler left it aborted, say), the step is undone and a failure
		// recorded instead.
		b.write(sg, tr, sp, false, last, func(err error) (*store.Transition, func()) {
			return fail(steps.WithCode(CodeTxAborted, fmt.Errorf("commit step: %w", err)))
		}, func() { e.stats.succeeded.Add(1) })
		return nil
	}
	tr, done := fail(herr)
	b.write(sg, tr, sp, true, last, nil, done)
	return nil
}

// send runs a remote step: it builds the command, writes it to the outbox
// for the participant, and leaves the saga waiting for the reply, whose
// deadline is the step's Timeout.
func (b *batch) send(ctx context.Context, sg *store.Saga, def *compiled, idx int, dir steps.Direction, key steps.Key, sp, topic, typ string, last bool) error {
	e := b.e
	run := &StepRun{Tx: b.stepTx(), Key: key, SagaID: sg.ID, SagaName: sg.Name, Step: sg.StepName, Direction: dir,
		Epoch: sg.Epoch, Attempt: sg.Attempt + 1}
	if sg.BusinessKey != nil {
		run.BusinessKey = *sg.BusinessKey
	}
	payload, err := recovered(func() ([]byte, error) { return def.send(ctx, run, idx, dir, sg.State) })
	if err != nil {
		tr := e.failureTransition(sg, def, idx, dir, sg.Attempt+1, err, 0)
		b.write(sg, tr, sp, true, last, nil, func() { e.stats.failed.Add(1) })
		return nil
	}
	id := uuid.Must(uuid.NewV7())
	keyText := key.String()
	msg := store.Message{
		ID: id, Topic: topic, Delivery: store.DeliveryRelay, AggregateType: aggregateType(sg.Name),
		AggregateID: sg.ID.String(), Type: typ, Payload: payload, SagaID: &sg.ID, StepKey: &keyText,
		Headers: map[string]string{
			store.HeaderMessageID: id.String(), store.HeaderType: typ, store.HeaderSagaID: sg.ID.String(),
			store.HeaderStepKey: keyText, store.HeaderReplyTo: e.replyTopic(sg.Name), store.HeaderDirection: string(dir),
		},
	}
	e.sign(&msg)
	tr := transitionFrom(sg)
	tr.AwaitingReply = true
	tr.CheckAfter, tr.ExactDeadline = def.steps[idx].timeout, true
	tr.Messages = []store.Message{msg}
	detail, _ := json.Marshal(map[string]string{"topic": topic, "type": typ, "message_id": id.String()})
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventCommandSent, StepName: sg.StepName,
		Direction: string(dir), Epoch: sg.Epoch, Attempt: sg.Attempt + 1, Detail: detail}}
	b.write(sg, tr, sp, false, last, nil, func() { sg.AwaitingReply = true })
	return nil
}

// reply applies a participant's reply to the saga waiting for it: the step
// completes, or, refused, fails for good. A reply for a step the saga is not
// waiting on (late, duplicate, after a cancel) is dropped.
func (b *batch) reply(ctx context.Context, c *store.Claimed, ls *store.LockedSaga, key steps.Key, last bool) error {
	e := b.e
	b.delivered = append(b.delivered, c.ID)
	sg := &ls.Saga
	def := e.lookupName(sg.Name)
	idx, known := 0, false
	if def != nil {
		idx, known = def.byName[sg.StepName]
	}
	if !known || !sg.AwaitingReply || sg.StepName != key.Step || sg.Direction != string(key.Direction) || sg.Epoch != key.Epoch {
		e.stats.stale.Add(1)
		return nil
	}
	var r steps.Reply
	if err := json.Unmarshal(c.Payload, &r); err != nil {
		return b.park(ctx, c, &sg.ID, CodeMalformed, "malformed reply: "+err.Error())
	}
	sp := b.savepoint()
	dir := key.Direction
	attempt := sg.Attempt + 1
	if !r.OK {
		code := r.Code
		if code == "" {
			code = CodeRefused
		}
		sg.AwaitingReply = false // refused: the participant did nothing to undo
		tr := e.failureTransition(sg, def, idx, dir, attempt, steps.Permanent(steps.WithCode(code, errors.New(r.Error))), 0)
		b.write(sg, tr, sp, false, last, nil, func() { e.stats.failed.Add(1) })
		return nil
	}
	run := &StepRun{Tx: b.stepTx(), Key: key, SagaID: sg.ID, SagaName: sg.Name, Step: sg.StepName, Direction: dir,
		Epoch: sg.Epoch, Attempt: attempt}
	newState, herr := recovered(func() ([]byte, error) { return def.reply(ctx, run, idx, sg.State, r.Result) })
	if herr == nil {
		herr = e.checkNewState(sg.StepName, newState)
	}
	fail := func(herr error) (*store.Transition, func()) {
		tr := e.failureTransition(sg, def, idx, dir, attempt, steps.Permanent(herr), 0)
		return tr, func() { e.stats.failed.Add(1) }
	}
	if herr == nil {
		tr := e.successTransition(sg, def, idx, dir, newState, 0, key.String())
		tr.History = append([]store.HistoryEntry{{SagaID: sg.ID, Event: EventReplyReceived, StepName: sg.StepName,
			Direction: string(dir), Epoch: sg.Epoch, Attempt: attempt}}, tr.History...)
		// If OnReply left the transaction unusable, it is undone and a
		// failure recorded instead.
		b.write(sg, tr, sp, false, last, func(err error) (*store.Transition, func()) {
			return fail(steps.WithCode(CodeTxAborted, fmt.Errorf("apply reply: %w", err)))
		}, func() { e.stats.succeeded.Add(1) })
		return nil
	}
	// OnReply failed: its writes are rolled back with the savepoint.
	tr, done := fail(herr)
	b.write(sg, tr, sp, true, last, nil, done)
	return nil
}

// checkNewState refuses state a handler left that cannot be stored.
func (e *Engine) checkNewState(step string, state []byte) error {
	if len(state) > e.cfg.MaxStateBytes {
		return steps.Permanent(steps.WithCode(CodeTooLarge,
			fmt.Errorf("state is %d bytes after step %q, more than MaxStateBytes (%d)", len(state), step, e.cfg.MaxStateBytes)))
	}
	if bytes.Contains(state, []byte(`\u0000`)) {
		return steps.Permanent(steps.WithCode(CodeStateEncode,
			errors.New("state contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store")))
	}
	return nil
}

// recordAbandoned writes the failure of an abandoned attempt in a
// transaction of its own, fenced on the version the attempt started from,
// so that the attempt counts, is retried after its backoff or compensated,
// and never blocks its saga. It first waits for the saga's execution lock:
// the abandoned transaction holds it until its server process notices the
// closed connection, and whoever runs the saga next must see this record.
func (e *Engine) recordAbandoned(ctx context.Context, a *abandonedStep) error {
	tr := e.failureTransition(&a.saga, a.def, a.idx, a.dir, a.attempt, a.err, a.elapsed)
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		wait := e.maxStepTimeout() + e.cfg.HandlerGrace
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+strconv.FormatInt(wait.Milliseconds(), 10)+"; SAVEPOINT sagaflow_abandoned"); err != nil {
			return err
		}
		if err := e.st.LockSaga(ctx, tx, a.saga.ID); err != nil {
			return err
		}
		fenced, err := e.st.ApplyTransition(ctx, tx, tr, "sagaflow_abandoned")
		switch {
		case err != nil:
			return err
		case !fenced:
			// Another worker ran the step meanwhile; the timeline still
			// shows the abandoned attempt.
			failed := tr.History[0]
			failed.Detail = durationDetail(a.elapsed, map[string]any{"superseded": true})
			return e.st.InsertHistory(ctx, tx, &failed)
		case len(tr.Messages) > 0:
			return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("saga: record abandoned step of saga %s: %w", a.saga.ID, err)
	}
	return errAbandoned
}

// errorMessage is the text stored for a step's error: the handler's own
// message, without the outcome wrappers of package steps, whose meaning is
// stored apart (the code, and whether the step was retried).
func errorMessage(err error) string {
	for {
		var inner error
		switch e := err.(type) {
		case *steps.PermanentError:
			inner = e.Err
		case *steps.CodedError:
			inner = e.Err
		case *steps.RetryAfterError:
			inner = e.Err
		}
		if inner == nil {
			return err.Error()
		}
		err = inner
	}
}

// recovered runs f, turning a panic into a *panicError with the stack.
func recovered(f func() ([]byte, error)) (out []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			out, err = nil, &panicError{value: v, stack: debug.Stack()}
		}
	}()
	return f()
}

// stepTx is the transaction handed to a step: the step may use it, and nest
// savepoints with Begin, but it must not end it. Before the step's first
// statement it sends the writes its batch queued, so that they come first.
type stepTx struct {
	pgx.Tx
	b *batch
}

var errStepTxEnd = errors.New("saga: a step must not commit or roll back its transaction; return an error to fail the step")

func (stepTx) Commit(context.Context) error   { return errStepTxEnd }
func (stepTx) Rollback(context.Context) error { return errStepTxEnd }

func (t stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.flush(); err != nil {
		return nil, err
	}
	return t.Tx.Begin(ctx)
}

func (t stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.flush(); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.Tx.Exec(ctx, sql, args...)
}

// When the queue cannot be sent, the transaction is aborted or its
// connection gone (and the batch lost): Query and SendBatch then hand over
// the results of the step's statements on it, which carry their own errors.

func (t stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.flush(); err != nil {
		rows, _ := t.Tx.Query(ctx, sql, args...)
		rows.Close()
		return rows, err
	}
	return t.Tx.Query(ctx, sql, args...)
}

func (t stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.flush(); err != nil {
		return errRow{err}
	}
	return t.Tx.QueryRow(ctx, sql, args...)
}

func (t stepTx) SendBatch(ctx context.Context, q *pgx.Batch) pgx.BatchResults {
	_ = t.flush()
	return t.Tx.SendBatch(ctx, q)
}

func (t stepTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.flush(); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, columns, src)
}

func (t stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.flush(); err != nil {
		return nil, err
	}
	return t.Tx.Prepare(ctx, name, sql)
}

// LargeObjects and Conn hand out what runs statements without this wrapper:
// the queue is sent first; if that fails, the batch is lost.
func (t stepTx) LargeObjects() pgx.LargeObjects {
	_ = t.flush()
	return t.Tx.LargeObjects()
}

func (t stepTx) Conn() *pgx.Conn {
	_ = t.flush()
	return t.Tx.Conn()
}

// errRow is the result of a query that was never sent.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

var errAbandoned = errors.New("saga: handler ignored its cancelled context past the grace period; its connection was closed")

// abandonedError is callHandler's errAbandoned, saying what cancelled the
// context the handler ignored.
type abandonedError struct{ why string }

func (e *abandonedError) Error() string {
	return errAbandoned.Error() + " (cancelled by " + e.why + ")"
}
func (e *abandonedError) Unwrap() error { return errAbandoned }

type panicError struct {
	value any
	stack []byte
}

func (p *panicError) Error() string { return fmt.Sprintf("panic: %v", p.value) }

// callHandler runs the step function, recovering panics and enforcing the
// timeout. A handler that ignores its cancelled context for longer than
// HandlerGrace is abandoned: callHandler returns errAbandoned and the caller
// must not use the transaction again.
//
// The step is charged only for its own time: while its first statement
// waits for the batch to send the writes of earlier steps (which may wait on
// row locks held elsewhere), its clock stops. A cancel request for the saga
// cancels the handler's context with a [cancelRequested] cause.
func (e *Engine) callHandler(ctx context.Context, b *batch, def *compiled, run *StepRun, idx int, dir steps.Direction, state []byte, timeout time.Duration) ([]byte, error) {
	base, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	clock := newStepClock(timeout, func() { cancel(errStepTimedOut) })
	defer clock.stop()
	stepCtx := &stepContext{Context: base, clock: clock}
	b.clock.Store(clock)
	defer b.clock.Store(nil)
	if dir == steps.Forward {
		e.running.start(run.SagaID, cancel)
		defer e.running.stop(run.SagaID)
	}
	type result struct {
		state []byte
		err   error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() {
			if v := recover(); v != nil {
				r = result{err: &panicError{value: v, stack: debug.Stack()}}
			}
			done <- r
		}()
		r.state, r.err = def.run(stepCtx, run, idx, dir, state)
	}()
	var r result
	select {
	case r = <-done:
	case <-base.Done():
		grace := time.NewTimer(e.cfg.HandlerGrace)
		defer grace.Stop()
		select {
		case r = <-done:
		case <-grace.C:
			e.stats.abandoned.Add(1)
			why := "its timeout"
			var cr *cancelRequested
			if errors.As(context.Cause(base), &cr) {
				why = "a cancel request"
			} else if !errors.Is(context.Cause(base), errStepTimedOut) {
				why = "the engine's stop"
			}
			e.log.ErrorContext(ctx, "sagaflow abandoned a step handler that ignored its cancelled context",
				slog.String("step_key", run.Key.String()), slog.String("cancelled_by", why), slog.Duration("timeout", timeout))
			return nil, &abandonedError{why: why}
		}
	}
	cause := context.Cause(base)
	timedOut := errors.Is(cause, errStepTimedOut) && ctx.Err() == nil
	if r.err != nil && timedOut {
		// The attempt ran out of time; whatever it returned, say so.
		if steps.Code(r.err) == "" {
			r.err = steps.WithCode(CodeTimeout, fmt.Errorf("step %q timed out after %s: %w", run.Step, timeout, r.err))
		}
	}
	var cr *cancelRequested
	if r.err != nil && errors.As(cause, &cr) && ctx.Err() == nil {
		// Interrupted by a cancel request: the request takes the
		// failure's place.
		return r.state, cr
	}
	if r.err == nil && base.Err() != nil && ctx.Err() == nil {
		// Finished after its deadline (or a cancel request) but without
		// error: accept the result; its writes are still in the transaction
		// and commit with it.
		return r.state, nil
	}
	return r.state, r.err
}

// errStepTimedOut is the cause of a step context whose time ran out.
var errStepTimedOut = errors.New("saga: step timed out")

// stepContext is a step's context: its Err reports a timeout as
// context.DeadlineExceeded, and its Deadline is the step clock's, which
// moves while the clock is stopped.
type stepContext struct {
	context.Context
	clock *stepClock
}

func (c *stepContext) Deadline() (time.Time, bool) { return c.clock.deadline() }

func (c *stepContext) Err() error {
	err := c.Context.Err()
	if err != nil && errors.Is(context.Cause(c.Context), errStepTimedOut) {
		return context.DeadlineExceeded
	}
	return err
}

// stepClock is a step's timeout that can be stopped while the engine, not
// the step, holds the step up.
type stepClock struct {
	mu       sync.Mutex
	end      time.Time // when the time runs out, while running
	left     time.Duration
	paused   int // nested pauses
	timer    *time.Timer
	expired  bool
	onExpire func()
}

func newStepClock(timeout time.Duration, onExpire func()) *stepClock {
	c := &stepClock{end: time.Now().Add(timeout), onExpire: onExpire}
	c.timer = time.AfterFunc(timeout, c.fire)
	return c
}

func (c *stepClock) fire() {
	c.mu.Lock()
	if c.paused > 0 || c.expired {
		c.mu.Unlock()
		return
	}
	if d := time.Until(c.end); d > 0 {
		// Resumed after a pause: the deadline moved.
		c.timer.Reset(d)
		c.mu.Unlock()
		return
	}
	c.expired = true
	c.mu.Unlock()
	c.onExpire()
}

// pause stops the clock until the matching resume.
func (c *stepClock) pause() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.paused == 0 && !c.expired {
		c.left = time.Until(c.end)
	}
	c.paused++
}

func (c *stepClock) resume() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.paused--
	if c.paused > 0 || c.expired {
		return
	}
	c.end = time.Now().Add(c.left)
	c.timer.Reset(max(c.left, 0))
}

func (c *stepClock) deadline() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.paused > 0 {
		return time.Now().Add(c.left), true
	}
	return c.end, true
}

func (c *stepClock) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.expired = true
	c.timer.Stop()
}

// write queues the fenced transition tr of a command whose savepoint is sp,
// after rolling back to sp when rollback is set, and the next command's
// savepoint unless this was the batch's last command. Nothing is sent: the
// queue goes out in one round trip when a handler needs the transaction or
// when the batch ends (see [batch.flush]). The saga's version and status
// move at once, so that a later command of the same saga in this batch sees
// them; if the saga had moved on (the fence did not hold), everything since
// sp is rolled back when the queue is sent, and done does not run.
func (b *batch) write(sg *store.Saga, tr *store.Transition, sp string, rollback, last bool,
	onFailure func(error) (*store.Transition, func()), done func()) {
	if h := b.e.hooks.outcome; h != nil {
		h(tr)
	}
	w := &pendingWrite{sg: sg, tr: tr, sp: sp, rollback: rollback, onFailure: onFailure, done: done,
		version: sg.Version, status: sg.Status}
	if !last {
		w.next = b.nextSavepoint()
	}
	b.clean = w.next
	b.pending = append(b.pending, pendingOp{w: w})
	b.applied(w)
}

// applied moves the saga of w as its write will, once the write is sent.
func (b *batch) applied(w *pendingWrite) {
	w.sg.Version = w.version + 1
	w.sg.Status = w.tr.Status
	for _, m := range w.tr.Messages {
		if m.Delay <= 0 {
			b.ready = true
		}
	}
}

// flush sends the queued writes in one round trip. See [batch.flushWith].
func (b *batch) flush() error {
	if len(b.pending) == 0 {
		return b.broken
	}
	return b.flushWith(nil)
}

// flushWith sends the queued writes, followed by what tail queues, in one
// round trip, and deals with what went wrong, in order:
//
//   - a write whose fence did not hold (the saga moved on) is rolled back to
//     its savepoint, with its handler's writes;
//   - a write of a step that succeeded but failed inside the transaction is
//     rolled back to its savepoint and replaced by the step's failure;
//
// and the writes after it, and tail, are sent again: rolling back to a
// savepoint undoes everything after it. Only the first write of a round
// trip can have its handler's statements behind it (a handler that uses the
// transaction sends the queue first), so the writes sent again lose
// nothing. Any other error is returned, and the batch is lost.
func (b *batch) flushWith(tail func(*pgx.Batch)) error {
	if b.broken != nil {
		return b.broken
	}
	if err := b.sendQueued(b.ctx, tail); err != nil {
		b.broken = err
		return err
	}
	return nil
}

func (b *batch) sendQueued(ctx context.Context, tail func(*pgx.Batch)) error {
	e := b.e
	for {
		// A failed step whose handler left the transaction aborted is rolled
		// back to its savepoint on its own, before the rest: pgx prepares a
		// pipeline's new statements before any of them runs, and PostgreSQL
		// refuses to prepare in an aborted transaction. Only the first write
		// of a round trip can have its handler's statements behind it.
		if len(b.pending) > 0 && b.pending[0].w != nil && b.pending[0].w.rollback {
			w := b.pending[0].w
			if _, err := b.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+w.sp); err != nil {
				return fmt.Errorf("saga: roll back step of saga %s: %w", w.sg.ID, err)
			}
			w.rollback = false
		}
		q := &pgx.Batch{}
		for _, op := range b.pending {
			if op.open != "" {
				q.Queue("SAVEPOINT " + op.open)
				continue
			}
			w := op.w
			start := q.Len()
			if w.rollback {
				q.Queue("ROLLBACK TO SAVEPOINT " + w.sp)
			}
			w.update = q.Len() - start
			e.st.QueueTransition(q, w.tr)
			if w.next != "" {
				q.Queue("SAVEPOINT " + w.next)
			}
			w.n = q.Len() - start
		}
		tailFrom := q.Len()
		if tail != nil {
			tail(q)
		}
		if q.Len() == 0 {
			return nil
		}
		br := b.tx.SendBatch(ctx, q)
		failed, ferr := -1, error(nil)
	read:
		for i, op := range b.pending {
			n := 1
			if op.w != nil {
				n = op.w.n
			}
			for j := range n {
				tag, err := br.Exec()
				if err != nil {
					failed, ferr = i, err
					break read
				}
				if op.w != nil && j == op.w.update {
					op.w.fenced = tag.RowsAffected() == 1
				}
			}
			if op.w != nil && !op.w.fenced {
				failed = i
				break
			}
		}
		if failed < 0 {
			for range q.Len() - tailFrom {
				if _, err := br.Exec(); err != nil {
					ferr = err
					break
				}
			}
		}
		cerr := br.Close()
		done := b.pending
		if failed >= 0 {
			done = b.pending[:failed]
		}
		for _, op := range done {
			if op.w != nil && op.w.done != nil {
				op.w.done()
			}
		}
		switch {
		case failed < 0 && ferr == nil && cerr == nil:
			b.pending = nil
			return nil
		case failed < 0:
			b.pending = nil
			return errors.Join(ferr, cerr)
		case ferr != nil && !pgerr.Statement(ferr):
			return ferr
		}
		// The op at failed: every op before it is done; roll back to its
		// savepoint and send what follows again.
		op := b.pending[failed]
		rest := b.pending[failed+1:]
		if op.w == nil {
			return fmt.Errorf("saga: open savepoint %s: %w", op.open, ferr)
		}
		w := op.w
		if _, err := b.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+w.sp); err != nil {
			return fmt.Errorf("saga: roll back outcome of saga %s: %w", w.sg.ID, errors.Join(ferr, err))
		}
		w.sg.Version, w.sg.Status = w.version, w.status
		var again []pendingOp
		switch {
		case ferr == nil:
			// The saga moved on while the step ran: undo the step and ours.
			e.stats.stale.Add(1)
			e.log.InfoContext(ctx, "sagaflow refused a step commit: the saga moved on",
				slog.String("saga_id", w.sg.ID.String()), slog.Int64("version", w.version))
			if w.next != "" {
				// The next command's savepoint went with the rollback.
				again = append(again, pendingOp{open: w.next})
			}
		case w.onFailure != nil:
			tr, done := w.onFailure(fmt.Errorf("saga: write outcome of saga %s: %w", w.sg.ID, ferr))
			f := &pendingWrite{sg: w.sg, tr: tr, sp: w.sp, next: w.next, done: done, version: w.version, status: w.status}
			b.applied(f)
			again = append(again, pendingOp{w: f})
		case pgerr.Content(ferr) && !w.last:
			// PostgreSQL refused this saga's outcome itself: park the saga
			// with a fixed, storable error rather than lose the batch (and
			// every other saga in it) on every retry.
			e.log.ErrorContext(ctx, "sagaflow parked a saga whose outcome PostgreSQL refused",
				slog.String("saga_id", w.sg.ID.String()), slog.Any("error", ferr))
			f := &pendingWrite{sg: w.sg, tr: e.invalidOutcome(w.sg, ferr), sp: w.sp, next: w.next, version: w.version, status: w.status,
				last: true, done: func() { e.stats.failed.Add(1) }}
			b.applied(f)
			again = append(again, pendingOp{w: f})
		default:
			return fmt.Errorf("saga: write outcome of saga %s: %w", w.sg.ID, ferr)
		}
		b.pending = append(again, rest...)
	}
}

// flush sends the batch's queued writes before the step's own statement,
// with the step's clock stopped: the step is not charged for them.
func (t stepTx) flush() error {
	if len(t.b.pending) == 0 {
		return t.b.broken
	}
	clock := t.b.clock.Load()
	clock.pause()
	defer clock.resume()
	return t.b.flush()
}

// stepTx returns the transaction handed to a step.
func (b *batch) stepTx() stepTx { return stepTx{Tx: b.tx, b: b} }

// compensateFrom is the first step to compensate when step idx of sg fails
// for good or the saga is cancelled: the step before it, or the step itself
// when it is a remote step whose command went out and whose reply never
// came (the participant may have carried it out).
func compensateFrom(sg *store.Saga, def *compiled, idx int) int {
	if sg.AwaitingReply && steps.Direction(sg.Direction) == steps.Forward {
		return def.prevCompensable(idx)
	}
	return def.prevCompensable(idx - 1)
}

func transitionFrom(sg *store.Saga) *store.Transition {
	return &store.Transition{
		ID: sg.ID, Version: sg.Version, Status: sg.Status, StepIndex: sg.StepIndex, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Attempt: sg.Attempt,
		LastError: sg.LastError, LastErrorCode: sg.LastErrorCode, FailedStep: sg.FailedStep,
	}
}

// invalidOutcome parks sg, as failed, when PostgreSQL refused the
// transition its step produced: everything it writes is fixed text or made
// storable, so it cannot fail the same way.
func (e *Engine) invalidOutcome(sg *store.Saga, cause error) *store.Transition {
	reason := safetext.Text("the step's outcome could not be stored: "+cause.Error(), 2000)
	tr := failTransition(sg, sg.StepName, CodeInvalidOutcome, reason)
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventSagaFailed, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Error: reason, ErrorCode: CodeInvalidOutcome}}
	return tr
}

func failTransition(sg *store.Saga, step, code, reason string) *store.Transition {
	tr := transitionFrom(sg)
	tr.Status = store.StatusFailed
	tr.LastError, tr.LastErrorCode, tr.FailedStep = &reason, &code, &step
	return tr
}

// moveTo points tr at step i in direction dir with its command, or ends the
// saga with endStatus when i is before the first or past the last step.
func (e *Engine) moveTo(tr *store.Transition, sg *store.Saga, def *compiled, i int, dir steps.Direction, endStatus, endEvent string) {
	if i < 0 || i >= len(def.steps) {
		tr.Status = endStatus
		tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: endEvent, Epoch: sg.Epoch})
		return
	}
	status := store.StatusRunning
	if dir == steps.Compensate {
		status = store.StatusCompensating
	}
	tr.Status, tr.StepIndex, tr.StepName, tr.Direction, tr.Attempt = status, i, def.steps[i].name, string(dir), 0
	tr.CheckAfter = def.steps[i].timeout + e.cfg.RescueSlack
	tr.Messages = append(tr.Messages, e.commandMessage(sg.ID, sg.Name, def.steps[i].name, dir, sg.Epoch, sg.Version+1, 0))
}

// maxCodeBytes bounds a stored error code.
const maxCodeBytes = 200

func durationDetail(d time.Duration, extra map[string]any) []byte {
	m := map[string]any{"duration_ms": float64(d.Microseconds()) / 1000}
	for k, v := range extra {
		m[k] = v
	}
	out, _ := json.Marshal(m)
	return out
}

func (e *Engine) successTransition(sg *store.Saga, def *compiled, idx int, dir steps.Direction, newState []byte, elapsed time.Duration, key string) *store.Transition {
	tr := transitionFrom(sg)
	tr.State = newState
	if key != "" {
		tr.InboxConsumer, tr.InboxKey = store.InboxConsumerEngine, key
	}
	event := EventStepCompleted
	if dir == steps.Compensate {
		event = EventCompensationCompleted
	}
	tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: event, StepName: sg.StepName,
		Direction: string(dir), Epoch: sg.Epoch, Attempt: sg.Attempt + 1, Detail: durationDetail(elapsed, nil)})
	if dir == steps.Forward {
		tr.LastError, tr.LastErrorCode, tr.FailedStep = nil, nil, nil
		e.moveTo(tr, sg, def, idx+1, steps.Forward, store.StatusCompleted, EventSagaCompleted)
	} else {
		e.moveTo(tr, sg, def, def.prevCompensable(idx-1), steps.Compensate, store.StatusCompensated, EventSagaCompensated)
	}
	return tr
}

func (e *Engine) failureTransition(sg *store.Saga, def *compiled, idx int, dir steps.Direction, attempt int, herr error, elapsed time.Duration) *store.Transition {
	// A handler's code, or a participant's, is stored and indexed: it must
	// be storable, whatever the handler returned.
	code := safetext.Text(steps.Code(herr), maxCodeBytes)
	var pe *panicError
	var de *stateDecodeError
	switch {
	case code != "":
	case errors.As(herr, &pe):
		code = CodePanic
	case errors.As(herr, &de):
		code = CodeStateDecode
	default:
		code = CodeError
	}
	msg := safetext.Text(errorMessage(herr), 4000)
	extra := map[string]any{}
	if pe != nil {
		extra["stack"] = safetext.Text(string(pe.stack), 16000)
	}
	tr := transitionFrom(sg)
	failed := store.HistoryEntry{SagaID: sg.ID, Event: EventStepFailed, StepName: sg.StepName, Direction: string(dir),
		Epoch: sg.Epoch, Attempt: attempt, Error: msg, ErrorCode: code}

	policy := def.policy(idx, dir)
	var ra *steps.RetryAfterError
	retryable := !steps.IsPermanent(herr) && de == nil && attempt < policy.MaxAttempts
	if retryable {
		delay := policy.Backoff(attempt)
		if errors.As(herr, &ra) {
			delay = ra.Delay
		}
		extra["retry_in_ms"] = delay.Milliseconds()
		failed.Detail = durationDetail(elapsed, extra)
		tr.History = append(tr.History, failed)
		tr.Attempt = attempt
		if dir == steps.Forward {
			tr.LastError, tr.LastErrorCode = &msg, &code
		}
		tr.CheckAfter = delay + def.steps[idx].timeout + e.cfg.RescueSlack
		tr.Messages = append(tr.Messages, e.commandMessage(sg.ID, sg.Name, sg.StepName, dir, sg.Epoch, sg.Version+1, delay))
		return tr
	}
	extra["final"] = true
	failed.Detail = durationDetail(elapsed, extra)
	tr.History = append(tr.History, failed)
	tr.Attempt = attempt
	tr.LastError, tr.LastErrorCode, tr.FailedStep = &msg, &code, &sg.StepName
	if dir == steps.Compensate || de != nil {
		// A compensation gave up, or the state cannot be read at all: park
		// the saga for an operator.
		tr.Status = store.StatusFailed
		tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: EventSagaFailed, StepName: sg.StepName,
			Direction: string(dir), Epoch: sg.Epoch, Error: msg, ErrorCode: code})
		return tr
	}
	e.startCompensation(tr, sg, def, idx)
	return tr
}

// startCompensation points tr at the first compensation after step idx of
// sg failed for good or was cancelled (see [compensateFrom]), with its
// history entry, or ends the saga compensated when nothing completed.
func (e *Engine) startCompensation(tr *store.Transition, sg *store.Saga, def *compiled, idx int) {
	prev := compensateFrom(sg, def, idx)
	if prev >= 0 {
		tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: EventCompensationStarted,
			StepName: def.steps[prev].name, Direction: string(steps.Compensate), Epoch: sg.Epoch})
	}
	e.moveTo(tr, sg, def, prev, steps.Compensate, store.StatusCompensated, EventSagaCompensated)
}

// current reports whether cmd, which carries the saga's version, is the
// saga's current command in every other respect too: its step, direction
// and epoch, and, when the saga records it, the outbox id of the command
// written for this version. A command that passes the version fence but
// names another step, or is not the one the saga wrote (a forgery, or a
// copy sent early to skip a retry's backoff), is refused.
func (cmd command) current(c *store.Claimed, ls *store.LockedSaga) bool {
	if cmd.Step != ls.StepName || string(cmd.Direction) != ls.Direction || cmd.Epoch != ls.Epoch {
		return false
	}
	return ls.CommandID == nil || c.ID == uuid.Nil || c.ID == *ls.CommandID
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
