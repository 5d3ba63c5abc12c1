package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// Defaults for steps that leave a field zero.
const (
	// MaxAttemptsDefault is the number of attempts of a step, the first
	// included, when its RetryPolicy does not say.
	MaxAttemptsDefault = 5
	// StepTimeoutDefault bounds one attempt of a step that sets no Timeout.
	StepTimeoutDefault = time.Minute
	// BackoffInitialDefault and BackoffMaxDefault shape [DefaultBackoff].
	BackoffInitialDefault = time.Second
	BackoffMaxDefault     = 5 * time.Minute
)

// StepFunc is a step's action or compensation. It runs inside the
// transaction that commits the step (run.Tx): rows it writes there commit
// exactly when the step does. It may change *state; the change is saved with
// the step. Return nil for success, or an error: see package steps for
// [steps.Permanent], [steps.RetryAfter] and [steps.WithCode].
//
// A StepFunc must honour ctx: it is cancelled at the step's timeout.
type StepFunc[S any] func(ctx context.Context, run *StepRun, state *S) error

// StepRun describes the execution a [StepFunc] is part of.
type StepRun struct {
	// Tx is the step's transaction. Use it for the step's database effects;
	// do not commit or roll it back (Commit and Rollback return
	// ErrStepTxEnd).
	Tx pgx.Tx
	// Key is the step-scoped idempotency key, the same for every attempt and
	// duplicate of this step. Pass Key.String() to external services.
	Key         steps.Key
	SagaID      uuid.UUID
	SagaName    string
	BusinessKey string // "" when the saga was started without one
	Step        string
	Direction   steps.Direction
	Epoch       int
	Attempt     int // 1 for the first attempt

	// group holds, for the compensation of a parallel step, the branches
	// that completed, in the order of the definition.
	group []branchResult
}

// IdempotencyKey returns Key as a string, ready for an Idempotency-Key header.
func (r *StepRun) IdempotencyKey() string { return r.Key.String() }

// BackoffFunc returns how long to wait before the next attempt, given the
// number of the attempt that just failed (1 for the first). A negative
// duration is taken as none: the next attempt is due at once.
type BackoffFunc func(attempt int) time.Duration

// ExponentialBackoff returns a BackoffFunc that doubles from initial up to
// maxDelay, with up to 20% random jitter either way.
func ExponentialBackoff(initial, maxDelay time.Duration) BackoffFunc {
	return func(attempt int) time.Duration {
		return lifecycle.Jitter(lifecycle.Exponential(initial, maxDelay, attempt), -0.2, 0.2)
	}
}

// DefaultBackoff is exponential from 1s to 5m with jitter.
var DefaultBackoff = ExponentialBackoff(BackoffInitialDefault, BackoffMaxDefault)

// RetryPolicy says how often, and how far apart, a step is attempted.
type RetryPolicy struct {
	// MaxAttempts counts every attempt, the first included; 1 means never
	// retry. Defaults to MaxAttemptsDefault; a negative value is refused by
	// [Engine.Register].
	MaxAttempts int
	// Backoff spaces the attempts. Defaults to DefaultBackoff.
	Backoff BackoffFunc
}

func (p *RetryPolicy) withDefaults() RetryPolicy {
	out := RetryPolicy{}
	if p != nil {
		out = *p
	}
	if out.MaxAttempts == 0 {
		out.MaxAttempts = MaxAttemptsDefault
	}
	if out.Backoff == nil {
		out.Backoff = DefaultBackoff
	}
	return out
}

// retryDelay is how long after failed attempt the next one is due: the
// policy's Backoff, or the delay the handler asked for with
// [steps.RetryAfter]. Steps and branches both retry by it. A negative delay
// (a BackoffFunc's, or a RetryAfterError built by hand) is none: taken
// as it was, it pulled the saga's rescue deadline back by as much, into
// the past, and the rescuer took a saga whose retry was on its way for
// stuck.
func (p RetryPolicy) retryDelay(attempt int, herr error) time.Duration {
	var ra *steps.RetryAfterError
	if errors.As(herr, &ra) {
		return max(ra.Delay, 0)
	}
	return max(p.Backoff(attempt), 0)
}

