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
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/store"
)

// commandType is the outbox type of a step command.
const commandType = "sagaflow.step"

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
	if c.Type != commandType {
		return cmd, fmt.Errorf("message type %q is not %q", c.Type, commandType)
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

// commandMessage builds the outbox row of the command for a saga's step.
func (e *Engine) commandMessage(sagaID uuid.UUID, name, step string, dir steps.Direction, epoch int, version int64, delay time.Duration) store.Message {
	cmd := command{SagaID: sagaID, Saga: name, Step: step, Direction: dir, Epoch: epoch, Version: version}
	payload, _ := json.Marshal(cmd) // plain fields: cannot fail
	key := steps.Key{SagaID: sagaID, Step: step, Direction: dir, Epoch: epoch}.String()
	id := uuid.Must(uuid.NewV7())
	return store.Message{
		ID: id, Topic: e.cfg.CommandTopic, Delivery: store.DeliveryDirect,
		AggregateType: "saga." + name, AggregateID: sagaID.String(), Type: commandType, Payload: payload,
		Headers: map[string]string{
			"sagaflow-message-id": id.String(),
			"sagaflow-saga-id":    sagaID.String(),
			"sagaflow-step-key":   key,
			"sagaflow-type":       commandType,
		},
		SagaID: &sagaID, StepKey: &key, Delay: delay,
	}
}

type batchResult struct {
	claimed      int
	readyCreated bool // a command that is due now was written
}

// batch is the work of one transaction.
type batch struct {
	e         *Engine
	tx        pgx.Tx
	delivered []uuid.UUID
	deferred  []uuid.UUID
	ready     bool
}

// runBatch claims up to BatchSize commands, runs their steps in one
// transaction (each under a savepoint) and commits once.
func (e *Engine) runBatch(fetchCtx, ctx context.Context) (res batchResult, err error) {
	conn, err := e.pool.Acquire(fetchCtx)
	if err != nil {
		return res, fmt.Errorf("saga: acquire connection: %w", err)
	}
	hijacked := false
	defer func() {
		if !hijacked {
			conn.Release()
		}
	}()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("saga: begin batch: %w", err)
	}
	defer func() {
		if !hijacked {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	// The lease in database time: a worker that stops talking to PostgreSQL
	// (paused, partitioned) while it holds claims loses its session and with
	// it the claims and the uncommitted step.
	lease := e.maxStepTimeout() + e.cfg.HandlerGrace + 5*time.Second
	if _, err := tx.Exec(ctx, "SELECT set_config('idle_in_transaction_session_timeout', $1, true)",
		strconv.FormatInt(lease.Milliseconds(), 10)); err != nil {
		return res, fmt.Errorf("saga: set lease: %w", err)
	}
	claimed, err := e.st.ClaimDirect(ctx, tx, e.cfg.CommandTopic, e.cfg.BatchSize)
	if err != nil {
		return res, err
	}
	res.claimed = len(claimed)
	if len(claimed) == 0 {
		return res, nil
	}

	b := &batch{e: e, tx: tx}
	cmds := make([]command, len(claimed))
	valid := make([]bool, len(claimed))
	var ids []uuid.UUID
	for i := range claimed {
		cmd, derr := decodeCommand(&claimed[i])
		if derr != nil {
			if err := b.park(ctx, &claimed[i], nil, CodeMalformed, "malformed command: "+derr.Error()); err != nil {
				return res, err
			}
			continue
		}
		cmds[i], valid[i] = cmd, true
		ids = append(ids, cmd.SagaID)
	}
	sagas := map[uuid.UUID]*store.LockedSaga{}
	if len(ids) > 0 {
		if sagas, err = e.st.LockSagas(ctx, tx, ids); err != nil {
			return res, err
		}
	}
	for i := range claimed {
		if !valid[i] {
			continue
		}
		if err := b.handle(ctx, &claimed[i], cmds[i], sagas[cmds[i].SagaID]); err != nil {
			if errors.Is(err, errAbandoned) {
				// The handler still uses the connection: never touch it again.
				hijacked = true
				raw := conn.Hijack()
				_ = raw.PgConn().Conn().Close()
			}
			return res, err
		}
	}

	end := &pgx.Batch{}
	if len(b.delivered) > 0 {
		e.st.QueueMarkDelivered(end, b.delivered)
	}
	if len(b.deferred) > 0 {
		e.st.QueueDefer(end, b.deferred, deferDelay, deferDelayMax)
	}
	if b.ready {
		e.st.QueueNotify(end, e.cfg.CommandTopic)
	}
	if end.Len() > 0 {
		if err := tx.SendBatch(ctx, end).Close(); err != nil {
			return res, fmt.Errorf("saga: finish batch: %w", err)
		}
	}
	if h := e.hooks.beforeCommit; h != nil {
		if err := h(ctx, tx); err != nil {
			return res, err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("saga: commit batch of %d steps: %w", len(claimed), err)
	}
	res.readyCreated = b.ready
	return res, nil
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
	reason = sanitizeText(reason, 2000)
	b.e.stats.parked.Add(1)
	b.e.log.WarnContext(ctx, "sagaflow parked a command", slog.String("message_id", c.ID.String()),
		slog.String("code", code), slog.String("reason", reason))
	if err := b.e.st.MarkDead(ctx, b.tx, c.ID, reason); err != nil {
		return err
	}
	if sagaID == nil {
		sagaID = c.SagaID
	}
	if sagaID != nil {
		detail, _ := json.Marshal(map[string]string{"message_id": c.ID.String()})
		return b.e.st.InsertHistory(ctx, b.tx, &store.HistoryEntry{
			SagaID: *sagaID, Event: EventCommandParked, Error: reason, ErrorCode: code, Detail: detail,
		})
	}
	return nil
}

// handle runs one claimed command. A returned error aborts the batch.
func (b *batch) handle(ctx context.Context, c *store.Claimed, cmd command, ls *store.LockedSaga) error {
	e := b.e
	if ls == nil {
		return b.park(ctx, c, nil, CodeUnknownSaga, fmt.Sprintf("saga %s does not exist", cmd.SagaID))
	}
	if ls.Name != cmd.Saga {
		return b.park(ctx, c, &ls.ID, CodeMalformed, fmt.Sprintf("command names saga %q but saga %s is a %q", cmd.Saga, ls.ID, ls.Name))
	}
	def := e.lookupName(ls.Name)
	if def == nil {
		return b.park(ctx, c, &ls.ID, CodeUnknownSaga,
			fmt.Sprintf("no definition named %q is registered with this engine (registered: %s)", ls.Name, e.registeredNames()))
	}
	if !ls.Locked {
		// Another transaction runs a step of this saga right now.
		e.stats.deferred.Add(1)
		b.deferred = append(b.deferred, c.ID)
		return nil
	}
	if ls.Version != cmd.Version || Status(ls.Status).Terminal() {
		e.stats.stale.Add(1)
		b.delivered = append(b.delivered, c.ID)
		return nil
	}
	b.delivered = append(b.delivered, c.ID)
	idx, known := def.byName[ls.StepName]
	dir := steps.Direction(ls.Direction)
	if !known || !dir.Valid() {
		reason := fmt.Sprintf("saga %q has no step %q (direction %q); was the definition changed?", ls.Name, ls.StepName, ls.Direction)
		if err := b.park(ctx, c, &ls.ID, CodeUnknownStep, reason); err != nil {
			return err
		}
		return b.apply(ctx, ls, &plan{tr: b.failTransition(ls, ls.StepName, CodeUnknownStep, reason),
			history: []store.HistoryEntry{{SagaID: ls.ID, Event: EventSagaFailed, StepName: ls.StepName,
				Direction: ls.Direction, Epoch: ls.Epoch, Error: reason, ErrorCode: CodeUnknownStep}}})
	}
	return b.execute(ctx, ls, def, idx, dir)
}

// execute runs step idx of the saga in direction dir under a savepoint and
// writes its outcome.
func (b *batch) execute(ctx context.Context, ls *store.LockedSaga, def *compiled, idx int, dir steps.Direction) error {
	e := b.e
	key := steps.Key{SagaID: ls.ID, Step: ls.StepName, Direction: dir, Epoch: ls.Epoch}
	keyText := key.String()

	pre := &pgx.Batch{}
	pre.Queue("SAVEPOINT sagaflow_step")
	fresh := false
	e.st.QueueInboxKey(pre, store.InboxConsumerEngine, keyText).Exec(func(tag pgconn.CommandTag) error { fresh = tag.RowsAffected() == 1; return nil })
	if err := b.tx.SendBatch(ctx, pre).Close(); err != nil {
		return fmt.Errorf("saga: open step %s: %w", keyText, err)
	}
	if !fresh {
		// The key is in the inbox: this step's effects were committed before.
		// Move on without running it twice.
		e.stats.dedup.Add(1)
		p := b.successPlan(ls, def, idx, dir, nil, 0)
		p.history = append([]store.HistoryEntry{{SagaID: ls.ID, Event: EventStepDeduplicated, StepName: ls.StepName,
			Direction: string(dir), Epoch: ls.Epoch, Attempt: ls.Attempt + 1}}, p.history...)
		return b.apply(ctx, ls, p)
	}

	attempt := ls.Attempt + 1
	timeout := def.steps[idx].timeout
	run := &StepRun{
		Tx: b.tx, Key: key, SagaID: ls.ID, SagaName: ls.Name, Step: ls.StepName, Direction: dir,
		Epoch: ls.Epoch, Attempt: attempt,
	}
	if ls.BusinessKey != nil {
		run.BusinessKey = *ls.BusinessKey
	}
	started := time.Now()
	newState, herr := e.callHandler(ctx, def, run, idx, dir, ls.State, timeout)
	if errors.Is(herr, errAbandoned) {
		return herr
	}
	elapsed := time.Since(started)
	if herr == nil {
		if len(newState) > e.cfg.MaxStateBytes {
			herr = steps.Permanent(steps.WithCode(CodeTooLarge,
				fmt.Errorf("state is %d bytes after step %q, more than MaxStateBytes (%d)", len(newState), ls.StepName, e.cfg.MaxStateBytes)))
		} else if bytes.Contains(newState, []byte(`\u0000`)) {
			herr = steps.Permanent(steps.WithCode(CodeStateEncode,
				errors.New("state contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store")))
		}
	}
	if herr == nil {
		p := b.successPlan(ls, def, idx, dir, newState, elapsed)
		err := b.apply(ctx, ls, p)
		if err == nil || !isStatementError(err) {
			return err
		}
		// The step's own writes or ours failed inside the transaction (the
		// handler left it aborted, say): undo the step and record a failure.
		herr = steps.WithCode(CodeTxAborted, fmt.Errorf("commit step: %w", err))
	}
	if _, err := b.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT sagaflow_step"); err != nil {
		return fmt.Errorf("saga: roll back step %s: %w", keyText, err)
	}
	e.stats.failed.Add(1)
	return b.apply(ctx, ls, b.failurePlan(ls, def, idx, dir, attempt, herr, elapsed))
}

// isStatementError reports whether err came from PostgreSQL about a statement
// (so the transaction can be rolled back to a savepoint) rather than from the
// connection.
func isStatementError(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr)
}

var errAbandoned = errors.New("saga: handler ignored its cancelled context past the grace period; its connection was closed")

type panicError struct {
	value any
	stack []byte
}

func (p *panicError) Error() string { return fmt.Sprintf("panic: %v", p.value) }

// callHandler runs the step function, recovering panics and enforcing the
// timeout. A handler that ignores its cancelled context for longer than
// HandlerGrace is abandoned: callHandler returns errAbandoned and the caller
// must not use the transaction again.
func (e *Engine) callHandler(ctx context.Context, def *compiled, run *StepRun, idx int, dir steps.Direction, state []byte, timeout time.Duration) ([]byte, error) {
	stepCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
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
	case <-stepCtx.Done():
		grace := time.NewTimer(e.cfg.HandlerGrace)
		defer grace.Stop()
		select {
		case r = <-done:
		case <-grace.C:
			e.stats.abandoned.Add(1)
			e.log.ErrorContext(ctx, "sagaflow abandoned a step handler that ignored its context",
				slog.String("step_key", run.Key.String()), slog.Duration("timeout", timeout))
			return nil, errAbandoned
		}
	}
	if r.err != nil && stepCtx.Err() != nil && ctx.Err() == nil && errors.Is(stepCtx.Err(), context.DeadlineExceeded) {
		// The attempt ran out of time; whatever it returned, say so.
		if steps.Code(r.err) == "" {
			r.err = steps.WithCode(CodeTimeout, fmt.Errorf("step %q timed out after %s: %w", run.Step, timeout, r.err))
		}
	}
	if r.err == nil && stepCtx.Err() != nil && ctx.Err() == nil {
		// Finished after its deadline but without error: accept the result;
		// its writes are still in the transaction and commit with it.
		return r.state, nil
	}
	return r.state, r.err
}

