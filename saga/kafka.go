package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/consume"
	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// KafkaConfig connects an engine to Kafka. It has two modes.
//
// The hybrid mode (the default) carries over Kafka only what crosses a
// service boundary: the commands of [Remote] steps, which a relay (package
// relay) publishes to the participants' topics, and the participants'
// replies, which the engine consumes in one consumer group, each in the
// saga's transaction. Every local step is claimed from PostgreSQL exactly
// as in the Postgres-only mode, at its speed.
//
// Kafka mode ([KafkaConfig.AllSteps]) carries every step command over
// Kafka: the commands are still written to the outbox in the step's
// transaction, a relay publishes them, and the engine's workers consume them
// as members of one consumer group. Choose it to spread a saga type's local
// steps over engines by partition (each engine runs the partitions the
// group gives it), or to keep every command on the bus for other consumers
// to see; it costs a relay hop and a consumer group per step. The executor,
// the keys and the fencing are the same in all modes.
//
// The rest of this comment is about Kafka mode.
//
// A partition's messages run one at a time: a slow step holds up the
// commands behind it on its partition, other sagas' too, for as long as it
// runs (at most its Timeout plus HandlerGrace). Give command topics more
// partitions than the engines have workers, and keep slow calls short or
// remote. A command that cannot run yet never waits in its partition: it is
// moved back to the outbox and published again later.
//
// Each saga type has its own topic, CommandTopic + "." + the saga's name
// (sagaflow.commands.checkout, say), partitioned by saga id: an engine
// consumes only the sagas it knows, and one saga's commands stay in order.
// Create the topics before starting the engine, or let the cluster create
// them.
type KafkaConfig struct {
	// Brokers to consume from. Required unless NewReader is set (a reader
	// of another client, or of another transport such as NATS JetStream:
	// see package transport/natsbus), which then is all the engine reads
	// through.
	Brokers []string
	// AllSteps carries every step command over Kafka (Kafka mode), not only
	// remote steps' commands and replies (the hybrid mode, the default).
	AllSteps bool
	// Dialer connects to the brokers (TLS, SASL: see package kafkaconfig).
	// Defaults to plain TCP.
	Dialer *kafka.Dialer
	// GroupID names the engines' consumer group. Defaults to
	// "sagaflow-engine-" + Schema. Engines of another schema on the same
	// cluster need another Config.CommandTopic too.
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
	// bounds it (group.min.session.timeout.ms and
	// group.max.session.timeout.ms, 6 s and 30 min by default: outside them
	// the engine consumes nothing, logs an error and its Health is not
	// ready), and New refuses 2^31 ms (about 24.8 days) or more, which the
	// Kafka protocol cannot carry. It also
	// bounds a rebalance (how long the coordinator waits for the engines to
	// join again, and so how long a stopping engine may wait for one); 10 s
	// when zero.
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
	// ReplyStepLimit bounds how long the step run at once after a reply
	// (see "Remote steps" in the package doc) may hold the Kafka worker
	// that applied the reply, in the hybrid mode: the replies behind it in
	// its partition wait for it. Past the limit the step is given up (its
	// context cancelled, its transaction's connection closed, nothing of it
	// recorded), the reply is applied again on its own with the step's
	// command, and an engine worker runs the step, its attempt counted as
	// usual; for a minute after, that step of that saga type is not run at
	// once after a reply on this engine. Defaults to
	// ReplyStepLimitDefault; negative runs such steps to their Timeout on the
	// reply worker. Kafka mode has no such limit: there every step runs on
	// a partition.
	ReplyStepLimit time.Duration
	// NewReader, when set, makes the reader each Kafka worker consumes:
	// a seam for another Kafka client, a wrapper that adds metrics, or a
	// test. It gets the group and the topics (Engine.CommandTopics) and
	// must commit only the offsets it is asked to, synchronously. Defaults
	// to a kafka-go reader in the consumer group, from the first offset.
	NewReader func(groupID string, topics []string) KafkaReader
}

// KafkaReader is what a Kafka worker consumes from; *kafka.Reader
// satisfies it.
type KafkaReader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

