package saga

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/store"
)

// Starts made on the engine's own pool ([Start], not [StartTx]) that run at
// the same time commit together, with a concurrency key or without (not
// those with StartOpts.NoWait, which lock their key first): each is a statement of its own, and up to
// startGroupMax of them share one transaction and one commit. A start
// returns, as before, once its saga has committed.
//
// Why: a start was a transaction of its own, and under load most of its
// time was spent waiting for its commit record to reach the disk, one
// commit after the other. The steps that follow already commit in batches.
//
// There is no added wait: a start that finds no group committing goes at
// once, alone if nothing else waits; starts that arrive while a group
// commits wait for it to end and then go together. One group at a time is
// what the measurements favoured (docs/benchmarks.md): more at a time meant
// smaller groups and more commits.
//
// If a group fails for any reason (a start that PostgreSQL refuses, a lock
// wait longer than startGroupLockWait, a lost connection), each of its
// starts runs again alone, at the same time as the others, so that each
// gets its own result and one bad start holds back no other. Running a start
// again is safe even if its group did commit: its id is fixed, and the start
// then finds its own saga, as a retried start does.
const startGroupMax = 128

// startGroupLockWait is how long a group waits for a row lock before its
// starts run alone.
const startGroupLockWait = 50 * time.Millisecond

// startGroupTimeout bounds one group's round trip. The callers stop
// waiting when their own context ends.
const startGroupTimeout = time.Minute

// startReq is one start waiting to be committed with others.
type startReq struct {
	sg       *store.Saga
	check    store.Check
	deadline time.Duration
	rows     *store.Transition
	key      string // the business key, to order a group's inserts
	// admit, for a start with a concurrency key, is its admission: queued
	// right after its insert, in the same transaction (concurrency.go).
	admit *admitReq

	// state: reqWaiting, reqTaken, reqGivenUp or reqSent.
	state    atomic.Int32
	inserted bool
	err      error
	done     chan struct{}
}

// admitReq is a keyed start's admission under its concurrency key.
type admitReq struct {
	name, key string
	limit     int
	command   uuid.UUID     // the first step's command, held while the saga waits
	checkAt   time.Duration // its rescue deadline once admitted
	got       store.Admission
}

// queue queues r's insert and, for a keyed start, its admission on b;
// inserted is set when b's results are read.
func (r *startReq) queue(e *Engine, b *pgx.Batch, inserted *bool) {
	e.st.QueueStartSaga(b, r.sg, r.check, r.deadline, r.rows, e.cfg.CommandTopic, inserted)
	if a := r.admit; a != nil {
		e.st.QueueAdmitStarted(b, &a.got, r.sg.ID, a.name, a.key, a.limit, a.command, a.checkAt)
	}
}

// started reports whether r's saga was inserted (and, keyed, admitted or
// queued under its key), from the results of its queued statements.
func (r *startReq) started(inserted bool) bool {
	if r.admit != nil {
		return r.admit.got.Position >= 0
	}
	return inserted
}

// The states of a startReq. A caller gives up (its context ended) while its
// start is waiting or taken: the group then leaves it out, and nothing is
// written. Once the group has its connection it marks its starts sent, and
// from then on a caller that gives up cannot know whether its saga started.
const (
	reqWaiting int32 = iota // queued
	reqTaken                // in a group that waits for a connection
	reqGivenUp              // its caller gave up before it was sent
	reqSent                 // on its way to PostgreSQL
)

// startGroup queues the starts that wait for a slot.
type startGroup struct {
	mu      sync.Mutex
	waiting []*startReq
	running bool         // a group is committing
	grouped atomic.Int64 // starts committed in a group of more than one
}

func newStartGroup() *startGroup {
	return &startGroup{}
}

// count is how many starts were committed in a group of more than one; 0
// for an engine that was not made by [New].
func (g *startGroup) count() int64 {
	if g == nil {
		return 0
	}
	return g.grouped.Load()
}

// start commits the start r with whatever other starts wait, and reports
// whether its saga was inserted (false: its business key or id was taken).
func (g *startGroup) start(ctx context.Context, e *Engine, r *startReq) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	r.done = make(chan struct{})
	g.mu.Lock()
	g.waiting = append(g.waiting, r)
	var group []*startReq
	if !g.running {
		g.running = true
		group = g.take()
	}
	g.mu.Unlock()
	if group != nil {
		go g.run(e, group)
	}
	select {
	case <-r.done:
		return r.inserted, r.err
	case <-ctx.Done():
		if r.state.CompareAndSwap(reqWaiting, reqGivenUp) || r.state.CompareAndSwap(reqTaken, reqGivenUp) {
			return false, fmt.Errorf("%w (nothing was started)", ctx.Err())
		}
		// Sent: it may commit, or may have committed already.
		return false, fmt.Errorf("%w (the saga may have been started: its statement had been sent; start it again with the same StartOpts.ID or business key to find out)", ctx.Err())
	}
}

