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

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// Parallel is a step whose branches run at once, each as its own step with
// its own step-scoped key ("<step>.<branch>"), attempts and compensation,
// and which completes when every branch has completed (see "Parallel
// steps" in the package documentation).
//
// Branches cannot overwrite each other: each gets the saga's state as it was
// when the group started, by value, and returns a result instead of changing
// the state; Join applies the results to the state once all have completed.
type Parallel[S any] struct {
	// Branches run at once. At least one; names unique within the step.
	Branches []Branch[S]
	// Join, when set, applies the branches' results (by branch name, as
	// JSON) to the state, in the transaction of the last branch to
	// complete. An error from Join fails the group for good: the completed
	// branches are compensated.
	Join func(ctx context.Context, run *StepRun, state *S, results map[string]json.RawMessage) error
}

// Branch is one branch of a [Parallel] step.
type Branch[S any] struct {
	// Name identifies the branch within its step: letters, digits, '.',
	// '-' and '_'; with the step's name and a '.', at most 64 bytes.
	Name string
	// Action does the branch's work in its own transaction (run.Tx), given
	// the state as the group started. Its result (nil for none) is encoded
	// as JSON for Join and Compensate. Required, unless Remote is set.
	Action func(ctx context.Context, run *StepRun, state S) (any, error)
	// Remote, instead of Action, makes the branch a call to another
	// service: its command goes to the participant when the group starts,
	// and the participant's reply completes the branch (its result is the
	// branch's result) or, refused, fails it for good. No reply within
	// Timeout fails the branch for good, and the group compensates it too
	// (Compensate gets a null result), since the participant may have acted.
	Remote *RemoteBranch[S]
	// Compensate undoes Action, given its result, when the group fails (a
	// branch or the join failed for good) or a later step fails for good,
	// or the saga is cancelled. Optional.
	Compensate func(ctx context.Context, run *StepRun, state S, result json.RawMessage) error
	// Retry governs Action's attempts; nil means the defaults. A branch
	// whose attempts are spent, or that fails with a permanent error, fails
	// the group.
	Retry *RetryPolicy
	// Timeout bounds one attempt. Defaults to StepTimeoutDefault.
	Timeout time.Duration
}

// RemoteBranch is a branch that calls another service (see [Branch].Remote),
// as a [Remote] step does. Its compensation is the branch's Compensate,
// which runs locally: to undo the participant's work, it writes a command
// for the participant in its transaction (package outbox).
type RemoteBranch[S any] struct {
	// Topic receives the command; Type is the command's type, which the
	// participant routes on. Required.
	Topic, Type string
	// Command builds the command's payload, encoded as JSON. Required.
	Command func(ctx context.Context, run *StepRun, state S) (any, error)
}

// History events of parallel steps.
const (
	// EventBranchesStarted: the saga entered a parallel step; Detail lists
	// the branches that run. Each branch then records step_completed or
	// step_failed under the step name "<step>.<branch>".
	EventBranchesStarted = "branches_started"
)

// branchType is the outbox type of a branch's command.
const branchType = wire.TypeBranch

// compiledParallel is a parallel step as the executor uses it.
type compiledParallel struct {
	branches []compiledBranch
	// run runs branch i on the encoded state and returns its encoded
	// result.
	run func(ctx context.Context, r *StepRun, i int, state []byte) ([]byte, error)
	// command builds remote branch i's command payload.
	command func(ctx context.Context, r *StepRun, i int, state []byte) ([]byte, error)
	// join applies the results to the encoded state.
	join func(ctx context.Context, r *StepRun, state []byte, results map[string]json.RawMessage) ([]byte, error)
}

type compiledBranch struct {
	name          string
	remoteTopic   string // set for a remote branch
	remoteType    string
	retry         RetryPolicy
	timeout       time.Duration
	hasCompensate bool
}

// branchResult is a completed branch, for the group's compensation.
type branchResult struct {
	index  int
	result json.RawMessage
}

