package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// VersionMax is the highest version a definition may have.
const VersionMax = 1_000_000

// nameVersion identifies one version of a saga definition.
type nameVersion struct {
	name    string
	version int
}

// WithVersion sets the definition's version (1 when never set). Every saga
// runs to its end on the version it started with: register the old version
// beside the new one while sagas started on it are in flight, and an engine
// runs each saga on its own version. An engine that lacks a saga's version
// leaves that saga's commands to engines that have it, without holding
// anything else back; once nothing runs on a version any more (see
// [Engine.Versions]), stop registering it, or move its sagas with
// [MigrateSagas]. See "Versions" in the package documentation.
func (d *Definition[S]) WithVersion(v int) *Definition[S] {
	if d != nil {
		d.version = v
	}
	return d
}

// Version returns the definition's version: 1 unless [Definition.WithVersion]
// set another; 0 for a nil definition.
func (d *Definition[S]) Version() int {
	if d == nil {
		return 0
	}
	return max(d.version, 1)
}

// anyVersionRemote reports whether a registered version of name has a
// remote step.
func (e *Engine) anyVersionRemote(name string) bool {
	for nv, c := range e.registered().byVersion {
		if nv.name == name && c.hasRemote() {
			return true
		}
	}
	return false
}

// Position is where a saga is in its definition: a step and a direction.
type Position struct {
	Step      string          `json:"step"`
	Direction steps.Direction `json:"direction"`
}

// Migration moves in-flight sagas from one version of a definition to
// another (see [MigrateSagas]). From and To are two versions of the same
// saga name.
type Migration[From, To any] struct {
	From *Definition[From]
	To   *Definition[To]
	// Map gives a saga's state and position in To from its state and
	// position in From. It must be a pure function of its arguments: the
	// dry run and the real run call it alike. An error skips that saga, with
	// the error as the reason.
	Map func(ctx context.Context, id uuid.UUID, state *From, at Position) (*To, Position, error)
}

// MigrateOpts selects and paces a migration.
type MigrateOpts struct {
	// DryRun computes every move and changes nothing.
	DryRun bool
	// IDs, when set, migrates only these sagas; otherwise every saga of
	// From that has not ended, oldest first.
	IDs []uuid.UUID
	// Max caps how many sagas are looked at. Defaults to
	// BulkReplayMaxDefault; at most BulkReplayMaxLimit.
	Max int
}

// SagaMove is what a migration did, or would do, to one saga.
type SagaMove struct {
	ID          uuid.UUID `json:"id"`
	FromVersion int       `json:"from_version"`
	ToVersion   int       `json:"to_version"`
	From        Position  `json:"from"`
	To          Position  `json:"to,omitzero"`
	// State is the saga's new state (JSON).
	State json.RawMessage `json:"state,omitempty"`
	// Key is the step key the saga continues under; KeyReused says that a
	// step with that key committed before (the saga ran a step of that name
	// and direction in this epoch): it is not run again, the saga goes on
	// past it.
	Key       string `json:"key,omitempty"`
	KeyReused bool   `json:"key_reused,omitempty"`
	// Applied is true when the saga was moved (never in a dry run).
	Applied bool `json:"applied"`
	// Skipped says why the saga was not, or would not be, moved; "" when it
	// was, or would be.
	Skipped string `json:"skipped,omitempty"`
}

// MigrationResult lists a migration's moves, in the order the sagas were
// looked at.
type MigrationResult struct {
	DryRun bool       `json:"dry_run"`
	Moves  []SagaMove `json:"moves"`
	// Moved counts the sagas moved (or that a dry run would move); Skipped
	// the others.
	Moved, Skipped int
}

// EventSagaMigrated: an operator moved the saga to another version of its
// definition ([MigrateSagas]); Detail has both versions and positions.
const EventSagaMigrated = "saga_migrated"

