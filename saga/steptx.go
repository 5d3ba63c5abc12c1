package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/store"
)

// batchTx is a batch's pipelined savepoint transaction, on a connection of
// its own, which can be given up to a handler that will not let go of it.
//
// Each command runs under a savepoint ([batchTx.savepoint]); its fenced
// writes are queued ([batchTx.write]), not sent: the queue goes out in one
// round trip when something needs the transaction (a step's first
// statement, see [stepTx]) or when the batch ends ([batchTx.flushWith]).
type batchTx struct {
	e    *Engine
	conn *pgxpool.Conn
	tx   pgx.Tx
	// ctx is the batch's context: the queued writes are sent with it, also
	// when a step's statement is what sends them. A step's own context ends
	// with its timeout; the batch's writes must not.
	ctx context.Context
	// abandoned is set when the connection was given up to a handler.
	abandoned bool
	// committed is set once the batch's COMMIT, sent in a pgx batch rather
	// than by tx.Commit, succeeded: tx does not know it ended.
	committed bool
	// step is the span of the step attempt running now, if any.
	attempt stepSpan
	// pending are the writes queued on tx but not sent yet.
	pending []pendingOp
	// broken is set when a flush failed where no error could be returned
	// (a step took the bare connection); the batch is then lost.
	broken error
	// clean names a savepoint with nothing written after it, ready for the
	// next command, or is "" when there is none.
	clean string
	seq   int
	// outer is the batch's first savepoint, which every later one is
	// nested in, or "" when none was opened.
	outer string
	// due holds the commands written that are due now, but for those a
	// later transition of the batch deleted (see [batchTx.supersede]), each
	// with whether a direct worker runs it (or a relay publishes it); a due
	// command without an id sets dueAnon.
	due     map[uuid.UUID]bool
	dueAnon bool
	// soonest is the shortest delay of the direct commands written for
	// later (a retry's backoff, a timer) or deferred; soonestRelay that of
	// the relay rows written for later (Kafka mode's retries and timers); 0
	// when none was.
	soonest, soonestRelay time.Duration
	// clock is the running step's clock, stopped while the step waits for
	// the batch's earlier writes to be sent; nil between steps. Atomic: an
	// abandoned handler may still use the transaction.
	clock atomic.Pointer[stepClock]
	// superseded maps a saga to the command its last transition wrote for
	// a step that this batch runs at once (see [batch.continueAt]): the
	// saga's next transition deletes it.
	superseded map[uuid.UUID]uuid.UUID
	// stats are the counters of what the batch did, added to the engine's
	// when it commits: a batch rolled back and run again is counted once.
	stats statCounters
	// head, when set, is a saga's transition that the saga's next write in
	// this batch carries, in the same update (see [batch.thenRun]).
	head *chainHead
	// before, when set, runs ahead of a step's first statement, before the
	// queued writes are sent: it may queue a write that must come first
	// (see [batch.successThenSend]). It runs once.
	before func() error
	// stamped is the trace context that the last transition written
	// carries in place of the saga's own, if any (see
	// [engineTelemetry.lastStamped]).
	stamped trace.SpanContext
	// givenUp is set when the handler running now was given up (abandoned
	// past HandlerGrace, or cut on a reply worker), before its context is
	// cancelled for that and before its worker goes on: the handler's
	// later statements then fail at once, touching nothing of the batch.
	givenUp atomic.Bool
	// cut, when positive, is how long the handler run now may run before
	// it is given up, its transaction with it (see [Engine.callHandler]):
	// KafkaConfig.ReplyStepLimit, while a step runs at once on a Kafka
	// reply worker in the hybrid mode (see [batch.reply]); else 0.
	cut time.Duration
	// pauses is the engine's pausesHeard when the batch began: a pause
	// heard of since may cover a saga the batch claimed before it.
	pauses int64
	// prefetched holds the sagas of a batch of Kafka messages read before
	// they run (see [Engine.prefetchSagas]), each until its message reads it.
	prefetched map[uuid.UUID]prefetched
}

// pauseHeard reports whether a pause was announced since the batch began.
func (t *batchTx) pauseHeard() bool {
	return t.e.pausesHeard.Load() != t.pauses
}

