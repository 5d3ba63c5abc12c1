package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/store"
)

// RescueResult says what one [Engine.RescueNow] did.
type RescueResult struct {
	// Redriven sagas got a new command for their current step, under the
	// same step-scoped key. It also counts the branches of parallel steps
	// whose command was lost and was sent again.
	Redriven int
	// FailedOver sagas had spent their attempts: they now compensate (or,
	// if they were compensating, are failed; or, at a step with
	// PauseWhenExhausted, are paused). It also counts parallel steps failed
	// because a branch's command was lost with its attempts spent.
	FailedOver int
	// Waiting sagas still had their command pending in the queue (workers
	// down or busy): their deadline was moved, no attempt spent.
	Waiting int
	// Busy sagas had a step running right now and were left alone.
	Busy int
	// Superseded sagas moved on between the rescuer's read and its update;
	// the rescue was dropped.
	Superseded int
	// Deadlines counts sagas past their deadline ([Definition.WithDeadline],
	// [StartOpts.Deadline]) for which a cancel request was recorded.
	Deadlines int
	// Released held commands were held for a pause that no longer covers
	// their saga (their release was lost to a race with the step or batch
	// that wrote them held): they are due again, as [Engine.Resume] makes
	// them.
	Released int
	// Woken sagas waited without a time limit for something that had
	// happened (a signal pending, a child ended) more than RescueSlack
	// before, without moving, and had no wake-up pending in the outbox:
	// their wake-up had been lost (deleted, or parked as dead). Each was
	// sent a new one. (In Kafka mode a wake-up that was published and
	// waits in a consumer's backlog longer than RescueSlack counts as lost
	// too; the second one finds the saga moved on and does nothing.)
	Woken int
	// Rechecked sagas were looked at before their deadline: a step had
	// moved the deadline later without moving the rescuer's indexed lower
	// bound. Their next check was moved to the deadline; nothing else.
	Rechecked int
}

// RescueNow runs the stuck-saga rescuer once, now, instead of waiting for
// its interval: it finds running and compensating sagas of the registered
// definitions whose deadline (database time) has passed, and re-drives or
// fails over each. Before that, it releases the commands
// held for a pause that no longer exists (see "Pause" in the package doc).
// Safe to run on many engines at once.
func (e *Engine) RescueNow(ctx context.Context) (RescueResult, error) {
	var res RescueResult
	if err := e.ready("Engine.RescueNow"); err != nil {
		return res, err
	}
	names := e.registeredNameList()
	if len(names) == 0 {
		return res, nil
	}
	// First, so that a saga whose command was held and is now released is
	// not judged stuck below.
	if err := e.releaseStrayHeld(ctx, &res); err != nil {
		return res, err
	}
	// Then the sagas whose check came before their deadline, so that only
	// sagas past their deadline are judged below.
	if err := e.raiseChecks(ctx, &res); err != nil {
		return res, err
	}
	for {
		before := res
		n, err := e.rescuePass(ctx, names, &res)
		if err != nil {
			return res, err
		}
		// Another pass only when this one was full and moved something on:
		// every saga it looked at got a later deadline or a new state, so
		// the next pass sees different sagas.
		changed := res.Redriven+res.FailedOver+res.Waiting+res.Busy+res.Superseded >
			before.Redriven+before.FailedOver+before.Waiting+before.Busy+before.Superseded
		if n < e.cfg.RescueBatch || !changed {
			if err := e.resendWakes(ctx, names, &res); err != nil {
				return res, err
			}
			if err := e.resendBranches(ctx, names, &res); err != nil {
				return res, err
			}
			err := e.enforceDeadlines(ctx, names, &res)
			return res, err
		}
	}
}

// resendWakes sends a new wake-up to the sagas that wait without a time
// limit (so without a deadline) for a signal that is pending, or a child
// that has ended, since more than RescueSlack ago, and have not moved since:
// their wake-up was lost. The saga's updated_at moves with it, so a saga is
// woken at most once per RescueSlack; a wake-up that finds the saga moved on
// does nothing.
func (e *Engine) resendWakes(ctx context.Context, names []string, res *RescueResult) error {
	sagas, err := e.st.WaitsReady(ctx, e.pool, names, e.cfg.RescueSlack, e.cfg.RescueBatch)
	if err != nil {
		return fmt.Errorf("saga: rescue: %w", err)
	}
	return e.rescueEach(ctx, sagas, "wake a saga whose wake-up was lost", res, e.wakeAgain)
}

