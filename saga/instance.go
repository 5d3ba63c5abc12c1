package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// Status is where a saga is in its life.
type Status string

const (
	// StatusRunning: running its steps forward.
	StatusRunning Status = "running"
	// StatusCompensating: undoing its completed steps in reverse order.
	StatusCompensating Status = "compensating"
	// StatusCompleted: every step succeeded. Terminal.
	StatusCompleted Status = "completed"
	// StatusCompensated: a step failed for good (or the saga was cancelled)
	// and every completed step was compensated. Terminal.
	StatusCompensated Status = "compensated"
	// StatusFailed: a compensation gave up, or the saga could not run at
	// all. Parked for an operator, with its error. Terminal until replayed.
	StatusFailed Status = "failed"
)

// Terminal reports whether a saga in status s has ended.
func (s Status) Terminal() bool {
	return s == StatusCompleted || s == StatusCompensated || s == StatusFailed
}

// statuses are the valid statuses, in the order of a saga's life.
var statuses = []Status{StatusRunning, StatusCompensating, StatusCompleted, StatusCompensated, StatusFailed}

// Valid reports whether s is one of the statuses above.
func (s Status) Valid() bool { return slices.Contains(statuses, s) }

// checkStatuses refuses a filter on a status that no saga can have: it
// would match nothing, and hide the typo that made it.
func checkStatuses(ss []Status) error {
	for _, s := range ss {
		if !s.Valid() {
			names := make([]string, len(statuses))
			for i, v := range statuses {
				names[i] = string(v)
			}
			return fmt.Errorf("unknown status %q (want one of %s)", s, strings.Join(names, ", "))
		}
	}
	return nil
}

// History event types.
const (
	EventSagaStarted           = "saga_started"
	EventStepCompleted         = "step_completed"
	EventStepFailed            = "step_failed" // an attempt failed; Detail says whether it will be retried
	EventStepDeduplicated      = "step_deduplicated"
	EventCompensationStarted   = "compensation_started"
	EventCompensationCompleted = "compensation_completed"
	EventSagaCompleted         = "saga_completed"
	EventSagaCompensated       = "saga_compensated"
	EventSagaFailed            = "saga_failed"
	EventSagaCancelled         = "saga_cancelled"
	EventDeadlineCleared       = "deadline_cleared" // the saga passed its deadline after its pivot: it goes forward
	EventCommandParked         = "command_parked"
	EventSagaRescued           = "saga_rescued"
	EventSagaResumed           = "saga_resumed"
	EventSagaRerun             = "saga_rerun"
	EventCommandSent           = "command_sent" // a remote step sent its command; the saga waits for the reply
	EventReplyReceived         = "reply_received"
)

// ErrorInfo is a saga's last error.
type ErrorInfo struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Step    string `json:"step,omitempty"` // the step that failed for good, if any
}

// Event is one entry of a saga's timeline. At is the database's clock.
type Event struct {
	At        time.Time       `json:"at"`
	Type      string          `json:"type"`
	Step      string          `json:"step,omitempty"`
	Direction steps.Direction `json:"direction,omitempty"`
	Epoch     int             `json:"epoch"`
	Attempt   int             `json:"attempt,omitempty"`
	Error     string          `json:"error,omitempty"`
	ErrorCode string          `json:"error_code,omitempty"`
	Detail    json.RawMessage `json:"detail,omitempty"`
}

// Instance is a saga as stored.
type Instance struct {
	ID          uuid.UUID       `json:"id"`
	Name        string          `json:"name"`
	BusinessKey string          `json:"business_key,omitempty"`
	Status      Status          `json:"status"`
	Step        string          `json:"step"` // the current (or last) step
	StepIndex   int             `json:"step_index"`
	Direction   steps.Direction `json:"direction"`
	Epoch       int             `json:"epoch"`
	Attempt     int             `json:"attempt"` // failed attempts of the current step
	State       json.RawMessage `json:"state"`
	Version     int64           `json:"version"` // the row's version, which fences every transition
	// DefinitionVersion is the version of its definition the saga runs on
	// ([Definition.WithVersion]).
	DefinitionVersion int        `json:"definition_version"`
	NextCheckAt       *time.Time `json:"next_check_at,omitempty"` // deadline of a running saga
	LastError         *ErrorInfo `json:"last_error,omitempty"`
	CreatedAt         time.Time  `json:"created_at"`
	UpdatedAt         time.Time  `json:"updated_at"`
	EndedAt           *time.Time `json:"ended_at,omitempty"`
	// Wait says what the saga waits for at its step, nil when it does not
	// wait.
	Wait *WaitInfo `json:"wait,omitempty"`
	// Deadline is when the saga must have ended, or it is cancelled
	// ([StartOpts.Deadline], [Definition.WithDeadline]); nil for none.
	Deadline *time.Time `json:"deadline,omitempty"`
	// ParentID is, for a child saga ([Child]), the saga that started it.
	ParentID *uuid.UUID `json:"parent_id,omitempty"`
	// Concurrency is the saga's place under its concurrency key
	// ([StartOpts.ConcurrencyKey]), nil when it was started without one.
	Concurrency *ConcurrencyInfo `json:"concurrency,omitempty"`
	// Paused says why the saga is paused ([Engine.Pause],
	// [Engine.PauseType], Step.PauseWhenExhausted), nil when it is not.
	Paused *PauseInfo `json:"paused,omitempty"`
	// History is the timeline, oldest first. Filled by [Engine.Get], empty
	// in [Engine.List] results.
	History []Event `json:"history,omitempty"`
}