// sign signs m's headers and payload when commands travel over Kafka
// signed.
func (e *Engine) sign(m *store.Message) {
	if m.Delivery == store.DeliveryRelay {
		e.signer.SignMap(m.Headers, m.Payload)
	}
}

// replyTopic is where participants reply to a saga type's remote steps:
// Kafka.ReplyTopic, or the saga type's Kafka command topic + ".replies" (in
// both modes, so that switching modes keeps the participants' reply topic).
func (e *Engine) replyTopic(sagaName string) string {
	if e.cfg.Kafka.ReplyTopic != "" {
		return e.cfg.Kafka.ReplyTopic
	}
	return e.cfg.CommandTopic + "." + sagaName + ".replies"
}

// allKafka reports whether step commands travel over Kafka (Kafka mode).
func (e *Engine) allKafka() bool { return e.cfg.Kafka != nil && e.cfg.Kafka.AllSteps }

// commandTopic is the topic of a saga type's commands in Kafka mode, or the
// direct command topic otherwise (Postgres-only and hybrid modes).
func (e *Engine) commandTopic(sagaName string) string {
	if !e.allKafka() {
		return e.cfg.CommandTopic
	}
	return e.cfg.CommandTopic + "." + sagaName
}

func (e *Engine) commandDelivery() string {
	if !e.allKafka() {
		return store.DeliveryDirect
	}
	return store.DeliveryRelay
}

// CommandTopics returns the Kafka topics an engine with Kafka consumes: in
// Kafka mode its registered sagas' command topics; in both modes, for sagas
// with remote steps, their reply topics. Create them before starting the
// engine. It is empty for an engine without Kafka, and for a hybrid engine
// whose sagas have no remote steps.
func (e *Engine) CommandTopics() []string {
	if e.ready("Engine.CommandTopics") != nil || e.cfg.Kafka == nil {
		return nil
	}
	var topics, replies []string
	for _, name := range e.registeredNameList() {
		if e.allKafka() {
			topics = append(topics, e.commandTopic(name))
		}
		if e.anyVersionRemote(name) && !slices.Contains(replies, e.replyTopic(name)) {
			replies = append(replies, e.replyTopic(name))
		}
	}
	return append(topics, replies...)
}

// kafkaReaders is how many Kafka workers (consumer group members) a started
// engine runs: one per worker in Kafka mode; in the hybrid mode one per
// worker as well, since a reply runs the step after it in the reply's
// transaction, or none when no registered saga has a remote step.
func (e *Engine) kafkaReaders() int {
	if e.cfg.Kafka == nil || len(e.CommandTopics()) == 0 {
		return 0
	}
	return e.cfg.Workers
}

func (e *Engine) newCommandReader() KafkaReader {
	k := e.cfg.Kafka
	if k.NewReader != nil {
		return k.NewReader(k.GroupID, e.CommandTopics())
	}
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
		RebalanceTimeout:  rebalanceTimeout(k),
		CommitInterval:    0, // commit synchronously, after the step's transaction
		Logger:            nil,
		ErrorLogger:       kafka.LoggerFunc(func(msg string, args ...any) { e.log.Debug("sagaflow kafka: " + fmt.Sprintf(msg, args...)) }),
	})
}

// rebalanceTimeoutDefault bounds a rebalance of the engines' group when
// KafkaConfig.SessionTimeout is not set (kafka-go's own default is 30 s).
const rebalanceTimeoutDefault = 10 * time.Second

// rebalanceTimeout is how long the group coordinator waits for the members
// to join again when the group changes: the session timeout when one is
// set, else rebalanceTimeoutDefault. An engine that stops closes its
// readers, and each one that leaves makes the others join again; a reader
// that is joining when it is closed waits for that round to end. With
// kafka-go's default, an engine's Stop could take 30 s (a CI run's Stop
// timed out there).
func rebalanceTimeout(k *KafkaConfig) time.Duration {
	if k.SessionTimeout > 0 {
		return k.SessionTimeout
	}
	return rebalanceTimeoutDefault
}