// plan is the writes of one step outcome.
type plan struct {
	tr       store.Transition
	history  []store.HistoryEntry
	messages []store.Message
}

// apply writes p in one round trip; if the fenced update finds the saga moved
// on, the step's writes are rolled back to its savepoint and the command is
// counted stale.
func (b *batch) apply(ctx context.Context, ls *store.LockedSaga, p *plan) error {
	e := b.e
	q := &pgx.Batch{}
	fenced := false
	e.st.QueueTransition(q, &p.tr).Exec(func(tag pgconn.CommandTag) error {
		fenced = tag.RowsAffected() == 1
		return nil
	})
	for i := range p.history {
		e.st.QueueHistory(q, &p.history[i])
	}
	for i := range p.messages {
		e.st.QueueMessage(q, &p.messages[i])
	}
	if err := b.tx.SendBatch(ctx, q).Close(); err != nil {
		return fmt.Errorf("saga: write outcome of saga %s: %w", ls.ID, err)
	}
	if !fenced {
		e.stats.stale.Add(1)
		if _, err := b.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT sagaflow_step"); err != nil {
			return fmt.Errorf("saga: roll back fenced step of saga %s: %w", ls.ID, err)
		}
		e.log.InfoContext(ctx, "sagaflow refused a step commit: the saga moved on",
			slog.String("saga_id", ls.ID.String()), slog.Int64("version", ls.Version))
		return nil
	}
	ls.Version++
	ls.Status = p.tr.Status
	for _, m := range p.messages {
		if m.Delay <= 0 {
			b.ready = true
		}
	}
	return nil
}