func (p *compiledParallel) hasCompensate() bool {
	return slices.ContainsFunc(p.branches, func(b compiledBranch) bool { return b.hasCompensate })
}

func (p *compiledParallel) hasRemote() bool {
	return slices.ContainsFunc(p.branches, func(b compiledBranch) bool { return b.remoteTopic != "" })
}

func (p *compiledParallel) index(name string) int {
	return slices.IndexFunc(p.branches, func(b compiledBranch) bool { return b.name == name })
}

func (p *compiledParallel) names() []string {
	out := make([]string, len(p.branches))
	for i, b := range p.branches {
		out[i] = b.name
	}
	return out
}

func compileParallel[S any](saga, step string, p *Parallel[S]) (*compiledParallel, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: saga %q step %q: %s", ErrInvalidDefinition, saga, step, fmt.Sprintf(format, args...))
	}
	if len(p.Branches) == 0 {
		return nil, bad("Parallel has no branches")
	}
	c := &compiledParallel{}
	for i, b := range p.Branches {
		if !wire.ValidName(b.Name) || !wire.ValidName(step+"."+b.Name) {
			return nil, bad("branch %d: name %q must be letters, digits, '.', '-' or '_', and %q at most 64 bytes", i, b.Name, step+"."+b.Name)
		}
		if c.index(b.Name) >= 0 {
			return nil, bad("two branches named %q", b.Name)
		}
		switch {
		case b.Action == nil && b.Remote == nil:
			return nil, bad("branch %q has no Action", b.Name)
		case b.Action != nil && b.Remote != nil:
			return nil, bad("branch %q has both an Action and a Remote", b.Name)
		case b.Remote != nil && (b.Remote.Topic == "" || b.Remote.Type == "" || b.Remote.Command == nil):
			return nil, bad("branch %q: Remote needs Topic, Type and Command", b.Name)
		}
		if b.Timeout < 0 {
			return nil, bad("branch %q has a negative Timeout", b.Name)
		}
		if b.Retry != nil && b.Retry.MaxAttempts < 0 {
			return nil, bad("branch %q: Retry.MaxAttempts is negative", b.Name)
		}
		timeout := b.Timeout
		if timeout == 0 {
			timeout = StepTimeoutDefault
		}
		cb := compiledBranch{name: b.Name, retry: b.Retry.withDefaults(), timeout: timeout, hasCompensate: b.Compensate != nil}
		if b.Remote != nil {
			cb.remoteTopic, cb.remoteType = b.Remote.Topic, b.Remote.Type
		}
		c.branches = append(c.branches, cb)
	}
	decode := func(raw []byte) (S, error) {
		var s S
		if err := json.Unmarshal(raw, &s); err != nil {
			return s, &stateDecodeError{err: err}
		}
		return s, nil
	}
	c.run = func(ctx context.Context, r *StepRun, i int, raw []byte) ([]byte, error) {
		s, err := decode(raw)
		if err != nil {
			return nil, err
		}
		v, err := p.Branches[i].Action(ctx, r, s)
		if err != nil {
			return nil, err
		}
		out, err := json.Marshal(v)
		if err != nil {
			return nil, steps.Permanent(steps.WithCode(CodeStateEncode, fmt.Errorf("encode the result of branch %q: %w", p.Branches[i].Name, err)))
		}
		return out, nil
	}
	c.command = func(ctx context.Context, r *StepRun, i int, raw []byte) ([]byte, error) {
		s, err := decode(raw)
		if err != nil {
			return nil, err
		}
		v, err := p.Branches[i].Remote.Command(ctx, r, s)
		if err != nil {
			return nil, err
		}
		out, err := json.Marshal(v)
		if err != nil {
			return nil, steps.Permanent(fmt.Errorf("encode the command of branch %q: %w", p.Branches[i].Name, err))
		}
		return out, nil
	}
	c.join = func(ctx context.Context, r *StepRun, raw []byte, results map[string]json.RawMessage) ([]byte, error) {
		if p.Join == nil {
			return nil, nil // the state is as it was
		}
		s, err := decode(raw)
		if err != nil {
			return nil, err
		}
		if err := p.Join(ctx, r, &s, results); err != nil {
			return nil, err
		}
		out, err := json.Marshal(&s)
		if err != nil {
			return nil, steps.Permanent(steps.WithCode(CodeStateEncode, fmt.Errorf("encode state: %w", err)))
		}
		return out, nil
	}
	return c, nil
}