// kafkaWork is one Kafka executor: it runs each message's command in a
// transaction and commits the message's offset only after that transaction
// committed. Nothing waits in its partition for long: a command that cannot
// run yet (its saga is busy, or this engine does not know its saga or step)
// is moved back to the outbox after a few quick tries and published again
// later, and a message whose content PostgreSQL refuses is dead-lettered.
func (e *Engine) kafkaWork(fetch, work context.Context, r KafkaReader) {
	e.hstate.workerUp()
	defer e.hstate.workerDown()
	defer func() {
		if err := r.Close(); err != nil {
			e.log.WarnContext(work, "sagaflow kafka: close reader", slog.Any("error", err))
		}
	}()
	// Stopping inside consumeKafka leaves the offset uncommitted: the
	// command is redelivered to whichever engine takes the partition.
	loop := consume.Loop{Reader: r, Log: e.log, What: "sagaflow kafka", Handle: e.consumeKafka,
		CommitLost: "the redelivered command will be stale", OnFetch: e.hstate.fetches.Fetched}
	if kr, ok := r.(*kafka.Reader); ok && e.cfg.BatchSize > 1 {
		// kafka-go's reader keeps a message that a cancelled fetch did not
		// take, so a batch can take what it holds ready without waiting.
		// Other readers (the seam) run a message at a time. The reader is
		// the engine's own: no one else reads its stats.
		loop.HandleBatch, loop.MaxBatch = e.consumeKafkaBatch, e.cfg.BatchSize
		loop.Queued = func() int { return int(kr.Stats().QueueLength) }
	}
	loop.Run(fetch, work)
}

// consumeKafkaBatch deals with messages fetched together: in one
// transaction when each can simply run now, else one at a time as
// consumeKafka does. It reports how many of them, from the first, it dealt
// with before work ended.
func (e *Engine) consumeKafkaBatch(fetch, work context.Context, ms []kafka.Message) int {
	if len(ms) > 1 {
		ok, err := e.runKafkaBatch(work, ms)
		if ok {
			for _, m := range ms {
				e.tel.noteLag(m)
			}
			return len(ms)
		}
		if work.Err() == nil {
			// (A batch cut short by the engine's stop is not run again here.)
			e.stats.busRerun.Add(1)
		}
		if err != nil && work.Err() == nil {
			e.log.DebugContext(work, "sagaflow kafka: a batch of messages runs one at a time", slog.Int("messages", len(ms)),
				slog.Any("error", err))
		}
	}
	for i, m := range ms {
		if !e.consumeKafka(fetch, work, m) {
			return i
		}
	}
	return len(ms)
}

// kafkaHoldAfter is how many times a command that cannot run yet is tried
// in place, a few milliseconds apart, before it leaves its partition: the
// usual holder of a saga is a transaction that is just committing.
const kafkaHoldAfter = 3

// Delays of a command moved back to the outbox before it is published
// again: a busy saga is free again soon; an unknown saga or step waits for
// an engine that knows it (a rolling deploy). Each grows to half the time
// the command has been held so far: a busy saga's up to deferDelayMax, as a
// deferred direct command's, an unknown one's up to a minute.
const (
	holdDelayBusy    = 20 * time.Millisecond
	holdDelayUnknown = 2 * time.Second
)

// waitKind says why a command could not run yet.
type waitKind int

const (
	runDone     waitKind = iota // ran, parked or dropped: done with it
	waitBusy                    // another transaction holds its saga
	waitUnknown                 // this engine does not know its saga or step
	// waitAgain: the step run at once after what the message brought (a
	// reply, a wait's end) was given up with its transaction; the message
	// runs again at once, and is then written without the step.
	waitAgain
)

