package saga

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// This file is the saga's state machine: every decision about where a saga
// goes next, as functions of the saga's row, its definition and what
// happened (a step's outcome, a reply, a cancel request, a passed deadline,
// an operator's replay). Nothing here reads a clock or the database, or
// writes anything: the batch, the rescuer, cancel and replay apply what these
// functions return (see [Engine.transition]).
//
// A retry's backoff is the one value that comes from elsewhere: the step's
// [BackoffFunc], which is part of its definition.

// machine makes a saga's decisions. It holds only the engine's
// configuration that the decisions depend on.
type machine struct {
	// slack is Config.RescueSlack, added to a step's timeout to give the
	// saga's deadline.
	slack time.Duration
	// maxState is Config.MaxStateBytes.
	maxState int
}

// decision is where a saga goes next: the fenced update of its row, with the
// history entries and inbox key that go with it, and the command of the
// saga's next position, which the caller builds ([Engine.transition]).
type decision struct {
	tr *store.Transition
	// next is the command to write, or nil (the saga ends, fails, or waits
	// for a reply).
	next *nextCommand
	// retry says that the same step is attempted again, after next's delay.
	retry bool
	// applied, when set, runs once the transition is written and its fence
	// held (the executor's, not the machine's: see [batch.await]).
	applied func()
	// thenRun says that the local step next names runs at once, and
	// that its outcome's update carries this transition (the executor's:
	// see [batch.thenRun]).
	thenRun bool
}

// nextCommand is a command a decision writes: for step in direction dir of
// run epoch, due after delay. It carries the saga's next version.
type nextCommand struct {
	step  string
	dir   steps.Direction
	epoch int
	delay time.Duration
}

// transitionFrom is a transition that leaves sg as it is.
func transitionFrom(sg *store.Saga) *store.Transition {
	return &store.Transition{
		ID: sg.ID, Version: sg.Version, Status: sg.Status, StepIndex: sg.StepIndex, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Attempt: sg.Attempt,
		LastError: sg.LastError, LastErrorCode: sg.LastErrorCode, FailedStep: sg.FailedStep,
		// A saga that waits keeps waiting, until its wait's end: a retry or
		// a re-drive of its step does not start the wait again.
		WaitKind: deref(sg.WaitKind), WaitFor: deref(sg.WaitFor),
	}
}

// failTransition parks sg as failed at step with code and reason.
func failTransition(sg *store.Saga, step, code, reason string) *store.Transition {
	tr := transitionFrom(sg)
	tr.Status = store.StatusFailed
	tr.LastError, tr.LastErrorCode, tr.FailedStep = &reason, &code, &step
	return tr
}

// statusFor is the status of a saga moving in direction dir.
func statusFor(dir steps.Direction) string {
	if dir == steps.Compensate {
		return store.StatusCompensating
	}
	return store.StatusRunning
}

// stepTimeoutIn is the timeout of step in def, or StepTimeoutDefault when
// def is nil or has no such step.
func stepTimeoutIn(def *compiled, step string) time.Duration {
	if def != nil {
		if idx, ok := def.byName[step]; ok {
			return def.steps[idx].timeout
		}
	}
	return StepTimeoutDefault
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

// moveTo points d at step i in direction dir with its command, or ends the
// saga with endStatus when i is before the first or past the last step.
func (m machine) moveTo(d *decision, sg *store.Saga, def *compiled, i int, dir steps.Direction, endStatus, endEvent string) {
	tr := d.tr
	if i < 0 || i >= len(def.steps) {
		tr.Status = endStatus
		tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: endEvent, Epoch: sg.Epoch})
		return
	}
	tr.Status, tr.StepIndex, tr.StepName, tr.Direction, tr.Attempt = statusFor(dir), i, def.steps[i].name, string(dir), 0
	tr.WaitKind, tr.WaitFor = "", ""
	tr.CheckAfter = m.deadline(def.steps[i].timeout)
	d.next = &nextCommand{step: def.steps[i].name, dir: dir, epoch: sg.Epoch}
}

