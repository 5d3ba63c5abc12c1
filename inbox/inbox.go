package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
)

// MaxMessageBytesDefault bounds a message's value.
const MaxMessageBytesDefault = 1 << 20

// ErrInvalidConfig wraps every configuration problem found by [New].
var ErrInvalidConfig = errors.New("inbox: invalid config")

// Config configures an [Inbox].
type Config struct {
	// Consumer names this consumer in the inbox table: ids are unique per
	// consumer, so two services (or two handlers) can process one message
	// each once. Required.
	Consumer string
	// Schema holds the tables. Defaults to migrations.SchemaDefault.
	Schema string
	// Logger receives logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// Inbox records processed message ids per consumer.
type Inbox struct {
	pool     *pgxpool.Pool
	st       *store.Store
	consumer string
	log      *slog.Logger
	// wakes notifies, after a commit of Process or of a consumer's batch,
	// the relays of the outbox rows written in it.
	wakes *store.Notifier
}

// New returns an inbox on pool; the schema must have been migrated.
func New(pool *pgxpool.Pool, cfg *Config) (*Inbox, error) {
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if strings.TrimSpace(c.Consumer) == "" {
		return nil, fmt.Errorf("%w: Consumer is required (it names this consumer in the inbox)", ErrInvalidConfig)
	}
	if err := safetext.Check("Consumer", c.Consumer, safetext.MaxKeyBytes); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if c.Schema == "" {
		c.Schema = store.SchemaDefault
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	log := telemetry.Logger(c.Logger)
	return &Inbox{pool: pool, st: st, consumer: c.Consumer, log: log, wakes: store.NewNotifier(pool, log)}, nil
}

// Message is a received message. Every field holds what came off the wire,
// untouched: a handler that writes one to a text column must make it safe
// first (PostgreSQL refuses NUL bytes and invalid UTF-8).
type Message struct {
	// ID is the deduplication key: the sagaflow-message-id header, else
	// topic/partition/offset. It is recorded in the inbox as it is when it
	// is valid UTF-8 without NUL bytes and at most 512 bytes long, else as
	// "sha256:" and the hex SHA-256 of its bytes, so any id deduplicates.
	ID        string
	Type      string // the sagaflow-type header, "" when absent
	Topic     string
	Partition int
	Offset    int64
	Key       []byte
	Value     []byte
	// Headers maps each header name to its value. When a name appears
	// more than once, the last value wins (a [Consumer] dead-letters a
	// message that repeats one of sagaflow's own headers instead).
	Headers map[string]string
	// RawHeaders are the headers as received, in order, duplicates
	// included. A dead letter keeps them byte for byte.
	RawHeaders []RawHeader
}

// RawHeader is one header as received, its name and value byte for byte.
type RawHeader struct {
	Key   []byte
	Value []byte
}

// storeHeaders converts hs for a dead letter; nil stays nil.
func storeHeaders(hs []RawHeader) []store.RawHeader {
	if hs == nil {
		return nil
	}
	out := make([]store.RawHeader, len(hs))
	for i, h := range hs {
		out[i] = store.RawHeader(h)
	}
	return out
}

// HandlerFunc processes a message inside the transaction that records it.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, msg Message) error

// Process runs fn in a new transaction that first records msg.ID for this
// consumer. It reports false, without calling fn, when the id was recorded
// before (a duplicate). When fn fails, nothing is recorded and the error is
// returned, so the message can be processed again.
//
// The outbox rows fn writes with outbox.InsertTx (a participant's replies
// too) wake the relay after the commit, not inside it: a notification in the
// transaction would keep its commit from sharing a WAL flush with others.
func (in *Inbox) Process(ctx context.Context, msg Message, fn HandlerFunc) (processed bool, err error) {
	ctx, wakes := store.WithWakes(ctx)
	err = pgx.BeginTxFunc(ctx, in.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var err error
		processed, err = in.ProcessTx(ctx, tx, msg, fn)
		if err == nil {
			fault.Hit(fault.InboxBeforeCommit)
		}
		return err
	})
	if err != nil {
		return false, err
	}
	// Before the wake-up: a crash here loses it, and the relay's poll must
	// publish what the handler wrote.
	fault.Hit(fault.InboxAfterCommit)
	wakes.Notify(in.wakes)
	return processed, nil
}

// ProcessTx is [Inbox.Process] inside the caller's transaction tx. It
// reports false, without calling fn, for a duplicate; the caller then
// commits or rolls back as it likes.
func (in *Inbox) ProcessTx(ctx context.Context, tx pgx.Tx, msg Message, fn HandlerFunc) (bool, error) {
	if msg.ID == "" {
		return false, errors.New("inbox: message has no id")
	}
	fresh, err := in.st.InsertInboxKey(ctx, tx, in.consumer, safetext.Key(msg.ID))
	if err != nil {
		return false, fmt.Errorf("inbox: %s: %w", in.consumer, err)
	}
	if !fresh {
		return false, nil
	}
	if err := callHandler(ctx, tx, msg, fn); err != nil {
		return false, err
	}
	return true, nil
}

// recordAll records the ids of msgs, as ProcessTx records one, in one
// statement for them all, and reports for each whether it is to run: its id
// was new, and no message before it in msgs had the same id.
func (in *Inbox) recordAll(ctx context.Context, tx pgx.Tx, msgs []Message) ([]bool, error) {
	keys := make([]string, 0, len(msgs))
	seen := make(map[string]bool, len(msgs))
	for _, m := range msgs {
		if m.ID == "" {
			return nil, errors.New("inbox: message has no id")
		}
		if k := safetext.Key(m.ID); !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
	}
	fresh, err := in.st.InsertInboxKeys(ctx, tx, in.consumer, keys)
	if err != nil {
		return nil, fmt.Errorf("inbox: %s: %w", in.consumer, err)
	}
	out := make([]bool, len(msgs))
	for i, m := range msgs {
		k := safetext.Key(m.ID)
		out[i] = fresh[k]
		delete(fresh, k) // a later copy is a duplicate
	}
	return out, nil
}

// callHandler runs fn, turning a panic into a permanent error: a handler
// that panics on a message would panic again on every redelivery.
func callHandler(ctx context.Context, tx pgx.Tx, msg Message, fn HandlerFunc) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &poisonError{err: fmt.Errorf("handler panicked on message %s: %v", msg.ID, v)}
		}
	}()
	return fn(ctx, tx, msg)
}