// compensate undoes the group's completed branches (r.group), the last in
// the definition's order first, in the compensation's transaction.
func (p *Parallel[S]) compensate(ctx context.Context, r *StepRun, s S) error {
	for i := len(r.group) - 1; i >= 0; i-- {
		br := r.group[i]
		if f := p.Branches[br.index].Compensate; f != nil {
			if err := f(ctx, r, s, br.result); err != nil {
				return fmt.Errorf("compensate branch %q: %w", p.Branches[br.index].Name, err)
			}
		}
	}
	return nil
}

// branchTopic is the direct topic of branch commands: workers claim them
// one at a time, so that the branches of one saga run on several workers at
// once.
func (e *Engine) branchTopic() string { return e.cfg.CommandTopic + ".branches" }

// branchMessage is the command of branch of sg's parallel step, written
// when sg is at version (its next version, for the transition that enters
// the group), due after delay.
func (e *Engine) branchMessage(sg *store.Saga, step, branch string, version int64, delay time.Duration) store.Message {
	c := wire.Command{SagaID: wire.UUID(sg.ID), Saga: sg.Name, Step: step + "." + branch, Direction: steps.Forward,
		Epoch: sg.Epoch, Version: version}
	m := e.engineMessage(c, sg.DefVersion, branchType)
	m.Topic, m.Delivery = e.branchTopic(), store.DeliveryDirect
	key := c.Key().String()
	m.Headers[wire.HeaderStepKey] = key
	m.StepKey, m.Delay = &key, delay
	e.sign(&m)
	return m
}

// enterGroup starts the branches of parallel step idx of sg: the saga waits
// for them, with one command per branch that has not completed in this
// epoch; when every branch completed before (a resumed saga), it joins at
// once.
func (b *batch) enterGroup(ctx context.Context, sg *store.Saga, def *compiled, idx int, sp string, last bool) error {
	e := b.e
	p := def.steps[idx].parallel
	if err := b.tx.flush(); err != nil {
		return err
	}
	rows, err := e.st.Branches(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName)
	if err != nil {
		return err
	}
	var run []string
	for _, name := range p.names() {
		if !slices.ContainsFunc(rows, func(r store.Branch) bool { return r.Name == name && r.Status == store.BranchCompleted }) {
			run = append(run, name)
		}
	}
	if len(run) == 0 {
		return b.join(ctx, sg, def, idx, sp, last, time.Now())
	}
	tr := transitionFrom(sg)
	tr.WaitKind, tr.WaitFor, tr.SetWaitUntil, tr.WaitDelay = store.WaitBranches, "", true, -1
	tr.EnterGroup = &store.GroupEntry{Step: sg.StepName, Branches: run}
	detail, _ := json.Marshal(map[string]any{"branches": run})
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventBranchesStarted, StepName: sg.StepName,
		Direction: string(steps.Forward), Epoch: sg.Epoch, Detail: detail}}
	for _, name := range run {
		br := p.branches[p.index(name)]
		if br.remoteTopic == "" {
			tr.Messages = append(tr.Messages, e.branchMessage(sg, sg.StepName, name, sg.Version+1, 0))
			continue
		}
		// A remote branch: its command to the participant, and its
		// timeout, a branch command due when the reply is late.
		m, err := b.remoteBranchCommand(ctx, sg, p, name)
		if err != nil {
			d := e.machine.groupFailed(sg, def, idx, sg.StepName+"."+name, 1, steps.Permanent(err), 0)
			b.tx.write(sg, e.transition(sg, d), sp, true, last, nil, func() { b.tx.stats.failed.Add(1) })
			return nil
		}
		tr.Messages = append(tr.Messages, m, e.branchMessage(sg, sg.StepName, name, sg.Version+1, br.timeout))
	}
	stampAll(tr, sg.TraceContext)
	b.announce += len(run) - 1 // one wake-up per branch, so that they start on several workers
	b.tx.write(sg, tr, sp, false, last, nil, nil)
	return nil
}

