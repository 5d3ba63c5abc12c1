package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/consume"
	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/wire"
)

// Reader is what a [Consumer] reads from: *kafka.Reader, in a consumer
// group, satisfies it.
type Reader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
}

var _ consume.Reader = Reader(nil)

// OffsetsNotKept is implemented by a [Reader] whose messages get a new
// Offset when they are delivered again (package rabbitbus: RabbitMQ tells
// a consumer no position). A message without a sagaflow-message-id header
// is known to the inbox by its topic, partition and offset; over such a
// reader that identity does not survive a redelivery, so the message could
// be processed twice. A [Consumer] of such a reader dead-letters a message
// without an id instead, with that reason (requeued from the dead letters,
// it gets an id).
type OffsetsNotKept interface {
	OffsetsNotKept() bool
}

// Retry defaults of a [Consumer].
const (
	RetryInitialDefault = 100 * time.Millisecond
	RetryMaxDefault     = 30 * time.Second
	// MaxAttemptsDefault bounds how often a failing message is tried
	// before it is dead-lettered: about an hour at the default backoff.
	MaxAttemptsDefault = 130
	// RetentionDefault is how long a running consumer keeps its processed
	// keys: longer than the engine's default OutboxRetention (7 days), so a
	// replayed message is still recognised.
	RetentionDefault = 14 * 24 * time.Hour
	// RetentionIntervalDefault is how often a running consumer deletes its
	// old keys.
	RetentionIntervalDefault = time.Hour
	// retentionBatch bounds the rows of one delete statement.
	retentionBatch = 1000
)

// ConsumerConfig configures a [Consumer].
type ConsumerConfig struct {
	// Handlers process messages by type (the sagaflow-type header).
	Handlers map[string]HandlerFunc
	// Default, when set, processes messages whose type has no handler (and
	// messages without a type). Without it they are dead-lettered.
	Default HandlerFunc
	// MaxMessageBytes bounds a message's value; a larger one is
	// dead-lettered. Defaults to MaxMessageBytesDefault.
	MaxMessageBytes int
	// RetryInitial and RetryMax space the retries of a handler that failed
	// with an error that is not permanent. Default to RetryInitialDefault and
	// RetryMaxDefault.
	RetryInitial, RetryMax time.Duration
	// MaxAttempts bounds how often a message whose handler keeps failing is
	// tried; then it is dead-lettered with the last error, so one bad
	// message cannot hold its partition (and everything behind it) forever.
	// Defaults to MaxAttemptsDefault.
	MaxAttempts int
	// BatchSize, above 1, lets the consumer deal with up to that many
	// messages in one transaction when its reader is kafka-go's
	// *kafka.Reader and holds them ready at once (a backlog): each message
	// gets its own key and its handler runs as it would alone, but the
	// handlers share the transaction, so what one leaves in it
	// (SET LOCAL, set_config(..., true), transaction advisory locks,
	// temporary tables ON COMMIT DROP) is there for the next. If any
	// message of the batch is poison or its handler fails, nothing of the
	// batch is committed and its messages run one at a time, each handler
	// once more. Defaults to 1: one message per transaction; at most
	// BatchSizeMax.
	BatchSize int
	// Queued, with BatchSize above 1, reports how many messages the reader
	// holds ready. It is asked once per batch, after its first message: the
	// batch then tops up with at most that many, and with none when it
	// reports none, instead of waiting for each message after the first (a
	// wait an idle Go process can stretch to a millisecond, on every
	// message at low load). A negative count means unknown: the batch waits
	// as without Queued. For a *kafka.Reader whose stats nothing else reads:
	// func() int { return int(r.Stats().QueueLength) } (Stats resets the
	// reader's other counters). Defaults to nil: wait.
	Queued func() int
	// Retention is how long this consumer's processed keys are kept: a
	// running consumer deletes older ones every RetentionInterval, so a
	// service without a saga engine (a participant) cleans its own inbox.
	// Defaults to RetentionDefault; negative keeps them (an engine on the
	// same schema deletes every consumer's keys after its InboxRetention).
	Retention time.Duration
	// RetentionInterval is how often old keys are deleted. Defaults to
	// RetentionIntervalDefault.
	RetentionInterval time.Duration
	// TracerProvider makes the consumer's spans: one per message, a child
	// of the trace context its traceparent header carries (a malformed one
	// is ignored). Defaults to OpenTelemetry's global provider.
	TracerProvider trace.TracerProvider
	// MeterProvider makes the consumer's metrics (see
	// docs/observability.md). Defaults to OpenTelemetry's global provider.
	MeterProvider metric.MeterProvider
}