// Remote makes a step a call to another service (a participant, see
// package steps): instead of running an Action, the step sends a command to
// the service's topic and the saga waits for its reply, which arrives over
// Kafka. A successful reply completes the step; a failure reply, or no reply
// within the step's Timeout, fails it for good and the saga compensates (the
// rescuer notices a passed Timeout at its next run, up to
// Config.RescueInterval later). A
// remote compensation with no reply in time is sent again, under the same
// step key, until its CompensateRetry attempts are spent.
// Remote steps need an engine with Config.Kafka (the hybrid mode by default;
// KafkaConfig.NewReader lets the replies come over NATS or RabbitMQ, see
// package transport/natsbus and transport/rabbitbus).
type Remote[S any] struct {
	// Topic receives the service's commands. Required.
	Topic string
	// Type of the command message, which the participant routes on. Required.
	Type string
	// Command builds the command's payload, encoded as JSON. Required. After
	// a local step it runs at once, in that step's transaction, and its
	// command is written with the local step's success; its statements on
	// run.Tx see the local step's writes, commit with the send, and are
	// rolled back when it fails. An error fails the step as an Action's
	// would: retried, or for good. It runs as an Action does: ctx ends at
	// the step's Timeout (which also bounds the wait for the reply) and
	// with a cancel request, which is then applied in the step's place
	// (also when the Command returns a payload anyway: a cancel asked for
	// before it returned sends nothing); a Command that ignores its ctx
	// past Config.HandlerGrace is abandoned
	// with its worker's connection, and the attempt recorded (as the local
	// step's when it ran in that step's transaction, whose success is then
	// lost and runs again). Build the payload from the state: a slow
	// Command holds its worker's batch for as long as it runs.
	Command func(ctx context.Context, run *StepRun, state *S) (any, error)
	// OnReply, when set, applies a successful reply's result (JSON) to the
	// state. An error it returns, of any kind (steps.RetryAfter and plain
	// errors included), fails the step for good and the saga compensates:
	// the reply is consumed and not asked for again, so the step's Retry
	// does not apply (the step's compensation undoes the participant's
	// effect). Decide in OnReply only what the result itself settles.
	OnReply func(ctx context.Context, run *StepRun, state *S, result json.RawMessage) error
	// CompensateType, when set, makes the step's compensation remote too: a
	// command of this type goes to Topic with CompensateCommand's payload
	// (Command's when nil), and its reply is awaited.
	CompensateType    string
	CompensateCommand func(ctx context.Context, run *StepRun, state *S) (any, error)
}

// Step is one step of a saga over state S.
type Step[S any] struct {
	// Name identifies the step within its saga, in keys, history and
	// commands: letters, digits, '.', '-' and '_', at most 64 bytes.
	Name string
	// Action does the step's work. Required, unless Remote or Wait is set.
	Action StepFunc[S]
	// Remote, instead of Action, makes the step a call to another service.
	Remote *Remote[S]
	// Wait, instead of Action, makes the step wait: for a time, a signal
	// or a child saga (see [Wait]).
	Wait *Wait[S]
	// Parallel, instead of Action, makes the step a group of branches that
	// run at once and join when all have completed (see [Parallel]).
	Parallel *Parallel[S]
	// Compensate undoes Action after a later step failed for good, or after
	// the saga was cancelled. Optional: a step without one is skipped when
	// compensating.
	Compensate StepFunc[S]
	// Retry governs Action's attempts; nil means the defaults.
	Retry *RetryPolicy
	// CompensateRetry governs Compensate's attempts; nil means Retry.
	CompensateRetry *RetryPolicy
	// Timeout bounds one attempt (its context is cancelled then). An attempt
	// that runs out of time fails with code step_timeout and is retried like
	// any other failure. Defaults to StepTimeoutDefault. The Timeout
	// cancels the attempt's context; it does not undo a success: an attempt
	// that returns nil after it, its transaction intact, has completed the
	// step, and its writes commit (statements sent with the cancelled
	// context are not, or are cancelled on the server).
	//
	// A local step's transaction stays open while it runs, and PostgreSQL
	// ends a transaction left idle for longer than its largest setting,
	// 2^31-1 ms (about 24.8 days): a longer Timeout is kept (the step's
	// context and the saga's rescue deadline use it), but an attempt that
	// sits idle in its transaction for more than 24.8 days loses its
	// session and is attempted again, as after any lost session. A remote
	// step holds no transaction while its reply is awaited.
	Timeout time.Duration
	// Pivot marks the step after which the saga can no longer be undone
	// (the card is charged, the order is shipped): once it has completed,
	// no compensation runs, and what follows only goes forward. At most one
	// step of a saga is the pivot; it has no Compensate (it would never
	// run). See "Pivots" in the package documentation.
	Pivot bool
	// Retriable marks a step after the pivot: it is retried until it
	// succeeds, past Retry.MaxAttempts (with Retry's backoff, at most
	// Retry.MaxDelay apart), and never compensated. An error it returns as
	// permanent (steps.Permanent), a refusal of its remote call, or a state
	// that cannot be decoded ends the saga failed, for an operator to
	// resume; it is still not compensated. Every step after the pivot must
	// be Retriable, without Compensate.
	Retriable bool
	// PauseWhenExhausted pauses the saga for an operator when Action's
	// retries are spent (Retry.MaxAttempts attempts failed with errors that
	// are not permanent), instead of compensating; for a Retriable step,
	// instead of retrying on. The saga keeps its position and records the
	// last error; [Engine.Resume] runs the step again with its attempts
	// counted afresh. A permanent error still compensates (or, after the
	// pivot, fails the saga). See "Pause" in the package documentation.
	PauseWhenExhausted bool
}

