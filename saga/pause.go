package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// History events of pauses.
const (
	// EventSagaPaused: an operator paused the saga, or a step whose
	// retries ran out asked to (Step.PauseWhenExhausted); ErrorCode says
	// which ("operator" or "retries_exhausted").
	EventSagaPaused = "saga_paused"
	// EventSagaUnpaused: the saga's pause was lifted ([Engine.Resume]).
	EventSagaUnpaused = "saga_unpaused"
)

// Pause codes: why a saga is paused ([PauseInfo.Code]).
const (
	PauseCodeOperator  = "operator"          // Engine.Pause or Engine.PauseType
	PauseCodeExhausted = "retries_exhausted" // a step's retries ran out (Step.PauseWhenExhausted)
)

// PauseInfo says why and since when a saga is paused.
type PauseInfo struct {
	// Type is true when every saga of the saga's type is paused
	// ([Engine.PauseType]), false when this saga is ([Engine.Pause]).
	Type   bool      `json:"type,omitempty"`
	Code   string    `json:"code"`
	Reason string    `json:"reason"`
	Step   string    `json:"step,omitempty"` // the step that asked to pause
	At     time.Time `json:"at"`
}

func pauseInfo(p *store.Pause) *PauseInfo {
	if p == nil {
		return nil
	}
	return &PauseInfo{Type: p.Kind == store.PauseType, Code: p.Code, Reason: p.Reason, Step: deref(p.StepName), At: p.At}
}

// Pause pauses a saga that has not ended: no new step of it starts (no
// step, compensation, retry, timer or signal delivery) until [Engine.Resume]
// lifts the pause. A step that runs when the pause commits finishes and
// records its outcome; the command it writes next waits. A cancel request
// is recorded; its compensations wait too. Pausing a paused saga does
// nothing. It returns an error wrapping [ErrNotFound] for an unknown id and
// [ErrNotRunning] for a saga that has ended.
//
// Pause works whatever engine runs the saga, and from an operator tool's
// engine that registered no definitions. The reason is stored as text
// PostgreSQL accepts: a NUL becomes the two characters \0, invalid UTF-8
// becomes U+FFFD, and it is cut to at most 2000 bytes.
func (e *Engine) Pause(ctx context.Context, id uuid.UUID, reason string) error {
	return e.pause(ctx, nil, "Engine.Pause", id, reason)
}

// PauseTx is [Engine.Pause] inside the caller's transaction, which should
// be READ COMMITTED (pgx's default; see [Engine.ResumeTx] for the others):
// the pause counts from when tx commits,
// and an error undoes only its own work (it runs under a savepoint).
func (e *Engine) PauseTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string) error {
	if tx == nil {
		return fmt.Errorf("saga: pause %s: tx is nil", id)
	}
	return e.pause(ctx, tx, "Engine.PauseTx", id, reason)
}

func (e *Engine) pause(ctx context.Context, tx pgx.Tx, what string, id uuid.UUID, reason string) error {
	if err := e.ready(what); err != nil {
		return err
	}
	reason = safetext.Text(reason, MaxReasonBytes)
	err := e.within(ctx, tx, func(tx pgx.Tx) error {
		// Not the row lock: a step that runs now holds it until it commits,
		// and the pause must not wait for that step.
		sg, err := e.st.GetSaga(ctx, tx, id, false)
		if errors.Is(err, store.ErrNotFound) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		if Status(sg.Status).Terminal() {
			return fmt.Errorf("status is %s: %w", sg.Status, ErrNotRunning)
		}
		ok, err := e.st.InsertPause(ctx, tx, &store.Pause{Kind: store.PauseSaga, SagaID: &sg.ID, SagaName: sg.Name,
			Code: store.PauseCodeOperator, Reason: reason})
		if err != nil || !ok {
			return err
		}
		detail, _ := json.Marshal(map[string]string{"reason": reason})
		if err := e.st.InsertHistory(ctx, tx, &store.HistoryEntry{SagaID: sg.ID, Event: EventSagaPaused, StepName: sg.StepName,
			Direction: sg.Direction, Epoch: sg.Epoch, ErrorCode: store.PauseCodeOperator, Detail: detail}); err != nil {
			return err
		}
		// A batch that claimed the saga's command before this commits
		// looks at the pauses again before it runs it.
		return e.st.NotifyPause(ctx, tx)
	})
	if err != nil {
		return fmt.Errorf("saga: pause %s: %w", id, err)
	}
	return nil
}

