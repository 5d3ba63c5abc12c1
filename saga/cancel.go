package saga

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// History events of a cancel request.
const (
	// EventCancelRequested: a cancel request was recorded; its reason is
	// the entry's error. EventSagaCancelled follows when it is applied.
	EventCancelRequested = "cancel_requested"
	// EventCancelRefused: a pending cancel request was dropped because the
	// saga was no longer running when an engine came to apply it (it had
	// ended, or was compensating already); the entry's detail says why.
	EventCancelRefused = "cancel_refused"
)

// CodeCancelRefused is the error code of an [EventCancelRefused] entry.
const CodeCancelRefused = "cancel_refused"

// MaxReasonBytes bounds a stored operator reason (of a cancel, pause,
// unpause, resume or rerun). Every such reason is stored as text PostgreSQL
// accepts: a NUL becomes the two characters \0, invalid UTF-8 becomes
// U+FFFD, and it is cut to at most MaxReasonBytes bytes.
const MaxReasonBytes = 2000

// Cancel stops a running saga: the steps that completed are compensated in
// reverse order, and the saga ends compensated. The request is durable once
// Cancel returns nil:
//
//   - when no step of the saga runs, it is applied at once, in Cancel's own
//     transaction;
//   - when a step runs, the engine running it (in this process or another)
//     cancels the step's context, and the request is applied in that step's
//     transaction instead of its outcome: the step is rolled back, unless it
//     returned success anyway, and then it is compensated too. No later step
//     runs.
//
// Both are recorded in the saga's history: [EventCancelRequested] when the
// request is recorded, [EventSagaCancelled] when it is applied.
//
// Cancel returns an error wrapping [ErrNotFound] for a saga that does not
// exist and [ErrNotRunning] for one that is compensating or has ended.
func (e *Engine) Cancel(ctx context.Context, id uuid.UUID, reason string) error {
	if err := e.ready("Engine.Cancel"); err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.CancelTx(ctx, tx, id, reason) })
}

// CancelTx is [Engine.Cancel] inside the caller's transaction. The request
// counts from when tx commits: steps that run before then are not affected,
// and a saga that ends before then has the request refused
// ([EventCancelRefused]). When no step of the saga runs at the call, tx
// holds the saga until it ends, so that no step starts meanwhile, and the
// request is applied with tx's commit. Like Cancel, it needs the saga's
// definition registered on this engine (an error wrapping [ErrNotRegistered]
// otherwise): a tool without definitions uses [Engine.RequestCancelTx].
func (e *Engine) CancelTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string) error {
	if err := e.ready("Engine.CancelTx"); err != nil {
		return err
	}
	return e.cancel(ctx, tx, id, reason, "", true)
}

// RequestCancel records a durable request to cancel a running saga, for
// tools that do not know the saga's definition (the operator CLI). An
// engine that knows the definition applies it as [Engine.Cancel] describes:
// at once when no step runs, else in place of the running step's outcome.
// It returns an error wrapping [ErrNotFound] or [ErrNotRunning] as Cancel
// does.
func (e *Engine) RequestCancel(ctx context.Context, id uuid.UUID, reason string) error {
	if err := e.ready("Engine.RequestCancel"); err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.RequestCancelTx(ctx, tx, id, reason) })
}

// RequestCancelTx is [Engine.RequestCancel] inside the caller's
// transaction.
func (e *Engine) RequestCancelTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string) error {
	if err := e.ready("Engine.RequestCancelTx"); err != nil {
		return err
	}
	return e.cancel(ctx, tx, id, reason, "", false)
}

