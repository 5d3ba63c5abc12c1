package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/store"
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
	names := e.registeredNameList()
	if len(names) == 0 {
		return res, nil
	}
	for {
		n, err := e.rescuePass(ctx, names, &res)
		if err != nil {
			return res, err
		}
		if n < e.cfg.RescueBatch {
			return res, nil
		}
	}
}

func (e *Engine) rescuePass(ctx context.Context, names []string, res *RescueResult) (int, error) {
	var found int
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		stuck, err := e.st.StuckSagas(ctx, tx, names, e.cfg.RescueBatch)
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
			switch {
			case !s.Locked:
				res.Busy++
				continue
			case !known || s.CommandStatus == store.OutboxPending:
				// Waiting in the queue, or at a step only another engine
				// knows: not lost. Look again later.
				if _, err := e.st.ExtendDeadline(ctx, tx, s.ID, s.Version, e.cfg.RescueSlack); err != nil {
					return err
				}
				res.Waiting++
				continue
			}
			if h := e.hooks.beforeRescueUpdate; h != nil {
				h(&s.Saga)
			}
			tr, failover := e.rescueTransition(s, def, idx)
			sp := fmt.Sprintf("sagaflow_rescue_%d", i)
			if _, err := tx.Exec(ctx, "SAVEPOINT "+sp); err != nil {
				return err
			}
			fenced, err := e.st.ApplyTransition(ctx, tx, tr, sp)
			switch {
			case err != nil:
				return err
			case !fenced:
				res.Superseded++
			case failover:
				res.FailedOver++
				e.stats.failedOver.Add(1)
			default:
				res.Redriven++
				e.stats.rescued.Add(1)
			}
			if fenced {
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
	tr = transitionFrom(&s.Saga)
	tr.Attempt = attempt
	tr.CheckAfter = def.steps[idx].timeout + e.cfg.RescueSlack
	tr.History = []store.HistoryEntry{rescued}
	tr.Messages = []store.Message{e.commandMessage(s.ID, s.Name, s.StepName, dir, s.Epoch, s.Version+1, 0)}
	return tr, false
}
