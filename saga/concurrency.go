package saga

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
)

// Concurrency keys: at most N running sagas of a definition per key (a
// customer, an order, an account). See [Definition.WithConcurrency] and
// [StartOpts.ConcurrencyKey].
//
// A start with a key locks the key's counter row in the start's transaction
// (the caller's, for [StartTx]), and [machine.admit] decides: the saga takes
// a slot and runs, or it waits in the key's queue, in start order, with its
// first command held (due at 'infinity', so no worker and no relay sees it,
// and it holds back nothing of other keys). A trigger of migration 010
// releases the slot in the transaction that ends the saga, whatever ends it
// (a step, the rescuer, a cancel, an operator), and admits the next waiting
// sagas of the key in that same transaction.

// History events of concurrency keys.
const (
	// EventConcurrencyQueued: the saga started while its key was at its
	// limit and waits for a slot; the detail names the key and the saga's
	// position.
	EventConcurrencyQueued = "concurrency_queued"
	// EventConcurrencyAdmitted: a slot of the key was released and the
	// waiting saga took it; its first step runs now.
	EventConcurrencyAdmitted = "concurrency_admitted"
)

// ConcurrencyLimitMax bounds [Definition.WithConcurrency].
const ConcurrencyLimitMax = 1 << 20

// WithConcurrency limits the sagas of d that run at once per concurrency key
// ([StartOpts.ConcurrencyKey]) to n: a start beyond the limit waits, in start
// order, until a saga of the same key ends (completed, compensated or
// failed, including by a cancel). Sagas started without a key are not
// limited. n must be between 1 and [ConcurrencyLimitMax]; 0 removes the
// limit. It returns d.
//
// Resuming or rerunning a failed saga ([Engine.Resume], [Engine.Rerun])
// takes a slot of its key again at once, even above the limit: the
// operator's act goes ahead of the queue, and waiting sagas are admitted
// once the key is under its limit again.
func (d *Definition[S]) WithConcurrency(n int) *Definition[S] {
	if d != nil {
		d.concurrency = n
	}
	return d
}

// checkConcurrencyLimit refuses a limit out of range at registration.
func checkConcurrencyLimit(name string, n int) error {
	if n < 0 || n > ConcurrencyLimitMax {
		return fmt.Errorf("%w: saga %q: concurrency limit %d is outside 0..%d", ErrInvalidDefinition, name, n, ConcurrencyLimitMax)
	}
	return nil
}

// ConcurrencyInfo is a saga's place under its concurrency key.
type ConcurrencyInfo struct {
	Key string `json:"key"`
	// Queued says the saga waits for a slot; Position is then its place in
	// the key's queue, 1 for the next to be admitted.
	Queued   bool `json:"queued"`
	Position int  `json:"position,omitempty"`
	// Running is how many sagas of the key hold a slot, and Limit the
	// definition's limit as of the key's last start.
	Running int `json:"running"`
	Limit   int `json:"limit"`
}

// admission is what a keyed start does.
type admission int

const (
	admitRun    admission = iota // take a slot, run
	admitQueue                   // wait in the key's queue
	admitRefuse                  // return ErrConcurrencyLimit
)

// admit decides a keyed start, given how many sagas of its key hold a slot
// (running) and the limit. Waiting sagas go first: a start is admitted only
// while the key is under its limit, and the queue is admitted by the release
// itself, so a start never overtakes a waiting saga (the release leaves the
// key at its limit while anyone waits).
func (m machine) admit(running, limit int, noWait bool) admission {
	switch {
	case running < limit:
		return admitRun
	case noWait:
		return admitRefuse
	default:
		return admitQueue
	}
}

// checkConcurrency checks a start's concurrency key against def.
func checkConcurrency(def *compiled, o *StartOpts) error {
	if o.ConcurrencyKey == "" {
		if o.NoWait {
			return fmt.Errorf("%w: start %s: StartOpts.NoWait is set without a StartOpts.ConcurrencyKey", ErrInvalidInput, def.name)
		}
		return nil
	}
	if err := checkInput("start "+def.name, inputField{"StartOpts.ConcurrencyKey", o.ConcurrencyKey, safetext.MaxKeyBytes}); err != nil {
		return err
	}
	if def.concurrency == 0 {
		return fmt.Errorf("%w: start %s: StartOpts.ConcurrencyKey %q is set but the definition has no concurrency limit (Definition.WithConcurrency)",
			ErrInvalidInput, def.name, o.ConcurrencyKey)
	}
	return nil
}

// startConcurrent starts sg under its concurrency key in one transaction:
// db's when the caller gave one (own false), else a transaction of the
// engine's pool. startSaga writes the saga's rows (see [Engine.startRaw]).
func (e *Engine) startConcurrent(ctx context.Context, db store.DBTX, own bool, def *compiled, sg *store.Saga, rows *store.Transition,
	o *StartOpts, startSaga func(store.DBTX) (bool, error)) (bool, error) {
	var inserted bool
	run := func(db store.DBTX) error {
		key := o.ConcurrencyKey
		running, err := e.st.LockConcurrencyKey(ctx, db, def.name, key, def.concurrency)
		if err != nil {
			return err
		}
		a := e.machine.admit(running, def.concurrency, o.NoWait)
		if a == admitRefuse {
			return fmt.Errorf("saga: start %s: concurrency key %q has %d of %d sagas running: %w",
				def.name, key, running, def.concurrency, ErrConcurrencyLimit)
		}
		inserted, err = startSaga(db)
		if err != nil || !inserted {
			return err
		}
		if a == admitRun {
			return e.st.AdmitConcurrent(ctx, db, sg.ID, def.name, key)
		}
		pos, err := e.st.QueueConcurrent(ctx, db, sg.ID, def.name, key, rows.Messages[0].ID, e.firstDeadline(def.steps[0].timeout))
		if err != nil {
			return err
		}
		detail, _ := json.Marshal(map[string]any{"concurrency_key": key, "position": pos, "running": running, "limit": def.concurrency})
		return e.st.InsertHistory(ctx, db, &store.HistoryEntry{SagaID: sg.ID, Event: EventConcurrencyQueued,
			StepName: sg.StepName, Direction: sg.Direction, Detail: detail})
	}
	if own {
		if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return run(tx) }); err != nil {
			return false, err
		}
		return inserted, nil
	}
	return inserted, run(db)
}

// fillConcurrency sets the Concurrency of those of ins started with a key.
func (e *Engine) fillConcurrency(ctx context.Context, ins []Instance) error {
	if len(ins) == 0 {
		return nil
	}
	ids := make([]uuid.UUID, len(ins))
	for i := range ins {
		ids[i] = ins[i].ID
	}
	got, err := e.st.SagaConcurrency(ctx, e.pool, ids)
	if err != nil {
		return err
	}
	for i := range ins {
		c, ok := got[ins[i].ID]
		if !ok {
			continue
		}
		ins[i].Concurrency = &ConcurrencyInfo{Key: c.Key, Queued: c.Position > 0, Position: c.Position, Running: c.Running, Limit: c.Max}
	}
	return nil
}