// Definition is a typed saga: a name and ordered steps over the state S,
// which is stored as JSON between steps. Make one with [Define] and register
// it with [Engine.Register].
type Definition[S any] struct {
	name     string
	steps    []Step[S]
	deadline time.Duration
	// concurrency is the limit of running sagas per concurrency key
	// (concurrency.go); 0 for none.
	concurrency int
	// version is the definition's version (version.go); 0 means 1.
	version int
}

// WithDeadline gives every saga of d a deadline: a saga that has not ended
// d after its start is cancelled, with code [CodeDeadline], so that the
// steps it completed are compensated. A saga already compensating is left
// to finish. [StartOpts.Deadline] overrides it per saga. It returns d.
func (d *Definition[S]) WithDeadline(dur time.Duration) *Definition[S] {
	if d != nil {
		d.deadline = dur
	}
	return d
}

// Define returns a saga definition. Problems with it (an empty name, no
// steps, duplicate step names) are reported by [Engine.Register].
func Define[S any](name string, steps ...Step[S]) *Definition[S] {
	return &Definition[S]{name: name, steps: steps}
}

// Name returns the saga's name; "" for a nil definition.
func (d *Definition[S]) Name() string {
	if d == nil {
		return ""
	}
	return d.name
}

// AnyDefinition is a [Definition] of any state type, as the engine holds it.
type AnyDefinition interface {
	Name() string
	// Version is the definition's version (see [Definition.WithVersion]).
	Version() int
	compile() (*compiled, error)
}

// compiled is a definition as the executor uses it, without type parameters.
type compiled struct {
	name    string
	version int // at least 1
	steps   []compiledStep
	// pivot is the index of the pivot step, or -1.
	pivot    int
	byName   map[string]int
	deadline time.Duration
	// concurrency is the limit per concurrency key (concurrency.go).
	concurrency int
	owner       any // the *Definition[S] it came from
	// run decodes the state, runs step i in direction dir and encodes the
	// state again.
	run func(ctx context.Context, r *StepRun, i int, dir steps.Direction, state []byte) ([]byte, error)
	// send builds the command payload of remote step i in direction dir.
	send func(ctx context.Context, r *StepRun, i int, dir steps.Direction, state []byte) ([]byte, error)
	// reply applies a successful reply's result to the state.
	reply func(ctx context.Context, r *StepRun, i int, state []byte, result json.RawMessage) ([]byte, error)
}

