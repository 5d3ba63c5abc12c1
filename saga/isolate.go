package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// abandonedStep is what is needed to record an abandoned attempt after its
// transaction is gone.
type abandonedStep struct {
	saga    store.Saga
	def     *compiled
	idx     int
	dir     steps.Direction
	attempt int
	err     error
	elapsed time.Duration
	// historyOnly is set when the step ran at once after a reply or a
	// wait's end, which went with its transaction: the saga never was where
	// the attempt started, so only the attempt's history entry is written
	// (see [Engine.recordAbandoned]).
	historyOnly bool
	// cut is set when the step ran at once on a Kafka reply worker and
	// was cut at KafkaConfig.ReplyStepLimit (see [batch.abandon]): its
	// attempt is not recorded, and the step is handed to a worker.
	cut bool
}

// abandon gives the connection up to a handler that ignored its cancelled
// context: it is closed, which ends the transaction on the server, and never
// touched again (the handler may still be using it). The abandoned attempt
// is then recorded, with its retry, in a transaction of its own.
//
// Until the attempt is recorded, this engine's workers leave the saga's
// commands alone (see [Engine.recording]): the command of the abandoned
// attempt is claimable again as soon as the server ends the transaction,
// and a worker that took it first would run the attempt again uncounted,
// and could end the saga before the abandoned attempt was in its history.
func (e *Engine) abandon(ctx context.Context, t *batchTx, b *batch) error {
	t.abandoned = true
	if a := b.abandoned; a != nil && !a.cut {
		e.recording.Store(a.saga.ID, recordingNow{})
		defer func() { e.recording.Store(a.saga.ID, time.Now()) }()
	}
	_ = t.conn.Hijack().PgConn().Conn().Close()
	if b.abandoned == nil || b.abandoned.cut {
		// A parallel step's branch: its command is still pending and runs
		// again once the server notices the closed connection. Or a step
		// cut on a reply worker: the reply comes again, and is written
		// with the step's command for a worker.
		return nil
	}
	if h := e.hooks.beforeRecordAbandoned; h != nil {
		h(b.abandoned.saga.ID)
	}
	if err := e.recordAbandoned(context.WithoutCancel(ctx), b.abandoned); !errors.Is(err, errAbandoned) {
		return err
	}
	return nil
}

// recordingNow marks a saga in [Engine.recording] whose abandoned attempt
// is being recorded; once it is, the time it was recorded at.
type recordingNow struct{}

// recordedFresh is how long after an abandoned attempt was recorded a
// worker of the engine reads its saga again before running a command of it:
// a claim whose statement began before the record committed found the saga
// as it was before the record (see [batch.recorded]).
const recordedFresh = 10 * time.Second

// recordAbandoned writes the failure of an abandoned attempt in a
// transaction of its own, fenced on the version the attempt started from,
// so that the attempt counts, is retried after its backoff or compensated,
// and never blocks its saga. It first waits for the saga's execution lock:
// the abandoned transaction holds it until its server process notices the
// closed connection, and whoever runs the saga next must see this record.
func (e *Engine) recordAbandoned(ctx context.Context, a *abandonedStep) error {
	tr := e.transition(&a.saga, e.machine.failure(&a.saga, a.def, a.idx, a.dir, a.attempt, a.err, a.elapsed))
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		wait := settingMillis(e.maxStepTimeout(), e.cfg.HandlerGrace)
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+wait+"; SAVEPOINT sagaflow_abandoned"); err != nil {
			return err
		}
		if err := e.st.LockSaga(ctx, tx, a.saga.ID); err != nil {
			return err
		}
		// A step run at once after a reply or a wait's end: no fence could
		// tell its saga's position (the version it would have had may be
		// another write's, a cancel's say), so nothing but the history.
		fenced := false
		if !a.historyOnly {
			var err error
			if fenced, err = e.st.ApplyTransition(ctx, tx, tr, "sagaflow_abandoned"); err != nil {
				return err
			}
		}
		switch {
		case !fenced:
			// Another worker ran the step meanwhile; the timeline still
			// shows the abandoned attempt.
			failed := tr.History[0]
			failed.Detail = durationDetail(a.elapsed, map[string]any{"superseded": true})
			return e.st.InsertHistory(ctx, tx, &failed)
		case len(tr.Messages) > 0:
			return e.st.Notify(ctx, tx, e.cfg.CommandTopic)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("saga: record abandoned step of saga %s: %w", a.saga.ID, err)
	}
	return errAbandoned
}