// Consumer is a Kafka consume loop built on [Inbox.Process]. Run it with
// [Consumer.Run], or in the background with [Consumer.Start] and
// [Consumer.Stop].
type Consumer struct {
	in   *Inbox
	r    Reader
	cfg  ConsumerConfig
	loop *consume.Loop // one for the consumer's life: it keeps a message a stop gave up
	life lifecycle.Lifecycle
	tel  *consumerTelemetry
	// batched counts the messages dealt with several to a transaction.
	batched atomic.Int64
	// idRequired: the reader's offsets do not survive a redelivery (see
	// [OffsetsNotKept]), so a message without an id is poison.
	idRequired bool
	// fetches follows the loop's fetches for Health.
	fetches consume.FetchHealth
}

// BatchSizeMax is the largest ConsumerConfig.BatchSize.
const BatchSizeMax = 1000

// Batched returns how many messages the consumer dealt with several to a
// transaction (the messages its reader had ready at once).
func (c *Consumer) Batched() int64 { return c.batched.Load() }

// NewConsumer returns a consumer of r's messages into in.
func (in *Inbox) NewConsumer(r Reader, cfg *ConsumerConfig) (*Consumer, error) {
	c := ConsumerConfig{}
	if cfg != nil {
		c = *cfg
	}
	if r == nil {
		return nil, fmt.Errorf("%w: reader is nil", ErrInvalidConfig)
	}
	if len(c.Handlers) == 0 && c.Default == nil {
		return nil, fmt.Errorf("%w: no Handlers and no Default: every message would be dead-lettered", ErrInvalidConfig)
	}
	for _, f := range []struct {
		name     string
		negative bool
	}{
		{"MaxMessageBytes", c.MaxMessageBytes < 0}, {"RetryInitial", c.RetryInitial < 0}, {"RetryMax", c.RetryMax < 0},
		{"MaxAttempts", c.MaxAttempts < 0}, {"RetentionInterval", c.RetentionInterval < 0}, {"BatchSize", c.BatchSize < 0},
	} {
		if f.negative {
			return nil, fmt.Errorf("%w: %s must not be negative", ErrInvalidConfig, f.name)
		}
	}
	if c.BatchSize > BatchSizeMax {
		return nil, fmt.Errorf("%w: BatchSize %d is more than %d", ErrInvalidConfig, c.BatchSize, BatchSizeMax)
	}
	if c.Retention == 0 {
		c.Retention = RetentionDefault
	}
	if c.RetentionInterval == 0 {
		c.RetentionInterval = RetentionIntervalDefault
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = MaxAttemptsDefault
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = MaxMessageBytesDefault
	}
	if c.RetryInitial == 0 {
		c.RetryInitial = RetryInitialDefault
	}
	if c.RetryMax == 0 {
		c.RetryMax = RetryMaxDefault
	}
	tel, err := newConsumerTelemetry(in.consumer, &c)
	if err != nil {
		return nil, fmt.Errorf("inbox: consumer %s: telemetry: %w", logText(in.consumer), err)
	}
	cons := &Consumer{in: in, r: r, cfg: c, tel: tel}
	if nk, ok := r.(OffsetsNotKept); ok && nk.OffsetsNotKept() {
		cons.idRequired = true
	}
	cons.loop = &consume.Loop{
		Reader: r, Log: in.log, What: "sagaflow inbox", Attrs: []any{slog.String("consumer", in.consumer)},
		Handle: func(fetch, work context.Context, m kafka.Message) bool {
			return cons.traced(fetch, work, FromKafka(m), m.HighWaterMark)
		},
		// The offset moves only after the transaction committed; if this
		// commit is lost, the redelivery is a duplicate the inbox skips.
		CommitLost: "the message will be redelivered and skipped",
		OnFetch:    cons.fetches.Fetched,
	}
	if _, ok := r.(*kafka.Reader); ok && c.BatchSize > 1 {
		// kafka-go's reader keeps a message that a cancelled fetch did not
		// take, so a batch can take what it holds ready without waiting.
		// Other readers (the seam) deal with a message at a time.
		cons.loop.HandleBatch, cons.loop.MaxBatch = cons.handleBatch, c.BatchSize
		cons.loop.Queued = c.Queued
	}
	return cons, nil
}

