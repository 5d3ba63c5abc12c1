package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// StartOpts are the options of [Start] and [StartTx]. nil means none.
type StartOpts struct {
	// BusinessKey makes the start idempotent: a second start of the same saga
	// with the same key starts nothing and returns the first saga's id with
	// Existing set. Typically an order id. At most 512 bytes
	// (wire.MaxKeyBytes), valid UTF-8 without NUL: else the start is
	// refused with [ErrInvalidInput].
	BusinessKey string
	// ID sets the saga's id. Defaults to a new UUIDv7. Starting again with
	// an id in use returns that saga with Existing set when it is a saga of
	// the same definition and business key (a retried start), and an error
	// wrapping [ErrSagaIDTaken] when it is not. A business key in use
	// decides first: the saga that has it is returned, whatever its id.
	ID uuid.UUID
	// Deadline, when positive, is how long the saga may take: a saga that
	// has not ended by then is cancelled with code [CodeDeadline] and
	// compensates. It overrides the definition's ([Definition.WithDeadline]).
	Deadline time.Duration
	// ConcurrencyKey puts the saga under a key of its definition's
	// concurrency limit ([Definition.WithConcurrency]): while the key has as
	// many running sagas as the limit, the saga waits, in start order, and
	// its first step runs once one of them ends. At most
	// [github.com/sagaflow/sagaflow/wire.MaxKeyBytes] bytes of valid UTF-8 without NUL. Setting it for
	// a definition without a limit is an error.
	ConcurrencyKey string
	// NoWait makes a start whose ConcurrencyKey is at its limit fail with an
	// error wrapping [ErrConcurrencyLimit], starting nothing, instead of
	// waiting.
	NoWait bool
}

// Started says which saga a start refers to.
type Started struct {
	ID uuid.UUID
	// Existing is true when a saga with the same business key already
	// existed and nothing new was started.
	Existing bool
}

// Start starts a saga of definition d with the initial state, on the
// engine's pool, and returns once the saga has committed. The saga's row, its
// first history entry and its first command are one statement. Starts made
// while another start of the engine commits wait for it and then commit
// together, up to 128 in one transaction ([Stats.StartsGrouped]); a start that
// finds none committing goes at once. A group in which a start fails, or waits
// more than 50 ms for a business key another transaction holds, runs each of
// its starts again on a connection of its own, so each gets its own answer.
// Such a blocked start holds a connection of the pool, as [StartTx] does:
// bound the concurrent starts of one business key, or other starts wait for
// a free connection.
//
// If ctx ends before the start's statement was sent, Start returns an error
// wrapping ctx's error that says nothing was started, and nothing is. If it
// ends after, the saga may have been started, and the error says so: start
// again with the same [StartOpts.ID] or business key to find out; without
// either, starting again may start a second saga.
//
// See [StartTx] to start a saga inside the caller's transaction.
func Start[S any](ctx context.Context, e *Engine, d *Definition[S], state S, opts *StartOpts) (Started, error) {
	if err := e.ready("Start"); err != nil {
		return Started{}, err
	}
	return start(ctx, e, e.pool, true, d, state, opts)
}

// StartTx starts a saga inside the caller's transaction tx: the saga row, its
// first history entry and its first command commit with tx, or not at all.
// Nothing runs until tx commits. With a business key already in use it
// returns the existing saga's id and Existing: true, and writes nothing (the
// caller may then want to roll back its own writes).
//
// The engines are told of the saga when tx commits, by a notification in tx.
// Under a context from outbox.WakeAfterCommit (or in an inbox handler's
// context) they are told when the caller calls its wake function after the
// commit instead, so that tx's commit can share a WAL flush with others.
func StartTx[S any](ctx context.Context, e *Engine, tx pgx.Tx, d *Definition[S], state S, opts *StartOpts) (Started, error) {
	if err := e.ready("StartTx"); err != nil {
		return Started{}, err
	}
	return start(ctx, e, tx, false, d, state, opts)
}

