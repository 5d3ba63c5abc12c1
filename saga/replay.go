package saga

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/pace"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/steps"
)

// Resume restarts a failed saga where it failed: the step (action or
// compensation) that gave up runs again, with its attempts counted afresh
// and under the same step-scoped key (its effects were rolled back, so the
// key is not in the inbox). Use it once the cause is fixed. It returns an
// error wrapping [ErrNotReplayable] for a saga that is not failed.
//
// The failure it goes past stays visible: the saga_resumed entry of the
// timeline carries its error, code and step. A saga that failed running
// forward keeps it as its last error until the step succeeds; one that
// failed compensating gets back, as its last error, what made it compensate
// (a step's failure, a cancel), as it had before the compensation failed.
//
// Resume also lifts the pause of a paused saga ([Engine.Pause], or a step's
// Step.PauseWhenExhausted): it continues where it paused, each held command
// due when it was due before, or now when that has passed; a step that
// paused runs again with its attempts counted afresh. A saga whose type is
// paused ([Engine.PauseType]) stays held until [Engine.ResumeType]. Lifting a
// pause waits for a step of the saga whose outcome is being committed at
// that moment (not for a handler that runs), so that the command it wrote is
// released too. Resume
// of such a saga, not paused on its own, returns an error wrapping
// [ErrNotReplayable] that says so. To lift a pause and do nothing else (an
// operator's unpause: a saga that failed while paused must not be replayed
// by it), use [Engine.Unpause].
//
// Resume needs no definition: an operator tool can call it on an engine
// that registered none; an engine that knows the saga runs it.
func (e *Engine) Resume(ctx context.Context, id uuid.UUID, reason string) error {
	return e.resumeOrUnpause(ctx, nil, "Engine.Resume", id, reason)
}

// ResumeTx is [Engine.Resume] inside the caller's transaction, which should
// be READ COMMITTED (pgx's default): it takes effect when tx commits, and an
// error undoes only its own work (it runs under a savepoint). In a
// REPEATABLE READ or SERIALIZABLE transaction it reads the transaction's
// snapshot, which can predate another operator's action: its answer can then
// be stale (a pause lifted meanwhile, say) rather than an error. tx holds the
// saga's row from the call to its commit, and waits for a step of the saga
// whose outcome is being committed.
func (e *Engine) ResumeTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string) error {
	if tx == nil {
		return fmt.Errorf("saga: resume %s: tx is nil", id)
	}
	return e.resumeOrUnpause(ctx, tx, "Engine.ResumeTx", id, reason)
}

// resumeOrUnpause lifts the saga's own pause, or else resumes it, in tx
// (nil: a transaction of its own).
func (e *Engine) resumeOrUnpause(ctx context.Context, tx pgx.Tx, what string, id uuid.UUID, reason string) error {
	if err := e.ready(what); err != nil {
		return err
	}
	err := e.within(ctx, tx, func(tx pgx.Tx) error {
		sg, lifted, err := e.liftPause(ctx, tx, id, reason)
		if err != nil || lifted {
			return err // a paused saga has not ended: there is nothing to replay
		}
		if !Status(sg.Status).Terminal() {
			// Not paused on its own: a pause of its whole type is what
			// holds it, if anything.
			if err := e.heldByType(ctx, tx, sg, ErrNotReplayable); err != nil {
				return err
			}
		}
		return e.resume(ctx, tx, id, reason, 0)
	})
	if err != nil {
		return fmt.Errorf("saga: resume %s: %w", id, err)
	}
	return nil
}

// within runs fn in tx, under a savepoint so that an error undoes only fn's
// work, or, when tx is nil, in a READ COMMITTED transaction of its own.
func (e *Engine) within(ctx context.Context, tx pgx.Tx, fn func(pgx.Tx) error) error {
	if tx == nil {
		return pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, fn)
	}
	return pgx.BeginFunc(ctx, tx, fn)
}

func (e *Engine) resume(ctx context.Context, tx pgx.Tx, id uuid.UUID, reason string, expect int64) error {
	reason = safetext.Text(reason, MaxReasonBytes)
	return e.replay(ctx, tx, id, expect, func(tx pgx.Tx, sg *store.Saga) (*store.Transition, error) {
		var hist []store.History
		if Status(sg.Status) == StatusFailed && steps.Direction(sg.Direction) == steps.Compensate {
			// What made it compensate becomes its last error again.
			var err error
			if hist, err = e.st.History(ctx, tx, sg.ID); err != nil {
				return nil, err
			}
		}
		d, err := e.machine.resume(sg, e.lookup(sg), hist, reason)
		if err != nil {
			return nil, err
		}
		return e.transition(sg, d), nil
	})
}