func (b *batch) transition(ls *store.LockedSaga) store.Transition {
	return store.Transition{
		ID: ls.ID, Version: ls.Version, Status: ls.Status, StepIndex: ls.StepIndex, StepName: ls.StepName,
		Direction: ls.Direction, Epoch: ls.Epoch, Attempt: ls.Attempt,
		LastError: ls.LastError, LastErrorCode: ls.LastErrorCode, FailedStep: ls.FailedStep,
	}
}

func (b *batch) failTransition(ls *store.LockedSaga, step, code, reason string) store.Transition {
	tr := b.transition(ls)
	tr.Status = store.StatusFailed
	tr.LastError, tr.LastErrorCode, tr.FailedStep = &reason, &code, &step
	return tr
}

// moveTo points tr at step i in direction dir with its command, or ends the
// saga with status end when i < 0 or past the last step.
func (b *batch) moveTo(p *plan, ls *store.LockedSaga, def *compiled, i int, dir steps.Direction, delay time.Duration, endStatus string, endEvent string) {
	if i < 0 || i >= len(def.steps) {
		p.tr.Status = endStatus
		p.history = append(p.history, store.HistoryEntry{SagaID: ls.ID, Event: endEvent, Epoch: ls.Epoch})
		return
	}
	status := store.StatusRunning
	if dir == steps.Compensate {
		status = store.StatusCompensating
	}
	p.tr.Status, p.tr.StepIndex, p.tr.StepName, p.tr.Direction, p.tr.Attempt = status, i, def.steps[i].name, string(dir), 0
	p.tr.CheckAfter = delay + def.steps[i].timeout + b.e.cfg.RescueSlack
	p.messages = append(p.messages, b.e.commandMessage(ls.ID, ls.Name, def.steps[i].name, dir, ls.Epoch, ls.Version+1, delay))
}

