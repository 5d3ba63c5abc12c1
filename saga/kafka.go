package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/store"
)

// KafkaConfig makes an engine carry step commands over Kafka instead of
// straight from the outbox table: the commands are still written to the
// outbox in the step's transaction, a relay (package relay) publishes them,
// and the engine's workers consume them as members of one consumer group.
// The executor, the keys and the fencing are the same as in the
// Postgres-only mode.
//
// Each saga type has its own topic, CommandTopic + "." + the saga's name
// (sagaflow.commands.checkout, say), partitioned by saga id: an engine
// consumes only the sagas it knows, and one saga's commands stay in order.
// Create the topics before starting the engine, or let the cluster create
// them.
type KafkaConfig struct {
	// Brokers to consume from. Required.
	Brokers []string
	// Dialer connects to the brokers (TLS, SASL: see package kafkaconfig).
	// Defaults to plain TCP.
	Dialer *kafka.Dialer
	// GroupID names the engines' consumer group. Defaults to
	// "sagaflow-engine-" + Schema.
	GroupID string
	// ReplyTopic receives participants' replies to the commands of remote
	// steps, for every saga of the engine: then every engine in the group
	// must register the same sagas. Defaults to one reply topic per saga
	// type, its command topic + ".replies", so that engines registering
	// different sagas can share a schema.
	ReplyTopic string
	// SessionTimeout is how long the group coordinator waits for a silent
	// engine (killed, paused, cut off) before it gives the engine's
	// partitions to the others; their commands wait that long. Heartbeats
	// go every tenth of it. Zero keeps kafka-go's default (30 s); the broker
	// bounds it (group.min.session.timeout.ms, 6 s by default).
	SessionTimeout time.Duration
	// SigningKey, when set, signs every command, cancel request and remote
	// command the engine writes for Kafka with HMAC-SHA256 (the
	// sagaflow-signature header; see docs/security.md), and makes the
	// engine refuse, before any effect, a command or reply consumed from
	// Kafka without a valid signature: it is dead-lettered. Every service
	// on the bus (participants too) must share the key. Defaults to no
	// signing.
	SigningKey []byte
	// VerifyKeys are earlier keys still accepted while SigningKey is being
	// rotated.
	VerifyKeys [][]byte
}

// sign signs m's headers and payload when commands travel over Kafka
// signed.
func (e *Engine) sign(m *store.Message) {
	if m.Delivery == store.DeliveryRelay {
		e.signer.SignMap(m.Headers, m.Payload)
	}
}

// replyTopic is where participants reply to a saga type's remote steps.
func (e *Engine) replyTopic(sagaName string) string {
	if e.cfg.Kafka.ReplyTopic != "" {
		return e.cfg.Kafka.ReplyTopic
	}
	return e.commandTopic(sagaName) + ".replies"
}

// commandReader is what a Kafka worker consumes from; *kafka.Reader
// satisfies it.
type commandReader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

// commandTopic is the topic of a saga type's commands in Kafka mode, or the
// direct command topic otherwise.
func (e *Engine) commandTopic(sagaName string) string {
	if e.cfg.Kafka == nil {
		return e.cfg.CommandTopic
	}
	return e.cfg.CommandTopic + "." + sagaName
}

func (e *Engine) commandDelivery() string {
	if e.cfg.Kafka == nil {
		return store.DeliveryDirect
	}
	return store.DeliveryRelay
}

// CommandTopics returns the Kafka topics an engine in Kafka mode consumes:
// its registered sagas' command topics and, for sagas with remote steps,
// their reply topics. Create them before starting the engine.
func (e *Engine) CommandTopics() []string {
	var topics, replies []string
	for _, name := range e.registeredNameList() {
		topics = append(topics, e.commandTopic(name))
		if e.lookupName(name).hasRemote() && !slices.Contains(replies, e.replyTopic(name)) {
			replies = append(replies, e.replyTopic(name))
		}
	}
	return append(topics, replies...)
}

func (e *Engine) newCommandReader() commandReader {
	k := e.cfg.Kafka
	return kafka.NewReader(kafka.ReaderConfig{
		Brokers:           k.Brokers,
		Dialer:            k.Dialer,
		GroupID:           k.GroupID,
		GroupTopics:       e.CommandTopics(),
		StartOffset:       kafka.FirstOffset,
		MinBytes:          1,
		MaxBytes:          10 << 20,
		MaxWait:           250 * time.Millisecond,
		SessionTimeout:    k.SessionTimeout,
		HeartbeatInterval: k.SessionTimeout / 10,
		CommitInterval:    0, // commit synchronously, after the step's transaction
		Logger:            nil,
		ErrorLogger:       kafka.LoggerFunc(func(msg string, args ...any) { e.log.Debug("sagaflow kafka: " + fmt.Sprintf(msg, args...)) }),
	})
}