// supersede makes the next transition of saga id written in this batch
// delete the pending command cmd.
func (t *batchTx) supersede(id, cmd uuid.UUID) {
	if t.superseded == nil {
		t.superseded = map[uuid.UUID]uuid.UUID{}
	}
	t.superseded[id] = cmd
}

// leaseMillis is how long, in milliseconds, a batch's transaction may sit
// idle before PostgreSQL ends it: longer than any step may run, up to the
// setting's largest value (see settingMillis).
func (e *Engine) leaseMillis() string {
	return settingMillis(e.maxStepTimeout(), e.cfg.HandlerGrace, 5*time.Second)
}

// settingMillis is the sum of ds in milliseconds, for a PostgreSQL setting
// in milliseconds (idle_in_transaction_session_timeout, lock_timeout), whose
// largest value is 2^31-1 ms, about 24.8 days. A longer sum is that: a step
// whose Timeout is longer (a remote step's reply awaited for 30 days, say)
// made every batch of the engine fail at its BEGIN ("invalid value for
// parameter"), and one of time.Duration's longest wrapped the sum negative.
func settingMillis(ds ...time.Duration) string {
	return strconv.FormatInt(min(sumCapped(ds...).Milliseconds(), math.MaxInt32), 10)
}

// beginLocals sets, for the transaction, in a statement that a pipeline
// can hold: the lease in database time (a worker that stops talking to
// PostgreSQL while it holds claims, paused or partitioned, loses its
// session and with it the claims and the uncommitted steps), and a check
// that notices a vanished client while a statement runs.
const beginLocals = "SELECT set_config('idle_in_transaction_session_timeout', $1, true), " +
	"set_config('client_connection_check_interval', '1000', true)"

// beginBatchWith acquires a connection (waiting at most as long as acquire
// allows) and begins a batch transaction on it, READ COMMITTED whatever the
// server's default, with what first queues sent in the BEGIN's round trip:
// the transaction, its settings and first's statements go in one
// pipeline. On an error the transaction is rolled back, the connection
// released, and first's results must not be used.
func (e *Engine) beginBatchWith(acquire, ctx context.Context, first func(*pgx.Batch)) (*batchTx, error) {
	pauses := e.pausesHeard.Load()
	conn, err := e.pool.Acquire(acquire)
	if err != nil {
		return nil, fmt.Errorf("saga: acquire connection: %w", err)
	}
	q := &pgx.Batch{}
	q.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	q.Queue(beginLocals, e.leaseMillis())
	first(q)
	br := conn.SendBatch(ctx, q)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		if tx != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
		conn.Release() // the pool closes a connection left in a transaction
		return nil, fmt.Errorf("saga: begin batch: %w", err)
	}
	return &batchTx{e: e, conn: conn, tx: tx, ctx: ctx, pauses: pauses}, nil
}

// end rolls back what was not committed and releases the connection,
// unless it was abandoned.
func (t *batchTx) end(ctx context.Context) {
	t.e.tel.endStep(t, nil, nil)
	if t.abandoned {
		return
	}
	if !t.committed {
		_ = t.tx.Rollback(context.WithoutCancel(ctx))
	}
	t.conn.Release()
}

// savepoint returns a savepoint with nothing written after it, opening one
// (queued, sent with the next flush) if needed.
func (t *batchTx) savepoint() string {
	if t.clean != "" {
		sp := t.clean
		t.clean = ""
		return sp
	}
	sp := t.nextSavepoint()
	if t.outer == "" {
		t.outer = sp
	}
	t.pending = append(t.pending, pendingOp{open: sp})
	return sp
}

func (t *batchTx) nextSavepoint() string {
	t.seq++
	return "sagaflow_step_" + strconv.Itoa(t.seq)
}

