// Package outbox lets a service write its own integration events into
// sagaflow's outbox, in its own transaction, and operate the outbox: see how
// far behind the relay is, and publish already published messages once more.
//
// A message written with [InsertTx] or [Outbox.InsertTx] commits or rolls
// back with the caller's business change, and the relay (package relay)
// publishes it after the commit, at least once, in order per key. Consumers
// deduplicate it by its id, which travels as the message id header (see
// docs/protocol.md).
//
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, "UPDATE orders SET status = 'paid' WHERE id = $1", orderID); err != nil {
//			return err
//		}
//		return outbox.InsertTx(ctx, tx, outbox.Message{
//			Topic: "orders.events", Key: orderID, Type: "OrderPaid", Payload: body,
//		})
//	})
//
// The schema must have been migrated (package migrations).
package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pace"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/wire"
)

// Bounds of a message's text fields, in bytes.
const (
	// MaxKeyBytes bounds Key, Type and AggregateType.
	MaxKeyBytes = 1024
	// MaxHeaderBytes bounds each header's name and value.
	MaxHeaderBytes = 8192
)

// ReservedHeaderPrefix starts the names of the headers sagaflow itself sets
// (the message's type, saga, step key, signature…). A message written here
// may not set them: a consumer would take it for one of the engine's
// commands or replies.
const ReservedHeaderPrefix = wire.HeaderPrefix

// ErrInvalidMessage is returned, wrapped with the field at fault, for a
// message that cannot be written: nothing is written then, and the caller's
// transaction stays usable.
var ErrInvalidMessage = errors.New("outbox: invalid message")

// ErrDuplicateID is returned, wrapped, when a message's ID is in the
// outbox already.
var ErrDuplicateID = errors.New("outbox: message id already in the outbox")

// Message is an integration event for the relay to publish.
type Message struct {
	// ID identifies the message to consumers, which deduplicate by it.
	// Zero: a new time-ordered UUID. An ID already in the outbox fails with
	// ErrDuplicateID, and aborts the transaction as any failed statement
	// does.
	ID uuid.UUID
	// Topic is the Kafka topic (letters, digits, '.', '_', '-'; at most
	// 249 bytes).
	Topic string
	// Key is the partition key: messages with the same key go to the same
	// partition, and one relay publishes them in the order they were
	// written (rows of one transaction in insert order). Transactions that
	// write the same key concurrently are ordered by when each wrote, not
	// by when it committed; a retry or several relays can reorder too (see
	// package relay). Write one key's events from one transaction at a time
	// when their order matters.
	Key string
	// Type names the event, e.g. "OrderPaid"; it travels as a header.
	Type string
	// AggregateType names what Key identifies, e.g. "order". Optional.
	AggregateType string
	// Payload is the message's value, any bytes. nil or empty is sent as a
	// value of zero bytes, never as a null value, which a compacted topic
	// would take for a tombstone (kafka-go's reader returns it as nil).
	Payload []byte
	// Headers are extra Kafka headers, e.g. traceparent. Names may not start
	// with ReservedHeaderPrefix.
	Headers map[string]string
	// Delay holds the message back this long after the database's now().
	Delay time.Duration
}

// Check reports what is wrong with m, or nil.
func (m *Message) Check() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidMessage}, args...)...)
	}
	if !store.LegalTopic(m.Topic) {
		return bad("Topic %q is not a legal topic name (1 to 249 of letters, digits, '.', '_', '-')", safetext.Text(m.Topic, 300))
	}
	for _, f := range []struct{ name, v string }{{"Key", m.Key}, {"Type", m.Type}, {"AggregateType", m.AggregateType}} {
		if err := safetext.Check(f.name, f.v, MaxKeyBytes); err != nil {
			return bad("%v", err)
		}
	}
	if m.Delay < 0 {
		return bad("Delay %v is negative", m.Delay)
	}
	for k, v := range m.Headers {
		switch {
		case k == "":
			return bad("a header has an empty name")
		case strings.HasPrefix(strings.ToLower(k), ReservedHeaderPrefix):
			return bad("header %q: names starting with %q are sagaflow's own", safetext.Text(k, 300), ReservedHeaderPrefix)
		}
		if err := safetext.Check("header name", k, MaxHeaderBytes); err != nil {
			return bad("%v", err)
		}
		if err := safetext.Check(fmt.Sprintf("header %q", safetext.Text(k, 300)), v, MaxHeaderBytes); err != nil {
			return bad("%v", err)
		}
	}
	return nil
}

// Outbox is the outbox of one schema.
type Outbox struct {
	st   *store.Store
	pool *pgxpool.Pool
}