// wakeAgain is [Engine.resendWakes] for one saga, in tx.
func (e *Engine) wakeAgain(ctx context.Context, tx pgx.Tx, sg *store.Saga) (RescueResult, error) {
	if ok, err := e.st.TouchSaga(ctx, tx, sg.ID, sg.Version); err != nil || !ok {
		return RescueResult{}, err // moved on since it was read: nothing to do
	}
	detail, _ := json.Marshal(map[string]string{"reason": fmt.Sprintf(
		"what the saga waits for (%s) has happened, and its wake-up was lost; woken again", deref(sg.WaitKind))})
	if err := e.st.InsertHistory(ctx, tx, &store.HistoryEntry{SagaID: sg.ID, Event: EventSagaRescued, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Attempt: sg.Attempt, Detail: detail}); err != nil {
		return RescueResult{}, err
	}
	msg := e.nudgeMessage(sg, wakeType)
	if err := e.st.InsertMessage(ctx, tx, &msg); err != nil {
		return RescueResult{}, err
	}
	if err := e.st.Notify(ctx, tx, e.cfg.CommandTopic); err != nil {
		return RescueResult{}, err
	}
	fault.Hit(fault.RescueWakeBeforeCommit)
	return RescueResult{Woken: 1}, nil
}

// resendBranches looks at the sagas in a parallel step that have not moved
// for RescueSlack and have a running branch whose command was lost
// (deleted, or parked as dead): a branch has no deadline of its own, and the
// saga's wait has none, so nothing else would ever run that branch. Under
// the saga's row lock, which every transaction that ends a branch or writes
// its retry holds, it reads the lost branches again and decides for each
// ([machine.rescueBranch]): its command goes again under the same key, or,
// with its attempts spent, the group fails. The saga's updated_at moves, so
// a saga is looked at at most once per RescueSlack.
func (e *Engine) resendBranches(ctx context.Context, names []string, res *RescueResult) error {
	sagas, err := e.st.SagasWithLostBranches(ctx, e.pool, names, e.cfg.RescueSlack, e.cfg.RescueBatch)
	if err != nil {
		return fmt.Errorf("saga: rescue: %w", err)
	}
	return e.rescueEach(ctx, sagas, "rescue a branch whose command was lost", res, e.rescueBranches)
}

// rescueEach runs fn for each of sagas in a transaction of its own and,
// once it committed, adds what it did to res and to the engine's stats. One
// saga's trouble is logged ("could not " + what) and does not hold back the
// others; only the end of ctx stops it.
func (e *Engine) rescueEach(ctx context.Context, sagas []store.Saga, what string, res *RescueResult,
	fn func(ctx context.Context, tx pgx.Tx, sg *store.Saga) (RescueResult, error)) error {
	for i := range sagas {
		sg := &sagas[i]
		var did RescueResult
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			var err error
			did, err = fn(ctx, tx, sg)
			return err
		})
		switch {
		case err == nil:
			res.Woken += did.Woken
			res.Redriven += did.Redriven
			res.FailedOver += did.FailedOver
			e.stats.rescued.Add(int64(did.Redriven))
			e.stats.failedOver.Add(int64(did.FailedOver))
		case ctx.Err() != nil:
			return ctx.Err()
		default:
			e.log.ErrorContext(ctx, "sagaflow could not "+what, slog.String("saga_id", sg.ID.String()), slog.Any("error", err))
		}
	}
	return nil
}