// take removes up to startGroupMax waiting starts, skipping those given
// up, and marks them taken. Called with g.mu held.
func (g *startGroup) take() []*startReq {
	var group []*startReq
	n := 0
	for ; n < len(g.waiting) && len(group) < startGroupMax; n++ {
		r := g.waiting[n]
		if r.state.CompareAndSwap(reqWaiting, reqTaken) {
			group = append(group, r)
		}
	}
	g.waiting = append(g.waiting[:0], g.waiting[n:]...)
	return group
}

// run commits group, then the next waiting starts, until none wait.
func (g *startGroup) run(e *Engine, group []*startReq) {
	for len(group) > 0 {
		g.commit(e, group)
		g.mu.Lock()
		group = g.take()
		if len(group) == 0 {
			g.running = false
		}
		g.mu.Unlock()
	}
}

// commit runs group's starts in one transaction, BEGIN to COMMIT in one
// round trip. If that fails, each start runs again alone, all at once, and
// commit returns without waiting for them.
func (g *startGroup) commit(e *Engine, group []*startReq) {
	// One order for every group: two groups that insert the same business
	// keys (or ids) wait for each other in the same order rather than
	// deadlock.
	slices.SortFunc(group, func(a, b *startReq) int {
		return cmp.Or(cmp.Compare(a.sg.Name, b.sg.Name), cmp.Compare(a.ckey(), b.ckey()), cmp.Compare(a.key, b.key),
			slices.Compare(a.sg.ID[:], b.sg.ID[:]))
	})
	ctx, cancel := context.WithTimeout(context.Background(), startGroupTimeout)
	group, err := g.commitTogether(ctx, e, group)
	cancel()
	if err == nil {
		if len(group) > 1 {
			g.grouped.Add(int64(len(group)))
		}
		for _, r := range group {
			close(r.done)
		}
		return
	}
	e.log.Debug("sagaflow: a group of starts failed; each runs again alone", "starts", len(group), "error", err)
	for _, r := range group {
		go alone(e, r)
	}
}

// ckey is r's concurrency key, "" for none: a group's key rows are
// written in one order too.
func (r *startReq) ckey() string {
	if r.admit == nil {
		return ""
	}
	return r.admit.key
}

// alone runs r on a connection of its own, unless its caller gave up before
// it was sent.
func alone(e *Engine, r *startReq) {
	defer close(r.done)
	ctx, cancel := context.WithTimeout(context.Background(), startGroupTimeout)
	defer cancel()
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		r.err = fmt.Errorf("start saga %s %s: %w", r.sg.Name, r.sg.ID, err)
		return
	}
	defer conn.Release()
	if !r.state.CompareAndSwap(reqTaken, reqSent) && r.state.Load() != reqSent {
		return // given up: nothing was sent
	}
	if r.admit == nil {
		r.inserted, r.err = e.st.StartSaga(ctx, conn, r.sg, r.check, r.deadline, r.rows, e.cfg.CommandTopic, false)
		return
	}
	// The insert and the admission in one pipeline: one implicit
	// transaction.
	var inserted bool
	b := &pgx.Batch{}
	r.queue(e, b, &inserted)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		r.err = fmt.Errorf("start %s with concurrency key %q: %w", r.sg.Name, r.admit.key, err)
		return
	}
	r.inserted = r.started(inserted)
}

// commitTogether sends group's starts, left out those whose callers gave up
// while it waited for a connection (they are done, with nothing written), and
// returns the starts it sent.
func (g *startGroup) commitTogether(ctx context.Context, e *Engine, group []*startReq) ([]*startReq, error) {
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		return group, err
	}
	defer conn.Release()
	sent := group[:0]
	for _, r := range group {
		if r.state.CompareAndSwap(reqTaken, reqSent) {
			sent = append(sent, r)
		} else {
			close(r.done) // given up: its caller has returned
		}
	}
	if len(sent) == 0 {
		return sent, nil
	}
	inserted := make([]bool, len(sent))
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	// A start whose business key (or id) another transaction has just
	// inserted waits for that transaction, which may be a caller's long
	// one (StartTx). The group does not wait with it: it fails, and that
	// start waits alone.
	b.Queue("SET LOCAL lock_timeout = " + strconv.Itoa(int(startGroupLockWait.Milliseconds())))
	for i, r := range sent {
		r.queue(e, b, &inserted[i])
	}
	store.QueueCommit(b, nil)
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		// A statement failed: the transaction is aborted, not ended. A
		// connection released inside it would be closed by the pool.
		_ = tx.Rollback(ctx)
		return sent, err
	}
	for i, r := range sent {
		r.inserted = r.started(inserted[i])
	}
	return sent, nil
}