// start inserts the saga through db. own says db is the engine's pool, so
// the statement commits on its own: the workers are then told after the
// commit (see [Engine.announce]); in the caller's transaction, the
// notification goes with that transaction's commit.
func start[S any](ctx context.Context, e *Engine, db store.DBTX, own bool, d *Definition[S], state S, opts *StartOpts) (Started, error) {
	if d == nil {
		return Started{}, fmt.Errorf("%w: nil definition", ErrNotRegistered)
	}
	if db == nil {
		return Started{}, fmt.Errorf("saga: start %s: tx is nil", d.name)
	}
	def, err := e.lookupOwner(d, d.name)
	if err != nil {
		return Started{}, err
	}
	raw, err := json.Marshal(&state)
	if err != nil {
		return Started{}, fmt.Errorf("saga: start %s: encode state: %w", d.name, err)
	}
	if err := e.checkState(d.name, raw); err != nil {
		return Started{}, err
	}
	o := StartOpts{}
	if opts != nil {
		o = *opts
	}
	return e.startRaw(ctx, db, own, def, raw, o, nil)
}

// startRaw starts a saga of def with the encoded state raw, through db (see
// [start]). parent, for a child saga, carries its parent's columns
// (ParentID, ParentName, ParentKey).
func (e *Engine) startRaw(ctx context.Context, db store.DBTX, own bool, def *compiled, raw []byte, o StartOpts, parent *store.Saga) (Started, error) {
	if err := checkInput("start "+def.name, inputField{"StartOpts.BusinessKey", o.BusinessKey, safetext.MaxKeyBytes}); err != nil {
		return Started{}, err
	}
	if o.Deadline < 0 {
		return Started{}, fmt.Errorf("%w: start %s: StartOpts.Deadline is negative", ErrInvalidInput, def.name)
	}
	if err := checkConcurrency(def, &o); err != nil {
		return Started{}, err
	}
	deadline := def.deadline
	if o.Deadline > 0 {
		deadline = o.Deadline
	}
	id := o.ID
	if id == uuid.Nil {
		id = uuid.Must(uuid.NewV7())
	}
	first := def.steps[0]
	sg := &store.Saga{ID: id, Name: def.name, Status: store.StatusRunning, StepIndex: 0, StepName: first.name,
		Direction: string(steps.Forward), State: raw, Version: 1, DefVersion: def.version}
	if o.BusinessKey != "" {
		sg.BusinessKey = &o.BusinessKey
	}
	detailMap := map[string]string{}
	if o.BusinessKey != "" {
		detailMap["business_key"] = o.BusinessKey
	}
	if parent != nil {
		sg.ParentID, sg.ParentName, sg.ParentKey, sg.ParentVersion = parent.ParentID, parent.ParentName, parent.ParentKey, parent.ParentVersion
		detailMap["parent_id"] = parent.ParentID.String()
		detailMap["parent_key"] = deref(parent.ParentKey)
	}
	var detail []byte
	if len(detailMap) > 0 {
		detail, _ = json.Marshal(detailMap)
	}
	rows := &store.Transition{
		History: []store.HistoryEntry{{SagaID: id, Event: EventSagaStarted, StepName: first.name,
			Direction: string(steps.Forward), Detail: detail}},
		Messages: []store.Message{e.commandMessage(id, def.name, def.version, first.name, steps.Forward, 0, 1, 0)},
	}
	span := e.tel.traceStart(ctx, sg, rows)
	startSaga := func(db store.DBTX) (bool, error) {
		return e.st.StartSaga(ctx, db, sg, e.firstDeadline(first.timeout), deadline, rows, e.cfg.CommandTopic, !own)
	}
	// A start on the engine's pool commits with the others (startgroup.go).
	var req *startReq
	if own && e.starts != nil {
		req = &startReq{sg: sg, check: e.firstDeadline(first.timeout), deadline: deadline, rows: rows, key: o.BusinessKey}
	}
	var inserted bool
	var err error
	if o.ConcurrencyKey != "" { // concurrency.go
		inserted, err = e.startConcurrent(ctx, db, own, def, sg, rows, &o, startSaga, req)
	} else if req != nil {
		inserted, err = e.starts.start(ctx, e, req)
	} else {
		inserted, err = startSaga(db)
	}
	endStart(span, inserted, err)
	if err != nil {
		return Started{}, fmt.Errorf("saga: %w", err)
	}
	if inserted {
		if own {
			e.announce()
		}
		return Started{ID: id}, nil
	}
	existing, err := e.existingStart(ctx, db, def.name, id, o.BusinessKey)
	if err != nil {
		return Started{}, err
	}
	return Started{ID: existing, Existing: true}, nil
}