func durationDetail(d time.Duration, extra map[string]any) []byte {
	m := map[string]any{"duration_ms": float64(d.Microseconds()) / 1000}
	for k, v := range extra {
		m[k] = v
	}
	out, _ := json.Marshal(m)
	return out
}

func (b *batch) successPlan(ls *store.LockedSaga, def *compiled, idx int, dir steps.Direction, newState []byte, elapsed time.Duration) *plan {
	b.e.stats.succeeded.Add(1)
	p := &plan{tr: b.transition(ls)}
	p.tr.State = newState
	event := EventStepCompleted
	if dir == steps.Compensate {
		event = EventCompensationCompleted
	}
	p.history = append(p.history, store.HistoryEntry{SagaID: ls.ID, Event: event, StepName: ls.StepName,
		Direction: string(dir), Epoch: ls.Epoch, Attempt: ls.Attempt + 1, Detail: durationDetail(elapsed, nil)})
	if dir == steps.Forward {
		p.tr.LastError, p.tr.LastErrorCode, p.tr.FailedStep = nil, nil, nil
		b.moveTo(p, ls, def, idx+1, steps.Forward, 0, store.StatusCompleted, EventSagaCompleted)
	} else {
		b.moveTo(p, ls, def, def.prevCompensable(idx-1), steps.Compensate, 0, store.StatusCompensated, EventSagaCompensated)
	}
	return p
}