type compiledStep struct {
	name           string
	hasCompensate  bool
	remoteTopic    string // set for a remote step
	remoteType     string // the forward command's type
	remoteCompType string // the compensation command's type, when it is remote
	retry          RetryPolicy
	compensateWith RetryPolicy
	timeout        time.Duration
	wait           *compiledWait     // set for a step that waits
	parallel       *compiledParallel // set for a parallel step
	retriable      bool              // after the pivot: retried until it succeeds, never compensated
	pauseExhausted bool              // pause the saga, not compensate, when its retries are spent
}

// remote reports whether step i runs in direction dir as a call to another
// service, and the command's topic and type.
func (c *compiled) remote(i int, dir steps.Direction) (topic, typ string, ok bool) {
	s := c.steps[i]
	switch {
	case s.remoteTopic == "":
		return "", "", false
	case dir == steps.Forward:
		return s.remoteTopic, s.remoteType, true
	case s.remoteCompType != "":
		return s.remoteTopic, s.remoteCompType, true
	}
	return "", "", false
}

func (c *compiled) hasRemote() bool {
	for _, s := range c.steps {
		if s.remoteTopic != "" {
			return true
		}
		if s.parallel != nil && s.parallel.hasRemote() {
			return true
		}
	}
	return false
}

func (c *compiled) policy(i int, dir steps.Direction) RetryPolicy {
	if dir == steps.Compensate {
		return c.steps[i].compensateWith
	}
	return c.steps[i].retry
}

// pastPivot reports whether step i comes after the pivot: the saga has
// committed to finishing, and only goes forward.
func (c *compiled) pastPivot(i int) bool { return c.pivot >= 0 && i > c.pivot }

// prevCompensable returns the highest step index <= i that has a
// compensation, or -1.
func (c *compiled) prevCompensable(i int) int {
	for ; i >= 0; i-- {
		if c.steps[i].hasCompensate {
			return i
		}
	}
	return -1
}

// checkPivot refuses, naming the step, what the pivot rule forbids for step
// i (s) of saga name, whose earlier steps c holds; it records the pivot.
// The rule: compensatable steps, then at most one pivot, then retriable
// steps, which are never compensated and cannot end the saga by
// compensating.
func checkPivot[S any](name string, c *compiled, i int, s *Step[S]) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: saga %q step %q: %s", ErrInvalidDefinition, name, s.Name, fmt.Sprintf(format, args...))
	}
	compensatable := s.Compensate != nil || (s.Remote != nil && s.Remote.CompensateType != "")
	switch {
	case s.Pivot && c.pivot >= 0:
		return bad("is a second pivot (step %q is the pivot): a saga has at most one", c.steps[c.pivot].name)
	case s.Pivot && s.Retriable:
		return bad("is both the pivot and Retriable: the steps after the pivot are the retriable ones")
	case s.Pivot && compensatable:
		return bad("is the pivot and has a compensation, which would never run: nothing is compensated once the pivot has completed")
	case s.Pivot:
		c.pivot = i
		return nil
	case c.pivot < 0 && s.Retriable:
		return bad("is Retriable but comes before any pivot: mark the step after which the saga cannot be undone with Pivot")
	case c.pivot < 0:
		return nil
	case compensatable:
		return bad("comes after the pivot %q and is compensatable: steps after the pivot are never compensated; "+
			"remove its compensation and mark it Retriable", c.steps[c.pivot].name)
	case !s.Retriable:
		return bad("comes after the pivot %q and is not marked Retriable: every step after the pivot is retried until it succeeds", c.steps[c.pivot].name)
	case s.Wait != nil && s.Wait.kind == store.WaitChild:
		return bad("waits for a child saga after the pivot %q: a child that fails would fail this step for good; start it before the pivot, "+
			"or from a retriable step's own code", c.steps[c.pivot].name)
	case s.Wait != nil && s.Wait.timeout > 0 && !s.Wait.goOn && s.Wait.onTimeout == nil:
		return bad("comes after the pivot %q and its wait's Timeout compensates: use TimeoutThen", c.steps[c.pivot].name)
	}
	return nil
}

// stateDecodeError means a saga's stored state does not decode into S.
type stateDecodeError struct{ err error }

func (e *stateDecodeError) Error() string { return "decode state: " + e.err.Error() }
func (e *stateDecodeError) Unwrap() error { return e.err }