// kafkaWork is one Kafka executor: it runs each message's command in a
// transaction and commits the message's offset only after that transaction
// committed. A message whose command cannot run yet (its saga is busy) or
// whose transaction failed is tried again, in order: its partition waits.
func (e *Engine) kafkaWork(fetch, work context.Context, r commandReader) {
	defer func() {
		if err := r.Close(); err != nil {
			e.log.WarnContext(work, "sagaflow kafka: close reader", slog.Any("error", err))
		}
	}()
	failures := 0
	for fetch.Err() == nil {
		m, err := r.FetchMessage(fetch)
		if fetch.Err() != nil {
			return
		}
		if err != nil {
			failures++
			e.log.WarnContext(work, "sagaflow kafka: fetch failed", slog.Any("error", err))
			if !lifecycle.Sleep(fetch, lifecycle.Backoff(failures)) {
				return
			}
			continue
		}
		failures = 0
		for attempt := 1; ; attempt++ {
			again, err := e.runKafkaMessage(work, m)
			if err == nil && !again {
				break
			}
			if err != nil && work.Err() == nil {
				e.log.ErrorContext(work, "sagaflow kafka: command failed; it runs again", slog.String("topic", m.Topic),
					slog.Int("partition", m.Partition), slog.Int64("offset", m.Offset), slog.Any("error", err))
			}
			// Stopping leaves the offset uncommitted: the command is
			// redelivered to whichever engine takes the partition.
			if !lifecycle.Sleep(fetch, min(lifecycle.Backoff(attempt), deferDelay<<min(attempt, 10))) {
				return
			}
		}
		if err := r.CommitMessages(work, m); err != nil && work.Err() == nil {
			e.log.WarnContext(work, "sagaflow kafka: commit offset failed; the redelivered command will be stale",
				slog.String("topic", m.Topic), slog.Int64("offset", m.Offset), slog.Any("error", err))
		}
	}
}

// runReply applies a participant's reply in tx and commits.
func (e *Engine) runReply(ctx context.Context, tx pgx.Tx, m kafka.Message, c *store.Claimed) (bool, error) {
	b := &batch{e: e, tx: tx, msg: &m, ctx: ctx}
	var keyText string
	for _, h := range m.Headers {
		if h.Key == store.HeaderStepKey {
			keyText = string(h.Value)
		}
	}
	key, kerr := steps.ParseKey(keyText)
	if kerr != nil || c.ID == uuid.Nil {
		if kerr == nil {
			kerr = errors.New("no valid " + store.HeaderMessageID + " header")
		}
		if err := b.park(ctx, c, nil, CodeMalformed, "malformed reply: "+kerr.Error()); err != nil {
			return false, err
		}
		return false, e.finish(ctx, tx, b)
	}
	sagas, err := e.st.LockSagas(ctx, tx, []uuid.UUID{key.SagaID})
	if err != nil {
		return false, err
	}
	ls := sagas[key.SagaID]
	switch {
	case ls == nil:
		if err := b.park(ctx, c, nil, CodeUnknownSaga, fmt.Sprintf("reply for saga %s, which does not exist", key.SagaID)); err != nil {
			return false, err
		}
	case !ls.Locked:
		return true, nil // a step of the saga runs right now: try again
	default:
		if err := b.reply(ctx, c, ls, key, true); err != nil {
			return false, err
		}
	}
	return false, e.finish(ctx, tx, b)
}

// claimedFromKafka describes a Kafka message as the executor's input.
func claimedFromKafka(m kafka.Message) store.Claimed {
	c := store.Claimed{Payload: m.Value, Age: time.Since(m.Time)}
	for _, h := range m.Headers {
		switch h.Key {
		case store.HeaderMessageID:
			c.ID, _ = uuid.Parse(string(h.Value))
		case store.HeaderType:
			c.Type = string(h.Value)
		case store.HeaderSagaID:
			if id, err := uuid.Parse(string(h.Value)); err == nil {
				c.SagaID = &id
			}
		}
	}
	return c
}

// runKafkaMessage runs one command from Kafka in its own transaction. again
// is true when the command must be tried again later (its saga is busy).
func (e *Engine) runKafkaMessage(ctx context.Context, m kafka.Message) (again bool, err error) {
	bt, err := e.beginBatch(ctx, ctx)
	if err != nil {
		return false, err
	}
	defer bt.end(ctx)
	tx := bt.tx
	c := claimedFromKafka(m)
	if c.Type == steps.ReplyType {
		return e.runReply(ctx, tx, m, &c)
	}
	cmd, derr := decodeCommand(&c)
	if derr == nil && c.ID == uuid.Nil {
		derr = errors.New("no valid " + store.HeaderMessageID + " header")
	}
	var ids []uuid.UUID
	if derr == nil {
		ids = []uuid.UUID{cmd.SagaID}
	}
	sagas, err := e.st.LockSagas(ctx, tx, ids)
	if err != nil {
		return false, err
	}
	fault.Hit(fault.EngineAfterClaim)
	b := &batch{e: e, tx: tx, msg: &m, ctx: ctx}
	err = b.handle(ctx, &c, cmd, derr, sagas, true)
	if errors.Is(err, errAbandoned) {
		// The attempt is recorded with its retry; this message is spent.
		return false, e.abandon(ctx, bt, b)
	}
	if err != nil {
		return false, err
	}
	if len(b.deferred) > 0 {
		return true, nil
	}
	if err := e.finish(ctx, tx, b); err != nil {
		return false, err
	}
	return false, nil
}