// DeadLetter stores msg with the reason it cannot be processed, and records
// its id, so a redelivery is skipped rather than dead-lettered again. It
// reports false when the id had been recorded before. It cannot fail on the
// message's content: the dead letter keeps the raw bytes of the key, the
// value and the headers, and a storable rendering of the text.
func (in *Inbox) DeadLetter(ctx context.Context, msg Message, reason string) (bool, error) {
	return in.Process(ctx, msg, func(ctx context.Context, tx pgx.Tx, msg Message) error {
		return in.st.InsertDeadLetter(ctx, tx, in.deadLetter(msg, reason))
	})
}

// deadLetterAt stores msg with the reason it cannot be processed, without
// recording its id: what a [Consumer] does with poison. The dead letter is
// stored once per position (topic, partition, offset), so a redelivery
// adds no second row where the transport keeps positions (Kafka, NATS; not
// RabbitMQ, whose redeliveries get a new offset); and a
// message that may be forged (its id copied from a genuine message still to
// come) cannot make the genuine one look like a duplicate.
func (in *Inbox) deadLetterAt(ctx context.Context, msg Message, reason string) error {
	return in.st.InsertDeadLetter(ctx, in.pool, in.deadLetter(msg, reason))
}

func (in *Inbox) deadLetter(msg Message, reason string) *store.DeadLetter {
	p, o := msg.Partition, msg.Offset
	return &store.DeadLetter{
		Consumer: in.consumer, MessageID: msg.ID, Topic: msg.Topic, Partition: &p, Offset: &o,
		Key: msg.Key, Value: msg.Value, Headers: msg.Headers, RawHeaders: storeHeaders(msg.RawHeaders), Reason: reason,
	}
}

// DeleteProcessed deletes this consumer's inbox keys processed longer than
// olderThan ago, at most batch rows per statement, and returns how many it
// deleted. Keep keys longer than the producers' outbox keeps published
// messages: a message replayed from the outbox after its key is gone would
// be processed again. A running [Consumer] does this itself
// (ConsumerConfig.Retention).
func (in *Inbox) DeleteProcessed(ctx context.Context, olderThan time.Duration, batch int) (int64, error) {
	if olderThan <= 0 || batch <= 0 {
		return 0, fmt.Errorf("%w: DeleteProcessed: olderThan (%v) and batch (%d) must be positive", ErrInvalidConfig, olderThan, batch)
	}
	n, err := store.DeleteInBatches(batch, func(limit int) (int64, error) {
		return in.st.DeleteInboxKeys(ctx, in.pool, in.consumer, olderThan, limit)
	})
	if err != nil {
		return n, fmt.Errorf("inbox: delete processed keys of %s: %w", logText(in.consumer), err)
	}
	return n, nil
}