// branch runs one branch's command: the branch's Action in its own
// savepoint; then, under the saga's row lock, its row is ended (or its
// retry written), and the last branch to complete joins the group, or a
// branch that failed for good fails it.
func (b *batch) branch(ctx context.Context, c *store.Claimed, cmd command, ls *store.LockedSaga, def *compiled, last bool) error {
	e := b.e
	b.delivered = append(b.delivered, c.ID)
	idx, ok := def.byName[ls.StepName]
	name, isBranch := strings.CutPrefix(cmd.Step, ls.StepName+".")
	if !ok || !isBranch || def.steps[idx].parallel == nil || ls.Direction != string(steps.Forward) ||
		Status(ls.Status) != StatusRunning || cmd.Epoch != ls.Epoch || deref(ls.WaitKind) != store.WaitBranches {
		b.tx.stats.stale.Add(1)
		return nil
	}
	p := def.steps[idx].parallel
	bi := p.index(name)
	if bi < 0 {
		b.tx.stats.stale.Add(1)
		return nil
	}
	if err := b.tx.flush(); err != nil {
		return err
	}
	rows, err := e.st.Branches(ctx, b.tx.tx, ls.ID, ls.Epoch, ls.StepName)
	if err != nil {
		return err
	}
	i := slices.IndexFunc(rows, func(r store.Branch) bool { return r.Name == name })
	if i < 0 || rows[i].Status != store.BranchRunning {
		b.tx.stats.stale.Add(1) // completed, failed or cancelled: a duplicate or a late copy
		return nil
	}
	sp := b.tx.savepoint()
	if err := b.tx.flush(); err != nil { // the savepoint exists before anything is rolled back to it
		return err
	}
	if p.branches[bi].remoteTopic != "" {
		// A remote branch's command is its timeout: no reply came in time.
		sg, ok, err := b.lockGroup(ctx, ls)
		if err != nil || !ok {
			return err
		}
		herr := steps.Permanent(steps.WithCode(CodeReplyTimeout, fmt.Errorf("no reply from %s within the branch's Timeout (%s)",
			p.branches[bi].remoteTopic, p.branches[bi].timeout)))
		return b.branchFailed(ctx, sg, def, idx, bi, rows[i].Attempt+1, herr, p.branches[bi].timeout, sp, last)
	}
	attempt := rows[i].Attempt + 1
	key := steps.Key{SagaID: ls.ID, Step: cmd.Step, Direction: steps.Forward, Epoch: ls.Epoch}
	run := &StepRun{Tx: b.tx.step(), Key: key, SagaID: ls.ID, SagaName: ls.Name, BusinessKey: deref(ls.BusinessKey),
		Step: cmd.Step, Direction: steps.Forward, Epoch: ls.Epoch, Attempt: attempt}
	started := time.Now()
	result, herr := e.callHandler(ctx, b.tx, run, false, p.branches[bi].timeout, func(ctx context.Context) ([]byte, error) {
		return p.run(ctx, run, bi, ls.State)
	})
	fault.At(ctx, fault.EngineAfterHandler)
	var ab *abandonedError
	if errors.As(herr, &ab) {
		return errAbandoned // the transaction is lost; the command runs again
	}
	elapsed := time.Since(started)
	if herr == nil && len(result) > e.cfg.MaxStateBytes {
		herr = steps.Permanent(steps.WithCode(CodeTooLarge, fmt.Errorf("branch %q returned %d bytes, more than MaxStateBytes", name, len(result))))
	}
	if herr != nil {
		// The attempt's writes go first: the handler may have left the
		// transaction unusable.
		if _, err := b.tx.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp); err != nil {
			return err
		}
	}
	// Under the saga's row lock from here: the branches of one saga end one
	// at a time, so the last sees every other.
	sg, ok, err := b.lockGroup(ctx, ls)
	if err != nil {
		return err
	}
	if !ok {
		// The group ended (failed, or the saga was cancelled) while the
		// branch ran: its effects are rolled back.
		_, err := b.tx.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp)
		return err
	}
	if herr != nil {
		return b.branchFailed(ctx, sg, def, idx, bi, attempt, herr, elapsed, sp, last)
	}
	return b.branchCompleted(ctx, sg, def, idx, name, key, attempt, result, elapsed, sp, last)
}

