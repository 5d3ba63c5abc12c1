package sagatest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// Beginner starts a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx (a
// savepoint) satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// StepOpts describe the execution [RunStep] pretends to be. nil means the
// defaults.
type StepOpts struct {
	// Direction runs the step's Action (steps.Forward, the default) or its
	// Compensate (steps.Compensate).
	Direction steps.Direction
	// SagaID is the saga the step belongs to. Defaults to a new id.
	SagaID uuid.UUID
	// SagaName is StepRun.SagaName. Defaults to "sagatest".
	SagaName    string
	BusinessKey string
	Epoch       int
	// Attempt is StepRun.Attempt. Defaults to 1.
	Attempt int
	// MaxStateBytes is your engine's saga.Config.MaxStateBytes: a state
	// larger than this after the step fails it, as in the engine. Defaults
	// to saga.MaxStateBytesDefault.
	MaxStateBytes int
}

// StepResult is what one [RunStep] did.
type StepResult[S any] struct {
	// State is the state as the step left it, after a JSON round trip as the
	// engine stores it. When the step failed it is the state it was given:
	// the engine keeps no change of a failed step.
	State S
	// Err is what the step returned (or the error that encoding the state
	// met). Inspect it with steps.IsPermanent, steps.Code and errors.As
	// (*steps.RetryAfterError).
	Err error
	// Command is, for a step with a Remote, the command it would send (its
	// payload as JSON); nil for other steps.
	Command json.RawMessage
	// Run is the StepRun the step was given; Run.Tx is the test
	// transaction, still open, in which the step's writes can be read.
	Run *saga.StepRun
}

// storable refuses, as the engine does after a step, an encoded state that
// PostgreSQL cannot store or that is over maxBytes: the step fails for
// good with the engine's code (review29 F1, F2).
func storable(step string, state []byte, maxBytes int) error {
	if maxBytes <= 0 {
		maxBytes = saga.MaxStateBytesDefault
	}
	problem, tooLarge := safetext.StateProblem(step, state, maxBytes)
	switch {
	case problem == "":
		return nil
	case tooLarge:
		return steps.Permanent(steps.WithCode(saga.CodeTooLarge, errors.New(problem)))
	}
	return steps.Permanent(steps.WithCode(saga.CodeStateEncode, errors.New(problem)))
}

// stepTx is the transaction RunStep hands a step: as the engine's, it
// refuses Commit and Rollback with saga.ErrStepTxEnd (a step that ended
// it would commit the test transaction); savepoints the step begins are
// its own.
type stepTx struct{ pgx.Tx }

func (stepTx) Commit(context.Context) error   { return saga.ErrStepTxEnd }
func (stepTx) Rollback(context.Context) error { return saga.ErrStepTxEnd }