// rescueBranches is [Engine.resendBranches] for one saga, in tx.
func (e *Engine) rescueBranches(ctx context.Context, tx pgx.Tx, sg *store.Saga) (RescueResult, error) {
	var did RescueResult
	def := e.lookup(sg)
	if def == nil {
		return did, nil // another engine's version: it rescues it
	}
	idx, ok := def.byName[sg.StepName]
	if !ok || def.steps[idx].parallel == nil {
		return did, nil
	}
	p := def.steps[idx].parallel
	if ok, err := e.st.TouchSaga(ctx, tx, sg.ID, sg.Version); err != nil || !ok {
		return did, err // moved on since it was read: nothing to do
	}
	lost, err := e.st.LostBranches(ctx, tx, sg.ID, sg.Epoch, sg.StepName)
	if err != nil {
		return did, err
	}
	for _, lb := range lost {
		bi := p.index(lb.Name)
		if bi < 0 {
			continue // a branch this version does not have
		}
		dec := e.machine.rescueBranch(sg, def, idx, bi, lb)
		step := sg.StepName + "." + lb.Name
		detail, _ := json.Marshal(map[string]any{"reason": dec.reason, "attempt": dec.attempt})
		if err := e.st.InsertHistory(ctx, tx, &store.HistoryEntry{SagaID: sg.ID, Event: EventSagaRescued, StepName: step,
			Direction: sg.Direction, Epoch: sg.Epoch, Attempt: dec.attempt, Detail: detail}); err != nil {
			return did, err
		}
		if !dec.resend {
			// Its attempts are spent: the group fails, and no other branch
			// needs its command any more.
			msg, code := dec.reason, CodeRescueExhausted
			if _, err := e.st.EndBranch(ctx, tx, sg.ID, sg.Epoch, sg.StepName, lb.Name, store.BranchFailed, dec.attempt, nil, &msg, &code); err != nil {
				return did, err
			}
			const sp = "sagaflow_rescue_branch"
			if _, err := tx.Exec(ctx, "SAVEPOINT "+sp); err != nil {
				return did, err
			}
			tr := e.transition(sg, dec.failed)
			e.tel.traceRescue(ctx, sg, tr, true)
			fenced, err := e.st.ApplyTransition(ctx, tx, tr, sp)
			if err != nil || !fenced {
				return RescueResult{}, err // fenced out: the row lock makes this unreachable, and nothing was written
			}
			e.log.WarnContext(ctx, "sagaflow failed a parallel step whose branch's command was lost with its attempts spent",
				slog.String("saga_id", sg.ID.String()), slog.String("branch", step))
			did = RescueResult{FailedOver: 1}
			break
		}
		if dec.attempt > 0 {
			if err := e.st.BranchAttempt(ctx, tx, sg.ID, sg.Epoch, sg.StepName, lb.Name, dec.attempt, dec.reason, ""); err != nil {
				return did, err
			}
		}
		m := e.branchMessage(sg, sg.StepName, lb.Name, sg.Version, dec.delay)
		if err := e.st.InsertMessage(ctx, tx, &m); err != nil {
			return did, err
		}
		did.Redriven++
		e.log.WarnContext(ctx, "sagaflow sent again the command of a branch that was lost", slog.String("saga_id", sg.ID.String()),
			slog.String("branch", step), slog.Int("attempt", dec.attempt))
	}
	if did == (RescueResult{}) {
		return did, nil
	}
	if err := e.st.Notify(ctx, tx, e.cfg.CommandTopic); err != nil {
		return RescueResult{}, err
	}
	fault.Hit(fault.RescueBranchBeforeCommit)
	return did, nil
}

// raiseChecksPasses bounds the statements of one [Engine.raiseChecks].
const raiseChecksPasses = 16

// raiseChecks moves the next check of sagas whose deadline's lower bound
// (next_check_at) passed before the deadline itself (due_at) to that
// deadline, RescueBatch sagas per statement.
func (e *Engine) raiseChecks(ctx context.Context, res *RescueResult) error {
	for range raiseChecksPasses {
		n, err := e.st.RaiseChecks(ctx, e.pool, e.cfg.RescueBatch)
		if err != nil {
			return err
		}
		res.Rechecked += int(n)
		if n < int64(e.cfg.RescueBatch) {
			return nil
		}
	}
	return nil
}

// rescueLockTimeout bounds how long the rescuer waits for a saga row that a
// worker's batch has written and not yet committed; it skips the saga then.
const rescueLockTimeout = 200 * time.Millisecond