// branchCompleted ends branch name of sg's parallel step idx with its
// result, under the saga's row lock, and joins the group when it was the
// last to complete.
func (b *batch) branchCompleted(ctx context.Context, sg *store.Saga, def *compiled, idx int, name string, key steps.Key, attempt int,
	result []byte, elapsed time.Duration, sp string, last bool) error {
	e := b.e
	ended, err := e.st.EndBranch(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName, name, store.BranchCompleted, attempt, result, nil, nil)
	if err != nil {
		return err
	}
	if !ended {
		if _, err := b.tx.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp); err != nil {
			return err
		}
		b.tx.stats.stale.Add(1)
		return nil
	}
	if _, err := e.st.InsertInboxKey(ctx, b.tx.tx, store.InboxConsumerEngine, key.String()); err != nil {
		return err
	}
	if err := e.st.InsertHistory(ctx, b.tx.tx, &store.HistoryEntry{SagaID: sg.ID, Event: EventStepCompleted, StepName: key.Step,
		Direction: string(steps.Forward), Epoch: sg.Epoch, Attempt: attempt, Detail: durationDetail(elapsed, nil)}); err != nil {
		return err
	}
	b.tx.stats.succeeded.Add(1)
	fault.At(ctx, fault.EngineBranchCompleted)
	rows, err := e.st.Branches(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName)
	if err != nil {
		return err
	}
	if slices.ContainsFunc(rows, func(r store.Branch) bool { return r.Status != store.BranchCompleted }) {
		return nil // others still run
	}
	return b.join(ctx, sg, def, idx, b.tx.savepoint(), last, time.Now().Add(-elapsed))
}

// join completes parallel step idx of sg, whose branches all completed:
// Join applies their results, and the saga moves on, or, when Join fails,
// the group fails.
func (b *batch) join(ctx context.Context, sg *store.Saga, def *compiled, idx int, sp string, last bool, started time.Time) error {
	e := b.e
	p := def.steps[idx].parallel
	rows, err := e.st.Branches(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName)
	if err != nil {
		return err
	}
	results := make(map[string]json.RawMessage, len(rows))
	for _, r := range rows {
		results[r.Name] = r.Result
	}
	key := steps.Key{SagaID: sg.ID, Step: sg.StepName, Direction: steps.Forward, Epoch: sg.Epoch}
	run := b.stepRun(sg, key, steps.Forward, sg.Attempt+1)
	newState, herr := recovered(func() ([]byte, error) { return p.join(ctx, run, sg.State, results) })
	if herr == nil && newState != nil {
		herr = e.machine.checkState(sg.StepName, newState)
	}
	if herr != nil {
		d := e.machine.groupFailed(sg, def, idx, sg.StepName, sg.Attempt+1, steps.Permanent(herr), time.Since(started))
		b.tx.write(sg, e.transition(sg, d), sp, true, last, nil, func() { b.tx.stats.failed.Add(1) })
		return nil
	}
	d := e.machine.success(sg, def, idx, steps.Forward, newState, time.Since(started), key.String())
	b.tx.write(sg, e.transition(sg, d), sp, false, last, nil, func() { b.tx.stats.succeeded.Add(1) })
	return nil
}