// FromKafka converts a kafka-go message. Its bytes are kept as they are:
// Headers maps each name to its last value, and RawHeaders keeps every
// header in order.
func FromKafka(m kafka.Message) Message {
	msg := Message{Topic: m.Topic, Partition: m.Partition, Offset: m.Offset, Key: m.Key, Value: m.Value,
		Headers: make(map[string]string, len(m.Headers)), RawHeaders: make([]RawHeader, 0, len(m.Headers))}
	for _, h := range m.Headers {
		msg.Headers[h.Key] = string(h.Value)
		msg.RawHeaders = append(msg.RawHeaders, RawHeader{Key: []byte(h.Key), Value: h.Value})
	}
	msg.ID = msg.Headers[store.HeaderMessageID]
	if msg.ID == "" {
		msg.ID = store.PositionID(m.Topic, m.Partition, m.Offset)
	}
	msg.Type = msg.Headers[store.HeaderType]
	return msg
}

// Run consumes until ctx ends, then returns nil. For each message it
// processes (or dead-letters) it and only then commits its offset; a
// message whose processing keeps failing is retried with backoff and holds
// its partition, so order is kept, until MaxAttempts. Meanwhile it deletes
// the consumer's keys older than Retention. Run on a consumer that runs
// already (started, or in another Run) returns an error at once.
func (c *Consumer) Run(ctx context.Context) error {
	started, err := c.life.Start(ctx, c.launch)
	if err != nil {
		return fmt.Errorf("inbox: consumer %s: %w", logText(c.in.consumer), err)
	}
	if !started {
		return fmt.Errorf("inbox: consumer %s: already running", logText(c.in.consumer))
	}
	<-ctx.Done()
	// ctx was the run's context: its goroutines are ending; wait for them.
	_, _ = c.life.Stop(context.WithoutCancel(ctx), true)
	return nil
}

// Start runs the consumer in the background and returns at once. Calling it
// on a running consumer does nothing; calling it while Stop is in progress
// returns an error. Cancelling ctx stops the consumer hard. A consumer
// stopped and started again on the same reader first takes up the message
// the stop gave up, if any.
func (c *Consumer) Start(ctx context.Context) error {
	if _, err := c.life.Start(ctx, c.launch); err != nil {
		return fmt.Errorf("inbox: consumer %s: %w", logText(c.in.consumer), err)
	}
	return nil
}

// Stop stops fetching and ends any wait between retries (that message is
// given up: its offset is not committed, and it comes again), lets a handler
// that is running finish and its offset be committed, and returns once the
// consumer's goroutines have exited. If ctx ends first, the handler's
// context is cancelled (its transaction rolls back and the message comes
// again) and Stop returns ctx.Err() once the handler has returned: a
// handler that ignores its context holds Stop up. Stop on a consumer that
// is not running returns nil.
func (c *Consumer) Stop(ctx context.Context) error {
	_, err := c.life.Stop(ctx, false)
	return err
}

func (c *Consumer) launch(fetch, work context.Context, wg *sync.WaitGroup) {
	wg.Go(func() { c.loop.Run(fetch, work) })
	if c.cfg.Retention > 0 {
		wg.Go(func() { c.retain(fetch) })
	}
}

// retain deletes old keys at once and then every RetentionInterval, until
// ctx ends.
func (c *Consumer) retain(ctx context.Context) {
	for {
		n, err := c.in.DeleteProcessed(ctx, c.cfg.Retention, retentionBatch)
		switch {
		case err != nil && ctx.Err() == nil:
			c.in.log.WarnContext(ctx, "sagaflow inbox: retention failed; it runs again later",
				slog.String("consumer", c.in.consumer), slog.Any("error", err))
		case n > 0:
			c.in.log.InfoContext(ctx, "sagaflow inbox: retention deleted old keys",
				slog.String("consumer", c.in.consumer), slog.Int64("keys", n))
		}
		if !lifecycle.Sleep(ctx, c.cfg.RetentionInterval) {
			return
		}
	}
}

