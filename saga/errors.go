package saga

import "errors"

var (
	// ErrInvalidDefinition is wrapped by every definition problem found by
	// [Engine.Register]: an empty or reused name, no steps, a duplicate step
	// name, a missing action.
	ErrInvalidDefinition = errors.New("saga: invalid definition")

	// ErrNotRegistered is returned when starting a saga whose definition was
	// not registered with the engine.
	ErrNotRegistered = errors.New("saga: definition not registered")

	// ErrNotFound is returned for a saga id that does not exist.
	ErrNotFound = errors.New("saga: not found")

	// ErrSagaIDTaken is returned by [Start] and [StartTx] when
	// [StartOpts.ID] names a saga of another definition, or one started
	// with another business key.
	ErrSagaIDTaken = errors.New("saga: saga id taken")

	// ErrNilEngine is returned by the functions and methods that are given a
	// nil *Engine, or one not made by [New].
	ErrNilEngine = errors.New("saga: nil engine")

	// ErrPayloadTooLarge is returned when a saga's encoded state exceeds
	// [Config.MaxStateBytes].
	ErrPayloadTooLarge = errors.New("saga: state too large")

	// ErrNotRunning is returned by [Engine.Cancel] for a saga that is already
	// compensating or has ended.
	ErrNotRunning = errors.New("saga: not running")

	// ErrPastPivot is returned by [Engine.Cancel] (and [Engine.CancelTx])
	// for a saga that has completed its pivot step: it can no longer be
	// compensated, and goes forward until it completes (see "Pivots" in the
	// package documentation).
	ErrPastPivot = errors.New("saga: past its pivot")

	// ErrEngineStarted is returned by [Engine.Register] once the engine runs.
	ErrEngineStarted = errors.New("saga: engine already started")

	// ErrInvalidConfig wraps every configuration problem found by [New].
	ErrInvalidConfig = errors.New("saga: invalid config")

	// ErrInvalidInput wraps every refusal of a caller's string that
	// PostgreSQL could not store or compare (a NUL byte, invalid UTF-8, a
	// business key past its index's limit); the error names the field.
	ErrInvalidInput = errors.New("saga: invalid input")

	// ErrNotReplayable is returned when a replay does not fit the saga's
	// status: only failed sagas resume, only ended sagas re-run.
	ErrNotReplayable = errors.New("saga: not replayable")

	// ErrNotPaused is wrapped by the error of [Engine.Unpause] for a saga
	// that is not paused on its own (not paused, or held only by its
	// type's pause).
	ErrNotPaused = errors.New("saga: not paused")
)

// ErrConcurrencyLimit is returned by a start with [StartOpts.NoWait] whose
// concurrency key has no free slot: as many running sagas as its
// definition's limit, or sagas waiting for one. The error names the key,
// the limit and the counts.
var ErrConcurrencyLimit = errors.New("saga: concurrency limit reached")

// Error codes stored with a saga's last error and its history entries. Codes
// that a handler attaches with steps.WithCode are stored as given.
const (
	CodeError           = "error"             // a handler returned an error without a code
	CodePanic           = "panic"             // a handler panicked; the stack is in the history
	CodeTimeout         = "step_timeout"      // an attempt ran past its step's timeout
	CodeStateDecode     = "state_decode"      // the stored state no longer decodes into the saga's type
	CodeStateEncode     = "state_encode"      // the state a handler left cannot be stored
	CodeTooLarge        = "payload_too_large" // the encoded state exceeds Config.MaxStateBytes, or a command MaxCommandBytes
	CodeUnknownStep     = "unknown_step"      // the saga's current step is not in its definition
	CodeCancelled       = "cancelled"         // an operator or the application cancelled the saga
	CodeTxAborted       = "tx_aborted"        // the handler left its transaction unusable
	CodeMalformed       = "malformed_command" // a command could not be decoded
	CodeUnknownSaga     = "unknown_saga"      // a command names a saga this engine does not know
	CodeAbandonedRunOn  = "handler_overran"   // a handler ignored its context past the grace period
	CodeRescueExhausted = "rescue_exhausted"  // the rescuer found the saga stuck with its attempts spent
	CodeReplyTimeout    = "reply_timeout"     // a participant did not reply within the step's Timeout
	CodeRefused         = "refused"           // a participant refused the command and named no code
	CodeUnverified      = "unverified"        // signing is on and a consumed message's signature is missing or wrong
	CodeInvalidOutcome  = "invalid_outcome"   // a step's outcome could not be stored; its saga is parked
)