// cancel records a cancel request for saga id, with code ("" for an
// operator's request, recorded as CodeCancelled), and applies it at once
// when apply is set and no step of the saga runs.
func (e *Engine) cancel(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason, code string, apply bool) error {
	if tx == nil {
		return fmt.Errorf("saga: cancel %s: tx is nil", id)
	}
	reason = safetext.Text(strings.TrimSpace(reason), MaxReasonBytes)
	if reason == "" {
		reason = "cancelled"
	}
	sg, err := e.st.GetSaga(ctx, tx, id, false)
	if errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("saga: cancel %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	if Status(sg.Status) != StatusRunning {
		return fmt.Errorf("saga: cancel %s: status is %s: %w", id, sg.Status, ErrNotRunning)
	}
	if apply && e.lookup(sg) == nil {
		return fmt.Errorf("saga: cancel %s: %w: this engine does not know saga %q; use RequestCancel", id, ErrNotRegistered, sg.Name)
	}
	if def := e.lookup(sg); def != nil && steps.Direction(sg.Direction) == steps.Forward {
		if idx, ok := def.byName[sg.StepName]; ok && def.pastPivot(idx) {
			return fmt.Errorf("saga: cancel %s: %w: %s", id, ErrPastPivot, pastPivotRefusal(def))
		}
	}
	recorded, err := e.st.RequestCancel(ctx, tx, id, sg.Epoch, reason, code)
	if err != nil {
		return fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	if recorded {
		if err := e.st.InsertHistory(ctx, tx, &store.HistoryEntry{SagaID: id, Event: EventCancelRequested,
			StepName: sg.StepName, Direction: sg.Direction, Epoch: sg.Epoch, Error: reason, ErrorCode: cmp.Or(code, CodeCancelled)}); err != nil {
			return fmt.Errorf("saga: cancel %s: %w", id, err)
		}
	}
	if apply {
		applied, err := e.applyCancelNow(ctx, tx, id)
		if err != nil || applied {
			return err
		}
	}
	// A step runs, or this engine does not know the saga: wake the engine
	// running the step (it cancels the step's context) and one that knows
	// the saga (the cancel command makes it look at the saga now, rather
	// than at its next command).
	msg := e.cancelMessage(sg)
	if err := e.st.InsertMessage(ctx, tx, &msg); err != nil {
		return fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	if err := e.st.Notify(ctx, tx, e.cfg.CommandTopic); err != nil {
		return fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	if err := e.st.NotifyCancel(ctx, tx, id); err != nil {
		return fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	return nil
}

// applyCancelNow applies saga id's pending cancel request in tx when this
// engine knows the saga and no step of it runs (its execution lock is free;
// tx then holds it). It reports whether it did.
//
// The saga's row and its lock come from one statement, whose snapshot is
// taken before the lock is tried: a step that commits in between leaves the
// row read stale while the lock is won, and the fenced update then finds a
// newer version. The read is made again (the failed attempt, lock
// included, is rolled back to the savepoint); a saga that keeps moving is
// left to the cancel command, as when a step runs.
func (e *Engine) applyCancelNow(ctx context.Context, tx pgx.Tx, id uuid.UUID) (bool, error) {
	if _, err := tx.Exec(ctx, "SAVEPOINT sagaflow_cancel"); err != nil {
		return false, fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	for range 3 {
		applied, fenced, err := e.tryCancelNow(ctx, tx, id)
		if err != nil || fenced {
			return applied, err
		}
	}
	return false, nil
}

// tryCancelNow is one attempt of [Engine.applyCancelNow]; fenced is false
// when the saga's row had moved on since it was read (the attempt is then
// rolled back to the savepoint sagaflow_cancel).
func (e *Engine) tryCancelNow(ctx context.Context, tx pgx.Tx, id uuid.UUID) (applied, fenced bool, err error) {
	// LockSagas tries the saga's execution lock without waiting.
	sagas, err := e.st.LockSagas(ctx, tx, []uuid.UUID{id}, "")
	if err != nil {
		return false, false, fmt.Errorf("saga: cancel %s: %w", id, err)
	}
	ls := sagas[id]
	if ls == nil || !ls.Locked || ls.CancelRequest == nil || Status(ls.Status) != StatusRunning {
		return false, true, nil
	}
	def := e.lookup(&ls.Saga)
	if def == nil {
		return false, true, nil
	}
	idx, ok := def.byName[ls.StepName]
	if !ok {
		return false, true, nil
	}
	if h := e.hooks.cancelRead; h != nil {
		h(id)
	}
	tr := e.transition(&ls.Saga, e.machine.cancel(&ls.Saga, def, idx, ls.CancelRequest.Reason, ls.CancelRequest.Code))
	fenced, err = e.st.ApplyTransition(ctx, tx, tr, "sagaflow_cancel")
	if err != nil || !fenced {
		if err != nil {
			err = fmt.Errorf("saga: cancel %s: %w", id, err)
		}
		return false, false, err
	}
	if len(tr.Messages) > 0 {
		if err := e.st.Notify(ctx, tx, e.cfg.CommandTopic); err != nil {
			return false, true, fmt.Errorf("saga: cancel %s: %w", id, err)
		}
	}
	return true, true, nil
}

// applyCancel deals with the pending cancel request of a saga whose lock
// the batch holds, before its command runs. It reports handled when the
// command is consumed by it (the request was applied); a refused request
// (the saga is no longer running, or the request is from an earlier run)
// is deleted and recorded, and the command goes on as usual.
func (b *batch) applyCancel(ctx context.Context, c *store.Claimed, ls *store.LockedSaga, def *compiled, last bool) (handled bool, err error) {
	r := ls.CancelRequest
	ls.CancelRequest = nil // once per batch
	b.e.running.forget(ls.ID)
	if why := cancelRefusal(&ls.Saga, r); why != "" {
		if err := b.tx.flush(); err != nil {
			return false, err
		}
		b.tx.clean = ""
		b.e.log.InfoContext(ctx, "sagaflow refused a cancel request", slog.String("saga_id", ls.ID.String()), slog.String("why", why))
		return false, b.e.st.RefuseCancel(ctx, b.tx.tx, ls.ID, EventCancelRefused, CodeCancelRefused, why)
	}
	idx, known := def.byName[ls.StepName]
	if !known {
		return false, nil // the command's own handling parks or defers it
	}
	if def.pastPivot(idx) && steps.Direction(ls.Direction) == steps.Forward {
		why := pastPivotRefusal(def)
		if err := b.tx.flush(); err != nil {
			return false, err
		}
		b.tx.clean = ""
		b.e.log.InfoContext(ctx, "sagaflow refused a cancel request", slog.String("saga_id", ls.ID.String()), slog.String("why", why))
		return false, b.e.st.RefuseCancel(ctx, b.tx.tx, ls.ID, EventCancelRefused, CodeCancelRefused, why)
	}
	sp := b.tx.savepoint()
	if c.ID != uuid.Nil {
		b.delivered = append(b.delivered, c.ID)
	}
	tr := b.e.transition(&ls.Saga, b.e.machine.cancel(&ls.Saga, def, idx, r.Reason, r.Code))
	b.tx.write(&ls.Saga, tr, sp, false, last, nil, func() { b.tx.stats.cancelled.Add(1) })
	return true, nil
}

// pastPivotRefusal is why a cancel request cannot apply to a saga past
// def's pivot.
func pastPivotRefusal(def *compiled) string {
	return fmt.Sprintf("the saga has passed its pivot step %q: it can no longer be compensated, and goes forward until it completes",
		def.steps[def.pivot].name)
}

// runningSteps knows the sagas whose commands this engine's workers hold
// (claimed in a batch, or consumed from Kafka) and, for the one whose step
// runs, how to cancel its handler's context; so that a cancel request that
// arrives after the claim interrupts the running step, or keeps a claimed
// step from starting at all.
type runningSteps struct {
	mu sync.Mutex
	m  map[uuid.UUID]*claimedSaga
}

type claimedSaga struct {
	cancel  context.CancelCauseFunc // set while a forward step's handler runs
	request *store.CancelRequest    // a request heard of since the claim
	// holders counts the batches that claimed the saga and have not
	// released it. Two can overlap: a batch that committed a step still
	// holds the saga until it returns, while another worker has claimed the
	// next command already; the first one's release must not drop the
	// second one's entry, or a cancel request would never reach its step.
	holders int
}

// cancelRequested is the cause of a step context cancelled by a cancel
// request.
type cancelRequested struct {
	reason string
	epoch  int    // the run the request is for
	code   string // "" for an operator's request
}

func (c *cancelRequested) Error() string { return "saga: cancel requested: " + c.reason }

// claim notes the sagas a batch holds, until release.
func (r *runningSteps) claim(ids ...uuid.UUID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[uuid.UUID]*claimedSaga{}
	}
	for _, id := range ids {
		c := r.m[id]
		if c == nil {
			c = &claimedSaga{}
			r.m[id] = c
		}
		c.holders++
	}
}

// release ends one claim of each saga; the entry goes with the last.
func (r *runningSteps) release(ids ...uuid.UUID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		if c := r.m[id]; c != nil {
			if c.holders--; c.holders <= 0 {
				delete(r.m, id)
			}
		}
	}
}

// start notes that a forward step of saga id runs with cancel; a request
// heard of before cancels it at once. Compensations are never interrupted:
// a cancel request has nothing to say to a saga that compensates already.
func (r *runningSteps) start(id uuid.UUID, cancel context.CancelCauseFunc) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[uuid.UUID]*claimedSaga{}
	}
	c := r.m[id]
	if c == nil {
		c = &claimedSaga{}
		r.m[id] = c
	}
	c.cancel = cancel
	if c.request != nil {
		cancel(&cancelRequested{reason: c.request.Reason, epoch: c.request.Epoch, code: c.request.Code})
	}
}

// forget drops the request heard of for saga id: it was applied or
// refused.
func (r *runningSteps) forget(id uuid.UUID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.m[id]; c != nil {
		c.request = nil
	}
}

// stop notes that saga id's handler returned.
func (r *runningSteps) stop(id uuid.UUID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.m[id]; c != nil {
		c.cancel = nil
	}
}

// pending returns the cancel request heard of for saga id since its claim,
// or nil.
func (r *runningSteps) pending(id uuid.UUID) *store.CancelRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.m[id]; c != nil {
		return c.request
	}
	return nil
}

