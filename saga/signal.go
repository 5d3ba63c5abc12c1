package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/wire"
)

// Signal is a message to one saga, for a step that awaits it ([OnSignal]).
// Address the saga by SagaID, or by Saga and BusinessKey.
type Signal struct {
	// SagaID addresses the saga by its id.
	SagaID uuid.UUID
	// Saga and BusinessKey address the saga by its definition's name and
	// the business key it was started with, when SagaID is not set.
	Saga, BusinessKey string
	// Name is what an [OnSignal] step awaits. Required.
	Name string
	// ID deduplicates: a second signal with the same ID to the same saga
	// has no effect and returns [SignalResult].Duplicate. Use the id of
	// what caused the signal (a webhook's event id, a message id). Defaults
	// to a new UUID, which deduplicates nothing.
	ID string
	// Payload is the signal's content, encoded as JSON ([json.RawMessage]
	// and []byte holding JSON are sent as they are). It is stored as bytes,
	// as sent: JSON that escapes a NUL ("\u0000") is accepted, and a
	// handler that copies it into the saga's state fails its step
	// (PostgreSQL's jsonb refuses it).
	Payload any
}

// SignalResult says what became of a signal.
type SignalResult struct {
	// SagaID is the saga the signal was addressed to; uuid.Nil when none
	// matched.
	SagaID uuid.UUID
	// Seq orders the saga's signals; an await takes the pending signal of
	// its name with the lowest Seq among those committed when it looks
	// (a signal whose transaction commits late may be overtaken).
	Seq int64
	// Duplicate is true when a signal with the same ID had been recorded
	// for the saga before: nothing new was written.
	Duplicate bool
}

// ErrSignalRejected is wrapped by the error of a signal that no saga can
// take: the saga does not exist ([ErrNotFound] is wrapped too), or it is no
// longer running ([ErrNotRunning]). The signal is recorded all the same,
// as rejected, with the reason: see [Engine.Signals].
var ErrSignalRejected = errors.New("saga: signal rejected")

// MaxSignalNameBytes bounds a signal's name.
const MaxSignalNameBytes = 200

func validSignalName(name string) bool {
	return name != "" && safetext.Problem(name, MaxSignalNameBytes) == ""
}

// Signal records sig for its saga and commits. A step that awaits it runs
// at once if the saga waits for it now; otherwise it is kept, and
// delivered when the saga reaches such a step.
//
// A signal to a saga that does not exist, or that is no longer running
// (ended, or compensating), is recorded as rejected and committed, and
// the error wraps [ErrSignalRejected]. Input that cannot be stored (a NUL
// byte, invalid UTF-8, an over-long name, ID or key, a payload that is not
// JSON or is larger than [Config.MaxStateBytes]) is refused with an error
// wrapping [ErrInvalidInput] and writes nothing.
func (e *Engine) Signal(ctx context.Context, sig Signal) (SignalResult, error) {
	if err := e.ready("Engine.Signal"); err != nil {
		return SignalResult{}, err
	}
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return SignalResult{}, fmt.Errorf("saga: signal: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	res, serr := e.signalTx(ctx, tx, sig, false)
	if serr != nil && !errors.Is(serr, ErrSignalRejected) {
		return res, serr
	}
	fault.At(ctx, fault.SignalBeforeCommit)
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("saga: signal %q: commit: %w", safetext.Text(sig.Name, 200), err)
	}
	fault.At(ctx, fault.SignalAfterCommit)
	if serr == nil && !res.Duplicate {
		// The wake-up is committed: this process's workers look at once,
		// and the others hear of it (see [Engine.announce]).
		e.announce()
	}
	return res, serr
}

// SignalTx is [Engine.Signal] inside the caller's transaction: the signal
// counts from when tx commits, together with the caller's own writes (a
// webhook handler's, behind its idempotency key). A rejected signal is
// written to tx too, and its error returned: commit to keep the record.
func (e *Engine) SignalTx(ctx context.Context, tx pgx.Tx, sig Signal) (SignalResult, error) {
	if err := e.ready("Engine.SignalTx"); err != nil {
		return SignalResult{}, err
	}
	return e.signalTx(ctx, tx, sig, true)
}