// compensateFrom is the first step to compensate when step idx of sg fails
// for good or the saga is cancelled: the step before it, or the step itself
// when it is a remote step whose command went out and whose reply never
// came (the participant may have carried it out).
func compensateFrom(sg *store.Saga, def *compiled, idx int) int {
	if def.steps[idx].parallel != nil && steps.Direction(sg.Direction) == steps.Forward {
		// Its completed branches are undone by the group's compensation.
		return def.prevCompensable(idx)
	}
	if sg.AwaitingReply && steps.Direction(sg.Direction) == steps.Forward {
		return def.prevCompensable(idx)
	}
	return def.prevCompensable(idx - 1)
}

// startCompensation points d at the first compensation after step idx of sg
// failed for good or was cancelled (see [compensateFrom]), with its history
// entry, or ends the saga compensated when nothing completed.
func (m machine) startCompensation(d *decision, sg *store.Saga, def *compiled, idx int) {
	prev := compensateFrom(sg, def, idx)
	if prev >= 0 {
		d.tr.History = append(d.tr.History, store.HistoryEntry{SagaID: sg.ID, Event: EventCompensationStarted,
			StepName: def.steps[prev].name, Direction: string(steps.Compensate), Epoch: sg.Epoch})
	}
	m.moveTo(d, sg, def, prev, steps.Compensate, store.StatusCompensated, EventSagaCompensated)
}

// success is the decision after step idx of sg succeeded in direction dir,
// leaving newState (nil keeps the stored state) after elapsed: forward, the
// next step runs or the saga completes; compensating, the previous
// compensable step is undone or the saga ends compensated. A non-empty key
// is recorded in the inbox.
func (m machine) success(sg *store.Saga, def *compiled, idx int, dir steps.Direction, newState []byte, elapsed time.Duration, key string) decision {
	d := decision{tr: transitionFrom(sg)}
	tr := d.tr
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
		m.moveTo(&d, sg, def, idx+1, steps.Forward, store.StatusCompleted, EventSagaCompleted)
	} else {
		m.moveTo(&d, sg, def, def.prevCompensable(idx-1), steps.Compensate, store.StatusCompensated, EventSagaCompensated)
	}
	return d
}

// deduplicated is the decision for a step whose key is in the inbox already:
// its effects were committed before, so it moves on as if it succeeded,
// without running twice.
func (m machine) deduplicated(sg *store.Saga, def *compiled, idx int, dir steps.Direction) decision {
	d := m.success(sg, def, idx, dir, nil, 0, "")
	d.tr.History = append([]store.HistoryEntry{{SagaID: sg.ID, Event: EventStepDeduplicated, StepName: sg.StepName,
		Direction: string(dir), Epoch: sg.Epoch, Attempt: sg.Attempt + 1}}, d.tr.History...)
	return d
}

// failure is the decision after attempt of step idx of sg failed with herr
// in direction dir, after elapsed:
//
//   - retried after its backoff (or the delay of a [steps.RetryAfter]) while
//     attempts are left and the error is not permanent;
//   - else, forward, the saga compensates from the step before (see
//     [compensateFrom]);
//   - else, compensating, or when the state cannot be decoded at all, the
//     saga is failed, for an operator.
func (m machine) failure(sg *store.Saga, def *compiled, idx int, dir steps.Direction, attempt int, herr error, elapsed time.Duration) decision {
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
	d := decision{tr: transitionFrom(sg)}
	tr := d.tr
	failed := store.HistoryEntry{SagaID: sg.ID, Event: EventStepFailed, StepName: sg.StepName, Direction: string(dir),
		Epoch: sg.Epoch, Attempt: attempt, Error: msg, ErrorCode: code}

	policy := def.policy(idx, dir)
	// A retriable step, after the pivot, has no attempt limit: it runs
	// until it succeeds or fails for good.
	retriable := dir == steps.Forward && def.steps[idx].retriable
	transient := !steps.IsPermanent(herr) && de == nil
	if transient && dir == steps.Forward && def.steps[idx].pauseExhausted && attempt >= policy.MaxAttempts {
		return m.pauseExhausted(d, sg, failed, attempt, policy.MaxAttempts, msg, code, extra, elapsed)
	}
	retryable := transient && (attempt < policy.MaxAttempts || retriable)
	if retryable {
		delay := policy.retryDelay(attempt, herr)
		extra["retry_in_ms"] = delay.Milliseconds()
		failed.Detail = durationDetail(elapsed, extra)
		tr.History = append(tr.History, failed)
		tr.Attempt = attempt
		if dir == steps.Forward {
			tr.LastError, tr.LastErrorCode = &msg, &code
		}
		tr.CheckAfter = m.deadline(delay, def.steps[idx].timeout)
		d.next = &nextCommand{step: sg.StepName, dir: dir, epoch: sg.Epoch, delay: delay}
		d.retry = true
		return d
	}
	extra["final"] = true
	failed.Detail = durationDetail(elapsed, extra)
	tr.History = append(tr.History, failed)
	tr.Attempt = attempt
	tr.LastError, tr.LastErrorCode, tr.FailedStep = &msg, &code, &sg.StepName
	if dir == steps.Compensate || de != nil || def.pastPivot(idx) {
		// A compensation gave up, or the state cannot be read at all, or a
		// step after the pivot failed for good (nothing may be undone any
		// more): park the saga for an operator.
		tr.Status = store.StatusFailed
		tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: EventSagaFailed, StepName: sg.StepName,
			Direction: string(dir), Epoch: sg.Epoch, Error: msg, ErrorCode: code})
		return d
	}
	m.startCompensation(&d, sg, def, idx)
	return d
}