// branchFailed writes the failed attempt of branch bi of sg's parallel step
// idx: a retry of the branch alone, or, when it failed for good, the
// group's failure.
func (b *batch) branchFailed(ctx context.Context, sg *store.Saga, def *compiled, idx, bi, attempt int, herr error,
	elapsed time.Duration, sp string, last bool) error {
	e := b.e
	br := def.steps[idx].parallel.branches[bi]
	step := sg.StepName + "." + br.name
	if _, err := b.tx.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp); err != nil {
		return err // the attempt's writes go; what follows records the failure
	}
	code := safetext.Text(steps.Code(herr), maxCodeBytes)
	if code == "" {
		code = CodeError
		if _, ok := herr.(*panicError); ok {
			code = CodePanic
		}
	}
	msg := safetext.Text(errorMessage(herr), 4000)
	b.tx.stats.failed.Add(1)
	if !steps.IsPermanent(herr) && attempt < br.retry.MaxAttempts {
		// As a step's, so that a steps.RetryAfter is honoured (found by
		// review11: a branch was retried after its backoff).
		delay := br.retry.retryDelay(attempt, herr)
		if err := e.st.BranchAttempt(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName, br.name, attempt, msg, code); err != nil {
			return err
		}
		detail := durationDetail(elapsed, map[string]any{"retry_in_ms": delay.Milliseconds()})
		if err := e.st.InsertHistory(ctx, b.tx.tx, &store.HistoryEntry{SagaID: sg.ID, Event: EventStepFailed, StepName: step,
			Direction: string(steps.Forward), Epoch: sg.Epoch, Attempt: attempt, Error: msg, ErrorCode: code, Detail: detail}); err != nil {
			return err
		}
		m := e.branchMessage(sg, sg.StepName, br.name, sg.Version, delay)
		b.tx.stats.retries.Add(1)
		return e.st.InsertMessage(ctx, b.tx.tx, &m)
	}
	if _, err := e.st.EndBranch(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName, br.name, store.BranchFailed, attempt, nil, &msg, &code); err != nil {
		return err
	}
	d := e.machine.groupFailed(sg, def, idx, step, attempt, herr, elapsed)
	b.tx.write(sg, e.transition(sg, d), b.tx.savepoint(), true, last, nil, nil)
	return nil
}

// groupFailed is the decision after parallel step idx of sg failed for good
// (its branch step failed, or its join): the branches still running are
// cancelled, and the saga compensates from the group itself (its completed
// branches), then the steps before it.
func (m machine) groupFailed(sg *store.Saga, def *compiled, idx int, step string, attempt int, herr error, elapsed time.Duration) decision {
	code := safetext.Text(steps.Code(herr), maxCodeBytes)
	if code == "" {
		code = CodeError
	}
	msg := safetext.Text(errorMessage(herr), 4000)
	d := decision{tr: transitionFrom(sg)}
	tr := d.tr
	tr.History = append(tr.History, store.HistoryEntry{SagaID: sg.ID, Event: EventStepFailed, StepName: step,
		Direction: string(steps.Forward), Epoch: sg.Epoch, Attempt: attempt, Error: msg, ErrorCode: code,
		Detail: durationDetail(elapsed, map[string]any{"final": true})})
	tr.LastError, tr.LastErrorCode, tr.FailedStep = &msg, &code, &step
	tr.CancelBranches = sg.StepName
	m.startCompensation(&d, sg, def, idx)
	return d
}

// groupResults reads the completed branches of sg's parallel step idx, in
// the definition's order, for its compensation.
func (b *batch) groupResults(ctx context.Context, sg *store.Saga, def *compiled, idx int) ([]branchResult, error) {
	if err := b.tx.flush(); err != nil {
		return nil, err
	}
	rows, err := b.e.st.Branches(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName)
	if err != nil {
		return nil, err
	}
	var out []branchResult
	for i, name := range def.steps[idx].parallel.names() {
		for _, r := range rows {
			switch {
			case r.Name != name:
			case r.Status == store.BranchCompleted:
				out = append(out, branchResult{index: i, result: r.Result})
			case r.Status == store.BranchFailed && deref(r.ErrorCode) == CodeReplyTimeout:
				// No reply came: the participant may have acted.
				out = append(out, branchResult{index: i, result: json.RawMessage("null")})
			}
		}
	}
	return out, nil
}