// signalTx records sig in tx. notify puts the wake-up's notification in
// tx, to be delivered with its commit; without it the caller announces
// the wake-up after the commit.
func (e *Engine) signalTx(ctx context.Context, tx pgx.Tx, sig Signal, notify bool) (SignalResult, error) {
	if tx == nil {
		return SignalResult{}, errors.New("saga: signal: tx is nil")
	}
	if !validSignalName(sig.Name) {
		return SignalResult{}, fmt.Errorf("%w: signal: Name %q must be 1-%d bytes of valid UTF-8 without NUL",
			ErrInvalidInput, safetext.Text(sig.Name, 100), MaxSignalNameBytes)
	}
	op := "signal " + sig.Name
	if err := checkInput(op, inputField{"Signal.ID", sig.ID, safetext.MaxKeyBytes},
		inputField{"Signal.Saga", sig.Saga, 64}, inputField{"Signal.BusinessKey", sig.BusinessKey, safetext.MaxKeyBytes}); err != nil {
		return SignalResult{}, err
	}
	payload, err := signalPayload(sig.Payload)
	if err != nil {
		return SignalResult{}, fmt.Errorf("%w: %s: Payload: %w", ErrInvalidInput, op, err)
	}
	if len(payload) > e.cfg.MaxStateBytes {
		return SignalResult{}, fmt.Errorf("%w: %s: Payload is %d bytes, more than MaxStateBytes (%d): %w",
			ErrInvalidInput, op, len(payload), e.cfg.MaxStateBytes, ErrPayloadTooLarge)
	}
	id := sig.ID
	if id == "" {
		id = uuid.Must(uuid.NewV7()).String()
	}

	target := sig.SagaID.String()
	var sg *store.Saga
	switch {
	case sig.SagaID != uuid.Nil:
		sg, err = e.st.GetSaga(ctx, tx, sig.SagaID, false)
	case sig.Saga != "" && sig.BusinessKey != "":
		target = sig.Saga + "/" + sig.BusinessKey
		var found uuid.UUID
		found, err = e.st.SagaIDByKey(ctx, tx, sig.Saga, sig.BusinessKey)
		if err == nil {
			sg, err = e.st.GetSaga(ctx, tx, found, false)
		}
	default:
		return SignalResult{}, fmt.Errorf("%w: %s: set SagaID, or Saga and BusinessKey", ErrInvalidInput, op)
	}
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return SignalResult{}, fmt.Errorf("saga: %s to %s: %w", op, target, err)
	}

	row := &store.SignalRow{Target: target, Name: sig.Name, SignalID: id, Payload: payload, Status: store.SignalPending}
	var rejected error
	switch {
	case sg == nil:
		rejected = fmt.Errorf("saga: %s to %s: %w: %w: no such saga", op, target, ErrSignalRejected, ErrNotFound)
	case Status(sg.Status) != StatusRunning:
		rejected = fmt.Errorf("saga: %s to saga %s: %w: %w: its status is %s", op, sg.ID, ErrSignalRejected, ErrNotRunning, sg.Status)
	}
	if sg != nil {
		row.SagaID = &sg.ID
	}
	if rejected != nil {
		row.Status, row.Error = store.SignalRejected, safetext.Text(rejected.Error(), 2000)
	}
	seq, inserted, status, why, err := e.st.InsertSignal(ctx, tx, row)
	if err != nil {
		return SignalResult{}, fmt.Errorf("saga: %s to %s: %w", op, target, err)
	}
	res := SignalResult{Seq: seq, Duplicate: !inserted}
	if sg != nil {
		res.SagaID = sg.ID
	}
	switch {
	case !inserted && status == store.SignalRejected:
		cause := ErrNotRunning
		if sg == nil {
			cause = ErrNotFound
		}
		return res, fmt.Errorf("saga: %s to %s: %w: %w: a signal with id %q was rejected before: %s", op, target, ErrSignalRejected,
			cause, safetext.Text(id, 200), why)
	case !inserted:
		return res, nil
	case rejected != nil:
		return res, rejected
	}
	// Wake the saga: an engine that knows it looks at what it waits for.
	// The wake-up is a command rather than a look at the saga here, so
	// that a saga reaching its await step while this transaction commits
	// cannot miss the signal (see [batch.wake]).
	msg := e.nudgeMessage(sg, wakeType)
	// The engine's wake-up span links to the sender's.
	telemetry.InjectSpanContext(trace.SpanContextFromContext(ctx), msg.Headers)
	if err := e.st.InsertMessage(ctx, tx, &msg); err != nil {
		return res, fmt.Errorf("saga: %s to %s: %w", op, target, err)
	}
	if notify {
		if err := e.st.Notify(ctx, tx, e.cfg.CommandTopic); err != nil {
			return res, fmt.Errorf("saga: %s to %s: %w", op, target, err)
		}
	}
	return res, nil
}

// signalPayload encodes a signal's payload as JSON.
func signalPayload(p any) ([]byte, error) {
	var raw []byte
	switch v := p.(type) {
	case nil:
		return []byte("null"), nil
	case json.RawMessage:
		raw = v
	case []byte:
		raw = v
	default:
		out, err := json.Marshal(p)
		if err != nil {
			return nil, err
		}
		return out, nil
	}
	if !json.Valid(raw) {
		return nil, errors.New("not valid JSON")
	}
	return raw, nil
}

// SignalInfo is a signal recorded for a saga, as [Engine.Signals] reads it.
type SignalInfo struct {
	Seq     int64
	Name    string
	ID      string
	Payload json.RawMessage // as sent; not necessarily valid JSON for a signal from a foreign writer
	// Status is "pending" (not taken by any step: kept for a step that
	// awaits it, and left so when the saga ends first), "delivered", or
	// "rejected" (Error says why: no saga could take it, or the step that
	// took it failed for good).
	Status string
	Error  string
	// Step and Epoch say where it was delivered.
	Step        string
	Epoch       int
	CreatedAt   time.Time
	DeliveredAt *time.Time // nil until delivered
}

// maxSignalsListed bounds [Engine.Signals].
const maxSignalsListed = 1000

// Signals returns the signals recorded for saga id, oldest first (at most
// 1000), and those addressed to id that matched no saga. (A signal
// addressed by name and business key that matched no saga is recorded
// with that address, which Signals does not list.)
func (e *Engine) Signals(ctx context.Context, id uuid.UUID) ([]SignalInfo, error) {
	if err := e.ready("Engine.Signals"); err != nil {
		return nil, err
	}
	rows, err := e.st.Signals(ctx, e.pool, id, maxSignalsListed)
	if err != nil {
		return nil, fmt.Errorf("saga: %w", err)
	}
	out := make([]SignalInfo, 0, len(rows))
	for _, r := range rows {
		si := SignalInfo{Seq: r.Seq, Name: r.Name, ID: r.SignalID, Payload: r.Payload, Status: r.Status, Error: r.Error,
			Step: deref(r.StepName), CreatedAt: r.CreatedAt, DeliveredAt: r.DeliveredAt}
		if r.Epoch != nil {
			si.Epoch = *r.Epoch
		}
		out = append(out, si)
	}
	return out, nil
}

// wakeType makes an engine look at what a saga waits for.
const wakeType = wire.TypeWake