// RunStep runs one step of a saga, outside any engine, in a test
// transaction, the way the engine would: the state goes through JSON, the
// handler gets a [saga.StepRun] whose Tx is that transaction (whose
// Commit and Rollback return saga.ErrStepTxEnd) and whose context ends at
// the step's Timeout, the step runs under a savepoint so
// that a failed step's writes are rolled back, and a successful step's state is encoded again
// and checked as the engine checks it: a NUL character, which PostgreSQL
// cannot store, or more than [StepOpts].MaxStateBytes fails the step for
// good (saga.CodeStateEncode, saga.CodeTooLarge).
// For a step with a Remote, it builds the command the step would send
// (Remote.Command, or Remote.CompensateCommand when compensating) instead.
//
// db is where the transaction comes from. With a pool (or a connection),
// RunStep begins a transaction that is rolled back when the test ends, so
// nothing the step writes is ever committed. With a pgx.Tx, the step runs
// in that transaction, under a savepoint, and the caller decides its fate.
//
// RunStep takes the step, not a definition: a saga.Definition does not
// expose its steps, so keep the steps you want to test in variables and
// give them to both saga.Define and RunStep. RunStep checks nothing that
// Engine.Register checks, and knows nothing of the saga around the step:
// no inbox key is written, no history, no next command.
func RunStep[S any](tb testing.TB, db Beginner, step saga.Step[S], state S, opts *StepOpts) StepResult[S] {
	tb.Helper()
	o := StepOpts{}
	if opts != nil {
		o = *opts
	}
	if o.Direction == "" {
		o.Direction = steps.Forward
	}
	if !o.Direction.Valid() {
		tb.Fatalf("sagatest: run step %q: StepOpts.Direction %q is neither forward nor compensate", step.Name, o.Direction)
	}
	if o.SagaID == uuid.Nil {
		o.SagaID = uuid.Must(uuid.NewV7())
	}
	if o.SagaName == "" {
		o.SagaName = "sagatest"
	}
	if o.Attempt == 0 {
		o.Attempt = 1
	}
	timeout := step.Timeout
	if timeout == 0 {
		timeout = saga.StepTimeoutDefault
	}
	ctx := context.Background()

	tx, ok := db.(pgx.Tx)
	if !ok {
		var err error
		tx, err = db.Begin(ctx)
		if err != nil {
			tb.Fatalf("sagatest: run step %q: begin the test transaction: %v", step.Name, err)
		}
		tb.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	}
	run := &saga.StepRun{Tx: stepTx{tx}, SagaID: o.SagaID, SagaName: o.SagaName, BusinessKey: o.BusinessKey, Step: step.Name,
		Direction: o.Direction, Epoch: o.Epoch, Attempt: o.Attempt,
		Key: steps.Key{SagaID: o.SagaID, Step: step.Name, Direction: o.Direction, Epoch: o.Epoch}}

	// The state the engine would hand the step: decoded from its JSON.
	raw, err := json.Marshal(&state)
	if err != nil {
		tb.Fatalf("sagatest: run step %q: encode the state: %v", step.Name, err)
	}
	var in S
	if err := json.Unmarshal(raw, &in); err != nil {
		tb.Fatalf("sagatest: run step %q: the state does not decode from its own JSON: %v", step.Name, err)
	}
	res := StepResult[S]{State: in, Run: run}

	var fn saga.StepFunc[S]
	var build func(context.Context, *saga.StepRun, *S) (any, error)
	switch {
	case step.Remote != nil && o.Direction == steps.Forward:
		build = step.Remote.Command
	case step.Remote != nil && step.Remote.CompensateType != "":
		build = step.Remote.CompensateCommand
		if build == nil {
			build = step.Remote.Command
		}
	case o.Direction == steps.Forward:
		fn = step.Action
	default:
		fn = step.Compensate
	}
	if fn == nil && build == nil && step.Wait != nil && o.Direction == steps.Forward {
		tb.Fatalf("sagatest: run step %q: it waits (Step.Wait), which only an engine does: run its saga in an engine "+
			"and make time pass with a Clock, or send its signal with Engine.Signal", step.Name)
	}
	if fn == nil && build == nil {
		tb.Fatalf("sagatest: run step %q: it has no %s to run", step.Name, map[steps.Direction]string{
			steps.Forward: "Action (or Remote.Command)", steps.Compensate: "Compensate (or Remote.CompensateType)"}[o.Direction])
	}

	// The engine's savepoint per step: a failed step leaves no writes.
	if _, err := tx.Exec(ctx, "SAVEPOINT sagatest_step"); err != nil {
		tb.Fatalf("sagatest: run step %q: savepoint: %v", step.Name, err)
	}
	stepCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	work := in // the handler's copy; a failure leaves res.State alone
	if build != nil {
		var cmd any
		cmd, err = build(stepCtx, run, &work)
		if err == nil {
			res.Command, err = json.Marshal(cmd)
			if err != nil {
				err = steps.Permanent(fmt.Errorf("encode command of step %q: %w", step.Name, err))
			}
		}
	} else {
		err = fn(stepCtx, run, &work)
	}
	if err == nil {
		// The state as the engine would store it.
		var out []byte
		if out, err = json.Marshal(&work); err == nil {
			var back S
			if err = json.Unmarshal(out, &back); err == nil {
				res.State = back
			}
		}
		if err != nil {
			err = steps.Permanent(steps.WithCode(saga.CodeStateEncode, fmt.Errorf("encode state: %w", err)))
		} else {
			err = storable(step.Name, out, o.MaxStateBytes)
		}
	}
	if err == nil {
		if _, relErr := tx.Exec(ctx, "RELEASE SAVEPOINT sagatest_step"); relErr != nil {
			// The handler left the transaction unusable.
			err = steps.Permanent(steps.WithCode(saga.CodeTxAborted, fmt.Errorf("release the step's savepoint: %w", relErr)))
		}
	}
	if err != nil {
		for _, q := range []string{"ROLLBACK TO SAVEPOINT sagatest_step", "RELEASE SAVEPOINT sagatest_step"} {
			if _, rbErr := tx.Exec(ctx, q); rbErr != nil {
				tb.Fatalf("sagatest: run step %q: roll back its writes after %v: %v", step.Name, err, rbErr)
			}
		}
	}
	res.Err = err
	return res
}