// write queues the fenced transition tr of a command whose savepoint is sp,
// after rolling back to sp when rollback is set, and the next command's
// savepoint unless this was the batch's last command. Nothing is sent: the
// queue goes out in one round trip when a handler needs the transaction or
// when the batch ends (see [batchTx.flush]). The saga's version and status
// move at once, so that a later command of the same saga in this batch sees
// them; if the saga had moved on (the fence did not hold), everything since
// sp is rolled back when the queue is sent, and done does not run.
func (t *batchTx) write(sg *store.Saga, tr *store.Transition, sp string, rollback, last bool,
	onFailure func(error) (*store.Transition, func()), done func()) {
	undo := ""
	if h := t.head; h != nil && h.sagaID == sg.ID {
		// The saga's transition before this one was queued for no write of
		// its own: this update carries it, from its savepoint.
		t.head = nil
		h.carry(tr)
		undo, sp = sp, h.sp
		done = both(h.done, done)
		if of := onFailure; of != nil {
			onFailure = func(err error) (*store.Transition, func()) {
				f, fd := of(err)
				h.carry(f)
				return f, both(h.done, fd)
			}
		}
	}
	if cmd, ok := t.superseded[sg.ID]; ok {
		delete(t.superseded, sg.ID)
		delete(t.due, cmd) // nothing to wake a worker for
		tr.Supersede = append(tr.Supersede, cmd)
	}
	if h := t.e.hooks.outcome; h != nil {
		h(tr)
	}
	t.e.tel.stampStep(t, sg, tr)
	w := &pendingWrite{sg: sg, tr: tr, sp: sp, undo: undo, rollback: rollback, onFailure: onFailure, done: done,
		version: sg.Version, status: sg.Status}
	if !last {
		w.next = t.nextSavepoint()
	}
	t.clean = w.next
	t.pending = append(t.pending, pendingOp{w: w})
	t.applied(w)
}

// applied moves the saga of w as its write will, once the write is sent.
func (t *batchTx) applied(w *pendingWrite) {
	w.sg.Version = w.version + 1
	w.sg.Status = w.tr.Status
	for _, m := range w.tr.Messages {
		if m.Delay > 0 {
			t.later(m.Delay, m.Delivery == store.DeliveryRelay)
			continue
		}
		if m.ID == uuid.Nil {
			t.dueAnon = true
			continue
		}
		if t.due == nil {
			t.due = map[uuid.UUID]bool{}
		}
		t.due[m.ID] = m.Delivery != store.DeliveryRelay
	}
}

// later notes a command, a relay row when relay, that comes due after d
// (see [Engine.wakeIn] and [Engine.notifyIn]).
func (t *batchTx) later(d time.Duration, relay bool) {
	soonest := &t.soonest
	if relay {
		soonest = &t.soonestRelay
	}
	if *soonest == 0 || d < *soonest {
		*soonest = d
	}
}

// ready reports whether a command that is due now was written and stays.
func (t *batchTx) ready() bool { return t.dueAnon || len(t.due) > 0 }

// readyDirect reports whether a command that is due now and that a direct
// worker runs was written and stays: a relay row wakes no worker.
func (t *batchTx) readyDirect() bool {
	if t.dueAnon {
		return true
	}
	for _, direct := range t.due {
		if direct {
			return true
		}
	}
	return false
}

// flush sends the queued writes in one round trip. See [batchTx.flushWith].
func (t *batchTx) flush() error {
	if len(t.pending) == 0 {
		return t.broken
	}
	return t.flushWith(nil)
}

// flushWith sends the queued writes, followed by what tail queues, in one
// round trip, and deals with what went wrong, in order:
//
//   - a write whose fence did not hold (the saga moved on) is rolled back to
//     its savepoint, with its handler's writes;
//   - a write of a step that succeeded but failed inside the transaction is
//     rolled back to its savepoint and replaced by the step's failure;
//
// and the writes after it, and tail, are sent again: rolling back to a
// savepoint undoes everything after it. Only the first write of a round
// trip can have its handler's statements behind it (a handler that uses the
// transaction sends the queue first), so the writes sent again lose
// nothing. Any other error is returned, and the batch is lost.
func (t *batchTx) flushWith(tail func(*pgx.Batch)) error {
	if t.broken != nil {
		return t.broken
	}
	if err := t.sendQueued(t.ctx, tail); err != nil {
		t.broken = err
		return err
	}
	return nil
}