func (r *runningSteps) ids() []uuid.UUID {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]uuid.UUID, 0, len(r.m))
	for id := range r.m {
		out = append(out, id)
	}
	return out
}

func (r *runningSteps) has(id uuid.UUID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.m[id]
	return ok
}

// heard records req for saga id and cancels its running handler; it
// reports whether a handler was running.
func (r *runningSteps) heard(id uuid.UUID, req store.CancelRequest) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.m[id]
	if c == nil {
		return false
	}
	c.request = &req
	if c.cancel != nil {
		c.cancel(&cancelRequested{reason: req.Reason, epoch: req.Epoch, code: req.Code})
		return true
	}
	return false
}

// interrupt looks for cancel requests of the given sagas, which this
// engine's workers hold: a running handler is cancelled, and a step not
// started yet will not start.
func (e *Engine) interrupt(ctx context.Context, ids []uuid.UUID) {
	if len(ids) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, notifyTimeout)
	defer cancel()
	reqs, err := e.st.CancelRequests(ctx, e.pool, ids)
	if err != nil {
		if ctx.Err() == nil {
			e.log.WarnContext(ctx, "sagaflow could not read cancel requests; it tries again at its next poll", slog.Any("error", err))
		}
		return
	}
	for id, r := range reqs {
		if e.running.heard(id, r) {
			e.log.InfoContext(ctx, "sagaflow cancelled a running step: its saga has a cancel request", slog.String("saga_id", id.String()))
		}
	}
}