// consumeKafka deals with m until it is done with (run, parked, dropped,
// dead-lettered or moved back to the outbox); false when work ended first.
func (e *Engine) consumeKafka(fetch, work context.Context, m kafka.Message) bool {
	e.tel.noteLag(m)
	expired, again := false, 0
	for attempt := 1; ; attempt++ {
		wait, err := e.runKafkaMessage(work, m, expired)
		if wait == waitAgain && err == nil {
			again++
			if again <= kafkaHoldAfter {
				// Not a try toward holding it: its run again does not run
				// the step at once, and its saga is free again as soon as
				// the server ends the transaction given up.
				attempt--
				continue
			}
			wait = waitBusy
		}
		switch {
		case err == nil && wait == runDone:
			return true
		case err != nil && pgerr.Content(err):
			// The same bytes fail the same way every time.
			err = e.deadLetterKafka(work, m, CodeMalformed, "PostgreSQL refuses the message's content: "+err.Error())
			if err == nil {
				return true
			}
		case err == nil && attempt >= kafkaHoldAfter:
			var held bool
			held, err = e.holdKafkaMessage(work, m, wait)
			if err == nil && held {
				return true
			}
			if err == nil {
				// Past UnknownSagaGrace: run it once more, to park it.
				expired = true
				continue
			}
		}
		if err != nil && work.Err() == nil {
			e.log.ErrorContext(work, "sagaflow kafka: command failed; it runs again", slog.String("topic", m.Topic),
				slog.Int("partition", m.Partition), slog.Int64("offset", m.Offset), slog.Any("error", err))
		}
		if !lifecycle.Sleep(fetch, min(lifecycle.Backoff(attempt), deferDelay<<min(attempt, 10))) {
			return false
		}
	}
}

// holdKafkaMessage moves m back to the outbox, to be published again after a
// delay, and reports true (true too when m cannot be held and was
// dead-lettered instead); or reports false, writing nothing, when a command
// for an unknown saga or step has been held for longer than
// UnknownSagaGrace, in the database's time.
func (e *Engine) holdKafkaMessage(ctx context.Context, m kafka.Message, wait waitKind) (bool, error) {
	h := &store.Held{ID: uuid.Must(uuid.NewV7()), Topic: m.Topic, AggregateType: "sagaflow.held", AggregateID: string(m.Key),
		Payload: m.Value, Headers: map[string]string{}, Delay: holdDelayBusy, MaxDelay: deferDelayMax, Reason: "held: its saga was busy"}
	grace := time.Duration(0)
	if wait == waitUnknown {
		// (Its delay grows up to a minute: an engine that knows it may be
		// minutes away, and each hold publishes the command again.)
		h.Delay, h.MaxDelay, grace = holdDelayUnknown, 0, e.cfg.UnknownSagaGrace
		h.Reason = "held: no engine that knows its saga or step has run it yet"
	}
	if safetext.Problem(h.AggregateID, safetext.MaxKeyBytes) != "" || safetext.Problem(m.Topic, 249) != "" {
		// Done with it either way: dead-lettered, not held.
		return true, e.deadLetterKafka(ctx, m, CodeMalformed, "the message's key or topic cannot be stored to hold it")
	}
	var original string
	for _, kv := range m.Headers {
		name, value := kv.Key, string(kv.Value)
		if safetext.Problem(name, 256) != "" || safetext.Problem(value, 8192) != "" {
			continue // only headers that are safe travel on; the protocol's were checked
		}
		switch name {
		case wire.HeaderHeldSince:
			if t, err := time.Parse(time.RFC3339Nano, value); err == nil {
				h.HeldSince = &t
			}
			continue
		case wire.HeaderMessageID:
			original = value
		case wire.HeaderType:
			h.Type = value
		case wire.HeaderSagaID:
			if id, err := uuid.Parse(value); err == nil {
				h.SagaID = &id
			}
		}
		h.Headers[name] = value
	}
	if _, ok := h.Headers[wire.HeaderHeldID]; !ok && original != "" {
		h.Headers[wire.HeaderHeldID] = original
	}
	held, delay := false, time.Duration(0)
	err := pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var err error
		held, delay, err = e.st.HoldMessage(ctx, tx, h, grace)
		return err
	})
	if err != nil {
		return false, fmt.Errorf("saga: hold command: %w", err)
	}
	if held {
		fault.At(ctx, fault.EngineAfterHold)
		e.stats.deferred.Add(1)
		e.notifyIn(delay)
	}
	return held, nil
}