func (t *batchTx) sendQueued(ctx context.Context, tail func(*pgx.Batch)) error {
	e := t.e
	for {
		// A failed step whose handler left the transaction aborted is rolled
		// back to its savepoint on its own, before the rest: pgx prepares a
		// pipeline's new statements before any of them runs, and PostgreSQL
		// refuses to prepare in an aborted transaction. Only the first write
		// of a round trip can have its handler's statements behind it.
		if len(t.pending) > 0 && t.pending[0].w != nil && t.pending[0].w.rollback {
			w := t.pending[0].w
			if _, err := t.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+w.undoTo()); err != nil {
				return fmt.Errorf("saga: roll back step of saga %s: %w", w.sg.ID, err)
			}
			w.rollback = false
		}
		q := &pgx.Batch{}
		for _, op := range t.pending {
			if op.open != "" {
				q.Queue("SAVEPOINT " + op.open)
				continue
			}
			w := op.w
			start := q.Len()
			if w.rollback {
				q.Queue("ROLLBACK TO SAVEPOINT " + w.undoTo())
			}
			w.update = q.Len() - start
			e.st.QueueTransition(q, w.tr)
			if w.next != "" {
				q.Queue("SAVEPOINT " + w.next)
			}
			w.n = q.Len() - start
		}
		if tail != nil {
			tail(q)
		}
		if q.Len() == 0 {
			return nil
		}
		br := t.tx.SendBatch(ctx, q)
		failed, ferr := -1, error(nil)
	read:
		for i, op := range t.pending {
			n := 1
			if op.w != nil {
				n = op.w.n
			}
			for j := range n {
				tag, err := br.Exec()
				if err != nil {
					failed, ferr = i, err
					break read
				}
				if op.w != nil && j == op.w.update {
					op.w.fenced = tag.RowsAffected() == 1
				}
			}
			if op.w != nil && !op.w.fenced {
				failed = i
				break
			}
		}
		// The tail's results are read by Close, which runs the callbacks
		// of the tail's queries (an answer the caller waits for).
		cerr := br.Close()
		done := t.pending
		if failed >= 0 {
			done = t.pending[:failed]
		}
		for _, op := range done {
			if op.w != nil && op.w.done != nil {
				op.w.done()
			}
		}
		switch {
		case failed < 0 && ferr == nil && cerr == nil:
			t.pending = nil
			return nil
		case failed < 0:
			t.pending = nil
			return errors.Join(ferr, cerr)
		case ferr != nil && !pgerr.Statement(ferr):
			return ferr
		}
		// The op at failed: every op before it is done; roll back to its
		// savepoint and send what follows again.
		op := t.pending[failed]
		rest := t.pending[failed+1:]
		if op.w == nil {
			return fmt.Errorf("saga: open savepoint %s: %w", op.open, ferr)
		}
		w := op.w
		// A step that succeeded but failed inside the transaction is undone
		// from its own savepoint; anything else from the write's.
		back := w.sp
		if ferr != nil && w.onFailure != nil {
			back = w.undoTo()
		}
		if _, err := t.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+back); err != nil {
			return fmt.Errorf("saga: roll back outcome of saga %s: %w", w.sg.ID, errors.Join(ferr, err))
		}
		w.sg.Version, w.sg.Status = w.version, w.status
		var again []pendingOp
		switch {
		case ferr == nil:
			// The saga moved on while the step ran: undo the step and ours.
			t.stats.stale.Add(1)
			e.log.InfoContext(ctx, "sagaflow refused a step commit: the saga moved on",
				slog.String("saga_id", w.sg.ID.String()), slog.Int64("version", w.version))
			if w.next != "" {
				// The next command's savepoint went with the rollback.
				again = append(again, pendingOp{open: w.next})
			}
		case w.onFailure != nil && pgerr.Content(ferr) && !w.last:
			// The step ran, and PostgreSQL refused its outcome itself
			// (bytes it cannot store, a value past a limit): retrying
			// would meet the same refusal. The handler's writes are undone
			// with it, and the saga is parked, for an operator to resume
			// once the cause is gone.
			e.log.ErrorContext(ctx, "sagaflow parked a saga whose step's outcome PostgreSQL refused",
				slog.String("saga_id", w.sg.ID.String()), slog.Any("error", ferr))
			f := &pendingWrite{sg: w.sg, tr: e.transition(w.sg, invalidOutcome(w.sg, ferr)), sp: w.sp, undo: w.undo, next: w.next,
				version: w.version, status: w.status, last: true, done: func() { t.stats.failed.Add(1) }}
			t.applied(f)
			again = append(again, pendingOp{w: f})
		case w.onFailure != nil:
			tr, done := w.onFailure(fmt.Errorf("saga: write outcome of saga %s: %w", w.sg.ID, ferr))
			f := &pendingWrite{sg: w.sg, tr: tr, sp: w.sp, undo: w.undo, next: w.next, done: done, version: w.version, status: w.status}
			t.applied(f)
			again = append(again, pendingOp{w: f})
		case pgerr.Content(ferr) && !w.last:
			// PostgreSQL refused this saga's outcome itself: park the saga
			// with a fixed, storable error rather than lose the batch (and
			// every other saga in it) on every retry.
			e.log.ErrorContext(ctx, "sagaflow parked a saga whose outcome PostgreSQL refused",
				slog.String("saga_id", w.sg.ID.String()), slog.Any("error", ferr))
			f := &pendingWrite{sg: w.sg, tr: e.transition(w.sg, invalidOutcome(w.sg, ferr)), sp: w.sp, next: w.next, version: w.version, status: w.status,
				last: true, done: func() { t.stats.failed.Add(1) }}
			t.applied(f)
			again = append(again, pendingOp{w: f})
		default:
			return fmt.Errorf("saga: write outcome of saga %s: %w", w.sg.ID, ferr)
		}
		t.pending = append(again, rest...)
	}
}

