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
	"github.com/sagaflow/sagaflow/steps"
)

// RescueResult says what one [Engine.RescueNow] did.
type RescueResult struct {
	// Redriven sagas got a new command for their current step, under the
	// same step-scoped key.
	Redriven int
	// FailedOver sagas had spent their attempts: they now compensate (or,
	// if they were compensating, are failed).
	FailedOver int
	// Waiting sagas still had their command pending in the queue (workers
	// down or busy): their deadline was moved, no attempt spent.
	Waiting int
	// Busy sagas had a step running right now and were left alone.
	Busy int
	// Superseded sagas moved on between the rescuer's read and its update;
	// the rescue was dropped.
	Superseded int
}

// RescueNow runs the stuck-saga rescuer once, now, instead of waiting for
// its interval: it finds running and compensating sagas of the registered
// definitions whose deadline (next_check_at, database time) has passed,
// and re-drives or fails over each. Safe to run on many engines at once.
func (e *Engine) RescueNow(ctx context.Context) (RescueResult, error) {
	var res RescueResult
	if err := e.ready("Engine.RescueNow"); err != nil {
		return res, err
	}
	names := e.registeredNameList()
	if len(names) == 0 {
		return res, nil
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
			return res, nil
		}
	}
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
			def := e.lookupName(s.Name)
			idx, known := 0, false
			if def != nil {
				idx, known = def.byName[s.StepName]
			}
			sp := fmt.Sprintf("sagaflow_rescue_%d", i)
			if _, err := tx.Exec(ctx, "SAVEPOINT "+sp); err != nil {
				return err
			}
			var outcome *int
			var tr *store.Transition
			failover := false
			switch {
			case !s.Locked:
				// A step is running right now: the saga is alive. Look
				// again later, so that this pass and the next reach others.
				outcome = &res.Busy
			case known && s.AwaitingReply:
				// The participant did not reply in time: the step fails for
				// good, and the compensation includes it (it may have run).
				// A command the relay has not published yet never will be,
				// so the compensation cannot overtake it.
				if s.CommandID != nil {
					if _, err := e.st.SupersedeMessage(ctx, tx, *s.CommandID,
						"superseded: the step timed out waiting for its reply before this command was published"); err != nil {
						return err
					}
				}
				//
				// A compensation is retried instead, like any other: the
				// command goes again under the same step key (the
				// participant runs it once, or sends its reply again), until
				// the step's CompensateRetry attempts are spent.
				timeout := steps.WithCode(CodeReplyTimeout, fmt.Errorf("no reply to step %q within its timeout (%s)",
					s.StepName, def.steps[idx].timeout))
				dir := steps.Direction(s.Direction)
				if dir == steps.Forward {
					timeout = steps.Permanent(timeout)
				}
				tr = e.failureTransition(&s.Saga, def, idx, dir, s.Attempt+1, timeout, 0)
				failover = tr.Status == store.StatusFailed || dir == steps.Forward
			case s.CommandStatus == store.OutboxPending || s.CommandStatus == "in_flight":
				// Waiting in the queue (workers down or busy), or published
				// lately to a consumer that may be behind: not lost.
				outcome = &res.Waiting
			case !known:
				// At a step only another engine knows, its command lost:
				// re-drive it; an engine that knows the step runs it, or
				// the command is parked after UnknownSagaGrace.
				tr = e.redrive(s, StepTimeoutDefault, s.Attempt)
			default:
				tr, failover = e.rescueTransition(s, def, idx)
			}
			if h := e.hooks.beforeRescueUpdate; h != nil && tr != nil {
				h(&s.Saga)
			}
			if tr != nil {
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
			switch {
			case !fenced:
				res.Superseded++
			case outcome != nil:
				*outcome++
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

// rescueTransition re-drives a stuck saga's current step with the same key,
// counting the lost attempt, or fails it over when its attempts are spent.
func (e *Engine) rescueTransition(s *store.StuckSaga, def *compiled, idx int) (tr *store.Transition, failover bool) {
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
	if attempt >= def.policy(idx, dir).MaxAttempts {
		tr = e.failureTransition(&s.Saga, def, idx, dir, attempt,
			steps.Permanent(steps.WithCode(CodeRescueExhausted, errors.New(reason))), 0)
		tr.History = append([]store.HistoryEntry{rescued}, tr.History...)
		return tr, true
	}
	tr = e.redrive(s, def.steps[idx].timeout, attempt)
	tr.History = []store.HistoryEntry{rescued}
	return tr, false
}

// redrive writes a new command for a stuck saga's current step, under the
// same step-scoped key.
func (e *Engine) redrive(s *store.StuckSaga, timeout time.Duration, attempt int) *store.Transition {
	tr := transitionFrom(&s.Saga)
	tr.Attempt = attempt
	tr.CheckAfter = timeout + e.cfg.RescueSlack
	detail, _ := json.Marshal(map[string]any{"reason": "command lost; re-driven", "attempt": attempt})
	tr.History = []store.HistoryEntry{{SagaID: s.ID, Event: EventSagaRescued, StepName: s.StepName,
		Direction: s.Direction, Epoch: s.Epoch, Attempt: attempt, Detail: detail}}
	tr.Messages = []store.Message{e.commandMessage(s.ID, s.Name, s.StepName, steps.Direction(s.Direction), s.Epoch, s.Version+1, 0)}
	return tr
}