// New returns the outbox in schema ("" for migrations.SchemaDefault). pool
// is needed only by [Outbox.Status] and [Outbox.Replay]; nil is fine for a
// service that only inserts.
func New(pool *pgxpool.Pool, schema string) (*Outbox, error) {
	if schema == "" {
		schema = migrations.SchemaDefault
	}
	st, err := store.New(schema)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return &Outbox{st: st, pool: pool}, nil
}

var defaultOutbox = func() *Outbox {
	o, err := New(nil, "")
	if err != nil {
		panic(err) // the default schema is valid
	}
	return o
}()

// Execer runs a statement: *pgxpool.Pool, *pgx.Conn and pgx.Tx are ones.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// WakeAfterCommit returns a context for code that writes outbox rows (and
// starts sagas with saga.StartTx) in a transaction the caller commits, and a
// function to call after that commit. Under the context, [InsertTx] and
// saga.StartTx record the relay's and the engines' wake-up instead of
// notifying inside the transaction; wake sends what was recorded, through db
// (a pool, say), in one round trip.
//
// Why: PostgreSQL keeps the commits of transactions that notify from sharing
// a WAL flush, so many small transactions that each write an outbox row
// commit one after the other. If wake is not called (the transaction rolled
// back, or the process died after the commit), the relay and the engines
// find the rows at their next poll. A wake that fails (its context ended,
// the connection broke) keeps what it did not send: calling it again sends
// it.
//
//	ctx, wake := outbox.WakeAfterCommit(ctx)
//	tx, err := pool.Begin(ctx)
//	// ... the order's rows, outbox.InsertTx(ctx, tx, msg) ...
//	if err := tx.Commit(ctx); err != nil { ... }
//	_ = wake(ctx, pool) // the rows are safe; a failed wake-up only delays them
func WakeAfterCommit(ctx context.Context) (context.Context, func(ctx context.Context, db Execer) error) {
	ctx, w := store.WithWakes(ctx)
	return ctx, func(ctx context.Context, db Execer) error {
		if err := w.NotifyNow(ctx, db); err != nil {
			return fmt.Errorf("outbox: %w", err)
		}
		return nil
	}
}

// InsertTx writes m into the outbox of the default schema in tx; see
// [Outbox.InsertTx].
func InsertTx(ctx context.Context, tx pgx.Tx, m Message) error {
	return defaultOutbox.InsertTx(ctx, tx, m)
}