// Rerun runs an ended saga (completed, compensated or failed) forward again
// from step from, under a new epoch: every step from there on gets a fresh
// step-scoped key, because the old keys are in the inbox. The state is the
// saga's current state. It returns an error wrapping [ErrNotReplayable] for
// a saga that has not ended, and an error naming the step when the saga has
// no such step.
func (e *Engine) Rerun(ctx context.Context, id uuid.UUID, from, reason string) error {
	return e.rerunOp(ctx, nil, "Engine.Rerun", id, from, reason)
}

// RerunTx is [Engine.Rerun] inside the caller's transaction, which should
// be READ COMMITTED (pgx's default; see [Engine.ResumeTx] for the others):
// it takes effect when tx commits, and an error undoes only its own work (it
// runs under a savepoint). tx holds the saga's row from the call to its
// commit.
func (e *Engine) RerunTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, from, reason string) error {
	if tx == nil {
		return fmt.Errorf("saga: rerun %s: tx is nil", id)
	}
	return e.rerunOp(ctx, tx, "Engine.RerunTx", id, from, reason)
}

func (e *Engine) rerunOp(ctx context.Context, tx pgx.Tx, what string, id uuid.UUID, from, reason string) error {
	if err := e.ready(what); err != nil {
		return err
	}
	if err := checkInput("rerun", inputField{"from step", from, 0}); err != nil {
		return err
	}
	if err := e.rerun(ctx, tx, id, from, reason, 0); err != nil {
		return fmt.Errorf("saga: rerun %s: %w", id, err)
	}
	return nil
}

func (e *Engine) rerun(ctx context.Context, tx pgx.Tx, id uuid.UUID, from, reason string, expect int64) error {
	reason = safetext.Text(reason, MaxReasonBytes)
	return e.replay(ctx, tx, id, expect, func(tx pgx.Tx, sg *store.Saga) (*store.Transition, error) {
		// A saga that has not ended is refused before its step is looked
		// for, which may read its history.
		if err := rerunnable(sg); err != nil {
			return nil, err
		}
		idx, first, err := e.stepIndex(ctx, tx, sg, from)
		if err != nil {
			return nil, err
		}
		d, err := e.machine.rerun(sg, e.lookup(sg), idx, first, from, reason)
		if err != nil {
			return nil, err
		}
		return e.transition(sg, d), nil
	})
}

// replay applies the transition plan returns for saga id, under the saga's
// row lock, in tx (nil: a transaction of its own). A non-zero expect
// refuses a saga whose version changed since the caller selected it.
func (e *Engine) replay(ctx context.Context, tx pgx.Tx, id uuid.UUID, expect int64, plan func(pgx.Tx, *store.Saga) (*store.Transition, error)) error {
	return e.within(ctx, tx, func(tx pgx.Tx) error {
		sg, err := e.st.GetSaga(ctx, tx, id, true)
		if errors.Is(err, store.ErrNotFound) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		if expect != 0 && sg.Version != expect {
			return fmt.Errorf("the saga changed since it was selected (version %d, now %d): %w", expect, sg.Version, ErrNotReplayable)
		}
		tr, err := plan(tx, sg)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SAVEPOINT sagaflow_replay"); err != nil {
			return err
		}
		ok, err := e.st.ApplyTransition(ctx, tx, tr, "sagaflow_replay")
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("the saga changed under a row lock")
		}
		return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
	})
}