// firstDeadline is how long after its start a saga counts as stuck: its
// first step's timeout and RescueSlack, as for every step, and RescueSlack
// once more as room. With the room, the first step's transition usually
// finds the deadline far enough out for the second step and leaves it alone;
// short rescue settings still rescue a lost first command soon.
//
// The rescuer may first look at the saga after the first step's timeout
// (the deadline's lower bound, next_check_at): a step that moves the
// deadline then never has to move that indexed column, unless its deadline
// is sooner (a remote step whose reply timeout is shorter than the first
// step's timeout). A saga still going then costs the rescuer one update.
func (e *Engine) firstDeadline(timeout time.Duration) store.Check {
	return store.Check{From: timeout, At: e.machine.deadline(timeout, e.cfg.RescueSlack)}
}

// existingStart finds the saga that a start which wrote nothing collided
// with: the saga with the same name and business key, or else the saga that
// holds the id. A saga holding the id counts only if it has the same name
// and business key (a retried start); otherwise the id is taken.
func (e *Engine) existingStart(ctx context.Context, db store.DBTX, name string, id uuid.UUID, key string) (uuid.UUID, error) {
	if key != "" {
		found, err := e.st.SagaIDByKey(ctx, db, name, key)
		if err == nil {
			return found, nil
		}
		if !errors.Is(err, store.ErrNotFound) {
			return uuid.Nil, fmt.Errorf("saga: start %s with business key %q: %w", name, key, err)
		}
	}
	sg, err := e.st.GetSaga(ctx, db, id, false)
	if errors.Is(err, store.ErrNotFound) {
		// Deleted between the insert and this read (retention, or an
		// operator): nothing holds the id or the key any more.
		return uuid.Nil, fmt.Errorf("saga: start %s with id %s: the saga it collided with was deleted meanwhile; start again", name, id)
	}
	if err != nil {
		return uuid.Nil, fmt.Errorf("saga: start %s with id %s: %w", name, id, err)
	}
	if sg.Name == name && deref(sg.BusinessKey) == key {
		return id, nil
	}
	held := fmt.Sprintf("a %q saga", sg.Name)
	if sg.BusinessKey != nil {
		held += fmt.Sprintf(" with business key %q", *sg.BusinessKey)
	}
	return uuid.Nil, fmt.Errorf("saga: start %s with id %s: %w: it belongs to %s", name, id, ErrSagaIDTaken, held)
}

// checkState refuses state that is too large or that PostgreSQL cannot store.
func (e *Engine) checkState(name string, raw []byte) error {
	if len(raw) > e.cfg.MaxStateBytes {
		return fmt.Errorf("saga: start %s: state is %d bytes, more than MaxStateBytes (%d): %w",
			name, len(raw), e.cfg.MaxStateBytes, ErrPayloadTooLarge)
	}
	if safetext.JSONHasNUL(raw) {
		return fmt.Errorf("%w: start %s: state contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store", ErrInvalidInput, name)
	}
	if !utf8.Valid(raw) {
		// A json.RawMessage (or a MarshalJSON) can carry bytes that
		// encoding/json passes through as they are.
		return fmt.Errorf("%w: start %s: state is not valid UTF-8, which PostgreSQL jsonb cannot store", ErrInvalidInput, name)
	}
	return nil
}