// pauseExhausted is the decision for a step that asked to pause when its
// retries ran out (Step.PauseWhenExhausted), after attempt failed: the saga
// pauses at the step, whose command is written held, with its attempts
// counted afresh for when an operator resumes it.
func (m machine) pauseExhausted(d decision, sg *store.Saga, failed store.HistoryEntry, attempt, max int, msg, code string,
	extra map[string]any, elapsed time.Duration) decision {
	tr := d.tr
	extra["paused"] = true
	failed.Detail = durationDetail(elapsed, extra)
	reason := fmt.Sprintf("step %q failed %d times (Retry.MaxAttempts %d); last error: %s", sg.StepName, attempt, max, msg)
	detail, _ := json.Marshal(map[string]string{"reason": reason})
	tr.History = append(tr.History, failed, store.HistoryEntry{SagaID: sg.ID, Event: EventSagaPaused, StepName: sg.StepName,
		Direction: string(steps.Forward), Epoch: sg.Epoch, Attempt: attempt, Error: msg, ErrorCode: store.PauseCodeExhausted, Detail: detail})
	tr.Attempt = 0
	tr.LastError, tr.LastErrorCode = &msg, &code
	step := sg.StepName
	tr.Pause = &store.Pause{Kind: store.PauseSaga, SagaName: sg.Name, Code: store.PauseCodeExhausted, Reason: reason, StepName: &step}
	d.next = &nextCommand{step: sg.StepName, dir: steps.Forward, epoch: sg.Epoch}
	d.retry = true
	return d
}

// checkState refuses state a handler left that cannot be stored: the step
// fails for good instead.
func (m machine) checkState(step string, state []byte) error {
	problem, tooLarge := safetext.StateProblem(step, state, m.maxState)
	switch {
	case problem == "":
		return nil
	case tooLarge:
		return steps.Permanent(steps.WithCode(CodeTooLarge, errors.New(problem)))
	}
	return steps.Permanent(steps.WithCode(CodeStateEncode, errors.New(problem)))
}

// sent is the decision after a remote step's command msg was built: the saga
// waits for the participant's reply, until exactly the step's timeout.
func (m machine) sent(sg *store.Saga, def *compiled, idx int, dir steps.Direction, msg store.Message) decision {
	tr := transitionFrom(sg)
	tr.AwaitingReply = true
	tr.CheckAfter, tr.ExactDeadline = def.steps[idx].timeout, true
	tr.Messages = []store.Message{msg}
	detail, _ := json.Marshal(map[string]string{"topic": msg.Topic, "type": msg.Type, "message_id": msg.ID.String()})
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventCommandSent, StepName: sg.StepName,
		Direction: string(dir), Epoch: sg.Epoch, Attempt: sg.Attempt + 1, Detail: detail}}
	return decision{tr: tr}
}