// InsertTx writes m into the outbox in tx and wakes the relay when tx
// commits. Under a context from [WakeAfterCommit], or inside a handler of
// inbox.Inbox.Process or of an inbox consumer given the handler's context,
// it leaves the wake-up to follow the commit instead, in a notification of
// its own: a notification inside a transaction keeps its commit from sharing
// a WAL flush with other commits. It refuses a message that [Message.Check] finds wrong, with an
// error wrapping ErrInvalidMessage, before writing anything.
func (o *Outbox) InsertTx(ctx context.Context, tx pgx.Tx, m Message) error {
	if tx == nil {
		return fmt.Errorf("%w: the transaction is nil", ErrInvalidMessage)
	}
	if err := m.Check(); err != nil {
		return err
	}
	if m.ID == uuid.Nil {
		id, err := uuid.NewV7()
		if err != nil {
			return fmt.Errorf("outbox: new message id: %w", err)
		}
		m.ID = id
	}
	if m.Payload == nil {
		m.Payload = []byte{}
	}
	if err := o.st.InsertMessageNotify(ctx, tx, &store.Message{
		ID: m.ID, Topic: m.Topic, Delivery: store.DeliveryRelay, AggregateType: m.AggregateType, AggregateID: m.Key,
		Type: m.Type, Payload: m.Payload, Headers: m.Headers, Delay: m.Delay,
	}); err != nil {
		if pgerr.Unique(err) {
			return fmt.Errorf("%w: %s (the transaction is aborted)", ErrDuplicateID, m.ID)
		}
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

// Status is the state of the outbox.
type Status struct {
	// Pending counts messages the relay has still to publish.
	Pending int64
	// OldestPendingAge is the age of the oldest pending message; 0 when
	// nothing is pending.
	OldestPendingAge time.Duration
	// Dead counts messages parked as dead: refused by the broker for good,
	// or superseded.
	Dead int64
	// Published counts published messages still kept (see the engine's
	// OutboxRetention).
	Published int64
	// DeadLetters counts the messages consumers dead-lettered that have not
	// been requeued.
	DeadLetters int64
}

// Status counts pending, dead and published messages, measures the age of
// the oldest pending one, and counts the dead letters not requeued.
func (o *Outbox) Status(ctx context.Context) (Status, error) {
	if o.pool == nil {
		return Status{}, errors.New("outbox: Status needs the pool given to outbox.New")
	}
	st, err := o.st.OutboxStatus(ctx, o.pool)
	if err != nil {
		return Status{}, fmt.Errorf("outbox: %w", err)
	}
	return Status{Pending: st.Pending, OldestPendingAge: st.OldestPendingAge, Dead: st.Dead,
		Published: st.Published, DeadLetters: st.DeadLetters}, nil
}

// Filter selects published messages. Zero fields select everything.
type Filter struct {
	Topic           string
	Type            string
	Key             string    // the partition key
	PublishedAfter  time.Time // inclusive
	PublishedBefore time.Time // exclusive
}

// Caps and rate of a replay.
const (
	// ReplayMaxDefault caps a replay that sets no Max.
	ReplayMaxDefault = 100
	// ReplayMaxLimit is the largest Max a replay accepts.
	ReplayMaxLimit = 10000
	// ReplayRateDefault is the messages per second of a replay that sets no
	// rate.
	ReplayRateDefault = 10
)

var replayLimits = pace.Limits{MaxDefault: ReplayMaxDefault, MaxLimit: ReplayMaxLimit, RateDefault: ReplayRateDefault}

// ReplayOpts selects published messages for [Outbox.Replay].
type ReplayOpts struct {
	Filter
	// Max caps how many messages are published again, oldest first.
	// Defaults to ReplayMaxDefault; a Max above ReplayMaxLimit, or a
	// negative Max or RatePerSecond, is refused.
	Max int
	// RatePerSecond limits messages per second. Defaults to
	// ReplayRateDefault.
	RatePerSecond float64
	// DryRun selects and reports, and changes nothing.
	DryRun bool
}

// ReplayResult reports a replay.
type ReplayResult struct {
	Matched     []uuid.UUID // the selected messages, oldest first
	Republished int64       // how many were made pending again
	DryRun      bool
}

// Replay makes already published messages pending again, so the relay
// publishes them once more; consumers deduplicate them by message id.
// Messages are selected by topic, type, key and publication time, oldest
// first, capped and rate limited. Only messages still kept (within the
// engine's OutboxRetention) can be replayed; the engine's own direct
// commands never are. If ctx ends or a statement fails midway, the error
// comes with the result so far: Republished counts what was done.
func (o *Outbox) Replay(ctx context.Context, opts ReplayOpts) (*ReplayResult, error) {
	if o.pool == nil {
		return nil, errors.New("outbox: Replay needs the pool given to outbox.New")
	}
	if err := pace.Normalise("outbox: replay", replayLimits, &opts.Max, &opts.RatePerSecond); err != nil {
		return nil, err
	}
	ids, err := o.st.PublishedMessages(ctx, o.pool, store.OutboxFilter{
		Topic: opts.Topic, Type: opts.Type, AggregateID: opts.Key,
		PublishedAfter: opts.PublishedAfter, PublishedBefore: opts.PublishedBefore,
	}, opts.Max)
	if err != nil {
		return nil, fmt.Errorf("outbox: replay: %w", err)
	}
	res := &ReplayResult{Matched: ids, DryRun: opts.DryRun}
	if opts.DryRun {
		return res, nil
	}
	err = pace.Each(ctx, len(ids), opts.RatePerSecond, func(i int) error {
		n, err := o.st.RepublishMessages(ctx, o.pool, ids[i:i+1])
		res.Republished += n
		return err
	})
	if err != nil {
		return res, fmt.Errorf("outbox: replay: %w", err)
	}
	if res.Republished > 0 {
		// Wake the relay rather than leave the rows to its next poll.
		if err := o.st.Notify(ctx, o.pool, opts.Topic); err != nil {
			return res, fmt.Errorf("outbox: replay: wake the relay: %w", err)
		}
	}
	return res, nil
}

// DeletePublished deletes the messages published longer than olderThan
// ago, at most batch rows per statement, and returns how many it deleted;
// olderThan and batch must be positive. Pending and dead messages are never
// deleted. A relay does this itself
// (relay.Config.Retention), and so does a saga engine's retention; call it
// for a schedule of your own.
func (o *Outbox) DeletePublished(ctx context.Context, olderThan time.Duration, batch int) (int64, error) {
	switch {
	case o.pool == nil:
		return 0, errors.New("outbox: DeletePublished needs the pool given to outbox.New")
	case olderThan <= 0 || batch <= 0:
		return 0, fmt.Errorf("outbox: DeletePublished: olderThan (%v) and batch (%d) must be positive", olderThan, batch)
	}
	n, err := store.DeleteInBatches(batch, func(limit int) (int64, error) {
		return o.st.DeletePublishedMessages(ctx, o.pool, olderThan, limit)
	})
	if err != nil {
		return n, fmt.Errorf("outbox: %w", err)
	}
	return n, nil
}