// WaitInfo is what a saga waits for (see [Wait]).
type WaitInfo struct {
	// Kind is "timer", "signal" or "child".
	Kind string `json:"kind"`
	// For names the signal, or the child saga's id; "" for a timer.
	For string `json:"for,omitempty"`
	// Until is when the wait ends by itself (a timer's time, a time
	// limit), in database time; nil when it has none.
	Until *time.Time `json:"until,omitempty"`
}

// DecodeState decodes the saga's state into v.
func (i *Instance) DecodeState(v any) error {
	if err := json.Unmarshal(i.State, v); err != nil {
		return fmt.Errorf("saga: decode state of %s: %w", i.ID, err)
	}
	return nil
}

func instanceFrom(sg *store.Saga) Instance {
	in := Instance{
		ID: sg.ID, Name: sg.Name, Status: Status(sg.Status), Step: sg.StepName, StepIndex: sg.StepIndex,
		Direction: steps.Direction(sg.Direction), Epoch: sg.Epoch, Attempt: sg.Attempt, State: sg.State,
		Version: sg.Version, NextCheckAt: sg.NextCheckAt, CreatedAt: sg.CreatedAt, UpdatedAt: sg.UpdatedAt,
		EndedAt: sg.EndedAt, DefinitionVersion: max(sg.DefVersion, 1),
	}
	if sg.BusinessKey != nil {
		in.BusinessKey = *sg.BusinessKey
	}
	if sg.WaitKind != nil {
		in.Wait = &WaitInfo{Kind: *sg.WaitKind, For: deref(sg.WaitFor), Until: sg.WaitUntil}
	}
	in.Deadline, in.ParentID = sg.DeadlineAt, sg.ParentID
	if sg.LastError != nil {
		in.LastError = &ErrorInfo{Message: *sg.LastError}
		if sg.LastErrorCode != nil {
			in.LastError.Code = *sg.LastErrorCode
		}
		if sg.FailedStep != nil {
			in.LastError.Step = *sg.FailedStep
		}
	}
	return in
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// Get returns a saga with its timeline. It returns an error wrapping
// [ErrNotFound] for an unknown id.
func (e *Engine) Get(ctx context.Context, id uuid.UUID) (*Instance, error) {
	if err := e.ready("Engine.Get"); err != nil {
		return nil, err
	}
	// One snapshot: the row, its timeline, its key's slot and its pause
	// agree with each other.
	return e.get(ctx, id, func(fn func(pgx.Tx) error) error {
		return pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, fn)
	})
}

// GetTx is [Engine.Get] inside the caller's transaction: it sees what tx
// sees (its own writes too). Its reads agree with each other when tx is
// REPEATABLE READ or SERIALIZABLE; in a READ COMMITTED one, a step that
// commits between them can show in some and not in others.
func (e *Engine) GetTx(ctx context.Context, tx pgx.Tx, id uuid.UUID) (*Instance, error) {
	if err := e.ready("Engine.GetTx"); err != nil {
		return nil, err
	}
	if tx == nil {
		return nil, fmt.Errorf("saga: get %s: tx is nil", id)
	}
	return e.get(ctx, id, func(fn func(pgx.Tx) error) error { return pgx.BeginFunc(ctx, tx, fn) })
}