// deadLetterKafka stores m in dead_letters with the reason, in a
// transaction of its own; it cannot fail on m's content.
func (e *Engine) deadLetterKafka(ctx context.Context, m kafka.Message, code, reason string) error {
	reason = safetext.Text(code+": "+reason, 4000)
	e.stats.parked.Add(1)
	e.log.WarnContext(ctx, "sagaflow dead-lettered a Kafka message", slog.String("topic", m.Topic),
		slog.Int("partition", m.Partition), slog.Int64("offset", m.Offset), slog.String("reason", safetext.Text(reason, 500)))
	return pgx.BeginTxFunc(ctx, e.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		return e.st.InsertDeadLetter(ctx, tx, kafkaDeadLetter(&m, headerValue(&m, wire.HeaderMessageID), reason))
	})
}

// kafkaDeadLetter describes m as a dead letter, with its raw bytes.
func kafkaDeadLetter(m *kafka.Message, id, reason string) *store.DeadLetter {
	p, o := m.Partition, m.Offset
	d := &store.DeadLetter{Consumer: store.InboxConsumerEngine, MessageID: id, Topic: m.Topic, Partition: &p, Offset: &o,
		Key: m.Key, Value: m.Value, Headers: map[string]string{}, RawHeaders: make([]store.RawHeader, len(m.Headers)), Reason: reason}
	for i, kv := range m.Headers {
		d.Headers[kv.Key] = string(kv.Value)
		d.RawHeaders[i] = store.RawHeader{Key: []byte(kv.Key), Value: kv.Value}
	}
	return d
}

func headerValue(m *kafka.Message, name string) string {
	for _, h := range m.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}

// runReply applies a participant's reply in bt, without committing: it
// returns the batch to finish, and the sagas whose execution lock it took
// (see [runningSteps.claim]), to release once the batch has ended.
func (e *Engine) runReply(ctx context.Context, bt *batchTx, in *kafkaIn, last bool) (waitKind, *batch, []uuid.UUID, error) {
	b := e.newBatch(bt, in.m)
	c, key, kerr := &in.c, in.key, in.kerr
	if kerr != nil {
		return runDone, b, nil, b.park(ctx, c, nil, CodeMalformed, "malformed reply: "+kerr.Error())
	}
	sagas, err := e.lockSagas(bt, []uuid.UUID{key.SagaID}, "")
	if err != nil {
		return runDone, b, nil, err
	}
	ls := sagas[key.SagaID]
	switch {
	case ls == nil:
		return runDone, b, nil, b.park(ctx, c, nil, CodeUnknownSaga, fmt.Sprintf("reply for saga %s, which does not exist", key.SagaID))
	case !ls.Locked:
		return waitBusy, b, nil, nil // a step of the saga runs right now: try again
	}
	// The step after the reply may run in this transaction: a cancel
	// request heard of meanwhile interrupts it.
	held := []uuid.UUID{ls.ID}
	e.running.claim(held...)
	return runDone, b, held, b.reply(b.traceReply(ctx, c, &ls.Saga, key.Direction), c, ls, key, last)
}

// replyKey is the step key a reply answers. The message id is not needed to
// apply a reply (the saga takes one reply per step key, and a copy finds the
// step done): any id will do, a Java service's included.
func replyKey(m *kafka.Message, c *store.Claimed) (steps.Key, error) {
	key, err := steps.ParseKey(headerValue(m, wire.HeaderStepKey))
	if err == nil && c.SagaID != nil && *c.SagaID != key.SagaID {
		err = fmt.Errorf("its %s header names saga %s but its step key saga %s", wire.HeaderSagaID, c.SagaID, key.SagaID)
	}
	if err == nil && c.SagaID == nil && headerValue(m, wire.HeaderSagaID) != "" {
		err = fmt.Errorf("its %s header is not a saga id", wire.HeaderSagaID)
	}
	return key, err
}

// commandKey is the step key of a command read from Kafka.
func commandKey(cmd command) string {
	return steps.Key{SagaID: cmd.SagaID, Step: cmd.Step, Direction: cmd.Direction, Epoch: cmd.Epoch}.String()
}

// kafkaIn is a message from Kafka parsed once, before it runs: its
// headers, signature check and command (or, for a reply, the step key it
// answers). A batch's read ahead and the message's run both use it.
type kafkaIn struct {
	m    *kafka.Message
	c    store.Claimed
	aerr error // its sagaflow headers are ambiguous
	verr error // its signature does not verify
	// A reply: the step key it answers.
	key  steps.Key
	kerr error
	// A command.
	cmd  command
	derr error
}