// MigrateSagas moves in-flight sagas of m.From's version to m.To's: for
// each saga, in a transaction of its own, it calls m.Map with the saga's
// decoded state and position, and writes the new state, position and
// version with the command of the new position; the saga's pending commands
// of the old position are deleted in that transaction. A saga that ends, or
// moves, meanwhile is fenced out as in any transition.
//
// A saga is skipped, with the reason in its [SagaMove], when a step of it
// runs at that moment (try again), when it waits for a remote step's reply
// or for a child saga (moving it would orphan that work), when it is not at
// m.From's version any more, or when Map fails or names a position To does
// not have. The saga's epoch is kept: a step it already completed under the
// same name and direction is not run again (SagaMove.KeyReused).
//
// With opts.DryRun every move is computed as for real and nothing is
// written. Neither definition needs to be registered with e; engines that
// register m.To run the moved sagas.
func MigrateSagas[From, To any](ctx context.Context, e *Engine, m Migration[From, To], opts *MigrateOpts) (*MigrationResult, error) {
	if err := e.ready("MigrateSagas"); err != nil {
		return nil, err
	}
	o := MigrateOpts{}
	if opts != nil {
		o = *opts
	}
	if m.From == nil || m.To == nil || m.Map == nil {
		return nil, fmt.Errorf("saga: migrate: %w: Migration needs From, To and Map", ErrInvalidInput)
	}
	from, err := m.From.compile()
	if err != nil {
		return nil, fmt.Errorf("saga: migrate: From: %w", err)
	}
	to, err := m.To.compile()
	if err != nil {
		return nil, fmt.Errorf("saga: migrate: To: %w", err)
	}
	if from.name != to.name || from.version == to.version {
		return nil, fmt.Errorf("saga: migrate: %w: From (%q version %d) and To (%q version %d) must be two versions of one saga",
			ErrInvalidInput, from.name, from.version, to.name, to.version)
	}
	switch {
	case o.Max < 0 || o.Max > BulkReplayMaxLimit:
		return nil, fmt.Errorf("saga: migrate: %w: Max %d is outside 0..%d", ErrInvalidInput, o.Max, BulkReplayMaxLimit)
	case o.Max == 0:
		o.Max = BulkReplayMaxDefault
	}
	ids := o.IDs
	if len(ids) > o.Max {
		ids = ids[:o.Max]
	}
	if len(ids) == 0 && len(o.IDs) == 0 {
		if ids, err = e.st.SagasAtVersion(ctx, e.pool, from.name, from.version, o.Max); err != nil {
			return nil, fmt.Errorf("saga: migrate: %w", err)
		}
	}
	res := &MigrationResult{DryRun: o.DryRun, Moves: make([]SagaMove, 0, len(ids))}
	for _, id := range ids {
		mv, err := migrateOne(ctx, e, &m, from, to, id, o.DryRun)
		if err != nil {
			return res, fmt.Errorf("saga: migrate %s: %w", id, err)
		}
		if mv.Skipped != "" {
			res.Skipped++
		} else {
			res.Moved++
		}
		res.Moves = append(res.Moves, mv)
	}
	return res, nil
}

func migrateOne[From, To any](ctx context.Context, e *Engine, m *Migration[From, To], from, to *compiled, id uuid.UUID, dryRun bool) (SagaMove, error) {
	mv := SagaMove{ID: id, FromVersion: from.version, ToVersion: to.version}
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		locked, err := e.st.TryLockSaga(ctx, tx, id)
		if err != nil {
			return err
		}
		if !locked {
			mv.Skipped = "a step of the saga runs right now; try again"
			return nil
		}
		sg, err := e.st.GetSaga(ctx, tx, id, true)
		if errors.Is(err, store.ErrNotFound) {
			mv.Skipped = "no such saga"
			return nil
		}
		if err != nil {
			return err
		}
		mv.From = Position{Step: sg.StepName, Direction: steps.Direction(sg.Direction)}
		if skip := migratable(sg, from); skip != "" {
			mv.Skipped = skip
			return nil
		}
		var old From
		if err := json.Unmarshal(sg.State, &old); err != nil {
			mv.Skipped = safetext.Text("its state does not decode as From's state: "+err.Error(), 500)
			return nil
		}
		st, at, err := callMap(ctx, m, id, &old, mv.From)
		if err != nil {
			mv.Skipped = safetext.Text("Map: "+err.Error(), 500)
			return nil
		}
		idx, ok := to.byName[at.Step]
		if !ok || !at.Direction.Valid() {
			mv.Skipped = safetext.Text(fmt.Sprintf("Map returned step %q, direction %q: version %d has no such position (its steps: %s)",
				at.Step, at.Direction, to.version, stepNames(to)), 500)
			return nil
		}
		raw, err := json.Marshal(st)
		if err == nil {
			err = e.machine.checkState(at.Step, raw)
		}
		if err != nil {
			mv.Skipped = safetext.Text("the new state cannot be stored: "+err.Error(), 500)
			return nil
		}
		mv.To, mv.State = at, raw
		key := steps.Key{SagaID: id, Step: at.Step, Direction: at.Direction, Epoch: sg.Epoch}
		mv.Key = key.String()
		if mv.KeyReused, err = e.st.InboxHas(ctx, tx, mv.Key); err != nil {
			return err
		}
		if dryRun {
			return errDryRun
		}
		if err := e.st.DeletePendingCommands(ctx, tx, id); err != nil {
			return err
		}
		tr := e.transition(sg, e.machine.migrated(sg, to, idx, at.Direction, raw, from.version))
		if _, err := tx.Exec(ctx, "SAVEPOINT sagaflow_migrate"); err != nil {
			return err
		}
		ok, err = e.st.ApplyTransition(ctx, tx, tr, "sagaflow_migrate")
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("the saga changed under its row lock")
		}
		mv.Applied = true
		return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
	})
	if errors.Is(err, errDryRun) {
		err = nil
	}
	return mv, err
}