// successThen is first, a step's success that moves the saga to the next
// step, followed in the same fenced update by then, the decision on that
// step made on the saga as first leaves it (its send, or its failure): one
// update at first's version that ends where then does, carrying first (see
// [carryInto]). first writes no command of its own.
func successThen(first, then decision) decision {
	tr := *then.tr
	tr.Version = first.tr.Version
	carryInto(&tr, first.tr)
	out := then
	out.tr = &tr
	if a, b := first.applied, then.applied; a != nil || b != nil {
		out.applied = func() {
			if a != nil {
				a()
			}
			if b != nil {
				b()
			}
		}
	}
	return out
}

// carryInto folds first, a transition written with no update of its own,
// into tr, which follows it in the same update: first's history goes
// first, its state stays unless tr sets one, its inbox key is recorded with
// tr's, the pending commands it deletes are deleted, and the signal it took
// (a wait's end) is delivered.
func carryInto(tr, first *store.Transition) {
	tr.History = append(append(make([]store.HistoryEntry, 0, len(first.History)+len(tr.History)), first.History...), tr.History...)
	if tr.State == nil {
		tr.State = first.State
	}
	keys := append([]string(nil), first.EarlierInboxKeys...)
	if first.InboxKey != "" {
		keys = append(keys, first.InboxKey)
	}
	tr.EarlierInboxKeys = append(keys, tr.EarlierInboxKeys...)
	tr.Supersede = append(append([]uuid.UUID(nil), first.Supersede...), tr.Supersede...)
	if first.DeliverSignal != 0 {
		tr.DeliverSignal, tr.DeliverStep, tr.RejectSignal = first.DeliverSignal, first.DeliverStep, first.RejectSignal
	}
}

// replied is the decision after a participant's successful reply to step idx
// of sg was applied, leaving newState: the step succeeded.
func (m machine) replied(sg *store.Saga, def *compiled, idx int, dir steps.Direction, newState []byte, key string) decision {
	d := m.success(sg, def, idx, dir, newState, 0, key)
	d.tr.History = append([]store.HistoryEntry{{SagaID: sg.ID, Event: EventReplyReceived, StepName: sg.StepName,
		Direction: string(dir), Epoch: sg.Epoch, Attempt: sg.Attempt + 1}}, d.tr.History...)
	return d
}

// refused is the decision after a participant refused step idx of sg: the
// step fails for good, with the participant's code (CodeRefused when it gave
// none). The participant did nothing to undo, so a forward step is not
// compensated itself.
func (m machine) refused(sg *store.Saga, def *compiled, idx int, dir steps.Direction, r steps.Reply) decision {
	// A participant in another language may send more than the protocol's
	// limits: cut to them, as a Go participant does before it sends.
	r.Error = safetext.Text(r.Error, wire.MaxReplyErrorBytes)
	code := safetext.Text(r.Code, wire.MaxReplyCodeBytes)
	if code == "" {
		code = CodeRefused
	}
	s := *sg
	s.AwaitingReply = false
	return m.failure(&s, def, idx, dir, sg.Attempt+1, steps.Permanent(steps.WithCode(code, errors.New(r.Error))), 0)
}

// invalidOutcome parks sg, as failed, when PostgreSQL refused the
// transition its step produced: everything it writes is fixed text or made
// storable, so it cannot fail the same way.
func invalidOutcome(sg *store.Saga, cause error) decision {
	reason := safetext.Text("the step's outcome could not be stored: "+cause.Error(), 2000)
	tr := failTransition(sg, sg.StepName, CodeInvalidOutcome, reason)
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventSagaFailed, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Error: reason, ErrorCode: CodeInvalidOutcome}}
	return decision{tr: tr}
}

// unknownStep parks sg, as failed, when no engine knew its step within
// UnknownSagaGrace; reason says what was not known.
func unknownStep(sg *store.Saga, reason string) decision {
	tr := failTransition(sg, sg.StepName, CodeUnknownStep, reason)
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventSagaFailed, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Error: reason, ErrorCode: CodeUnknownStep}}
	return decision{tr: tr}
}