func (d *Definition[S]) compile() (*compiled, error) {
	if d == nil {
		return nil, fmt.Errorf("%w: nil definition", ErrInvalidDefinition)
	}
	if !wire.ValidName(d.name) {
		return nil, fmt.Errorf("%w: saga name %q must be 1-64 letters, digits, '.', '-' or '_'", ErrInvalidDefinition, d.name)
	}
	if len(d.steps) == 0 {
		return nil, fmt.Errorf("%w: saga %q has no steps", ErrInvalidDefinition, d.name)
	}
	if err := checkConcurrencyLimit(d.name, d.concurrency); err != nil {
		return nil, err
	}
	if d.deadline < 0 {
		return nil, fmt.Errorf("%w: saga %q has a negative deadline", ErrInvalidDefinition, d.name)
	}
	if d.version < 0 || d.version > VersionMax {
		return nil, fmt.Errorf("%w: saga %q: version %d is outside 1..%d", ErrInvalidDefinition, d.name, d.version, VersionMax)
	}
	c := &compiled{name: d.name, version: max(d.version, 1), byName: make(map[string]int, len(d.steps)), owner: d, deadline: d.deadline, concurrency: d.concurrency,
		pivot: -1}
	encode := func(s *S) ([]byte, error) {
		out, err := json.Marshal(s)
		if err != nil {
			return nil, steps.Permanent(steps.WithCode(CodeStateEncode, fmt.Errorf("encode state: %w", err)))
		}
		return out, nil
	}
	for i, s := range d.steps {
		if !wire.ValidName(s.Name) {
			return nil, fmt.Errorf("%w: saga %q step %d: name %q must be 1-64 letters, digits, '.', '-' or '_'", ErrInvalidDefinition, d.name, i, s.Name)
		}
		if _, dup := c.byName[s.Name]; dup {
			return nil, fmt.Errorf("%w: saga %q has two steps named %q", ErrInvalidDefinition, d.name, s.Name)
		}
		kinds := 0
		for _, set := range []bool{s.Action != nil, s.Remote != nil, s.Wait != nil, s.Parallel != nil} {
			if set {
				kinds++
			}
		}
		switch {
		case kinds == 0:
			return nil, fmt.Errorf("%w: saga %q step %q has no Action", ErrInvalidDefinition, d.name, s.Name)
		case kinds > 1 && s.Parallel != nil:
			return nil, fmt.Errorf("%w: saga %q step %q has Parallel and an Action, Remote or Wait: its branches are its work", ErrInvalidDefinition, d.name, s.Name)
		case s.Parallel != nil && s.Compensate != nil:
			return nil, fmt.Errorf("%w: saga %q step %q has Parallel and Compensate: give each branch its Compensate", ErrInvalidDefinition, d.name, s.Name)
		case kinds > 1 && s.Wait != nil:
			return nil, fmt.Errorf("%w: saga %q step %q has a Wait and an Action or Remote: a step waits, or acts", ErrInvalidDefinition, d.name, s.Name)
		case s.Action != nil && s.Remote != nil:
			return nil, fmt.Errorf("%w: saga %q step %q has both an Action and a Remote", ErrInvalidDefinition, d.name, s.Name)
		case s.Remote != nil && (s.Remote.Topic == "" || s.Remote.Type == "" || s.Remote.Command == nil):
			return nil, fmt.Errorf("%w: saga %q step %q: Remote needs Topic, Type and Command", ErrInvalidDefinition, d.name, s.Name)
		case s.Remote != nil && s.Remote.CompensateType != "" && s.Compensate != nil:
			return nil, fmt.Errorf("%w: saga %q step %q has both a Compensate and a Remote.CompensateType", ErrInvalidDefinition, d.name, s.Name)
		}
		if s.Timeout < 0 {
			return nil, fmt.Errorf("%w: saga %q step %q has a negative Timeout", ErrInvalidDefinition, d.name, s.Name)
		}
		for _, p := range []struct {
			field  string
			policy *RetryPolicy
		}{{"Retry", s.Retry}, {"CompensateRetry", s.CompensateRetry}} {
			if p.policy != nil && p.policy.MaxAttempts < 0 {
				return nil, fmt.Errorf("%w: saga %q step %q: %s.MaxAttempts is %d; it counts attempts, the first included "+
					"(0 for the default, %d; 1 for no retry)", ErrInvalidDefinition, d.name, s.Name, p.field, p.policy.MaxAttempts, MaxAttemptsDefault)
			}
		}
		c.byName[s.Name] = i
		retry := s.Retry.withDefaults()
		comp := retry
		if s.CompensateRetry != nil {
			comp = s.CompensateRetry.withDefaults()
		}
		timeout := s.Timeout
		if timeout == 0 {
			timeout = StepTimeoutDefault
		}
		if err := checkPivot(d.name, c, i, &s); err != nil {
			return nil, err
		}
		cs := compiledStep{name: s.Name, hasCompensate: s.Compensate != nil, retry: retry, compensateWith: comp, timeout: timeout,
			retriable: s.Retriable, pauseExhausted: s.PauseWhenExhausted}
		if s.Remote != nil {
			cs.remoteTopic, cs.remoteType, cs.remoteCompType = s.Remote.Topic, s.Remote.Type, s.Remote.CompensateType
			cs.hasCompensate = cs.hasCompensate || s.Remote.CompensateType != ""
		}
		if s.Parallel != nil {
			if s.Pivot || c.pivot >= 0 {
				return nil, fmt.Errorf("%w: saga %q step %q: a parallel step cannot be the pivot or come after it", ErrInvalidDefinition, d.name, s.Name)
			}
			g, err := compileParallel(d.name, s.Name, s.Parallel)
			if err != nil {
				return nil, err
			}
			cs.parallel, cs.hasCompensate = g, g.hasCompensate()
		}
		if s.Wait != nil {
			w, err := compileWait(d.name, s.Name, s.Wait, encode)
			if err != nil {
				return nil, err
			}
			cs.wait = w
		}
		c.steps = append(c.steps, cs)
	}
	c.send = func(ctx context.Context, r *StepRun, i int, dir steps.Direction, raw []byte) ([]byte, error) {
		var state S
		if err := json.Unmarshal(raw, &state); err != nil {
			return nil, &stateDecodeError{err: err}
		}
		rm := d.steps[i].Remote
		build := rm.Command
		if dir == steps.Compensate && rm.CompensateCommand != nil {
			build = rm.CompensateCommand
		}
		v, err := build(ctx, r, &state)
		if err != nil {
			return nil, err
		}
		out, err := json.Marshal(v)
		if err != nil {
			return nil, steps.Permanent(fmt.Errorf("encode command of step %q: %w", d.steps[i].Name, err))
		}
		return out, nil
	}
	c.reply = func(ctx context.Context, r *StepRun, i int, raw []byte, result json.RawMessage) ([]byte, error) {
		var state S
		if err := json.Unmarshal(raw, &state); err != nil {
			return nil, &stateDecodeError{err: err}
		}
		if f := d.steps[i].Remote.OnReply; f != nil && r.Direction == steps.Forward {
			if err := f(ctx, r, &state, result); err != nil {
				return nil, err
			}
		}
		out, err := json.Marshal(&state)
		if err != nil {
			return nil, steps.Permanent(steps.WithCode(CodeStateEncode, fmt.Errorf("encode state: %w", err)))
		}
		return out, nil
	}
	c.run = func(ctx context.Context, r *StepRun, i int, dir steps.Direction, raw []byte) ([]byte, error) {
		var state S
		if err := json.Unmarshal(raw, &state); err != nil {
			return nil, &stateDecodeError{err: err}
		}
		if p := d.steps[i].Parallel; p != nil {
			if err := p.compensate(ctx, r, state); err != nil {
				return nil, err
			}
			return raw, nil
		}
		fn := d.steps[i].Action
		if dir == steps.Compensate {
			fn = d.steps[i].Compensate
		}
		if err := fn(ctx, r, &state); err != nil {
			return nil, err
		}
		out, err := json.Marshal(&state)
		if err != nil {
			return nil, steps.Permanent(steps.WithCode(CodeStateEncode, fmt.Errorf("encode state: %w", err)))
		}
		return out, nil
	}
	return c, nil
}