// migratable says why sg cannot be migrated from version from, or "".
func migratable(sg *store.Saga, from *compiled) string {
	switch {
	case max(sg.DefVersion, 1) != from.version:
		return fmt.Sprintf("it runs on version %d, not %d", max(sg.DefVersion, 1), from.version)
	case sg.Name != from.name:
		return fmt.Sprintf("it is a %q, not a %q", sg.Name, from.name)
	case Status(sg.Status).Terminal():
		return "it has ended (" + sg.Status + ")"
	case sg.AwaitingReply:
		return "it waits for the reply of a remote step; migrate it once the reply has come"
	case deref(sg.WaitKind) == store.WaitChild:
		return "it waits for a child saga; migrate it once the child has ended"
	case deref(sg.WaitKind) == store.WaitBranches:
		return "its parallel step's branches run; migrate it once the step has ended"
	}
	return ""
}

// callMap calls m.Map, turning a panic into an error.
func callMap[From, To any](ctx context.Context, m *Migration[From, To], id uuid.UUID, st *From, at Position) (out *To, pos Position, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	out, pos, err = m.Map(ctx, id, st, at)
	if err == nil && out == nil {
		err = errors.New("returned a nil state")
	}
	return out, pos, err
}

// migrated is the decision that moves sg to step idx of version to, in
// direction dir, with state raw.
func (m machine) migrated(sg *store.Saga, to *compiled, idx int, dir steps.Direction, raw []byte, fromVersion int) decision {
	tr := transitionFrom(sg)
	tr.Status, tr.StepIndex, tr.StepName, tr.Direction = statusFor(dir), idx, to.steps[idx].name, string(dir)
	tr.Attempt, tr.State, tr.DefVersion = 0, raw, to.version
	tr.WaitKind, tr.WaitFor = "", ""
	tr.CheckAfter = m.deadline(to.steps[idx].timeout)
	detail, _ := json.Marshal(map[string]any{"from_version": fromVersion, "to_version": to.version,
		"from_step": sg.StepName, "from_direction": sg.Direction, "to_step": to.steps[idx].name, "to_direction": string(dir)})
	tr.History = []store.HistoryEntry{{SagaID: sg.ID, Event: EventSagaMigrated, StepName: to.steps[idx].name,
		Direction: string(dir), Epoch: sg.Epoch, Detail: detail}}
	return decision{tr: tr, next: &nextCommand{step: to.steps[idx].name, dir: dir, epoch: sg.Epoch}}
}

// VersionCount is how many sagas of a name run on one version of its
// definition: those that have not ended, and the failed ones (which a
// resume would run on that version).
type VersionCount struct {
	Name         string `json:"name"`
	Version      int    `json:"version"`
	Running      int64  `json:"running"`
	Compensating int64  `json:"compensating"`
	Failed       int64  `json:"failed"`
}

// Versions counts sagas by name and definition version.
func (e *Engine) Versions(ctx context.Context) ([]VersionCount, error) {
	if err := e.ready("Engine.Versions"); err != nil {
		return nil, err
	}
	rows, err := e.st.CountVersions(ctx, e.pool)
	if err != nil {
		return nil, fmt.Errorf("saga: versions: %w", err)
	}
	var out []VersionCount
	for _, r := range rows {
		if n := len(out); n == 0 || out[n-1].Name != r.Name || out[n-1].Version != r.Version {
			out = append(out, VersionCount{Name: r.Name, Version: r.Version})
		}
		c := &out[len(out)-1]
		switch Status(r.Status) {
		case StatusRunning:
			c.Running = r.Count
		case StatusCompensating:
			c.Compensating = r.Count
		case StatusFailed:
			c.Failed = r.Count
		}
	}
	return out, nil
}
