package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/outbox"
)

// Relay publishes the outbox's relay rows to Kafka. See the package
// documentation for what it guarantees.
type Relay struct {
	pool *pgxpool.Pool
	w    Writer
	cfg  Config
	st   *store.Store
	// outbox deletes published rows past Retention.
	outbox *outbox.Outbox
	log    *slog.Logger
	wake   chan struct{}

	cycleMu sync.Mutex // one cycle at a time per Relay

	life lifecycle.Lifecycle

	stats counters
	hooks testHooks
	// tel is the relay's tracer and instruments (see telemetry.go).
	tel *relayTelemetry
	// listening is true while the LISTEN connection is in place.
	listening atomic.Bool
}

// testHooks let tests stop a cycle at chosen points.
type testHooks struct {
	// afterClaim runs after each claim, with the number of rows claimed.
	afterClaim func(rows int)
	// afterPublish runs after the writer returned (the broker acknowledged
	// the batch, or some of it) and before the rows are marked; an error
	// aborts the cycle as a crash would: the transaction rolls back and
	// the rows stay pending.
	afterPublish func() error
}

type counters struct {
	published, retries, dead, writes, writeFailures atomic.Int64
	outageWaits, outageStreak                       atomic.Int64
	latencyLast, latencyTotal                       atomic.Int64 // nanoseconds
}