// cancel is the decision that applies a cancel request to a running saga at
// step idx: compensate the steps that completed, from the one before idx (or
// idx itself, for a remote step whose command went out), and delete the
// request.
func (m machine) cancel(sg *store.Saga, def *compiled, idx int, reason, code string) decision {
	if code == "" {
		code = CodeCancelled
	}
	d := decision{tr: transitionFrom(sg)}
	m.leaveWait(d.tr, sg, def, idx, reason, code)
	tr := d.tr
	tr.LastError, tr.LastErrorCode = &reason, &code
	tr.AwaitingReply = false
	tr.ClearCancel = true
	tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: EventSagaCancelled, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Error: reason, ErrorCode: code})
	m.startCompensation(&d, sg, def, idx)
	return d
}

// leaveWait is what leaving a wait before its end takes, written with
// tr: the wait's timer command is no longer needed, and a child saga the
// step waits for is asked to cancel, for reason with code.
func (m machine) leaveWait(tr *store.Transition, sg *store.Saga, def *compiled, idx int, reason, code string) {
	if sg.WaitKind == nil {
		return
	}
	if *sg.WaitKind == store.WaitBranches {
		// The branches still running end, and their commands that no one
		// runs right now go; one that runs finds the group gone and rolls
		// its effects back.
		tr.CancelBranches = sg.StepName
		return
	}
	if sg.CommandID != nil {
		tr.Supersede = append(tr.Supersede, *sg.CommandID)
	}
	w := def.steps[idx].wait
	if *sg.WaitKind != store.WaitChild || w == nil || w.kind != store.WaitChild {
		return
	}
	child, err := uuid.Parse(deref(sg.WaitFor))
	if err != nil {
		return
	}
	tr.CancelChild = &store.ChildCancel{ID: child, Reason: safetext.Text("the parent saga "+sg.ID.String()+" stopped waiting: "+reason, MaxReasonBytes), Code: code}
}

// parked is the decision that makes sg wait at its step idx for kind
// (waitFor names the signal or the child), delay from now, or without a
// time limit when delay is negative: its command is due when the wait
// ends, and the rescuer counts from then. first says the saga reached the
// step just now (rather than having a wait re-armed), which the history
// records.
func (m machine) parked(sg *store.Saga, def *compiled, idx int, kind, waitFor string, delay time.Duration, first bool) decision {
	tr := transitionFrom(sg)
	tr.WaitKind, tr.WaitFor = kind, waitFor
	tr.SetWaitUntil, tr.WaitDelay = true, delay
	d := decision{tr: tr}
	if delay >= 0 {
		tr.CheckAfter, tr.ExactDeadline = m.deadline(delay, def.steps[idx].timeout), true
		d.next = &nextCommand{step: sg.StepName, dir: steps.Forward, epoch: sg.Epoch, delay: delay}
	} else {
		tr.WaitDelay = -1
	}
	if first {
		tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventWaitStarted, StepName: sg.StepName,
			Direction: string(steps.Forward), Epoch: sg.Epoch, Attempt: sg.Attempt + 1, Detail: waitDetail(kind, waitFor, delay)}}
	}
	return d
}

// waitTimedOut is the decision when the signal or child that step idx of
// sg waits for did not come in time and the wait has no handler of its
// own: the step fails for good, and a child still running is cancelled.
func (m machine) waitTimedOut(sg *store.Saga, def *compiled, idx int) decision {
	what := "signal " + strconv.Quote(def.steps[idx].wait.signal)
	if def.steps[idx].wait.kind == store.WaitChild {
		what = "child saga " + deref(sg.WaitFor)
	}
	err := steps.Permanent(steps.WithCode(CodeWaitTimeout, fmt.Errorf("%s did not come within the wait's timeout (%s)", what, def.steps[idx].wait.timeout)))
	d := m.failure(sg, def, idx, steps.Forward, sg.Attempt+1, err, 0)
	d.tr.History = append([]store.HistoryEntry{{SagaID: sg.ID, Event: EventWaitTimedOut, StepName: sg.StepName,
		Direction: string(steps.Forward), Epoch: sg.Epoch, Attempt: sg.Attempt + 1, ErrorCode: CodeWaitTimeout}}, d.tr.History...)
	m.leaveWait(d.tr, sg, def, idx, "its wait timed out", CodeWaitTimeout)
	d.tr.Supersede = nil // the command that found the time up is the wait's own
	return d
}