// parseKafka parses m once for [Engine.runKafkaIn].
func (e *Engine) parseKafka(m *kafka.Message) *kafkaIn {
	in := &kafkaIn{m: m}
	in.c, in.aerr = claimedFromKafka(*m)
	in.verr = e.signer.Verify(func(n string) string { return headerValue(m, n) }, m.Value)
	if in.aerr != nil || in.verr != nil {
		return in
	}
	if in.c.Type == wire.TypeReply {
		in.key, in.kerr = replyKey(m, &in.c)
		return in
	}
	in.cmd, in.derr = decodeCommand(&in.c)
	if in.derr == nil && in.c.ID == uuid.Nil {
		in.derr = errors.New("no valid " + wire.HeaderMessageID + " header")
	}
	return in
}

// sagaToLock is the saga, and the step key, that running the message reads
// first (runKafkaIn's and runReply's lockSagas); false when the message is
// refused before that (ambiguous, unverified, malformed).
func (in *kafkaIn) sagaToLock() (uuid.UUID, string, bool) {
	switch {
	case in.aerr != nil || in.verr != nil:
		return uuid.Nil, "", false
	case in.c.Type == wire.TypeReply:
		return in.key.SagaID, "", in.kerr == nil
	case in.derr != nil:
		return uuid.Nil, "", false
	}
	return in.cmd.SagaID, commandKey(in.cmd), true
}

// prefetched is a saga read and locked by prefetchSagas.
type prefetched struct {
	stepKey string
	ls      *store.LockedSaga
}

// prefetchSagas prepares the read ahead of the sagas of the messages ms,
// which will run one after another in one transaction: queue queues the
// reads (and lock tries) of all of them, to go in the BEGIN's round trip,
// as a claim from the outbox reads the sagas of its batch together; done,
// once that round trip succeeded, keeps what was read for lockSagas. It
// reads nothing when two of the messages name one saga (the second must
// read what the first wrote) or fewer than two name one. The sagas it
// locked are noted as running here at once, as a claim's are, until the
// caller releases those done returns: a cancel requested while earlier
// messages of the batch run is then heard of (see [Engine.notified]) and
// goes ahead of the saga's own message.
func (e *Engine) prefetchSagas(ms []*kafkaIn) (queue func(*pgx.Batch), done func(bt *batchTx) []uuid.UUID) {
	ids := make([]uuid.UUID, 0, len(ms))
	keys := make(map[uuid.UUID]string, len(ms))
	for _, in := range ms {
		id, stepKey, ok := in.sagaToLock()
		if !ok {
			continue
		}
		if _, dup := keys[id]; dup {
			return func(*pgx.Batch) {}, func(*batchTx) []uuid.UUID { return nil }
		}
		keys[id] = stepKey
		ids = append(ids, id)
	}
	if len(ids) < 2 {
		return func(*pgx.Batch) {}, func(*batchTx) []uuid.UUID { return nil }
	}
	read := make(map[uuid.UUID]*store.LockedSaga, len(ids))
	queue = func(q *pgx.Batch) {
		for _, id := range ids {
			e.st.QueueLockSaga(q, id, keys[id], read)
		}
	}
	done = func(bt *batchTx) []uuid.UUID {
		held := e.readAhead(bt, read, keys)
		if h := e.hooks.readAhead; h != nil {
			h(slices.Collect(maps.Keys(read)))
		}
		return held
	}
	return queue, done
}

// readAhead keeps the sagas read ahead of their messages (each for the
// step key in keys) for lockSagas, and notes those it locked as running
// here; it returns them, to release once the batch has ended.
func (e *Engine) readAhead(bt *batchTx, read map[uuid.UUID]*store.LockedSaga, keys map[uuid.UUID]string) []uuid.UUID {
	held := heldSagas(read)
	e.running.claim(held...)
	bt.prefetched = make(map[uuid.UUID]prefetched, len(read))
	for id, ls := range read {
		bt.prefetched[id] = prefetched{stepKey: keys[id], ls: ls}
	}
	return held
}