// recovered runs f, turning a panic into a *panicError with the stack.
func recovered(f func() ([]byte, error)) (out []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			out, err = nil, &panicError{value: v, stack: debug.Stack()}
		}
	}()
	return f()
}

var errAbandoned = errors.New("saga: handler ignored its cancelled context past the grace period; its connection was closed")

// abandonedError is callHandler's errAbandoned, saying what cancelled the
// context the handler ignored; cut says that the handler was not waited
// for: it ran past the reply worker's limit (see [batchTx.cut]).
type abandonedError struct {
	why string
	cut bool
}

func (e *abandonedError) Error() string {
	return errAbandoned.Error() + " (cancelled by " + e.why + ")"
}
func (e *abandonedError) Unwrap() error { return errAbandoned }

type panicError struct {
	value any
	stack []byte
}

func (p *panicError) Error() string { return fmt.Sprintf("panic: %v", p.value) }

// callHandler runs the step function, recovering panics and enforcing the
// timeout. A handler that ignores its cancelled context for longer than
// HandlerGrace is abandoned: callHandler returns errAbandoned and the caller
// must not use the transaction again.
//
// The step is charged only for its own time: while its first statement
// waits for the batch to send the writes of earlier steps (which may wait on
// row locks held elsewhere), its clock stops. A cancel request for the saga
// cancels the handler's context with a [cancelRequested] cause, when the
// step is cancellable: a forward step before the pivot.
func (e *Engine) callHandler(ctx context.Context, t *batchTx, run *StepRun, cancellable bool, timeout time.Duration,
	call func(ctx context.Context) ([]byte, error)) ([]byte, error) {
	base, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	clock := newStepClock(timeout, func() { cancel(errStepTimedOut) })
	defer clock.stop()
	stepCtx := &stepContext{Context: base, clock: clock}
	t.clock.Store(clock)
	defer t.clock.Store(nil)
	if cancellable {
		e.running.start(run.SagaID, cancel)
		defer e.running.stop(run.SagaID)
	}
	type result struct {
		state []byte
		err   error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() {
			if v := recover(); v != nil {
				r = result{err: &panicError{value: v, stack: debug.Stack()}}
			}
			done <- r
		}()
		r.state, r.err = call(stepCtx)
	}()
	var limit <-chan time.Time
	if t.cut > 0 {
		timer := time.NewTimer(t.cut)
		defer timer.Stop()
		limit = timer.C
	}
	// cut gives the handler up at the reply worker's limit, unless it
	// returned just now: run at once on a Kafka reply worker, it holds up
	// the replies behind it, so it is not waited for, and its transaction
	// is given up (see [batchTx.cut]).
	cut := func() (result, bool) {
		select {
		case r := <-done:
			return r, false
		default:
			t.givenUp.Store(true) // before the cancel, which the handler may be waiting for
			cancel(errCutOnReplyWorker)
			e.stats.cut.Add(1)
			return result{err: &abandonedError{why: "the reply worker's limit (KafkaConfig.ReplyStepLimit)", cut: true}}, true
		}
	}
	var r result
	select {
	case r = <-done:
	case <-limit:
		var gaveUp bool
		if r, gaveUp = cut(); gaveUp {
			return nil, r.err
		}
	case <-base.Done():
		grace := time.NewTimer(e.cfg.HandlerGrace)
		defer grace.Stop()
		select {
		case r = <-done:
		case <-limit:
			var gaveUp bool
			if r, gaveUp = cut(); gaveUp {
				return nil, r.err
			}
		case <-grace.C:
			t.givenUp.Store(true)
			e.stats.abandoned.Add(1)
			why := "its timeout"
			var cr *cancelRequested
			if errors.As(context.Cause(base), &cr) {
				why = "a cancel request"
			} else if !errors.Is(context.Cause(base), errStepTimedOut) {
				why = "the engine's stop"
			}
			e.log.ErrorContext(ctx, "sagaflow abandoned a step handler that ignored its cancelled context",
				slog.String("step_key", run.Key.String()), slog.String("cancelled_by", why), slog.Duration("timeout", timeout))
			return nil, &abandonedError{why: why}
		}
	}
	cause := context.Cause(base)
	timedOut := errors.Is(cause, errStepTimedOut) && ctx.Err() == nil
	if r.err != nil && timedOut {
		// The attempt ran out of time; whatever it returned, say so.
		if steps.Code(r.err) == "" {
			r.err = steps.WithCode(CodeTimeout, fmt.Errorf("step %q timed out after %s: %w", run.Step, timeout, r.err))
		}
	}
	var cr *cancelRequested
	if r.err != nil && errors.As(cause, &cr) && ctx.Err() == nil {
		// Interrupted by a cancel request: the request takes the
		// failure's place.
		return r.state, cr
	}
	if r.err == nil && base.Err() != nil && ctx.Err() == nil {
		if t.aborted() {
			// It swallowed the error of the statement its context's end
			// cut (57014), and its transaction is aborted: nothing it wrote
			// is left. The end of its context is the outcome, not a
			// tx_aborted failure (found by review32).
			if errors.As(cause, &cr) {
				return r.state, cr
			}
			if timedOut {
				return nil, steps.WithCode(CodeTimeout, fmt.Errorf("step %q timed out after %s: its statement was cancelled, and its transaction is aborted", run.Step, timeout))
			}
		}
		// Finished after its deadline (or a cancel request) but without
		// error: accept the result; its writes are still in the transaction
		// and commit with it.
		return r.state, nil
	}
	return r.state, r.err
}