// BranchInfo is one branch of a parallel step, as [Engine.Branches] returns
// it.
type BranchInfo struct {
	Step      string          `json:"step"`
	Branch    string          `json:"branch"`
	Epoch     int             `json:"epoch"`
	Status    string          `json:"status"` // running, completed, failed, cancelled
	Attempts  int             `json:"attempts"`
	Result    json.RawMessage `json:"result,omitempty"`
	LastError *ErrorInfo      `json:"last_error,omitempty"`
	StartedAt time.Time       `json:"started_at"`
	EndedAt   *time.Time      `json:"ended_at,omitempty"`
}

// Branches returns the branches of saga id's parallel steps, every epoch.
func (e *Engine) Branches(ctx context.Context, id uuid.UUID) ([]BranchInfo, error) {
	if err := e.ready("Engine.Branches"); err != nil {
		return nil, err
	}
	rows, err := e.st.SagaBranches(ctx, e.pool, id)
	if err != nil {
		return nil, fmt.Errorf("saga: branches of %s: %w", id, err)
	}
	out := make([]BranchInfo, 0, len(rows))
	for _, r := range rows {
		bi := BranchInfo{Step: r.Step, Branch: r.Name, Epoch: r.Epoch, Status: r.Status, Attempts: r.Attempt, StartedAt: r.StartedAt,
			EndedAt: r.EndedAt}
		if json.Valid(r.Result) {
			bi.Result = r.Result
		}
		if r.LastError != nil {
			bi.LastError = &ErrorInfo{Message: *r.LastError, Code: deref(r.ErrorCode)}
		}
		out = append(out, bi)
	}
	return out, nil
}

func (c *compiled) hasParallel() bool {
	return slices.ContainsFunc(c.steps, func(s compiledStep) bool { return s.parallel != nil })
}

// remoteBranchCommand builds the command of remote branch name of sg's
// parallel step p, for its participant.
func (b *batch) remoteBranchCommand(ctx context.Context, sg *store.Saga, p *compiledParallel, name string) (store.Message, error) {
	bi := p.index(name)
	br := p.branches[bi]
	key := steps.Key{SagaID: sg.ID, Step: sg.StepName + "." + name, Direction: steps.Forward, Epoch: sg.Epoch}
	run := &StepRun{Tx: b.tx.step(), Key: key, SagaID: sg.ID, SagaName: sg.Name, BusinessKey: deref(sg.BusinessKey),
		Step: key.Step, Direction: steps.Forward, Epoch: sg.Epoch, Attempt: 1}
	payload, err := recovered(func() ([]byte, error) { return p.command(ctx, run, bi, sg.State) })
	if err != nil {
		return store.Message{}, err
	}
	return b.e.remoteCommand(sg, key, br.remoteTopic, br.remoteType, payload)
}

// lockGroup takes the saga's row lock, under which a group's branches end
// one at a time, and reports whether the saga is still in the group ls
// was in (same step, epoch, running, waiting for its branches).
func (b *batch) lockGroup(ctx context.Context, ls *store.LockedSaga) (*store.Saga, bool, error) {
	if err := b.tx.flush(); err != nil {
		return nil, false, err
	}
	sg, err := b.e.st.GetSaga(ctx, b.tx.tx, ls.ID, true)
	if err != nil {
		return nil, false, err
	}
	if Status(sg.Status) != StatusRunning || sg.StepName != ls.StepName || sg.Epoch != ls.Epoch ||
		sg.Direction != string(steps.Forward) || deref(sg.WaitKind) != store.WaitBranches {
		b.tx.stats.stale.Add(1)
		return sg, false, nil
	}
	return sg, true, nil
}