// stepIndex finds step name of the saga, and the saga's first step: in its
// definition when this engine has it, else among the steps its history
// shows (an operator tool has no definitions); -1 then stands for an index
// the running engine fills in.
func (e *Engine) stepIndex(ctx context.Context, tx store.DBTX, sg *store.Saga, name string) (idx int, first string, err error) {
	if def := e.lookup(sg); def != nil {
		if idx, ok := def.byName[name]; ok {
			return idx, def.steps[0].name, nil
		}
		return 0, "", fmt.Errorf("saga %q has no step %q (its steps: %s)", sg.Name, name, stepNames(def))
	}
	hist, err := e.st.History(ctx, tx, sg.ID)
	if err != nil {
		return 0, "", err
	}
	var seen []string
	for _, h := range hist {
		if h.Event == EventSagaStarted && h.StepName != nil {
			first = *h.StepName
		}
		if h.StepName != nil && !slices.Contains(seen, *h.StepName) {
			seen = append(seen, *h.StepName)
		}
	}
	if !slices.Contains(seen, name) {
		return 0, "", fmt.Errorf("saga %s never ran a step %q (steps in its history: %v)", sg.ID, name, seen)
	}
	switch name {
	case first:
		return 0, first, nil
	case sg.StepName:
		return sg.StepIndex, first, nil
	}
	return -1, first, nil
}

func stepNames(def *compiled) string {
	names := make([]string, len(def.steps))
	for i, s := range def.steps {
		names[i] = s.name
	}
	return fmt.Sprint(names)
}

// Bulk replay limits.
const (
	// BulkReplayMaxDefault caps a bulk replay that sets no Max.
	BulkReplayMaxDefault = outbox.ReplayMaxDefault
	// BulkReplayMaxLimit is the largest Max a bulk replay accepts.
	BulkReplayMaxLimit = outbox.ReplayMaxLimit
	// ReplayRateDefault is the replays (or messages) per second of a bulk
	// replay that sets no rate.
	ReplayRateDefault = outbox.ReplayRateDefault
)

// BulkReplayOpts selects the sagas of [Engine.ReplayBulk]. Zero filters do
// not filter.
type BulkReplayOpts struct {
	Name          string
	Statuses      []Status // defaults to failed
	CreatedAfter  time.Time
	CreatedBefore time.Time
	EndedAfter    time.Time
	EndedBefore   time.Time
	FailedStep    string
	ErrorCode     string
	// FromStep, when set, re-runs each saga from that step under a new epoch
	// ([Engine.Rerun]); when empty, each failed saga resumes where it failed
	// ([Engine.Resume]).
	FromStep string
	// IDs, when set, keeps only these sagas of those the filter selects:
	// the ones a dry run listed, so that the replay confirmed after it acts
	// on what was shown and on no saga that came to match since (the web
	// UI's confirmation carries them). At most BulkReplayMaxLimit.
	IDs []uuid.UUID
	// Max caps how many sagas are replayed. Defaults to BulkReplayMaxDefault;
	// at most BulkReplayMaxLimit.
	Max int
	// RatePerSecond limits replays per second. Defaults to ReplayRateDefault.
	RatePerSecond float64
	// DryRun selects and reports, and changes nothing.
	DryRun bool
	// Reason is recorded in each saga's history.
	Reason string
}

// BulkReplayResult reports a bulk replay.
type BulkReplayResult struct {
	Matched  []uuid.UUID // selected and replayable, newest first (at most Max selected)
	Replayed []uuid.UUID // replayed (empty on a dry run)
	Errors   []BulkReplayError
	DryRun   bool
}

// BulkReplayError is one saga a bulk replay could not replay.
type BulkReplayError struct {
	ID  uuid.UUID
	Err error
}