// pendingOp is what a batch queued and has not sent: a savepoint to open,
// or a command's outcome.
type pendingOp struct {
	open string        // a savepoint to open, or ""
	w    *pendingWrite // a command's outcome, or nil
}

// pendingWrite is a command's fenced transition, queued. The savepoints of
// the writes queued after the first one of a flush have nothing of their
// handlers behind them: a handler that uses the transaction sends the
// queue first.
type pendingWrite struct {
	sg *store.Saga
	tr *store.Transition
	// sp is the savepoint taken before the command's writes, its handler's
	// included; rollback says to roll back to it before writing (the
	// handler failed). undo, when set, is the savepoint that rollback (and
	// a failure inside the transaction) rolls back to instead: the step's
	// own, when the write carries a transition before the step's (see
	// [batchTx.head]); sp then undoes both.
	sp       string
	undo     string
	rollback bool
	// next is the savepoint opened after the writes for the next command,
	// or "" after the batch's last command.
	next string
	// onFailure, for a step that succeeded, gives the failure to record
	// instead when the writes fail inside the transaction (the handler left
	// it aborted); nil when there is nothing to fall back to.
	onFailure func(err error) (*store.Transition, func())
	// done runs once the fence held.
	done func()
	// The saga's version and status before the write, which moved them.
	version int64
	status  string
	// last marks the last resort for a saga whose outcome could not be
	// stored (see [invalidOutcome]): if it fails too, the batch is
	// lost.
	last bool
	// Filled while sending: how many statements, which one is the update,
	// and whether it matched the saga.
	n, update int
	fenced    bool
}

// aborted reports whether the transaction is in a failed state (a
// statement of a step failed and nothing rolled it back yet), as of the
// last message from the server.
func (t *batchTx) aborted() bool {
	return t.conn.Conn().PgConn().TxStatus() == 'E'
}

// takeHead returns the transition queued for saga id's next write (see
// [batchTx.head]), if any, and unqueues it.
func (t *batchTx) takeHead(id uuid.UUID) *chainHead {
	h := t.head
	if h == nil || h.sagaID != id {
		return nil
	}
	t.head = nil
	return h
}

// undoTo is the savepoint that undoes w's step when it failed.
func (w *pendingWrite) undoTo() string {
	if w.undo != "" {
		return w.undo
	}
	return w.sp
}