// branchReply applies a participant's reply to a remote branch of the
// saga's parallel step: the branch completes with the reply's result, or,
// refused, fails for good (and with it the group).
func (b *batch) branchReply(ctx context.Context, c *store.Claimed, ls *store.LockedSaga, def *compiled, idx int, key steps.Key, last bool) error {
	e := b.e
	p := def.steps[idx].parallel
	name := strings.TrimPrefix(key.Step, ls.StepName+".")
	bi := p.index(name)
	if bi < 0 || p.branches[bi].remoteTopic == "" || key.Direction != steps.Forward || key.Epoch != ls.Epoch {
		b.tx.stats.stale.Add(1)
		return nil
	}
	r, err := wire.DecodeReply(c.Payload)
	if err != nil {
		return b.park(ctx, c, &ls.ID, CodeMalformed, "malformed reply: "+err.Error())
	}
	sg, ok, err := b.lockGroup(ctx, ls)
	if err != nil || !ok {
		return err
	}
	rows, err := e.st.Branches(ctx, b.tx.tx, sg.ID, sg.Epoch, sg.StepName)
	if err != nil {
		return err
	}
	i := slices.IndexFunc(rows, func(r store.Branch) bool { return r.Name == name })
	if i < 0 || rows[i].Status != store.BranchRunning {
		b.tx.stats.stale.Add(1) // a duplicate, or a reply after the timeout
		return nil
	}
	sp := b.tx.savepoint()
	if err := b.tx.flush(); err != nil {
		return err
	}
	attempt := rows[i].Attempt + 1
	if !r.OK {
		code := r.Code
		if code == "" {
			code = CodeRefused
		}
		herr := steps.Permanent(steps.WithCode(code, fmt.Errorf("%s", r.Error)))
		return b.branchFailed(ctx, sg, def, idx, bi, attempt, herr, 0, sp, last)
	}
	result := []byte(r.Result)
	if len(result) == 0 {
		result = []byte("null")
	}
	return b.branchCompleted(ctx, sg, def, idx, name, key, attempt, result, 0, sp, last)
}

// branchRescue is what the rescuer does with a branch whose command was
// lost (see [machine.rescueBranch]).
type branchRescue struct {
	// resend: the branch's command goes again under the same key, due
	// after delay; attempt is the attempt to record first (0 for none).
	resend  bool
	delay   time.Duration
	attempt int
	reason  string
	// failed, when resend is false: the branch's attempts are spent, and
	// the group fails with this decision.
	failed decision
}

// rescueBranch decides what to do with branch bi of sg's parallel step idx,
// whose command was lost (deleted, or parked as dead) while the branch ran,
// lb.Age after the group started it.
//
// A local branch's command goes again, counting the lost attempt (it may
// have run before it was lost), or, with its attempts spent, the group fails
// as when its last attempt failed. A remote branch's command is its
// timeout: it goes again, due when the timeout would have fired, so that a
// reply still completes the branch and no reply still fails it.
func (m machine) rescueBranch(sg *store.Saga, def *compiled, idx, bi int, lb store.LostBranch) branchRescue {
	br := def.steps[idx].parallel.branches[bi]
	if br.remoteTopic != "" {
		return branchRescue{resend: true, delay: max(br.timeout-lb.Age, 0),
			reason: fmt.Sprintf("the timeout of remote branch %q was lost; it is due again when the branch's Timeout (%s) has passed", br.name, br.timeout)}
	}
	attempt := lb.Attempt + 1
	reason := fmt.Sprintf("the command of branch %q was deleted or parked while the branch ran; attempt %d is counted as spent", br.name, attempt)
	if attempt < br.retry.MaxAttempts {
		return branchRescue{resend: true, attempt: attempt, reason: reason + "; the command goes again under the same key"}
	}
	herr := steps.Permanent(steps.WithCode(CodeRescueExhausted, errors.New(reason+", the last of the branch's attempts")))
	return branchRescue{attempt: attempt, reason: reason, failed: m.groupFailed(sg, def, idx, sg.StepName+"."+br.name, attempt, herr, 0)}
}