// cancelRefusal says why a pending cancel request r cannot apply to sg, or
// returns "" when it applies: only a running saga, in the run the request
// was made for, is cancelled.
func cancelRefusal(sg *store.Saga, r *store.CancelRequest) string {
	switch {
	case Status(sg.Status).Terminal():
		return "the saga had ended: " + sg.Status
	case Status(sg.Status) == StatusCompensating:
		return "the saga was compensating already"
	case r.Epoch != sg.Epoch:
		return fmt.Sprintf("requested for run %d; the saga is in run %d", r.Epoch, sg.Epoch)
	}
	return ""
}

// interruptedBy reports whether herr, the outcome of a step of sg in
// direction dir, is a cancel request that takes the step's place, and the
// request's reason and code: a forward step of a running saga, in the run the
// request was made for.
func interruptedBy(herr error, sg *store.Saga, dir steps.Direction) (reason, code string, ok bool) {
	var cr *cancelRequested
	if errors.As(herr, &cr) && dir == steps.Forward && Status(sg.Status) == StatusRunning && cr.epoch == sg.Epoch {
		return safetext.Text(cr.reason, MaxReasonBytes), cr.code, true
	}
	return "", "", false
}

// rescueAction is what the rescuer does with a saga past its deadline.
type rescueAction int

const (
	// rescueBusy: a step of the saga runs right now; only its deadline
	// moves, so that the rescuer reaches other sagas.
	rescueBusy rescueAction = iota
	// rescueWaiting: its command waits in the queue; only its deadline
	// moves.
	rescueWaiting
	// rescueRedrive: a new command for its current step, under the same
	// step-scoped key.
	rescueRedrive
	// rescueFailOver: its attempts are spent, or its reply did not come in
	// time: it compensates, or fails.
	rescueFailOver
)

// rescueDecision is the rescuer's decision for one stuck saga.
type rescueDecision struct {
	action rescueAction
	// d is the saga's transition; unset for rescueBusy and rescueWaiting.
	d decision
	// supersede says to supersede the saga's current command (s.CommandID)
	// first: the relay has not published it, and never will.
	supersede bool
}

// rescue decides what to do with s, a saga past its deadline; def is its
// definition, nil when this engine does not know it. How long it is overdue
// is in s, measured in database time.
func (m machine) rescue(s *store.StuckSaga, def *compiled) rescueDecision {
	idx, known := 0, false
	if def != nil {
		idx, known = def.byName[s.StepName]
	}
	switch {
	case !s.Locked:
		// A step is running right now: the saga is alive. Look again
		// later, so that this pass and the next reach others.
		return rescueDecision{action: rescueBusy}
	case known && s.AwaitingReply:
		// The participant did not reply in time: the step fails for good,
		// and the compensation includes it (it may have run). A command the
		// relay has not published yet never will be, so the compensation
		// cannot overtake it.
		//
		// A compensation is retried instead, like any other: the command
		// goes again under the same step key (the participant runs it once,
		// or sends its reply again), until the step's CompensateRetry
		// attempts are spent.
		timeout := steps.WithCode(CodeReplyTimeout, fmt.Errorf("no reply to step %q within its timeout (%s)",
			s.StepName, def.steps[idx].timeout))
		dir := steps.Direction(s.Direction)
		if dir == steps.Forward && !def.pastPivot(idx) {
			// After the pivot the command goes again instead, under the
			// same step key, like a compensation's.
			timeout = steps.Permanent(timeout)
		}
		d := m.failure(&s.Saga, def, idx, dir, s.Attempt+1, timeout, 0)
		action := rescueFailOver
		if d.retry {
			action = rescueRedrive
		}
		return rescueDecision{action: action, d: d, supersede: s.CommandID != nil}
	case s.CommandStatus == store.OutboxPending || s.CommandStatus == "in_flight":
		// Waiting in the queue (workers down or busy), or published lately
		// to a consumer that may be behind: not lost.
		return rescueDecision{action: rescueWaiting}
	case !known:
		// At a step only another engine knows, its command lost: re-drive
		// it; an engine that knows the step runs it, or the command is
		// parked after UnknownSagaGrace.
		return rescueDecision{action: rescueRedrive, d: m.redrive(s, StepTimeoutDefault, s.Attempt)}
	}
	// Its command was lost: re-drive the current step with the same key,
	// counting the lost attempt, or fail it over when its attempts are
	// spent.
	dir := steps.Direction(s.Direction)
	attempt := s.Attempt + 1
	what := "was deleted or consumed without progress"
	if s.CommandStatus != "" {
		what = "is " + s.CommandStatus
	}
	reason := fmt.Sprintf("no progress %s past the deadline; the step's command %s", s.Overdue.Round(1e6), what)
	detail, _ := json.Marshal(map[string]any{"reason": reason, "attempt": attempt})
	rescued := store.HistoryEntry{SagaID: s.ID, Event: EventSagaRescued, StepName: s.StepName,
		Direction: s.Direction, Epoch: s.Epoch, Attempt: attempt, Detail: detail}
	if attempt >= def.policy(idx, dir).MaxAttempts && !(dir == steps.Forward && def.steps[idx].retriable) {
		err := steps.WithCode(CodeRescueExhausted, errors.New(reason))
		if dir != steps.Forward || !def.steps[idx].pauseExhausted {
			// A step with PauseWhenExhausted pauses instead, as when its
			// last attempt fails (found by review10: the rescuer
			// compensated it).
			err = steps.Permanent(err)
		}
		d := m.failure(&s.Saga, def, idx, dir, attempt, err, 0)
		d.tr.History = append([]store.HistoryEntry{rescued}, d.tr.History...)
		return rescueDecision{action: rescueFailOver, d: d}
	}
	d := m.redrive(s, def.steps[idx].timeout, attempt)
	d.tr.History = []store.HistoryEntry{rescued}
	return rescueDecision{action: rescueRedrive, d: d}
}