// chainHead is a transition of a saga queued for no write of its own: the
// next write of the saga in the batch carries it (see [batchTx.head]).
type chainHead struct {
	sagaID uuid.UUID
	tr     *store.Transition // its history, state and inbox key
	sp     string            // its savepoint, before everything both wrote
	done   func()            // what runs once the write that carries it is in
}

// carry folds h's transition into tr, which follows it in the same update
// (see [carryInto]).
func (h *chainHead) carry(tr *store.Transition) { carryInto(tr, h.tr) }

// step returns the transaction handed to a step.
func (t *batchTx) step() stepTx { return stepTx{Tx: t.tx, bt: t} }

// stepTx is the transaction handed to a step: the step may use it, and nest
// savepoints with Begin, but it must not end it. Before the step's first
// statement it sends the writes its batch queued, so that they come first.
type stepTx struct {
	pgx.Tx
	bt *batchTx
}

// errGivenUp is what a step's statement gets once its handler was given
// up: its transaction is gone.
var errGivenUp = errors.New("saga: this step's handler was given up (abandoned, or cut on a reply worker); its transaction is gone")

// ErrStepTxEnd is what a step's StepRun.Tx answers to Commit and Rollback:
// the engine ends the transaction (a step fails by returning an error). A
// savepoint the step begins with Tx.Begin it may commit or roll back.
var ErrStepTxEnd = errors.New("saga: a step must not commit or roll back its transaction; return an error to fail the step")

func (stepTx) Commit(context.Context) error   { return ErrStepTxEnd }
func (stepTx) Rollback(context.Context) error { return ErrStepTxEnd }

func (t stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.flush(); err != nil {
		return nil, err
	}
	return t.nested().Begin(ctx)
}

// A step's statements are watched (see [stepTx.watch]): the end of the
// step's context cancels the statement, not the batch's connection.

// nested is t as the savepoints it begins see it: its statements watched,
// without the flush (stepTx's own methods flush first).
func (t stepTx) nested() nestedTx { return nestedTx{Tx: t.Tx, step: t} }

func (t stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.flush(); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.nested().Exec(ctx, sql, args...)
}

// When the queue cannot be sent, the transaction is aborted or its
// connection gone (and the batch lost): Query and SendBatch then hand over
// the results of the step's statements on it, which carry their own errors.

func (t stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.flush(); err != nil {
		rows, _ := t.Tx.Query(ctx, sql, args...)
		rows.Close()
		return rows, err
	}
	return t.nested().Query(ctx, sql, args...)
}

func (t stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.flush(); err != nil {
		return errRow{err}
	}
	return t.nested().QueryRow(ctx, sql, args...)
}

func (t stepTx) SendBatch(ctx context.Context, q *pgx.Batch) pgx.BatchResults {
	_ = t.flush()
	return t.nested().SendBatch(ctx, q)
}

func (t stepTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.flush(); err != nil {
		return 0, err
	}
	return t.nested().CopyFrom(ctx, table, columns, src)
}

func (t stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.flush(); err != nil {
		return nil, err
	}
	return t.nested().Prepare(ctx, name, sql)
}

// LargeObjects and Conn hand out what runs statements without this wrapper:
// the queue is sent first; if that fails, the batch is lost.
func (t stepTx) LargeObjects() pgx.LargeObjects {
	_ = t.flush()
	return t.Tx.LargeObjects()
}

func (t stepTx) Conn() *pgx.Conn {
	_ = t.flush()
	return t.Tx.Conn()
}

// flush sends the batch's queued writes before the step's own statement,
// with the step's clock stopped: the step is not charged for them.
func (t stepTx) flush() error {
	if t.bt.givenUp.Load() {
		return errGivenUp
	}
	if f := t.bt.before; f != nil {
		t.bt.before = nil
		if err := f(); err != nil {
			return err
		}
	}
	if len(t.bt.pending) == 0 {
		return t.bt.broken
	}
	clock := t.bt.clock.Load()
	clock.pause()
	defer clock.resume()
	return t.bt.flush()
}

// errRow is the result of a query that was never sent.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// both returns a function that runs a then b, either of which may be nil.
func both(a, b func()) func() {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	}
	return func() { a(); b() }
}