// New returns a relay that reads the outbox of cfg.Schema on pool and
// publishes through w. A nil cfg means the defaults. The schema must have
// been migrated with migrations.Migrate. The relay does not close w.
func New(pool *pgxpool.Pool, w Writer, cfg *Config) (*Relay, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if w == nil {
		return nil, fmt.Errorf("%w: writer is nil", ErrInvalidConfig)
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	ob, err := outbox.New(pool, c.Schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	r := &Relay{pool: pool, w: w, cfg: c, st: st, outbox: ob, log: telemetry.Logger(c.Logger), wake: make(chan struct{}, 1)}
	if r.tel, err = newRelayTelemetry(r); err != nil {
		return nil, fmt.Errorf("relay: telemetry: %w", err)
	}
	return r, nil
}

// Wake makes a running relay look for due rows now instead of at its next
// poll. Call it after committing rows that should go out at once, when no
// notification announces them. It never blocks.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Start launches the relay's loop and its notification listener and returns
// at once. Calling it on a running relay does nothing; calling it while Stop
// is in progress returns an error. Cancelling ctx stops the relay hard, as
// [Relay.StopAndCancel] does.
func (r *Relay) Start(ctx context.Context) error {
	started, err := r.life.Start(ctx, func(fetch, work context.Context, wg *sync.WaitGroup) {
		if !r.cfg.Sweeper {
			wg.Go(func() { r.listen(fetch) })
		}
		wg.Go(func() { r.loop(fetch, work) })
		if r.cfg.Retention > 0 {
			wg.Go(func() { r.retain(fetch) })
		}
	})
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	if started {
		r.log.InfoContext(ctx, "sagaflow relay started", slog.String("schema", r.cfg.Schema),
			slog.Int("batch_size", r.cfg.BatchSize))
	}
	return nil
}

// Stop stops claiming new batches, lets the batch in flight be published and
// marked, and returns once the relay's goroutines have exited. If ctx ends
// first, Stop cancels the batch in flight (its rows stay pending, and are
// published again later if the broker had them already), waits for the
// goroutines and returns ctx.Err(). Stop on a relay that is not running
// returns nil; it is safe to call concurrently and repeatedly.
func (r *Relay) Stop(ctx context.Context) error {
	return r.stop(ctx, false)
}

// StopAndCancel stops the relay at once: it cancels the batch in flight,
// whose transaction rolls back, and waits for the goroutines to exit or for
// ctx to end.
func (r *Relay) StopAndCancel(ctx context.Context) error {
	return r.stop(ctx, true)
}

func (r *Relay) stop(ctx context.Context, hard bool) error {
	stopped, err := r.life.Stop(ctx, hard)
	if stopped && err == nil {
		r.log.InfoContext(ctx, "sagaflow relay stopped", slog.String("schema", r.cfg.Schema))
	}
	return err
}

// loop drains due rows (see [Relay.drain]) until fetchCtx ends. Batches
// run on workCtx, so a graceful stop lets the batch in flight finish.
func (r *Relay) loop(fetchCtx, workCtx context.Context) {
	failures := 0
	for fetchCtx.Err() == nil {
		claimed := time.Now()
		res, err := r.drain(fetchCtx, workCtx)
		if err != nil {
			if fetchCtx.Err() != nil {
				return
			}
			failures++
			r.log.ErrorContext(fetchCtx, "sagaflow relay cycle failed; its rows stay pending",
				slog.Any("error", err), slog.Int("consecutive_failures", failures))
			if !lifecycle.Sleep(fetchCtx, lifecycle.Backoff(failures)) {
				return
			}
			continue
		}
		failures = 0
		if res.outage {
			// The broker is down: claiming the next batch would only fail
			// it too. Wake-ups do not shorten the pause.
			if !lifecycle.Sleep(fetchCtx, res.pause) {
				return
			}
			continue
		}
		if res.claimed >= r.cfg.BatchSize {
			continue // more may be due
		}
		// Rows that came due since the drain (or its last claim) began
		// count (it may not have claimed them), not only rows due later.
		// The drain asked already, unless it ended otherwise than short.
		wait := r.cfg.PollInterval
		d, ok := res.look.d, res.look.ok
		if !res.look.taken {
			var err error
			if d, ok, err = r.st.NextRelayDue(fetchCtx, r.pool, time.Since(claimed)); err != nil {
				ok = false
			}
		}
		if ok {
			wait = min(wait, max(d, time.Millisecond))
		}
		timer := time.NewTimer(wait)
		select {
		case <-fetchCtx.Done():
			timer.Stop()
			return
		case <-r.wake:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// listen wakes the loop when PostgreSQL announces new messages on the
// schema's channel. If the listening connection fails, the loop keeps
// polling until it is back.
func (r *Relay) listen(ctx context.Context) {
	lifecycle.Listen(ctx, r.pool, r.st.Channel(), r.log, "relay", func(string) { r.Wake() }, &r.listening)
}

// RunOnce runs one claim-publish-mark cycle, whether or not the relay is
// running, and reports how many rows it marked published and how many it
// marked failed (retried later, or parked as dead). It returns an error, and
// leaves the claimed rows pending, when the database or the cycle failed;
// a batch the broker refused is not an error. For tests and tools.
func (r *Relay) RunOnce(ctx context.Context) (published, failed int, err error) {
	res, err := r.cycle(ctx)
	return res.published, res.failed, err
}

type cycleResult struct {
	claimed, published, failed int
	// look is the look ahead taken in the last claim's transaction, if
	// one was (see [lookAhead]).
	look lookAhead
	// outage: nothing was published and some rows failed because the
	// broker is down; the loop waits pause before it claims again.
	outage bool
	pause  time.Duration
}

// overlapMinConns is the least pool size with which drain claims a batch
// while another is written: the relay then holds a connection for the batch
// being written, one for the batch being claimed, and one for LISTEN. With
// fewer, the claim would wait for a connection only the relay can free.
// With one more, the batch written before is marked on a fourth connection
// while the next is claimed, instead of before the claim.
const overlapMinConns = 3

// batch is one claimed batch on its way through the relay: claimed (its
// rows locked by an open transaction on conn), prepared, written, then
// settled (marked and committed) or released (rolled back: its rows stay
// pending as they were).
type batch struct {
	conn *pgxpool.Conn // nil once settled or released
	tx   pgx.Tx
	rows []store.RelayMessage

	// Set by prepare.
	msgs   []kafka.Message
	owners []*store.RelayMessage // parallel to msgs
	held   int                   // rows held back by the ordering guard

	// Set by prepare and send.
	published []uuid.UUID
	failures  []store.RelayFailure
	dead      []*store.RelayMessage // parallel to the Dead entries of failures
	// unpublished holds the ordering keys (see holdBack) of the rows that
	// were not published: failed, dead or held back.
	unpublished map[string]struct{}
	// deferred are the rows the writer held back behind a failed earlier
	// message of their key (PublishError.NotSent): due again with it,
	// spending no attempt.
	deferred       []store.RelayFailure
	retries, waits int
	outage         bool
	pause          time.Duration
}

func (b *batch) notPublished(row *store.RelayMessage) {
	if b.unpublished == nil {
		b.unpublished = map[string]struct{}{}
	}
	b.unpublished[row.AggregateID] = struct{}{}
}

// lookAhead is [store.Store.NextRelayDue]'s answer, asked in the
// transaction of a drain's last claim, in the round trip that ends it (its
// COMMIT, or the ROLLBACK of a claim that found nothing), instead of in a
// round trip of its own after the drain: the rows that came due since that
// claim began, or come due later, count.
type lookAhead struct {
	taken, ok bool
	d         time.Duration
}

func (b *batch) result() cycleResult {
	return cycleResult{claimed: len(b.rows), published: len(b.published), failed: len(b.failures),
		outage: b.outage, pause: b.pause}
}

// release rolls back b's transaction, unless it was committed, and returns
// its connection to the pool: the rows it held stay pending as they were.
// It does nothing to a batch already settled or released.
func (b *batch) release(ctx context.Context) {
	b.releaseLooking(ctx, nil, nil)
}

// releaseLooking is release, with the look ahead asked before the rollback
// in its round trip when lk is set (and left untaken if that failed).
func (b *batch) releaseLooking(ctx context.Context, st *store.Store, lk *lookAhead) {
	if b == nil || b.conn == nil {
		return
	}
	if b.conn.Conn().PgConn().TxStatus() != 'I' {
		// A failed rollback leaves the connection in a transaction, and
		// the pool closes such a connection instead of reusing it.
		if lk == nil || b.conn.Conn().PgConn().TxStatus() != 'T' {
			_ = b.tx.Rollback(context.WithoutCancel(ctx))
		} else {
			var l lookAhead
			q := &pgx.Batch{}
			st.QueueNextRelayDueInClaim(q, &l.d, &l.ok)
			q.Queue("ROLLBACK")
			if err := b.conn.SendBatch(context.WithoutCancel(ctx), q).Close(); err == nil {
				l.taken = true
				*lk = l
			}
		}
	}
	b.conn.Release()
	b.conn = nil
}

// cycle claims a batch, publishes it with one write, and marks its rows, in
// one transaction that touches nothing but those outbox rows.
func (r *Relay) cycle(ctx context.Context) (cycleResult, error) {
	r.cycleMu.Lock()
	defer r.cycleMu.Unlock()
	b, err := r.claim(ctx, nil)
	if err != nil {
		return cycleResult{}, err
	}
	defer b.release(ctx) // a no-op once settled
	if len(b.rows) == 0 {
		return cycleResult{}, nil
	}
	r.prepare(b, nil)
	if err := r.send(ctx, b); err != nil {
		return cycleResult{claimed: len(b.rows)}, err
	}
	if err := r.settle(ctx, b, nil); err != nil {
		return cycleResult{claimed: len(b.rows)}, err
	}
	return b.result(), nil
}

// drain publishes batch after batch for as long as they come back full,
// with the database's work beside the broker's: while batch N is written,
// batch N-1 is marked and committed and batch N+1 is claimed in a
// transaction of its own (both at once when the pool has a connection for
// each, else one after the other). Writes stay serial, in claim order, and
// batch N+1 is written only once N-1 has committed.
//
// Before batch N+1 is written, its rows whose ordering key had a message in
// batch N that was not published are held back (see [holdBack]): they are
// neither written nor marked, and stay pending as they were. A batch that
// held rows back is not overlapped with the next claim: the next claim
// comes after it committed, so the rows it held are claimed again ahead of
// the later rows of their key. When batch N ends in an outage, or with an
// error, batch N+1 is released without being written.
//
// drain returns the last batch's result once a claim comes back short (the
// backlog is drained), a batch held rows back or ended in an outage, on an
// error, or when fetchCtx ends (a graceful stop: the batch in flight is
// published and marked, the one claimed behind it released).
func (r *Relay) drain(fetchCtx, workCtx context.Context) (cycleResult, error) {
	r.cycleMu.Lock()
	defer r.cycleMu.Unlock()
	cur, err := r.claim(workCtx, nil)
	if err != nil {
		return cycleResult{}, err
	}
	r.prepare(cur, nil)
	canOverlap := r.pool.Config().MaxConns >= overlapMinConns
	canSettleBesideClaim := r.pool.Config().MaxConns >= overlapMinConns+1
	var prev *batch // written, not yet settled
	claims := 0
	for {
		if len(cur.rows) == 0 {
			// prev is settled first, so that the look ahead, in cur's
			// transaction, sees the retries prev wrote.
			var err error
			if prev != nil {
				err = r.settle(workCtx, prev, nil)
			}
			var res cycleResult
			cur.releaseLooking(workCtx, r.st, &res.look)
			return res, err
		}
		overlap := canOverlap && cur.held == 0 && len(cur.rows) >= r.cfg.BatchSize && fetchCtx.Err() == nil
		// The next claim starts after cur's last row, but every
		// fullClaimEvery-th, which starts from the oldest due row: see
		// [store.RelayPosition].
		claims++
		var after *store.RelayPosition
		if !r.cfg.Sweeper && claims%fullClaimEvery != 0 {
			after = cur.rows[len(cur.rows)-1].Position()
		}
		var (
			next                *batch
			settleErr, claimErr error
			beside              sync.WaitGroup
		)
		if prev != nil && overlap && canSettleBesideClaim {
			// prev held nothing back (cur was claimed during its write,
			// which a batch that holds rows back never is), so the next
			// claim may skip prev's rows while they are still locked: they
			// are published, or failed and due later. If prev's marks
			// fail, the next batch is released unwritten.
			beside.Go(func() { settleErr = r.settle(workCtx, prev, nil) })
			beside.Go(func() { next, claimErr = r.claim(workCtx, after) })
		} else if prev != nil || overlap {
			beside.Go(func() {
				if prev != nil {
					if settleErr = r.settle(workCtx, prev, nil); settleErr != nil {
						return
					}
				}
				if overlap {
					next, claimErr = r.claim(workCtx, after)
				}
			})
		}
		sendErr := r.send(workCtx, cur)
		beside.Wait()
		prev = nil // settled, or released by settle's failure
		if err := errors.Join(sendErr, settleErr, claimErr); err != nil {
			next.release(workCtx)
			if sendErr != nil {
				cur.release(workCtx)
				return cycleResult{}, err
			}
			// cur was written: mark it, so that its rows are not published
			// twice for an error that is not theirs.
			return cycleResult{}, errors.Join(err, r.settle(workCtx, cur, nil))
		}
		res := cur.result()
		if next == nil || res.outage || fetchCtx.Err() != nil {
			next.release(workCtx)
			var lk *lookAhead
			if next == nil && !res.outage && res.claimed < r.cfg.BatchSize {
				lk = &res.look // the drain ends here, short
			}
			err := r.settle(workCtx, cur, lk)
			return res, err
		}
		r.prepare(next, cur.unpublished)
		prev, cur = cur, next
	}
}

// fullClaimEvery is how often a drain's claim starts from the oldest due
// row instead of after the last row claimed: rows before that one that
// were locked by another relay, or committed late, wait at most this many
// batches.
const fullClaimEvery = 16

// claim begins a transaction on a connection of its own and claims a batch
// in it, BEGIN and the claim in one round trip; after, when set, is where
// the claim starts in the claim order. The rows stay locked until the
// batch is settled or released; a batch of no rows must be released too.
func (r *Relay) claim(ctx context.Context, after *store.RelayPosition) (*batch, error) {
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("relay: acquire a connection to claim a batch: %w", err)
	}
	b := &batch{conn: conn}
	q := &pgx.Batch{}
	q.BeginTx(pgx.TxOptions{})
	if r.cfg.Sweeper {
		r.st.QueueClaimSweepBatch(q, r.cfg.BatchSize, r.cfg.SweepAfter, &b.rows)
	} else {
		r.st.QueueClaimRelayBatch(q, r.cfg.BatchSize, after, &b.rows)
	}
	br := conn.SendBatch(ctx, q)
	b.tx = br.Tx()
	if err := br.Close(); err != nil {
		b.release(ctx)
		return nil, fmt.Errorf("relay: begin and claim a batch: %w", err)
	}
	if len(b.rows) > 0 {
		fault.Hit(fault.RelayAfterClaim)
	}
	if r.hooks.afterClaim != nil {
		r.hooks.afterClaim(len(b.rows))
	}
	return b, nil
}

// holdBack decides which rows of a batch, claimed while the batch before
// it was written, must wait: those whose ordering key had a message in the
// batch before that was not published (unpublished: it failed, was parked
// as dead, or was held back itself), so that a later message of a key is
// not written before the failure of an earlier one is recorded. A row's
// ordering key is its aggregateid, which is its message's Kafka key: the
// partitioner places messages by it, so the messages of one key share a
// partition and keep their order in it (in every topic: the key, not the
// topic, is what counts). A message sent without a key (a requeued dead
// letter with an empty aggregateid) is placed round robin, in no order; it
// shares the empty aggregateid's key, which holds back more than needed,
// never less. It returns nil when nothing is held back.
func holdBack(rows []store.RelayMessage, unpublished map[string]struct{}) []bool {
	if len(unpublished) == 0 {
		return nil
	}
	var hold []bool
	for i := range rows {
		if _, ok := unpublished[rows[i].AggregateID]; ok {
			if hold == nil {
				hold = make([]bool, len(rows))
			}
			hold[i] = true
		}
	}
	return hold
}

// prepare builds the messages of b's rows. It holds back the rows that
// [holdBack] picks for unpublished, the keys the batch written before b did
// not publish, and sets aside as dead the rows that can never be published.
func (r *Relay) prepare(b *batch, unpublished map[string]struct{}) {
	hold := holdBack(b.rows, unpublished)
	b.msgs = make([]kafka.Message, 0, len(b.rows))
	b.owners = make([]*store.RelayMessage, 0, len(b.rows))
	for i := range b.rows {
		row := &b.rows[i]
		if hold != nil && hold[i] {
			b.held++
			b.notPublished(row)
			continue
		}
		m, why := buildMessage(row, r.cfg.MaxMessageBytes)
		if why != "" {
			b.failures = append(b.failures, store.RelayFailure{ID: row.ID, Err: why, Dead: true})
			b.dead = append(b.dead, row)
			b.notPublished(row)
			continue
		}
		b.msgs = append(b.msgs, m)
		b.owners = append(b.owners, row)
	}
}

// send writes b's messages with one call of the writer (see publish) and
// decides what becomes of each row. When ctx ends during the write, or the
// afterPublish hook fails, it returns an error and b must be released.
func (r *Relay) send(ctx context.Context, b *batch) error {
	if len(b.msgs) == 0 {
		return nil
	}
	traced := r.tel.publish(ctx, b.msgs)
	errs := r.publish(ctx, b.msgs)
	traced.end(errs)
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("relay: publish batch of %d: %w", len(b.msgs), err)
	}
	fault.Hit(fault.RelayAfterAck)
	if r.hooks.afterPublish != nil {
		if err := r.hooks.afterPublish(); err != nil {
			return err
		}
	}
	// One outage streak per relay: the broker is down for every row, so
	// rows that failed in the same batch wait alike, and each batch that
	// still finds it down waits longer, up to OutageBackoffMax.
	streak := r.stats.outageStreak.Load()
	if slices.ContainsFunc(errs, func(e error) bool {
		c, _ := classify(e)
		return e != nil && c == classOutage
	}) {
		streak = r.stats.outageStreak.Add(1)
	} else {
		r.stats.outageStreak.Store(0)
	}
	// What each key's failure made its rows wait (see PublishError.NotSent).
	var keyWait map[string]time.Duration
	var notSent []int
	for i, e := range errs {
		if e == nil {
			b.published = append(b.published, b.owners[i].ID)
			continue
		}
		b.notPublished(b.owners[i])
		if c, _ := classify(e); c == classNotSent {
			notSent = append(notSent, i)
			continue
		}
		f := r.failure(b.owners[i], e, r.outageDelay(int(streak)))
		b.failures = append(b.failures, f)
		if keyWait == nil {
			keyWait = map[string]time.Duration{}
		}
		keyWait[b.owners[i].AggregateID] = max(keyWait[b.owners[i].AggregateID], f.Delay)
		switch {
		case f.Dead:
			b.dead = append(b.dead, b.owners[i])
		case f.Outage:
			b.waits++
		default:
			b.retries++
		}
	}
	for _, i := range notSent {
		row := b.owners[i]
		wait, ok := keyWait[row.AggregateID]
		if !ok {
			// No earlier message of its key failed: not a reason to hold
			// it back; a plain failure, so that it cannot spin.
			f := r.failure(row, fmt.Errorf("relay: the writer held the message back with no failed message of its key before it: %w", errs[i]), 0)
			b.failures = append(b.failures, f)
			if f.Dead {
				b.dead = append(b.dead, row)
			} else {
				b.retries++
			}
			continue
		}
		// Held back behind the failure: no attempt spent, due with it.
		b.deferred = append(b.deferred, store.RelayFailure{ID: row.ID, Err: truncate(errs[i].Error()), Delay: wait, Outage: true})
		b.held++
	}
	b.outage = b.waits > 0 && len(b.published) == 0
	if b.outage {
		b.pause = r.outageDelay(int(streak))
	}
	return nil
}

// settle marks b's rows and commits, in one round trip: one statement for
// the published rows, one for the failed ones, then COMMIT. Rows held back
// are left as they were. When it fails, b is released: its rows stay
// pending, and those the broker acknowledged are published again.
func (r *Relay) settle(ctx context.Context, b *batch, lk *lookAhead) error {
	q := &pgx.Batch{}
	// The commit need not wait for its WAL to reach the disk: a crash of
	// PostgreSQL that loses it leaves the rows pending, and they are
	// published again, which the inbox dedupes (at least once, as after a
	// crash between the broker's acknowledgement and this commit).
	q.Queue("SET LOCAL synchronous_commit = off")
	r.st.QueueMarkPublished(q, b.published)
	r.st.QueueMarkFailed(q, slices.Concat(b.failures, b.deferred))
	var l lookAhead
	if lk != nil {
		// After the marks, so that this batch's retries count.
		r.st.QueueNextRelayDueInClaim(q, &l.d, &l.ok)
	}
	store.QueueCommit(q, nil)
	if err := b.tx.SendBatch(ctx, q).Close(); err != nil {
		b.release(ctx)
		return fmt.Errorf("relay: mark and commit batch of %d: %w", len(b.rows), err)
	}
	// Committed by the batch: the connection is out of the transaction,
	// and b.tx must not be used again.
	b.conn.Release()
	b.conn = nil
	if lk != nil {
		l.taken = true
		*lk = l
	}

	r.stats.published.Add(int64(len(b.published)))
	r.stats.retries.Add(int64(b.retries))
	r.stats.outageWaits.Add(int64(b.waits))
	r.stats.dead.Add(int64(len(b.dead)))
	d := 0
	for _, f := range b.failures {
		if f.Dead {
			row := b.dead[d]
			d++
			r.log.WarnContext(ctx, "sagaflow relay parked a message as dead", slog.String("message_id", f.ID.String()),
				slog.String("topic", row.Topic), slog.String("type", row.Type), slog.Int("attempts", row.Attempts+1),
				slog.String("reason", f.Err))
		}
	}
	if b.retries > 0 {
		r.log.WarnContext(ctx, "sagaflow relay could not publish messages; they will be retried",
			slog.Int("retries", b.retries), slog.Int("published", len(b.published)),
			slog.String("error", firstRetry(b.failures, false)))
	}
	if b.waits > 0 {
		r.log.WarnContext(ctx, "sagaflow relay cannot reach the broker; messages wait for it without spending attempts",
			slog.Int("waiting", b.waits), slog.Int("published", len(b.published)),
			slog.Int64("consecutive_outages", r.stats.outageStreak.Load()), slog.String("error", firstRetry(b.failures, true)))
	}
	return nil
}

// firstRetry returns the error of the first failure that is retried, for
// a broker outage or not.
func firstRetry(fs []store.RelayFailure, outage bool) string {
	for _, f := range fs {
		if !f.Dead && f.Outage == outage {
			return f.Err
		}
	}
	return ""
}

// failure decides what becomes of a row whose message was not published
// (see [classify]): dead at once when the broker refused it for good; due
// again after outageDelay, without spending an attempt, when the broker
// could not be reached or could not take writes; otherwise one more attempt
// spent, and dead when that was its last.
func (r *Relay) failure(row *store.RelayMessage, err error, outageDelay time.Duration) store.RelayFailure {
	attempt := row.Attempts + 1
	f := store.RelayFailure{ID: row.ID}
	class, code := classify(err)
	switch {
	case class == classPermanent && code == CodeInvalidTopic:
		f.Dead, f.Err = true, reason(code, "the broker refused topic %q: %v", row.Topic, err)
	case class == classPermanent && code == CodeTooLarge:
		f.Dead, f.Err = true, reason(code, "the broker refused the message as too large: %v", err)
	case class == classPermanent && errors.As(err, new(*PublishError)):
		// A writer that is not Kafka's: its error says who refused.
		f.Dead, f.Err = true, reason(code, "refused for good: %v", err)
	case class == classPermanent:
		f.Dead, f.Err = true, reason(code, "the broker refused the message: %v", err)
	case class == classOutage:
		f.Outage, f.Err, f.Delay = true, truncate(err.Error()), outageDelay
	case attempt >= r.cfg.MaxAttempts:
		f.Dead, f.Err = true, reason(CodeAttemptsExhausted, "gave up after %d attempts: %v", attempt, err)
	default:
		f.Err, f.Delay = truncate(err.Error()), r.cfg.Backoff(attempt)
	}
	return f
}

// outageDelay is how long rows wait after the outage-th consecutive cycle
// whose writes failed because the broker was down: Backoff, capped by
// OutageBackoffMax so that publishing resumes soon after the broker is back.
func (r *Relay) outageDelay(outage int) time.Duration {
	return min(r.cfg.Backoff(outage), r.cfg.OutageBackoffMax)
}

// publish writes msgs with one WriteMessages call and returns the outcome of
// each (nil: the broker acknowledged it). Two failures of the whole call
// are narrowed down so that one bad row does not hold up the others: a
// message kafka-go refuses as too large before sending anything is set
// aside and the rest written again, and a topic-level error (an unknown
// topic, say) in a batch of several topics is retried topic by topic.
func (r *Relay) publish(ctx context.Context, msgs []kafka.Message) []error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	errs := make([]error, len(msgs))
	idx := make([]int, len(msgs))
	for i := range idx {
		idx[i] = i
	}
	r.write(ctx, msgs, idx, errs, true)
	return errs
}

func (r *Relay) write(ctx context.Context, all []kafka.Message, idx []int, errs []error, split bool) {
	for len(idx) > 0 {
		batch := make([]kafka.Message, len(idx))
		for j, i := range idx {
			batch[j] = all[i]
		}
		err := r.writeTimed(ctx, batch)
		if err == nil {
			return
		}
		var werrs kafka.WriteErrors
		if errors.As(err, &werrs) && len(werrs) == len(batch) {
			for j, e := range werrs {
				if e != nil {
					errs[idx[j]] = fmt.Errorf("relay: publish to %s: %w", batch[j].Topic, e)
				}
			}
			return
		}
		var tooLarge kafka.MessageTooLargeError
		if errors.As(err, &tooLarge) {
			// Requeued dead letters keep their original message id, so two
			// messages of a batch may share one: match the bytes too.
			tl := tooLarge.Message
			id := headerValue(tl.Headers, store.HeaderMessageID)
			if j := slices.IndexFunc(batch, func(m kafka.Message) bool {
				return headerValue(m.Headers, store.HeaderMessageID) == id && m.Topic == tl.Topic &&
					bytes.Equal(m.Key, tl.Key) && bytes.Equal(m.Value, tl.Value)
			}); j >= 0 {
				errs[idx[j]] = fmt.Errorf("relay: publish to %s: %w", batch[j].Topic, err)
				idx = slices.Delete(slices.Clone(idx), j, j+1)
				continue
			}
		}
		if topics := topicsOf(batch); split && ctx.Err() == nil && topicScoped(err) && len(topics) > 1 {
			for _, topic := range topics {
				var sub []int
				for j, i := range idx {
					if batch[j].Topic == topic {
						sub = append(sub, i)
					}
				}
				r.write(ctx, all, sub, errs, false)
			}
			return
		}
		werr := fmt.Errorf("relay: publish batch of %d to %s: %w", len(batch), joinTopics(batch), err)
		for _, i := range idx {
			errs[i] = werr
		}
		return
	}
}

func (r *Relay) writeTimed(ctx context.Context, batch []kafka.Message) error {
	start := time.Now()
	err := r.w.WriteMessages(ctx, batch...)
	d := int64(time.Since(start))
	r.stats.latencyLast.Store(d)
	r.stats.latencyTotal.Add(d)
	r.stats.writes.Add(1)
	if err != nil {
		r.stats.writeFailures.Add(1)
	}
	return err
}

// topicScoped reports whether err is about a topic rather than the cluster.
func topicScoped(err error) bool {
	for _, e := range []kafka.Error{kafka.UnknownTopicOrPartition, kafka.InvalidTopic, kafka.TopicAuthorizationFailed,
		kafka.LeaderNotAvailable, kafka.UnknownTopicID} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func headerValue(hs []kafka.Header, key string) string {
	for _, h := range hs {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// Health is the relay's backlog, from the database, and what this Relay
// value has done since it was created.
type Health struct {
	// Pending is the number of relay rows waiting to be published, due or
	// waiting for a retry.
	Pending int64
	// OldestPendingAge is the age of the oldest of them by the database's
	// clock: how far publishing lags behind. 0 when nothing is pending.
	OldestPendingAge time.Duration
	// Dead is the number of relay rows parked as dead, by any relay.
	Dead int64
	// DeadLetters is the number of messages consumers dead-lettered that
	// have not been requeued (store's dead_letters table).
	DeadLetters int64

	// Running reports whether the relay's loop is running.
	Running bool
	// Published is the number of rows this relay marked published. A
	// PostgreSQL crash can undo the marks of the last half second or so (see
	// "At least once" in the package doc); their rows are published and
	// counted again, so after a crash it can exceed the rows published.
	Published int64
	// Retries is the number of rows this relay put back for another
	// attempt after a failed publish.
	Retries int64
	// OutageWaits is the number of rows this relay put back, without
	// spending an attempt, because the broker could not be reached or could
	// not take writes.
	OutageWaits int64
	// ConsecutiveOutages is the number of cycles in a row whose writes
	// failed because the broker was down; 0 once a cycle's writes got
	// through. A health check can alert on it.
	ConsecutiveOutages int64
	// DeadLettered is the number of rows this relay parked as dead.
	DeadLettered int64
	// Writes and WriteFailures count calls of the writer, and those that
	// did not publish everything.
	Writes, WriteFailures int64
	// LastPublishLatency and AvgPublishLatency are the duration of the
	// last call of the writer and the mean over all calls.
	LastPublishLatency, AvgPublishLatency time.Duration
}

// Health reads the relay's backlog from the database and adds the relay's
// counters.
func (r *Relay) Health(ctx context.Context) (Health, error) {
	h := Health{
		Published:          r.stats.published.Load(),
		Retries:            r.stats.retries.Load(),
		OutageWaits:        r.stats.outageWaits.Load(),
		ConsecutiveOutages: r.stats.outageStreak.Load(),
		DeadLettered:       r.stats.dead.Load(),
		Writes:             r.stats.writes.Load(),
		WriteFailures:      r.stats.writeFailures.Load(),
		LastPublishLatency: time.Duration(r.stats.latencyLast.Load()),
	}
	if h.Writes > 0 {
		h.AvgPublishLatency = time.Duration(r.stats.latencyTotal.Load() / h.Writes)
	}
	h.Running = r.life.Running()
	st, err := r.outboxStatus(ctx)
	if err != nil {
		return h, err
	}
	h.Pending, h.OldestPendingAge, h.Dead, h.DeadLetters = st.Pending, st.OldestPendingAge, st.Dead, st.DeadLetters
	return h, nil
}

// retain deletes published rows older than Retention at once and then every
// RetentionInterval, until ctx ends.
func (r *Relay) retain(ctx context.Context) {
	for {
		n, err := r.outbox.DeletePublished(ctx, r.cfg.Retention, retentionBatch)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.WarnContext(ctx, "sagaflow relay: retention failed; it runs again later",
				slog.String("schema", r.cfg.Schema), slog.Any("error", err))
		case n > 0:
			r.log.InfoContext(ctx, "sagaflow relay: retention deleted published rows",
				slog.String("schema", r.cfg.Schema), slog.Int64("rows", n))
		}
		if !lifecycle.Sleep(ctx, r.cfg.RetentionInterval) {
			return
		}
	}
}
