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

// loop runs cycles until fetchCtx ends. Cycles run on workCtx, so a graceful
// stop lets the batch in flight finish.
func (r *Relay) loop(fetchCtx, workCtx context.Context) {
	failures := 0
	for fetchCtx.Err() == nil {
		res, err := r.cycle(workCtx)
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
		wait := r.cfg.PollInterval
		if d, ok, err := r.st.NextRelayDue(fetchCtx, r.pool); err == nil && ok {
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
	// outage: nothing was published and some rows failed because the
	// broker is down; the loop waits pause before it claims again.
	outage bool
	pause  time.Duration
}

// cycle claims a batch, publishes it with one write, and marks its rows, in
// one transaction that touches nothing but those outbox rows.
func (r *Relay) cycle(ctx context.Context) (cycleResult, error) {
	r.cycleMu.Lock()
	defer r.cycleMu.Unlock()
	var res cycleResult
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("relay: begin claim: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // a no-op after Commit
	claim := r.st.ClaimRelayBatch
	if r.cfg.Sweeper {
		claim = func(ctx context.Context, tx pgx.Tx, limit int) ([]store.RelayMessage, error) {
			return r.st.ClaimSweepBatch(ctx, tx, limit, r.cfg.SweepAfter)
		}
	}
	rows, err := claim(ctx, tx, r.cfg.BatchSize)
	if err != nil {
		return res, err
	}
	res.claimed = len(rows)
	if len(rows) == 0 {
		return res, nil
	}
	fault.Hit(fault.RelayAfterClaim)

	msgs := make([]kafka.Message, 0, len(rows))
	owners := make([]*store.RelayMessage, 0, len(rows))
	var failures []store.RelayFailure
	var dead []*store.RelayMessage // parallel to the Dead entries of failures
	for i := range rows {
		m, why := buildMessage(&rows[i], r.cfg.MaxMessageBytes)
		if why != "" {
			failures = append(failures, store.RelayFailure{ID: rows[i].ID, Err: why, Dead: true})
			dead = append(dead, &rows[i])
			continue
		}
		msgs = append(msgs, m)
		owners = append(owners, &rows[i])
	}

	var published []uuid.UUID
	retries, waits := 0, 0
	if len(msgs) > 0 {
		traced := r.tel.publish(ctx, msgs)
		errs := r.publish(ctx, msgs)
		traced.end(errs)
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("relay: publish batch of %d: %w", len(msgs), err)
		}
		fault.Hit(fault.RelayAfterAck)
		if r.hooks.afterPublish != nil {
			if err := r.hooks.afterPublish(); err != nil {
				return res, err
			}
		}
		// One outage streak per relay: the broker is down for every row,
		// so rows that failed in the same cycle wait alike, and each cycle
		// that still finds it down waits longer, up to OutageBackoffMax.
		streak := r.stats.outageStreak.Load()
		if slices.ContainsFunc(errs, func(e error) bool {
			c, _ := classify(e)
			return e != nil && c == classOutage
		}) {
			streak = r.stats.outageStreak.Add(1)
		} else {
			r.stats.outageStreak.Store(0)
		}
		for i, e := range errs {
			if e == nil {
				published = append(published, owners[i].ID)
				continue
			}
			f := r.failure(owners[i], e, r.outageDelay(int(streak)))
			failures = append(failures, f)
			switch {
			case f.Dead:
				dead = append(dead, owners[i])
			case f.Outage:
				waits++
			default:
				retries++
			}
		}
		res.outage = waits > 0 && len(published) == 0
		if res.outage {
			res.pause = r.outageDelay(int(streak))
		}
	}

	if err := r.st.MarkPublished(ctx, tx, published); err != nil {
		return res, err
	}
	if err := r.st.MarkFailed(ctx, tx, failures); err != nil {
		return res, err
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("relay: commit batch of %d: %w", len(rows), err)
	}
	r.stats.published.Add(int64(len(published)))
	r.stats.retries.Add(int64(retries))
	r.stats.outageWaits.Add(int64(waits))
	r.stats.dead.Add(int64(len(dead)))
	d := 0
	for _, f := range failures {
		if f.Dead {
			row := dead[d]
			d++
			r.log.WarnContext(ctx, "sagaflow relay parked a message as dead", slog.String("message_id", f.ID.String()),
				slog.String("topic", row.Topic), slog.String("type", row.Type), slog.Int("attempts", row.Attempts+1),
				slog.String("reason", f.Err))
		}
	}
	if retries > 0 {
		r.log.WarnContext(ctx, "sagaflow relay could not publish messages; they will be retried",
			slog.Int("retries", retries), slog.Int("published", len(published)), slog.String("error", firstRetry(failures, false)))
	}
	if waits > 0 {
		r.log.WarnContext(ctx, "sagaflow relay cannot reach the broker; messages wait for it without spending attempts",
			slog.Int("waiting", waits), slog.Int("published", len(published)),
			slog.Int64("consecutive_outages", r.stats.outageStreak.Load()), slog.String("error", firstRetry(failures, true)))
	}
	res.published, res.failed = len(published), len(failures)
	return res, nil
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
	// Published is the number of rows this relay marked published.
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
	st, err := r.st.RelayOutboxStatus(ctx, r.pool)
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