func (b *batch) failurePlan(ls *store.LockedSaga, def *compiled, idx int, dir steps.Direction, attempt int, herr error, elapsed time.Duration) *plan {
	e := b.e
	code := steps.Code(herr)
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
	msg := sanitizeText(herr.Error(), 4000)
	extra := map[string]any{}
	if pe != nil {
		extra["stack"] = sanitizeText(string(pe.stack), 16000)
	}
	p := &plan{tr: b.transition(ls)}
	failed := store.HistoryEntry{SagaID: ls.ID, Event: EventStepFailed, StepName: ls.StepName, Direction: string(dir),
		Epoch: ls.Epoch, Attempt: attempt, Error: msg, ErrorCode: code}

	policy := def.policy(idx, dir)
	var ra *steps.RetryAfterError
	retryable := !steps.IsPermanent(herr) && de == nil && attempt < policy.MaxAttempts
	if retryable {
		delay := policy.Backoff(attempt)
		if errors.As(herr, &ra) {
			delay = ra.Delay
		}
		e.stats.retries.Add(1)
		extra["retry_in_ms"] = delay.Milliseconds()
		failed.Detail = durationDetail(elapsed, extra)
		p.history = append(p.history, failed)
		p.tr.Attempt = attempt
		if dir == steps.Forward {
			p.tr.LastError, p.tr.LastErrorCode = &msg, &code
		}
		p.tr.CheckAfter = delay + def.steps[idx].timeout + e.cfg.RescueSlack
		p.messages = append(p.messages, e.commandMessage(ls.ID, ls.Name, ls.StepName, dir, ls.Epoch, ls.Version+1, delay))
		return p
	}
	extra["final"] = true
	failed.Detail = durationDetail(elapsed, extra)
	p.history = append(p.history, failed)
	p.tr.Attempt = attempt
	p.tr.LastError, p.tr.LastErrorCode, p.tr.FailedStep = &msg, &code, &ls.StepName
	if dir == steps.Compensate || de != nil {
		// A compensation gave up, or the state cannot be read at all: park
		// the saga for an operator.
		p.tr.Status = store.StatusFailed
		p.history = append(p.history, store.HistoryEntry{SagaID: ls.ID, Event: EventSagaFailed, StepName: ls.StepName,
			Direction: string(dir), Epoch: ls.Epoch, Error: msg, ErrorCode: code})
		return p
	}
	prev := def.prevCompensable(idx - 1)
	if prev >= 0 {
		p.history = append(p.history, store.HistoryEntry{SagaID: ls.ID, Event: EventCompensationStarted,
			StepName: def.steps[prev].name, Direction: string(steps.Compensate), Epoch: ls.Epoch})
	}
	b.moveTo(p, ls, def, prev, steps.Compensate, 0, store.StatusCompensated, EventSagaCompensated)
	return p
}
