package saga

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
)

// Concurrency keys: at most N running sagas of a definition per key (a
// customer, an order, an account). See [Definition.WithConcurrency] and
// [StartOpts.ConcurrencyKey].
//
// A start with a key writes the saga's row with its key and, in the same
// transaction (the caller's, for [StartTx]), calls saga_concurrency_admit of
// migration 009, which locks the key's counter row and decides: the saga
// takes a slot and runs, or it waits in the key's queue, in start order,
// with its first command held (due at 'infinity', so no worker and no relay
// sees it, and it holds back nothing of other keys). [machine.refuses] is
// the same rule for a start with [StartOpts.NoWait], decided before the
// saga is written. A trigger of migration 009
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

// refuses decides a start with [StartOpts.NoWait]: it is refused when its
// key has no free slot, or when sagas wait (a start never overtakes them).
// Without NoWait, the same rule decides between a slot and the queue, in
// the function saga_concurrency_admit of migration 009, which runs in the
// start's transaction.
func (m machine) refuses(running, waiting, limit int) bool {
	return running >= limit || waiting > 0
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

// startConcurrent starts sg under its concurrency key, atomically: the
// saga's rows (startSaga, see [Engine.startRaw]) and its slot or place in
// the queue. In the caller's transaction (own false) these are statements
// of db; on the engine's pool, in the transaction of a group of starts
// (startgroup.go: req is the start, nil when it is not grouped), or, for an
// engine not made by New, one
// pipelined batch, which PostgreSQL runs as one implicit transaction; so a
// keyed start costs no extra round trip.
// With [StartOpts.NoWait], the key is locked and checked first, in a
// transaction.
func (e *Engine) startConcurrent(ctx context.Context, db store.DBTX, own bool, def *compiled, sg *store.Saga, rows *store.Transition,
	o *StartOpts, startSaga func(store.DBTX) (bool, error), req *startReq) (bool, error) {
	key, cmd, check := o.ConcurrencyKey, rows.Messages[0].ID, e.firstDeadline(def.steps[0].timeout)
	sg.ConcurrencyKey = &key
	var a store.Admission
	switch {
	case o.NoWait:
		run := func(db store.DBTX) error {
			running, waiting, err := e.st.LockConcurrencyKey(ctx, db, def.name, key, def.concurrency)
			if err != nil {
				return err
			}
			if e.machine.refuses(running, waiting, def.concurrency) {
				return fmt.Errorf("start %s: concurrency key %q has %d of %d sagas running and %d waiting: %w",
					def.name, key, running, def.concurrency, waiting, ErrConcurrencyLimit)
			}
			inserted, err := startSaga(db)
			if err != nil || !inserted {
				a.Position = -1
				return err
			}
			a, err = e.st.AdmitStarted(ctx, db, sg.ID, def.name, key, def.concurrency, cmd, check.At)
			return err
		}
		var err error
		if own {
			err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return run(tx) })
		} else {
			err = run(db)
		}
		if err != nil {
			return false, err
		}
	case req != nil:
		// With the other starts on the pool (startgroup.go): the insert and
		// the admission in one transaction.
		req.admit = &admitReq{name: def.name, key: key, limit: def.concurrency, command: cmd, checkAt: check.At}
		return e.starts.start(ctx, e, req)
	case own:
		b := &pgx.Batch{}
		if _, err := startSaga(batchDB{b}); err != nil {
			return false, err
		}
		e.st.QueueAdmitStarted(b, &a, sg.ID, def.name, key, def.concurrency, cmd, check.At)
		if err := e.pool.SendBatch(ctx, b).Close(); err != nil {
			return false, fmt.Errorf("start %s with concurrency key %q: %w", def.name, key, err)
		}
	default:
		inserted, err := startSaga(db)
		if err != nil || !inserted {
			return false, err
		}
		if a, err = e.st.AdmitStarted(ctx, db, sg.ID, def.name, key, def.concurrency, cmd, check.At); err != nil {
			return false, err
		}
	}
	return a.Position >= 0, nil
}

// batchDB queues the statements of a store call into a batch instead of
// running them: Exec only, whose result the batch reports when it is
// read. It serves [store.Store.StartSaga], which runs one Exec; a call that
// reads rows fails here, loudly, rather than reading nothing.
type batchDB struct{ b *pgx.Batch }

func (d batchDB) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	d.b.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (d batchDB) Query(context.Context, string, ...any) (pgx.Rows, error) {
	return nil, errors.New("saga: batched start: a query cannot run inside a batch")
}

func (d batchDB) QueryRow(context.Context, string, ...any) pgx.Row {
	return errRow{errors.New("saga: batched start: a query cannot run inside a batch")}
}

// fillConcurrency sets the Concurrency of those of ins started with a key.
func (e *Engine) fillConcurrency(ctx context.Context, db store.DBTX, ins []Instance) error {
	if len(ins) == 0 {
		return nil
	}
	ids := make([]uuid.UUID, len(ins))
	for i := range ins {
		ids[i] = ins[i].ID
	}
	got, err := e.st.SagaConcurrency(ctx, db, ids)
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