// handle processes msg until it is done (processed, skipped as a duplicate
// or dead-lettered); it reports false when ctx ended first.
func (c *Consumer) handle(fetch, ctx context.Context, msg Message) bool {
	for attempt := 1; ; attempt++ {
		reason, err := c.process(ctx, msg)
		if err != nil && reason == "" && attempt >= c.cfg.MaxAttempts {
			reason = fmt.Sprintf("gave up after %d attempts: %v", attempt, err)
		}
		if reason != "" {
			err = c.deadLetter(ctx, msg, reason)
		}
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		c.in.log.WarnContext(ctx, "sagaflow inbox: processing failed; retrying", slog.String("consumer", c.in.consumer),
			slog.String("message_id", logText(msg.ID)), slog.Int("attempt", attempt), slog.Any("error", err))
		// A stop ends the wait: the message is given up, not committed,
		// and comes again.
		if !c.pause(fetch, attempt) {
			return false
		}
	}
}

// process runs msg's handler. It returns a dead-letter reason for poison,
// or the error of a failure worth retrying.
func (c *Consumer) process(ctx context.Context, msg Message) (deadReason string, err error) {
	h, reason := c.handler(msg)
	if reason != "" {
		return reason, nil
	}
	fresh, err := c.in.Process(ctx, msg, h)
	switch {
	case err == nil:
		if !fresh {
			noteDuplicate(ctx)
		}
		return "", nil
	case IsPermanent(err):
		return "refused by its handler: " + err.Error(), nil
	case pgerr.Content(err):
		// The same bytes would be refused on every retry.
		return "PostgreSQL refused the message's content: " + err.Error(), nil
	}
	return "", err
}

// handler returns the handler of msg, or why msg is poison.
func (c *Consumer) handler(msg Message) (HandlerFunc, string) {
	if len(msg.Value) > c.cfg.MaxMessageBytes {
		return nil, fmt.Sprintf("oversized: %d bytes, more than MaxMessageBytes (%d)", len(msg.Value), c.cfg.MaxMessageBytes)
	}
	if name := repeatedOwnHeader(msg.RawHeaders); name != "" {
		return nil, fmt.Sprintf("ambiguous: header %q appears more than once", logText(name))
	}
	if c.idRequired && msg.Headers[store.HeaderMessageID] == "" {
		return nil, "no " + store.HeaderMessageID + " header (nor a message id of the broker's): this reader's " +
			"offsets change when a message is delivered again, so it could not be deduplicated"
	}
	h := c.cfg.Handlers[msg.Type]
	if h == nil {
		h = c.cfg.Default
	}
	if h == nil {
		if msg.Type == "" {
			return nil, "no " + store.HeaderType + " header, and no Default handler"
		}
		return nil, fmt.Sprintf("unknown message type %q (handled: %s)", logText(msg.Type), c.handled())
	}
	return h, ""
}

// handleBatch deals with messages fetched together: in one transaction
// when each has a handler and every handler succeeds, else one at a time as
// [Consumer.handle] does, with its retries and dead letters. It reports how
// many of them, from the first, it dealt with before a context ended.
func (c *Consumer) handleBatch(fetch, work context.Context, ms []kafka.Message) int {
	if len(ms) > 1 && c.processBatch(work, ms) {
		return len(ms)
	}
	for i, m := range ms {
		if !c.traced(fetch, work, FromKafka(m), m.HighWaterMark) {
			return i
		}
	}
	return len(ms)
}