// PauseType pauses every saga named name that has not ended, and those
// started while the pause lasts, as [Engine.Pause] does one; [Engine.ResumeType]
// lifts it. Sagas paused on their own stay paused when the type's pause is
// lifted. name need not be registered with this engine. It reports whether
// the type was not paused already.
func (e *Engine) PauseType(ctx context.Context, name, reason string) (bool, error) {
	if err := e.ready("Engine.PauseType"); err != nil {
		return false, err
	}
	if err := checkInput("pause type", inputField{"saga name", name, 200}); err != nil {
		return false, err
	}
	if name == "" {
		return false, fmt.Errorf("saga: pause type: %w: empty saga name", ErrInvalidInput)
	}
	reason = safetext.Text(reason, MaxReasonBytes)
	var paused bool
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var err error
		paused, err = e.st.InsertPause(ctx, tx, &store.Pause{Kind: store.PauseType, SagaName: name, Code: store.PauseCodeOperator, Reason: reason})
		if err != nil || !paused {
			return err
		}
		return e.st.NotifyPause(ctx, tx)
	})
	if err != nil {
		return false, fmt.Errorf("saga: pause type %q: %w", name, err)
	}
	return paused, nil
}

// ResumeType lifts the pause of the saga type name ([Engine.PauseType]):
// each held command becomes due when it was due before, or now when that has
// passed. It reports whether the type was paused.
func (e *Engine) ResumeType(ctx context.Context, name string) (bool, error) {
	if err := e.ready("Engine.ResumeType"); err != nil {
		return false, err
	}
	if err := checkInput("resume type", inputField{"saga name", name, 200}); err != nil {
		return false, err
	}
	var lifted bool
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		p, err := e.st.DeletePause(ctx, tx, store.PauseType, nil, name)
		if err != nil || p == nil {
			return err
		}
		lifted = true
		return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
	})
	if err != nil {
		return false, fmt.Errorf("saga: resume type %q: %w", name, err)
	}
	return lifted, nil
}

// Unpause lifts the pause of a saga paused on its own ([Engine.Pause], or a
// step's Step.PauseWhenExhausted), as [Engine.Resume] does, and does
// nothing else: for a saga that is not paused on its own it returns an
// error wrapping [ErrNotPaused], where Resume would replay a failed one. Of
// two operators who unpause a saga at once, one lifts the pause and the
// other gets that error.
func (e *Engine) Unpause(ctx context.Context, id uuid.UUID, reason string) error {
	return e.unpauseOp(ctx, nil, "Engine.Unpause", id, reason)
}

// UnpauseTx is [Engine.Unpause] inside the caller's transaction, which
// should be READ COMMITTED (pgx's default), under a savepoint. In a
// REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates
// another operator's pause, it answers [ErrNotPaused] for a saga that is
// paused by now.
func (e *Engine) UnpauseTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string) error {
	if tx == nil {
		return fmt.Errorf("saga: unpause %s: tx is nil", id)
	}
	return e.unpauseOp(ctx, tx, "Engine.UnpauseTx", id, reason)
}

func (e *Engine) unpauseOp(ctx context.Context, tx pgx.Tx, what string, id uuid.UUID, reason string) error {
	if err := e.ready(what); err != nil {
		return err
	}
	err := e.within(ctx, tx, func(tx pgx.Tx) error {
		sg, lifted, err := e.liftPause(ctx, tx, id, reason)
		if err != nil || lifted {
			return err
		}
		if err := e.heldByType(ctx, tx, sg, ErrNotPaused); err != nil {
			return err
		}
		return fmt.Errorf("%w (status %s)", ErrNotPaused, sg.Status)
	})
	if err != nil {
		return fmt.Errorf("saga: unpause %s: %w", id, err)
	}
	return nil
}

// liftPause lifts saga id's own pause in tx, and returns the saga as read
// (not under its row lock: a step that ran when the saga was paused may
// still run, and holds it) and whether it had a pause.
func (e *Engine) liftPause(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string) (*store.Saga, bool, error) {
	sg, err := e.st.GetSaga(ctx, tx, id, false)
	if errors.Is(err, store.ErrNotFound) {
		return nil, false, ErrNotFound
	}
	if err != nil {
		return nil, false, err
	}
	lifted, err := e.unpause(ctx, tx, sg, safetext.Text(reason, MaxReasonBytes))
	return sg, lifted, err
}

// heldByType returns an error wrapping sentinel when the pause of sg's
// type holds it, which only ResumeType lifts.
func (e *Engine) heldByType(ctx context.Context, tx pgx.Tx, sg *store.Saga, sentinel error) error {
	ps, err := e.st.Pauses(ctx, tx, []uuid.UUID{sg.ID})
	if err != nil {
		return err
	}
	if p := ps[sg.ID]; p != nil && p.Kind == store.PauseType {
		return fmt.Errorf("%w: it is held by the pause of its type %q, which Engine.ResumeType (sagaflow unpause --type) lifts",
			sentinel, sg.Name)
	}
	return nil
}