// watchCancels is the fallback for lost notifications: every PollInterval
// it looks for cancel requests of the sagas whose commands are held here.
func (e *Engine) watchCancels(ctx context.Context) {
	t := time.NewTicker(e.cfg.PollInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			e.interrupt(ctx, e.running.ids())
		}
	}
}

// notified handles a notification on the engine's channel: a cancel
// request for a saga whose step runs here interrupts it; a pause makes the
// batches that began before it look at the pauses again.
func (e *Engine) notified(ctx context.Context, payload string) {
	if payload == store.PausePayload {
		e.pausesHeard.Add(1)
		return
	}
	rest, ok := strings.CutPrefix(payload, store.CancelPayload)
	if !ok {
		return
	}
	id, err := uuid.Parse(rest)
	if err != nil || !e.running.has(id) {
		return
	}
	go e.interrupt(ctx, []uuid.UUID{id})
}

// checkInput refuses, naming the field, a caller's string that PostgreSQL
// could not store or compare; limits bound the fields stored in an index.
func checkInput(op string, fields ...inputField) error {
	for _, f := range fields {
		if f.value == "" {
			continue
		}
		if p := safetext.Problem(f.value, f.limit); p != "" {
			return fmt.Errorf("%w: %s: %s %s", ErrInvalidInput, op, f.name, p)
		}
	}
	return nil
}

type inputField struct {
	name, value string
	limit       int // 0: no limit
}