// lockSagas is store.LockSagas in bt, answered from prefetchSagas's read
// when that read this one saga for the same step key (once: a saga read
// again is read afresh). A saga it found absent is read again. A fresh
// read goes after the writes the batch has queued, in their round trip: a
// second message for a saga whose first one ran earlier in the batch (a
// producer's retry of a command, a reply sent twice) must see that the
// first one's step is done.
func (e *Engine) lockSagas(bt *batchTx, ids []uuid.UUID, stepKey string) (map[uuid.UUID]*store.LockedSaga, error) {
	if len(ids) == 1 {
		if p, ok := bt.prefetched[ids[0]]; ok {
			delete(bt.prefetched, ids[0])
			if p.stepKey == stepKey {
				return map[uuid.UUID]*store.LockedSaga{ids[0]: p.ls}, nil
			}
		}
	}
	out := make(map[uuid.UUID]*store.LockedSaga, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	if err := bt.flushWith(func(q *pgx.Batch) {
		for _, id := range ids {
			e.st.QueueLockSaga(q, id, stepKey, out)
		}
	}); err != nil {
		return nil, fmt.Errorf("saga: read saga %s: %w", ids[0], err)
	}
	return out, nil
}

// claimedFromKafka describes a Kafka message as the executor's input. A
// command that an engine held (moved back to its outbox) is known by the id
// it was first consumed under. Repeated sagaflow headers make the message
// ambiguous: two readers could take it two ways.
func claimedFromKafka(m kafka.Message) (store.Claimed, error) {
	c := store.Claimed{Payload: m.Value}
	var heldID string
	seen := map[string]bool{}
	var ambiguous error
	for _, h := range m.Headers {
		if wire.IsOwnHeader(h.Key) {
			if seen[h.Key] && ambiguous == nil {
				ambiguous = fmt.Errorf("header %q appears more than once", safetext.Text(h.Key, 100))
			}
			seen[h.Key] = true
		}
		switch h.Key {
		case wire.HeaderMessageID:
			c.MessageID = string(h.Value)
			c.ID, _ = uuid.Parse(c.MessageID)
		case wire.HeaderHeldID:
			heldID = string(h.Value)
		case wire.HeaderType:
			c.Type = string(h.Value)
		case telemetry.HeaderTraceParent:
			c.TraceParent = string(h.Value)
		case telemetry.HeaderTraceState:
			c.TraceState = string(h.Value)
		case wire.HeaderSagaID:
			if id, err := uuid.Parse(string(h.Value)); err == nil {
				c.SagaID = &id
			}
		}
	}
	if id, err := uuid.Parse(heldID); err == nil {
		c.ID = id
	}
	return c, ambiguous
}

// runKafkaMessage runs one command from Kafka in its own transaction. It
// returns what the command waits for when it cannot run yet. expired says
// that a command for an unknown saga or step has waited past
// UnknownSagaGrace: it is parked.
func (e *Engine) runKafkaMessage(ctx context.Context, m kafka.Message, expired bool) (waitKind, error) {
	// The message's saga is read in the BEGIN's round trip.
	in := e.parseKafka(&m)
	id, stepKey, ok := in.sagaToLock()
	read := map[uuid.UUID]*store.LockedSaga{}
	bt, err := e.beginBatchWith(ctx, ctx, func(q *pgx.Batch) {
		if ok {
			e.st.QueueLockSaga(q, id, stepKey, read)
		}
	})
	if err != nil {
		return runDone, err
	}
	defer bt.end(ctx)
	if ok {
		defer e.running.release(e.readAhead(bt, read, map[uuid.UUID]string{id: stepKey})...)
	}
	wait, b, held, err := e.runKafkaIn(ctx, bt, in, expired, true)
	defer e.running.release(held...)
	if errors.Is(err, errAbandoned) {
		// The attempt is recorded with its retry; this message is spent,
		// unless the step ran at once after what the message brought (a
		// wait's end, a reply), which went with the transaction: only the
		// attempt's history entry is recorded, and the message runs again.
		// The step is then not run at once (see [batch.mayChain]).
		if err := e.abandon(ctx, bt, b); err != nil {
			return runDone, err
		}
		if a := b.abandoned; a != nil && b.ranAtOnce[a.saga.ID] {
			return waitAgain, nil
		}
		return runDone, nil
	}
	if err != nil || wait != runDone {
		return wait, err
	}
	return runDone, e.finish(ctx, b)
}

// runKafkaIn runs the message in in bt, without committing; last says that
// no other message follows it in bt. It returns the batch to finish, or
// what the message waits for when it cannot run yet (then nothing of it is
// to be committed), and the sagas whose execution lock it took, to release
// once the batch has ended.
func (e *Engine) runKafkaIn(ctx context.Context, bt *batchTx, in *kafkaIn, expired, last bool) (waitKind, *batch, []uuid.UUID, error) {
	c := &in.c
	if expired {
		c.Age = e.cfg.UnknownSagaGrace
	}
	if in.aerr != nil || in.verr != nil {
		b := e.newBatch(bt, in.m)
		code, why := CodeMalformed, "ambiguous: "+errString(in.aerr)
		if in.verr != nil {
			code, why = CodeUnverified, "refused before any effect: "+in.verr.Error()
		}
		return runDone, b, nil, b.park(ctx, c, nil, code, why)
	}
	if c.Type == wire.TypeReply {
		return e.runReply(ctx, bt, in, last)
	}
	cmd, derr := in.cmd, in.derr
	var ids []uuid.UUID
	var stepKey string
	if derr == nil {
		ids = []uuid.UUID{cmd.SagaID}
		stepKey = commandKey(cmd)
	}
	sagas, err := e.lockSagas(bt, ids, stepKey)
	if err != nil {
		return runDone, nil, nil, err
	}
	held := heldSagas(sagas)
	e.running.claim(held...)
	fault.At(ctx, fault.EngineAfterClaim)
	b := e.newBatch(bt, in.m)
	if err := b.handle(ctx, c, cmd, derr, sagas, last); err != nil {
		return runDone, b, held, err
	}
	if len(b.deferred) > 0 {
		if b.deferred[0].reason != "" {
			return waitUnknown, b, held, nil
		}
		return waitBusy, b, held, nil
	}
	return runDone, b, held, nil
}

// runKafkaBatch runs several messages fetched together in one transaction,
// each under its own savepoint, as a batch claimed from the outbox runs,
// and commits once. It reports false, having committed nothing, when one of
// them cannot simply run now (its saga is busy or unknown here, a handler
// overran, anything failed): the caller then runs them one at a time, each
// in its own transaction, with the retries, holds and dead letters of that
// path.
func (e *Engine) runKafkaBatch(ctx context.Context, ms []kafka.Message) (bool, error) {
	ins := make([]*kafkaIn, len(ms))
	for i := range ms {
		ins[i] = e.parseKafka(&ms[i])
	}
	// The sagas are read ahead in the BEGIN's round trip.
	queue, readDone := e.prefetchSagas(ins)
	bt, err := e.beginBatchWith(ctx, ctx, queue)
	if err != nil {
		return false, err
	}
	defer bt.end(ctx)
	var held []uuid.UUID
	defer func() { e.running.release(held...) }()
	defer e.running.release(readDone(bt)...)
	bs := make([]*batch, 0, len(ms))
	for i, in := range ins {
		wait, b, h, err := e.runKafkaIn(ctx, bt, in, false, i == len(ms)-1)
		held = append(held, h...)
		if errors.Is(err, errAbandoned) {
			// The connection goes with the handler: the attempt is
			// recorded, and the messages are run again one at a time (this
			// one is stale by then, unless the step ran at once after what
			// it brought: see runKafkaMessage).
			return false, e.abandon(ctx, bt, b)
		}
		if err != nil || wait != runDone {
			return false, err
		}
		bs = append(bs, b)
	}
	last := bs[len(bs)-1]
	for _, b := range bs[:len(bs)-1] {
		last.waitEnded = last.waitEnded || b.waitEnded
		last.announce += b.announce
	}
	if err := e.finish(ctx, last); err != nil {
		return false, err
	}
	e.stats.kafkaBatched.Add(int64(len(ms)))
	return true, nil
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