// redrive writes a new command for a stuck saga's current step, under the
// same step-scoped key, counting attempt.
func (m machine) redrive(s *store.StuckSaga, timeout time.Duration, attempt int) decision {
	tr := transitionFrom(&s.Saga)
	tr.Attempt = attempt
	tr.CheckAfter = m.deadline(timeout)
	detail, _ := json.Marshal(map[string]any{"reason": "command lost; re-driven", "attempt": attempt})
	tr.History = []store.HistoryEntry{{SagaID: s.ID, Event: EventSagaRescued, StepName: s.StepName,
		Direction: s.Direction, Epoch: s.Epoch, Attempt: attempt, Detail: detail}}
	return decision{tr: tr, next: &nextCommand{step: s.StepName, dir: steps.Direction(s.Direction), epoch: s.Epoch}}
}

// resume restarts a failed saga where it failed: the step that gave up, in
// its direction, with its attempts counted afresh. def may be nil (an
// operator tool's engine). hist is the saga's history, needed only for a
// saga that failed compensating: it gets back, as its last error, what made
// it compensate (see [compensationCause]).
func (m machine) resume(sg *store.Saga, def *compiled, hist []store.History, reason string) (decision, error) {
	if Status(sg.Status) != StatusFailed {
		return decision{}, fmt.Errorf("status is %s, and only failed sagas resume: %w", sg.Status, ErrNotReplayable)
	}
	dir := steps.Direction(sg.Direction)
	if !dir.Valid() {
		return decision{}, fmt.Errorf("direction %q is not valid", sg.Direction)
	}
	tr := transitionFrom(sg)
	tr.Status = statusFor(dir)
	tr.Attempt = 0
	tr.CheckAfter = m.deadline(stepTimeoutIn(def, sg.StepName))
	if dir == steps.Compensate {
		if c := compensationCause(hist, sg.Epoch); c != nil {
			tr.LastError, tr.LastErrorCode, tr.FailedStep = c.Error, c.ErrorCode, nil
			if c.Event == EventStepFailed {
				tr.FailedStep = c.StepName
			}
		}
	}
	detail, _ := json.Marshal(map[string]string{"reason": reason, "from_status": sg.Status, "failed_step": deref(sg.FailedStep)})
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventSagaResumed, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Error: deref(sg.LastError), ErrorCode: deref(sg.LastErrorCode), Detail: detail}}
	return decision{tr: tr, next: &nextCommand{step: sg.StepName, dir: dir, epoch: sg.Epoch}}, nil
}

