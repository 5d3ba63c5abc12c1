package saga

import (
	"fmt"
	"slices"

	"github.com/sagaflow/sagaflow/steps"
)

// StepInfo describes one step of a saga's definition, as an operator tool
// draws it.
type StepInfo struct {
	Name string
	// Compensable: the step has a compensation.
	Compensable bool
	// Remote: the step calls another service (see [Remote]).
	Remote bool
}

// DefinitionSteps returns the steps of the definition registered as name,
// in order, and false when the engine registered no such definition (or e
// is nil).
func (e *Engine) DefinitionSteps(name string) ([]StepInfo, bool) {
	if e == nil {
		return nil, false
	}
	reg := e.defs.Load()
	if reg == nil {
		return nil, false
	}
	def := reg.byName[name]
	if def == nil {
		return nil, false
	}
	out := make([]StepInfo, len(def.steps))
	for i, s := range def.steps {
		out[i] = StepInfo{Name: s.name, Compensable: s.hasCompensate, Remote: s.remoteTopic != ""}
	}
	return out, true
}

// HistorySteps returns the steps a saga's timeline shows, in the order they
// first appear: what an operator tool can draw of a saga whose definition
// it does not have. A step counts as compensable when a compensation of it
// appears in the timeline, and as remote when it sent a command; steps that
// never ran are missing.
func HistorySteps(inst *Instance) []StepInfo {
	if inst == nil {
		return nil
	}
	var out []StepInfo
	idx := map[string]int{}
	add := func(name string) int {
		if i, ok := idx[name]; ok {
			return i
		}
		idx[name] = len(out)
		out = append(out, StepInfo{Name: name})
		return len(out) - 1
	}
	for _, ev := range inst.History {
		if ev.Step == "" {
			continue
		}
		i := add(ev.Step)
		if ev.Direction == steps.Compensate && ev.Type != EventSagaCancelled && ev.Type != EventCancelRequested {
			out[i].Compensable = true
		}
		if ev.Type == EventCommandSent {
			out[i].Remote = true
		}
	}
	if inst.Step != "" {
		add(inst.Step)
	}
	return out
}

// PlanAction names an operator action that [PlanFor] previews.
type PlanAction string

// The actions [PlanFor] previews.
const (
	// PlanResume previews [Engine.Resume].
	PlanResume PlanAction = "resume"
	// PlanRerun previews [Engine.Rerun].
	PlanRerun PlanAction = "rerun"
	// PlanCancel previews [Engine.Cancel].
	PlanCancel PlanAction = "cancel"
)

// PlannedRun is one execution of a step that an action leads to.
type PlannedRun struct {
	Step      string
	Direction steps.Direction
	// Key is the step-scoped idempotency key the execution carries.
	Key steps.Key
	// Reused: the saga's timeline shows an execution under this key
	// already, so services that saw it before see the same key again.
	// False for a key never used.
	Reused bool
}

// Plan is what an action on a saga will do, computed by [PlanFor] from the
// saga as read and its steps. It is a preview: the saga may move on before
// the action is applied (compare Version).
type Plan struct {
	Action PlanAction
	// Version is the saga's version the plan was computed from.
	Version int64
	// Epoch is the epoch the planned executions run under.
	Epoch int
	// Runs are the executions the action starts, in order: the first runs
	// at once, each next one after the one before it succeeds.
	Runs []PlannedRun
	// Compensations run, in this order, when a run fails for good (for a
	// cancel: at once). Only the compensations of steps that completed by
	// then run.
	Compensations []PlannedRun
	// Kept are the steps before the first run whose effects stay as they
	// are: nothing runs them again.
	Kept []string
	// Ends is the status the saga ends with when every run (for a cancel:
	// every compensation) succeeds.
	Ends Status
	// Partial is set when the steps came from the timeline rather than a
	// definition: steps that never ran, and compensations that never ran,
	// are not known and not listed.
	Partial bool
}