// ReplayBulk replays the sagas that match opts, at most Max of them, at most
// RatePerSecond per second. A saga that cannot be replayed is reported in
// Errors and the others go on. With DryRun it only reports what it would
// replay.
func (e *Engine) ReplayBulk(ctx context.Context, opts BulkReplayOpts) (*BulkReplayResult, error) {
	if err := e.ready("Engine.ReplayBulk"); err != nil {
		return nil, err
	}
	if err := pace.Normalise("saga: replay", bulkLimits, &opts.Max, &opts.RatePerSecond); err != nil {
		return nil, err
	}
	if len(opts.Statuses) == 0 {
		opts.Statuses = []Status{StatusFailed}
	}
	if err := checkStatuses(opts.Statuses); err != nil {
		return nil, fmt.Errorf("saga: bulk replay: %w", err)
	}
	if err := checkInput("bulk replay", inputField{"BulkReplayOpts.Name", opts.Name, 0}, inputField{"BulkReplayOpts.FailedStep", opts.FailedStep, 0},
		inputField{"BulkReplayOpts.ErrorCode", opts.ErrorCode, 0}, inputField{"BulkReplayOpts.FromStep", opts.FromStep, 0}); err != nil {
		return nil, err
	}
	if len(opts.IDs) > BulkReplayMaxLimit {
		return nil, fmt.Errorf("saga: bulk replay: %d IDs, at most %d: %w", len(opts.IDs), BulkReplayMaxLimit, ErrInvalidInput)
	}
	f := store.ListFilter{Name: opts.Name, CreatedAfter: opts.CreatedAfter, CreatedBefore: opts.CreatedBefore,
		EndedAfter: opts.EndedAfter, EndedBefore: opts.EndedBefore, FailedStep: opts.FailedStep,
		ErrorCode: opts.ErrorCode, Limit: opts.Max, IDs: opts.IDs}
	for _, s := range opts.Statuses {
		f.Statuses = append(f.Statuses, string(s))
	}
	rows, _, err := e.st.ListSagas(ctx, e.pool, f)
	if err != nil {
		return nil, fmt.Errorf("saga: bulk replay: %w", err)
	}
	res := &BulkReplayResult{DryRun: opts.DryRun}
	versions := make(map[uuid.UUID]int64, len(rows))
	for _, r := range rows {
		// Only what the replay can act on: a dry run lists what would
		// really be replayed, and reports the rest with the reason.
		st := Status(r.Status)
		switch {
		case opts.FromStep == "" && st != StatusFailed:
			res.Errors = append(res.Errors, BulkReplayError{ID: r.ID,
				Err: fmt.Errorf("saga: resume %s: status is %s, and only failed sagas resume: %w", r.ID, st, ErrNotReplayable)})
			continue
		case opts.FromStep != "" && !st.Terminal():
			res.Errors = append(res.Errors, BulkReplayError{ID: r.ID,
				Err: fmt.Errorf("saga: rerun %s: status is %s, and only ended sagas re-run: %w", r.ID, st, ErrNotReplayable)})
			continue
		}
		if opts.FromStep != "" {
			// A step the saga does not have fails its rerun: the dry run
			// says so too, instead of listing it as one that would re-run.
			if _, _, err := e.stepIndex(ctx, e.pool, &r, opts.FromStep); err != nil {
				res.Errors = append(res.Errors, BulkReplayError{ID: r.ID, Err: fmt.Errorf("saga: rerun %s: %w", r.ID, err)})
				continue
			}
		}
		res.Matched = append(res.Matched, r.ID)
		versions[r.ID] = r.Version
	}
	if opts.DryRun {
		return res, nil
	}
	err = pace.Each(ctx, len(res.Matched), opts.RatePerSecond, func(i int) error {
		id := res.Matched[i]
		var err error
		// Each saga is replayed only as it was selected: one that changed
		// meanwhile (replayed by someone else, say) is reported, not touched.
		if opts.FromStep != "" {
			if err = e.rerun(ctx, nil, id, opts.FromStep, opts.Reason, versions[id]); err != nil {
				err = fmt.Errorf("saga: rerun %s: %w", id, err)
			}
		} else if err = e.resume(ctx, nil, id, opts.Reason, versions[id]); err != nil {
			err = fmt.Errorf("saga: resume %s: %w", id, err)
		}
		if err != nil {
			res.Errors = append(res.Errors, BulkReplayError{ID: id, Err: err})
		} else {
			res.Replayed = append(res.Replayed, id)
		}
		return nil
	})
	return res, err
}

var bulkLimits = pace.Limits{MaxDefault: BulkReplayMaxDefault, MaxLimit: BulkReplayMaxLimit, RateDefault: ReplayRateDefault}

// ReplayOutbox makes already published messages pending again, so the relay
// publishes them once more; see [outbox.Outbox.Replay].
func (e *Engine) ReplayOutbox(ctx context.Context, opts outbox.ReplayOpts) (*outbox.ReplayResult, error) {
	if err := e.ready("Engine.ReplayOutbox"); err != nil {
		return nil, err
	}
	return e.outbox.Replay(ctx, opts)
}

// OutboxStatus reports the outbox: pending messages, the age of the oldest,
// dead and published ones; see [outbox.Outbox.Status].
func (e *Engine) OutboxStatus(ctx context.Context) (outbox.Status, error) {
	if err := e.ready("Engine.OutboxStatus"); err != nil {
		return outbox.Status{}, err
	}
	return e.outbox.Status(ctx)
}