// compensationCause returns the entry of a saga's history that made epoch
// compensate: the last entry of the epoch that records an error while the
// saga ran forward (a step's final failure, a cancel). Nothing runs forward
// once an epoch compensates, so no later forward error can follow it. It
// returns nil when the history has no such entry.
func compensationCause(hist []store.History, epoch int) *store.History {
	for i := len(hist) - 1; i >= 0; i-- {
		h := &hist[i]
		if deref(h.Epoch) == epoch && deref(h.Direction) == string(steps.Forward) && deref(h.ErrorCode) != "" {
			return h
		}
	}
	return nil
}

// rerunnable refuses a saga that has not ended: only those re-run.
func rerunnable(sg *store.Saga) error {
	if !Status(sg.Status).Terminal() {
		return fmt.Errorf("status is %s, and only ended sagas re-run: %w", sg.Status, ErrNotReplayable)
	}
	return nil
}

// rerun runs an ended saga forward again from step from, at index idx (-1
// when only the running engine can tell), under a new epoch; first is the
// saga's first step. def may be nil (an operator tool's engine).
func (m machine) rerun(sg *store.Saga, def *compiled, idx int, first, from, reason string) (decision, error) {
	if err := rerunnable(sg); err != nil {
		return decision{}, err
	}
	switch {
	case Status(sg.Status) == StatusCompensated && from != first:
		// Every completed step was compensated: running from a later step
		// would leave the earlier ones undone, and a later failure would
		// compensate them twice.
		return decision{}, fmt.Errorf("status is compensated: it can only re-run from its first step %q, not %q: %w",
			first, from, ErrNotReplayable)
	case Status(sg.Status) == StatusFailed && steps.Direction(sg.Direction) == steps.Compensate:
		// The compensation of the failed step gave up: the steps after it
		// were undone, the steps up to it are still in effect. Only a step
		// after it can run again without repeating an effect.
		if def == nil {
			return decision{}, fmt.Errorf("it failed while compensating step %q, and only an engine that knows saga %q can tell "+
				"which steps after it may run again; resume it, or re-run it from such an engine: %w", sg.StepName, sg.Name, ErrNotReplayable)
		}
		if failedAt := def.byName[sg.StepName]; idx <= failedAt {
			return decision{}, fmt.Errorf("it failed while compensating step %q, whose effects (and those of the steps before it) are still in effect: "+
				"re-run it from a later step: %w", sg.StepName, ErrNotReplayable)
		}
	}
	tr := transitionFrom(sg)
	tr.Status, tr.StepIndex, tr.StepName, tr.Direction = store.StatusRunning, idx, from, string(steps.Forward)
	tr.Epoch, tr.Attempt = sg.Epoch+1, 0
	tr.LastError, tr.LastErrorCode, tr.FailedStep = nil, nil, nil
	tr.CheckAfter = m.deadline(stepTimeoutIn(def, from))
	detail, _ := json.Marshal(map[string]any{"reason": reason, "from_status": sg.Status, "from_step": from})
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventSagaRerun, StepName: from,
		Direction: string(steps.Forward), Epoch: sg.Epoch + 1, Detail: detail}}
	return decision{tr: tr, next: &nextCommand{step: from, dir: steps.Forward, epoch: sg.Epoch + 1}}, nil
}

// deadline is how long from now a saga counts as stuck when what it does
// next takes ds (a delay, a wait, a step's timeout): their sum and the
// slack, stopping at the longest duration (see [sumCapped]). Every rescue
// deadline a decision writes comes from here, so that none of them can
// wrap into the past.
func (m machine) deadline(ds ...time.Duration) time.Duration {
	return sumCapped(append(ds, m.slack)...)
}

// sumCapped adds durations, stopping at the longest time.Duration: a wait
// until a far future (SleepUntil the year 9999) is already the longest, and
// the step's timeout and the slack added to it must not turn the rescue
// deadline negative, into the past. A negative duration counts as none.
func sumCapped(ds ...time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		if d <= 0 {
			continue
		}
		if sum > math.MaxInt64-d {
			return math.MaxInt64
		}
		sum += d
	}
	return sum
}