// get reads saga id and its timeline in the transaction in gives it.
func (e *Engine) get(ctx context.Context, id uuid.UUID, in func(func(pgx.Tx) error) error) (*Instance, error) {
	var sg *store.Saga
	var hist []store.History
	one := make([]Instance, 1)
	err := in(func(tx pgx.Tx) error {
		var err error
		if sg, err = e.st.GetSaga(ctx, tx, id, false); err != nil {
			return err
		}
		if hist, err = e.st.History(ctx, tx, id); err != nil {
			return err
		}
		one[0] = instanceFrom(sg)
		if err := e.fillConcurrency(ctx, tx, one); err != nil {
			return err
		}
		return e.fillPauses(ctx, tx, one)
	})
	if errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("saga: get %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	inst := one[0]
	inst.History = make([]Event, 0, len(hist))
	for _, h := range hist {
		inst.History = append(inst.History, Event{
			At: h.At, Type: h.Event, Step: deref(h.StepName), Direction: steps.Direction(deref(h.Direction)),
			Epoch: deref(h.Epoch), Attempt: deref(h.Attempt), Error: deref(h.Error), ErrorCode: deref(h.ErrorCode),
			Detail: h.Detail,
		})
	}
	return &inst, nil
}

// List limits.
const (
	ListLimitDefault = 100
	ListLimitMax     = 1000
)

// ListOpts filters [Engine.List]. Zero fields do not filter.
type ListOpts struct {
	Name string
	// Statuses keeps sagas in any of these statuses; a status that is not
	// one of the Status constants is an error.
	Statuses      []Status
	BusinessKey   string
	CreatedAfter  time.Time // inclusive
	CreatedBefore time.Time // exclusive
	EndedAfter    time.Time // inclusive
	EndedBefore   time.Time // exclusive
	FailedStep    string    // the step whose failure the last error records
	ErrorCode     string    // the last error's code
	// Waiting keeps only sagas that wait (for a timer, a signal or a child
	// saga, see [Wait]).
	Waiting bool
	// ConcurrencyKey keeps only sagas started with this concurrency key
	// ([StartOpts.ConcurrencyKey]).
	ConcurrencyKey string
	// Queued keeps only sagas waiting for a slot of their concurrency key.
	Queued bool
	// Paused keeps only sagas that have not ended and are paused, on their
	// own ([Engine.Pause]) or with their type ([Engine.PauseType]).
	Paused bool
	// Cursor continues a previous listing: pass its NextCursor.
	Cursor string
	// Limit is the page size. Defaults to ListLimitDefault; at most
	// ListLimitMax.
	Limit int
}

// ListResult is one page of sagas, newest first.
type ListResult struct {
	Sagas      []Instance
	NextCursor string // "" on the last page
}

// List returns sagas matching opts, newest first, one page at a time.
func (e *Engine) List(ctx context.Context, opts *ListOpts) (*ListResult, error) {
	if err := e.ready("Engine.List"); err != nil {
		return nil, err
	}
	o := ListOpts{}
	if opts != nil {
		o = *opts
	}
	switch {
	case o.Limit < 0 || o.Limit > ListLimitMax:
		return nil, fmt.Errorf("saga: list: Limit %d is outside 0..%d", o.Limit, ListLimitMax)
	case o.Limit == 0:
		o.Limit = ListLimitDefault
	}
	if err := checkStatuses(o.Statuses); err != nil {
		return nil, fmt.Errorf("saga: list: %w", err)
	}
	if err := checkInput("list", inputField{"ListOpts.Name", o.Name, 0}, inputField{"ListOpts.BusinessKey", o.BusinessKey, 0},
		inputField{"ListOpts.FailedStep", o.FailedStep, 0}, inputField{"ListOpts.ErrorCode", o.ErrorCode, 0},
		inputField{"ListOpts.Cursor", o.Cursor, 0}, inputField{"ListOpts.ConcurrencyKey", o.ConcurrencyKey, 0}); err != nil {
		return nil, err
	}
	f := store.ListFilter{Name: o.Name, BusinessKey: o.BusinessKey, CreatedAfter: o.CreatedAfter,
		CreatedBefore: o.CreatedBefore, EndedAfter: o.EndedAfter, EndedBefore: o.EndedBefore,
		FailedStep: o.FailedStep, ErrorCode: o.ErrorCode, Waiting: o.Waiting, Cursor: o.Cursor, Limit: o.Limit,
		ConcurrencyKey: o.ConcurrencyKey, Queued: o.Queued, Paused: o.Paused}
	for _, s := range o.Statuses {
		f.Statuses = append(f.Statuses, string(s))
	}
	rows, next, err := e.st.ListSagas(ctx, e.pool, f)
	if err != nil {
		return nil, err
	}
	res := &ListResult{NextCursor: next, Sagas: make([]Instance, 0, len(rows))}
	for i := range rows {
		res.Sagas = append(res.Sagas, instanceFrom(&rows[i]))
	}
	if err := e.fillConcurrency(ctx, e.pool, res.Sagas); err != nil {
		return nil, err
	}
	if err := e.fillPauses(ctx, e.pool, res.Sagas); err != nil {
		return nil, err
	}
	return res, nil
}