// errStepTimedOut is the cause of a step context whose time ran out.
var errStepTimedOut = errors.New("saga: step timed out")

// errCutOnReplyWorker is the cause of the context of a step run at once on
// a Kafka reply worker past KafkaConfig.ReplyStepLimit: the step runs again
// on an engine worker.
var errCutOnReplyWorker = errors.New("saga: the step ran past the reply worker's limit (KafkaConfig.ReplyStepLimit); it runs again on an engine worker")

// stepContext is a step's context: its Err reports a timeout as
// context.DeadlineExceeded, and its Deadline is the step clock's, which
// moves while the clock is stopped.
type stepContext struct {
	context.Context
	clock *stepClock
}

func (c *stepContext) Deadline() (time.Time, bool) { return c.clock.deadline() }

func (c *stepContext) Err() error {
	err := c.Context.Err()
	if err != nil && errors.Is(context.Cause(c.Context), errStepTimedOut) {
		return context.DeadlineExceeded
	}
	return err
}

// stepClock is a step's timeout that can be stopped while the engine, not
// the step, holds the step up.
type stepClock struct {
	mu       sync.Mutex
	end      time.Time // when the time runs out, while running
	left     time.Duration
	paused   int // nested pauses
	timer    *time.Timer
	expired  bool
	onExpire func()
}

func newStepClock(timeout time.Duration, onExpire func()) *stepClock {
	c := &stepClock{end: time.Now().Add(timeout), onExpire: onExpire}
	c.timer = time.AfterFunc(timeout, c.fire)
	return c
}

func (c *stepClock) fire() {
	c.mu.Lock()
	if c.paused > 0 || c.expired {
		c.mu.Unlock()
		return
	}
	if d := time.Until(c.end); d > 0 {
		// Resumed after a pause: the deadline moved.
		c.timer.Reset(d)
		c.mu.Unlock()
		return
	}
	c.expired = true
	c.mu.Unlock()
	c.onExpire()
}

// pause stops the clock until the matching resume.
func (c *stepClock) pause() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.paused == 0 && !c.expired {
		c.left = time.Until(c.end)
	}
	c.paused++
}

func (c *stepClock) resume() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.paused--
	if c.paused > 0 || c.expired {
		return
	}
	c.end = time.Now().Add(c.left)
	c.timer.Reset(max(c.left, 0))
}

func (c *stepClock) deadline() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.paused > 0 {
		return time.Now().Add(c.left), true
	}
	return c.end, true
}

func (c *stepClock) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.expired = true
	c.timer.Stop()
}