// PlanFor computes what action would do to the saga inst, whose definition
// has the steps defSteps (from [Engine.DefinitionSteps]; or, with partial
// set, from [HistorySteps]). from is the step a rerun starts at, and must be
// empty for the other actions. It changes nothing and reads nothing but its
// arguments.
//
// It returns an error wrapping [ErrNotReplayable] when a resume or a rerun
// does not fit the saga's status, [ErrNotRunning] when a cancel does not,
// and an error naming the step when the saga has no such step. The rules
// are those of Resume, Rerun and Cancel, which remain the judges: a plan
// that PlanFor accepts can still be refused by them if the saga moved on.
func PlanFor(inst *Instance, defSteps []StepInfo, partial bool, action PlanAction, from string) (*Plan, error) {
	if inst == nil {
		return nil, fmt.Errorf("saga: plan: nil saga")
	}
	if action != PlanRerun && from != "" {
		return nil, fmt.Errorf("saga: plan %s: a from step applies to a rerun only", action)
	}
	p := &Plan{Action: action, Version: inst.Version, Epoch: inst.Epoch, Partial: partial}
	cur := slices.IndexFunc(defSteps, func(s StepInfo) bool { return s.Name == inst.Step })
	used := usedKeys(inst)
	run := func(i int, dir steps.Direction, epoch int) PlannedRun {
		k := steps.Key{SagaID: inst.ID, Step: defSteps[i].Name, Direction: dir, Epoch: epoch}
		return PlannedRun{Step: k.Step, Direction: dir, Key: k, Reused: used[k]}
	}
	// compensations lists the compensations of steps at indexes <= last, in
	// reverse order, under epoch.
	compensations := func(last, epoch int) []PlannedRun {
		var out []PlannedRun
		for i := min(last, len(defSteps)-1); i >= 0; i-- {
			if defSteps[i].Compensable {
				out = append(out, run(i, steps.Compensate, epoch))
			}
		}
		return out
	}
	switch action {
	case PlanResume:
		if inst.Status != StatusFailed {
			return nil, fmt.Errorf("saga: plan resume: status is %s, and only failed sagas resume: %w", inst.Status, ErrNotReplayable)
		}
		if cur < 0 {
			return nil, fmt.Errorf("saga: plan resume: the saga's step %q is not among its steps", inst.Step)
		}
		if inst.Direction == steps.Compensate {
			// The compensation that gave up runs again, then those of the
			// steps before it.
			p.Runs = append([]PlannedRun{run(cur, steps.Compensate, inst.Epoch)}, compensations(cur-1, inst.Epoch)...)
			p.Ends = StatusCompensated
			return p, nil
		}
		for i := cur; i < len(defSteps); i++ {
			p.Runs = append(p.Runs, run(i, steps.Forward, inst.Epoch))
		}
		p.Compensations = compensations(len(defSteps)-1, inst.Epoch)
		p.Kept = names(defSteps[:cur])
		p.Ends = StatusCompleted
		return p, nil
	case PlanRerun:
		if !inst.Status.Terminal() {
			return nil, fmt.Errorf("saga: plan rerun: status is %s, and only ended sagas re-run: %w", inst.Status, ErrNotReplayable)
		}
		at := slices.IndexFunc(defSteps, func(s StepInfo) bool { return s.Name == from })
		if at < 0 {
			return nil, fmt.Errorf("saga: plan rerun: saga %q has no step %q (its steps: %v)", inst.Name, from, names(defSteps))
		}
		switch {
		case inst.Status == StatusCompensated && at != 0:
			return nil, fmt.Errorf("saga: plan rerun: status is compensated: it can only re-run from its first step %q, not %q: %w",
				defSteps[0].Name, from, ErrNotReplayable)
		case inst.Status == StatusFailed && inst.Direction == steps.Compensate && at <= cur:
			return nil, fmt.Errorf("saga: plan rerun: it failed while compensating step %q, whose effects (and those of the steps before it) "+
				"are still in effect: re-run it from a later step: %w", inst.Step, ErrNotReplayable)
		}
		p.Epoch = inst.Epoch + 1
		for i := at; i < len(defSteps); i++ {
			p.Runs = append(p.Runs, run(i, steps.Forward, p.Epoch))
		}
		p.Compensations = compensations(len(defSteps)-1, p.Epoch)
		p.Kept = names(defSteps[:at])
		p.Ends = StatusCompleted
		return p, nil
	case PlanCancel:
		if inst.Status != StatusRunning {
			return nil, fmt.Errorf("saga: plan cancel: status is %s: %w", inst.Status, ErrNotRunning)
		}
		if cur < 0 {
			return nil, fmt.Errorf("saga: plan cancel: the saga's step %q is not among its steps", inst.Step)
		}
		// The steps before the current one completed. The current step is
		// compensated too when it is a remote step whose command went out
		// unanswered (the service may have carried it out); and when it is
		// running and completes anyway, which no plan can tell in advance.
		last := cur - 1
		if awaitingReply(inst) {
			last = cur
		}
		p.Compensations = compensations(last, inst.Epoch)
		p.Ends = StatusCompensated
		return p, nil
	}
	return nil, fmt.Errorf("saga: plan: unknown action %q", action)
}

// usedKeys returns the step keys the saga's timeline shows executions of.
func usedKeys(inst *Instance) map[steps.Key]bool {
	used := map[steps.Key]bool{}
	for _, ev := range inst.History {
		switch ev.Type {
		case EventStepCompleted, EventStepFailed, EventStepDeduplicated, EventCompensationCompleted,
			EventCommandSent, EventReplyReceived:
			if ev.Step != "" && ev.Direction.Valid() {
				used[steps.Key{SagaID: inst.ID, Step: ev.Step, Direction: ev.Direction, Epoch: ev.Epoch}] = true
			}
		}
	}
	return used
}

// awaitingReply reports whether the saga's timeline ends its current step's
// story with a command sent and no reply.
func awaitingReply(inst *Instance) bool {
	for i := len(inst.History) - 1; i >= 0; i-- {
		ev := inst.History[i]
		if ev.Step != inst.Step || ev.Epoch != inst.Epoch || ev.Direction != steps.Forward {
			continue
		}
		switch ev.Type {
		case EventCommandSent:
			return true
		case EventReplyReceived, EventStepCompleted, EventStepFailed:
			return false
		}
	}
	return false
}

func names(s []StepInfo) []string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = x.Name
	}
	return out
}