// processBatch runs ms's handlers in one transaction, each message with its
// own key as [Inbox.Process] records it, and commits once. It reports false,
// having committed nothing, when a message is poison or anything failed.
func (c *Consumer) processBatch(ctx context.Context, ms []kafka.Message) bool {
	msgs := make([]Message, len(ms))
	hs := make([]HandlerFunc, len(ms))
	for i, m := range ms {
		msgs[i] = FromKafka(m)
		var reason string
		if hs[i], reason = c.handler(msgs[i]); reason != "" {
			return false
		}
	}
	trs := make([]*msgTrace, 0, len(ms))
	ok := false
	defer func() {
		for i, tr := range trs {
			tr.end(c, ok, "its batch was rolled back; it runs again alone", ms[i].HighWaterMark)
		}
	}()
	ctx, wakes := store.WithWakes(ctx)
	err := pgx.BeginTxFunc(ctx, c.in.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		fresh, err := c.in.recordAll(ctx, tx, msgs)
		if err != nil {
			return err
		}
		for i := range msgs {
			tr := c.beginTrace(ctx, msgs[i])
			trs = append(trs, tr)
			if !fresh[i] {
				noteDuplicate(tr.ctx)
				continue
			}
			if err := callHandler(tr.ctx, tx, msgs[i], hs[i]); err != nil {
				return err
			}
		}
		fault.Hit(fault.InboxBeforeCommit)
		return nil
	})
	if err != nil {
		if ctx.Err() == nil {
			c.in.log.DebugContext(ctx, "sagaflow inbox: a batch of messages runs one at a time", slog.String("consumer", c.in.consumer),
				slog.Int("messages", len(ms)), slog.Any("error", err))
		}
		return false
	}
	// Before the wake-up: a crash here loses it, and the relay's poll must
	// publish what the handler wrote.
	fault.Hit(fault.InboxAfterCommit)
	wakes.Notify(c.in.wakes)
	ok = true
	c.batched.Add(int64(len(ms)))
	return true
}

// repeatedOwnHeader returns the name of a sagaflow header (sagaflow-…) that
// appears more than once, or "". A consumer that reads the first copy and
// one that reads the last would see two different messages, so such a
// message is refused rather than read either way.
func repeatedOwnHeader(hs []RawHeader) string {
	for i, h := range hs {
		if !wire.IsOwnHeader(string(h.Key)) {
			continue
		}
		for _, o := range hs[i+1:] {
			if string(o.Key) == string(h.Key) {
				return string(h.Key)
			}
		}
	}
	return ""
}

// deadLetter stores msg as poison, without recording its id (see
// Inbox.deadLetterAt): storing it cannot fail on its content.
func (c *Consumer) deadLetter(ctx context.Context, msg Message, reason string) error {
	noteDead(ctx, reason)
	c.in.log.WarnContext(ctx, "sagaflow inbox: dead-lettered a message", slog.String("consumer", c.in.consumer),
		slog.String("message_id", logText(msg.ID)), slog.String("topic", msg.Topic), slog.String("reason", logText(reason)))
	return c.in.deadLetterAt(ctx, msg, reason)
}

// logText bounds a string from the wire for a log line.
func logText(s string) string { return safetext.Text(s, 256) }

func (c *Consumer) handled() string {
	types := make([]string, 0, len(c.cfg.Handlers))
	for t := range c.cfg.Handlers {
		types = append(types, t)
	}
	sort.Strings(types)
	return strings.Join(types, ", ")
}

func (c *Consumer) pause(ctx context.Context, attempt int) bool {
	return lifecycle.Sleep(ctx, lifecycle.Jitter(lifecycle.Exponential(c.cfg.RetryInitial, c.cfg.RetryMax, attempt), 0, 0.2))
}

// IsPermanent reports whether err, or an error it wraps, says it is
// permanent (has a Permanent() bool method that returns true), as the errors
// of steps.Permanent do: a [Consumer] dead-letters such a message instead of
// retrying it.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

// poisonError marks a message that cannot be processed, ever.
type poisonError struct{ err error }

func (e *poisonError) Error() string   { return "permanent: " + e.err.Error() }
func (e *poisonError) Unwrap() error   { return e.err }
func (e *poisonError) Permanent() bool { return true }

// DecodeJSON decodes a message's JSON value into T. A value that does not
// decode is an error marked permanent, so a [Consumer] dead-letters the
// message instead of retrying it.
func DecodeJSON[T any](msg Message) (T, error) {
	var v T
	if err := json.Unmarshal(msg.Value, &v); err != nil {
		return v, &poisonError{err: fmt.Errorf("decode %s message %s: %w", msg.Type, msg.ID, err)}
	}
	return v, nil
}