func (e *Engine) rescuePass(ctx context.Context, names []string, res *RescueResult) (int, error) {
	var found int
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+strconv.FormatInt(rescueLockTimeout.Milliseconds(), 10)); err != nil {
			return err
		}
		stuck, err := e.st.StuckSagas(ctx, tx, names, e.cfg.RescueBatch, e.cfg.RescueSlack)
		if err != nil {
			return err
		}
		found = len(stuck)
		notify := false
		for i := range stuck {
			s := &stuck[i]
			sp := fmt.Sprintf("sagaflow_rescue_%d", i)
			if _, err := tx.Exec(ctx, "SAVEPOINT "+sp); err != nil {
				return err
			}
			dec := e.machine.rescue(s, e.lookup(&s.Saga))
			if dec.supersede {
				// No reply came in time: a command the relay has not
				// published yet never will be, so the compensation cannot
				// overtake it.
				if _, err := e.st.SupersedeMessage(ctx, tx, *s.CommandID,
					"superseded: the step timed out waiting for its reply before this command was published"); err != nil {
					return err
				}
			}
			var tr *store.Transition
			if dec.action == rescueRedrive || dec.action == rescueFailOver {
				tr = e.transition(&s.Saga, dec.d)
				e.tel.traceRescue(ctx, &s.Saga, tr, dec.action == rescueFailOver)
				if h := e.hooks.beforeRescueUpdate; h != nil {
					h(&s.Saga)
				}
				fault.Hit(fault.RescueAfterRead)
			}
			var fenced bool
			var err error
			if tr == nil {
				fenced, err = e.st.ExtendDeadline(ctx, tx, s.ID, s.Version, e.cfg.RescueSlack)
			} else {
				fenced, err = e.st.ApplyTransition(ctx, tx, tr, sp)
			}
			if err != nil {
				if !pgerr.Lock(err) {
					return err
				}
				// A worker's batch holds the row: it is alive. Skip.
				if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp); err != nil {
					return err
				}
				res.Busy++
				continue
			}
			failover := dec.action == rescueFailOver
			switch {
			case !fenced:
				res.Superseded++
			case dec.action == rescueBusy:
				res.Busy++
			case dec.action == rescueWaiting:
				res.Waiting++
			case failover:
				res.FailedOver++
				e.stats.failedOver.Add(1)
			default:
				res.Redriven++
				e.stats.rescued.Add(1)
			}
			if fenced && tr != nil {
				notify = notify || len(tr.Messages) > 0
				e.log.WarnContext(ctx, "sagaflow rescued a stuck saga", slog.String("saga_id", s.ID.String()),
					slog.String("step", s.StepName), slog.Bool("failed_over", failover), slog.Duration("overdue", s.Overdue))
			}
		}
		if notify {
			return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("saga: rescue: %w", err)
	}
	return found, nil
}

// releaseStrayHeld releases the held commands that no pause covers any more
// (see [store.Store.ReleaseStrayHeld]), [Config.RescueBatch] at a time, and
// wakes the workers and the relay as [Engine.Resume] does. Without it such a
// command would wait for ever: its saga is not paused, so the passes above
// would find its command pending and wait with it.
func (e *Engine) releaseStrayHeld(ctx context.Context, res *RescueResult) error {
	for {
		var n int
		err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			if found, err := e.st.StrayHeldExists(ctx, tx); err != nil || !found {
				return err
			}
			if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+strconv.FormatInt(rescueLockTimeout.Milliseconds(), 10)); err != nil {
				return err
			}
			var err error
			if n, err = e.st.ReleaseStrayHeld(ctx, tx, e.cfg.RescueBatch); err != nil || n == 0 {
				return err
			}
			return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
		})
		if pgerr.Lock(err) {
			// Pauses are being written (or sagas ended) for longer than
			// the rescuer waits: the next run tries again.
			return nil
		}
		if err != nil {
			return fmt.Errorf("saga: rescue: release held commands: %w", err)
		}
		if n > 0 {
			res.Released += n
			e.stats.released.Add(int64(n))
			e.log.WarnContext(ctx, "sagaflow released held commands that no pause covered any more", slog.Int("released", n))
		}
		if n < e.cfg.RescueBatch {
			return nil
		}
	}
}

// enforceDeadlines records a cancel request, with code [CodeDeadline], for
// each running saga of the named definitions past its deadline: the cancel
// lands like an operator's (see [Engine.Cancel]), ahead of whatever the
// saga does or waits for. A saga compensating already finishes as it is.
func (e *Engine) enforceDeadlines(ctx context.Context, names []string, res *RescueResult) error {
	ids, err := e.st.DeadlineDue(ctx, e.pool, names, e.cfg.RescueBatch)
	if err != nil {
		return fmt.Errorf("saga: deadlines: %w", err)
	}
	for _, id := range ids {
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			return e.cancel(ctx, tx, id, "the saga did not end within its deadline", CodeDeadline, true)
		})
		switch {
		case err == nil:
			res.Deadlines++
		case errors.Is(err, ErrNotRunning), errors.Is(err, ErrNotFound):
			// Ended, or began compensating, since it was read.
		case errors.Is(err, ErrPastPivot):
			// Past its pivot, a saga only goes forward: its deadline no
			// longer applies, and is cleared so that the next passes look
			// at the others.
			if err := e.st.ClearDeadline(ctx, e.pool, id, EventDeadlineCleared); err != nil {
				e.log.ErrorContext(ctx, "sagaflow could not clear the deadline of a saga past its pivot", slog.String("saga_id", id.String()), slog.Any("error", err))
			}
		case ctx.Err() != nil:
			return ctx.Err()
		default:
			// One saga's trouble must not hold back the others: the next
			// pass tries it again.
			e.log.ErrorContext(ctx, "sagaflow could not cancel a saga past its deadline", slog.String("saga_id", id.String()), slog.Any("error", err))
		}
	}
	return nil
}