// PausedTypes returns the saga types paused as a whole.
func (e *Engine) PausedTypes(ctx context.Context) (map[string]PauseInfo, error) {
	if err := e.ready("Engine.PausedTypes"); err != nil {
		return nil, err
	}
	ps, err := e.st.TypePauses(ctx, e.pool)
	if err != nil {
		return nil, fmt.Errorf("saga: paused types: %w", err)
	}
	out := make(map[string]PauseInfo, len(ps))
	for i := range ps {
		out[ps[i].SagaName] = *pauseInfo(&ps[i])
	}
	return out, nil
}

// unpause lifts saga id's own pause in tx, and reports whether it had one.
func (e *Engine) unpause(ctx context.Context, tx pgx.Tx, sg *store.Saga, reason string) (bool, error) {
	// A step that wrote its transition, and with it its next command held
	// by the pause, may commit after the release below, where nothing would
	// release the command again (found by pausing and resuming in a loop).
	// Its transaction holds the saga's row from its transition to its
	// commit: wait for that first. (Not the execution lock: that one is
	// held while a handler runs, for as long as its timeout.)
	if err := e.st.LockSagaRow(ctx, tx, sg.ID); err != nil {
		return false, err
	}
	p, err := e.st.DeletePause(ctx, tx, store.PauseSaga, &sg.ID, "")
	if err != nil || p == nil {
		return false, err
	}
	detail, _ := json.Marshal(map[string]any{"reason": reason, "paused_at": p.At, "pause_code": p.Code})
	if err := e.st.InsertHistory(ctx, tx, &store.HistoryEntry{SagaID: sg.ID, Event: EventSagaUnpaused, StepName: sg.StepName,
		Direction: sg.Direction, Epoch: sg.Epoch, Detail: detail}); err != nil {
		return false, err
	}
	// The rescuer left the saga alone while it was paused: its deadline
	// starts again from now.
	if err := e.st.RestartDeadline(ctx, tx, sg.ID, e.machine.deadline(stepTimeoutIn(e.lookup(sg), sg.StepName))); err != nil {
		return false, err
	}
	return true, e.st.Notify(ctx, tx, e.cfg.CommandTopic)
}

// hold keeps a step command or wake-up of a paused saga for when the pause
// is lifted: a direct command stays in the outbox, held; one consumed from
// Kafka is written back to the outbox, held.
func (b *batch) hold(ctx context.Context, c *store.Claimed, ls *store.LockedSaga) error {
	if err := b.tx.flush(); err != nil {
		return err
	}
	b.tx.clean = "" // what follows must not be rolled back by the next command
	b.tx.stats.deferred.Add(1)
	if b.msg == nil {
		return b.e.st.HoldClaimed(ctx, b.tx.tx, c.ID)
	}
	m := store.Message{ID: uuid.Must(uuid.NewV7()), Topic: b.msg.Topic, Delivery: store.DeliveryRelay,
		AggregateType: aggregateType(ls.Name, ls.DefVersion), AggregateID: ls.ID.String(), Type: c.Type, Payload: b.msg.Value,
		Headers: map[string]string{}, SagaID: &ls.ID}
	for _, h := range b.msg.Headers {
		if safetext.Problem(h.Key, 256) == "" && safetext.Problem(string(h.Value), 8192) == "" {
			m.Headers[h.Key] = string(h.Value)
		}
	}
	// The copy is published under its own message id; the engine knows it
	// by the id it was written with (the saga's command id), as a held
	// command's.
	if _, ok := m.Headers[wire.HeaderHeldID]; !ok {
		m.Headers[wire.HeaderHeldID] = c.IDText()
	}
	m.Headers[wire.HeaderMessageID] = m.ID.String()
	if c.Type == commandType {
		key := steps.Key{SagaID: ls.ID, Step: ls.StepName, Direction: steps.Direction(ls.Direction), Epoch: ls.Epoch}.String()
		m.StepKey = &key
	}
	return b.e.st.HoldPaused(ctx, b.tx.tx, &m)
}

// fillPauses sets the Paused field of the sagas that have not ended.
func (e *Engine) fillPauses(ctx context.Context, db store.DBTX, ins []Instance) error {
	var ids []uuid.UUID
	for i := range ins {
		if !ins[i].Status.Terminal() {
			ids = append(ids, ins[i].ID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	ps, err := e.st.Pauses(ctx, db, ids)
	if err != nil {
		return err
	}
	for i := range ins {
		ins[i].Paused = pauseInfo(ps[ins[i].ID])
	}
	return nil
}
