package participant

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/signing"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// Config configures a [Participant].
type Config struct {
	// Consumer names the service in its inbox (e.g. "payments"). Required.
	Consumer string
	// Schema holds the service's sagaflow tables (inbox, outbox). Defaults
	// to migrations.SchemaDefault.
	Schema string
	// Logger receives logs. Defaults to slog.Default().
	Logger *slog.Logger
	// ReplyTopics lists the only topics the participant replies to. A
	// command whose sagaflow-reply-to header names another topic is
	// dead-lettered with [CodeReplyTopicRefused], and not run: whoever can
	// write to the command topic must not be able to make the participant
	// write to any topic its relay reaches. Defaults to the reply topics of
	// engines that keep the default names, sagaflow.commands.<saga
	// name>.replies (see [IsDefaultReplyTopic]). An engine with its own
	// KafkaConfig.ReplyTopic, or its own CommandTopic, replies elsewhere:
	// list its reply topics here.
	ReplyTopics []string
	// SigningKey turns on signing when set: a command must carry a valid
	// sagaflow-signature header (HMAC-SHA256 under this key or one of
	// VerifyKeys, over the sagaflow headers and the payload), or it is
	// dead-lettered with [CodeUnverified] before any effect: its id is not
	// recorded and its handler does not run. The participant signs its
	// replies with this key. Every engine and participant on the bus must
	// share it. Defaults to none: nothing is signed or verified.
	SigningKey []byte
	// VerifyKeys are former signing keys whose signatures are still
	// accepted, so that the key can be changed without stopping the bus:
	// first add the new key to every service's VerifyKeys, then make it
	// the SigningKey everywhere, then drop the old one. Requires
	// SigningKey.
	VerifyKeys [][]byte
	// TracerProvider makes the participant's spans: one per handler run,
	// whose context its reply carries back to the saga. Defaults to
	// OpenTelemetry's global provider.
	TracerProvider trace.TracerProvider
	// MeterProvider makes the participant's metrics (see
	// docs/observability.md). Defaults to OpenTelemetry's global provider.
	MeterProvider metric.MeterProvider
}

// Participant serves the commands that sagas in other services send to this
// service's topic, and replies through this service's own outbox.
//
// Give its [Participant.Handlers] to an inbox.Consumer reading the
// service's command topic, and run a relay on the service's schema to
// publish the replies.
type Participant struct {
	in          *inbox.Inbox
	steps       *inbox.Inbox // step-scoped keys
	stepsName   string       // steps' consumer name
	st          *store.Store
	log         *slog.Logger
	keys        signing.Keys
	replyTopics map[string]bool // nil: IsDefaultReplyTopic
	handlers    map[string]inbox.HandlerFunc
	tel         *participantTelemetry
}

// New returns a participant on pool; the schema must have been
// migrated with migrations.Migrate.
func New(pool *pgxpool.Pool, cfg *Config) (*Participant, error) {
	c := Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Schema == "" {
		c.Schema = store.SchemaDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	in, err := inbox.New(pool, &inbox.Config{Consumer: c.Consumer, Schema: c.Schema, Logger: c.Logger})
	if err != nil {
		return nil, fmt.Errorf("participant: participant: %w", err)
	}
	keys, err := inbox.New(pool, &inbox.Config{Consumer: c.Consumer + "/steps", Schema: c.Schema, Logger: c.Logger})
	if err != nil {
		return nil, fmt.Errorf("participant: participant: %w", err)
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("participant: participant: %w", err)
	}
	tel, err := newParticipantTelemetry(&c)
	if err != nil {
		return nil, fmt.Errorf("participant: telemetry: %w", err)
	}
	p := &Participant{in: in, steps: keys, stepsName: c.Consumer + "/steps", st: st, log: telemetry.Logger(c.Logger), tel: tel,
		keys:     signing.Keys{Current: c.SigningKey, Previous: c.VerifyKeys},
		handlers: map[string]inbox.HandlerFunc{}}
	if c.ReplyTopics != nil {
		p.replyTopics = make(map[string]bool, len(c.ReplyTopics))
		for _, t := range c.ReplyTopics {
			p.replyTopics[t] = true
		}
	}
	return p, nil
}

func (c *Config) validate() error {
	for i, t := range c.ReplyTopics {
		if !store.LegalTopic(t) {
			return fmt.Errorf("%w: ReplyTopics[%d] %q is not a legal Kafka topic name (1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')",
				ErrInvalidConfig, i, safetext.Text(t, 256))
		}
	}
	if len(c.VerifyKeys) > 0 && len(c.SigningKey) == 0 {
		return fmt.Errorf("%w: VerifyKeys needs SigningKey: without it nothing is verified", ErrInvalidConfig)
	}
	for i, k := range c.VerifyKeys {
		if len(k) == 0 {
			return fmt.Errorf("%w: VerifyKeys[%d] is empty", ErrInvalidConfig, i)
		}
	}
	return nil
}

// defaultCommandTopic is saga.CommandTopicDefault, which this package
// cannot import (package saga imports it); a test keeps them equal.
const defaultCommandTopic = "sagaflow.commands"

// IsDefaultReplyTopic reports whether topic is named as an engine with the
// default names (no KafkaConfig.ReplyTopic, the default CommandTopic)
// names its reply topics: sagaflow.commands.<saga name>.replies. It is the
// rule a [Participant] replies by when Config.ReplyTopics is not
// set.
func IsDefaultReplyTopic(topic string) bool {
	name, ok := strings.CutPrefix(topic, defaultCommandTopic+".")
	if !ok {
		return false
	}
	name, ok = strings.CutSuffix(name, ".replies")
	return ok && name != "" && store.LegalTopic(topic)
}

// Inbox returns the participant's inbox, to build the consumer with:
// p.Inbox().NewConsumer(reader, &inbox.ConsumerConfig{Handlers: p.Handlers()}).
func (p *Participant) Inbox() *inbox.Inbox { return p.in }

// Handlers returns the registered handlers by command type.
func (p *Participant) Handlers() map[string]inbox.HandlerFunc { return p.handlers }

// Call is a saga's command as a participant's handler receives it.
type Call[C any] struct {
	Command C
	// Key is the step-scoped key of the saga step that sent the command:
	// the same for every copy and re-delivery. Pass it to external
	// services as their idempotency key.
	Key       steps.Key
	SagaID    uuid.UUID
	Direction steps.Direction
	Type      string
}

// Handle registers fn for commands of type commandType. fn runs inside the
// transaction that records the command's step-scoped key in the
// participant's inbox (which fn may not commit or roll back: see the
// package doc), so its database effects happen once per saga step
// whatever the duplicates; its result is sent back to the saga as the reply,
// written to the participant's outbox in the same transaction. An error
// marked [steps.Permanent] is sent back as a refusal (the saga compensates); any
// other error leaves the command to be retried, except an error of
// PostgreSQL refusing a value (a NUL byte in text, say), which the consumer
// dead-letters at once. A refusal is not recorded under the step key: a
// refused compensation, once its cause is fixed, runs when the saga is
// resumed (saga.Engine.Resume). Every reply names the command it answers
// (wire.Reply.InReplyTo), so that a refusal sent twice before the resume
// cannot fail the step the resume sent again. A step that ran before is not
// run again; its reply is sent again instead, as the answer to the command
// that asked.
//
// A command is checked before anything else, and dead-lettered without a
// reply or any effect when it fails a check: its signature when signing is
// on, its step key (present, well formed, storable, and agreeing with its
// saga id and direction headers), and its reply topic (see
// Config.ReplyTopics).
//
// A compensation must tolerate a forward step that never ran (after a reply
// timeout the saga compensates a step whose command may never have arrived).
// Then the participant records the forward step as done and refuses it with
// [CodeCompensatedBeforeRun]: the refusal is sent at once, and again when
// the forward command arrives, which does nothing else.
func Handle[C, R any](p *Participant, commandType string, fn func(ctx context.Context, tx pgx.Tx, call Call[C]) (R, error)) error {
	if commandType == "" || fn == nil {
		return errors.New("participant: handle: a command type and a function are required")
	}
	if _, dup := p.handlers[commandType]; dup {
		return fmt.Errorf("participant: handle: a handler for %q is already registered", commandType)
	}
	p.handlers[commandType] = p.tel.traced(commandType, func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		key, replyTo, err := p.admit(msg)
		if err != nil {
			return err // dead-lettered by the consumer
		}
		call := Call[C]{Key: key, SagaID: key.SagaID, Direction: key.Direction, Type: msg.Type}
		// Each reply names the command it answers (wire.Reply.InReplyTo):
		// a refusal is not recorded, so after a resume the engine tells a
		// copy of the old refusal from the answer to the command sent again.
		commandID := msg.Headers[wire.HeaderMessageID]
		// A savepoint around the step key and the handler's writes: a
		// refusal undoes both, so once its cause is fixed the saga can send
		// the same step again (Resume) and it runs. Deduplicate by the
		// step-scoped key, not only the message id: one saga step's command
		// may reach the participant as more than one message.
		fresh, err := p.openStep(ctx, tx, key)
		if err != nil {
			return err
		}
		var result R
		if fresh {
			err = func() error {
				if err := json.Unmarshal(msg.Value, &call.Command); err != nil {
					return steps.Permanent(steps.WithCode(CodeMalformedCommand, fmt.Errorf("decode command: %w", err)))
				}
				if key.Direction == steps.Compensate {
					if err := p.closeForward(ctx, tx, replyTo, key); err != nil {
						return err
					}
				}
				var herr error
				func() {
					defer func() {
						if v := recover(); v != nil {
							// A bug in the handler: refuse rather than crash the
							// service (and crash again on every redelivery).
							herr = steps.Permanent(steps.WithCode(CodePanic, fmt.Errorf("handler for %q panicked: %v", commandType, v)))
						}
					}()
					result, herr = fn(ctx, handlerTx{tx}, call)
				}()
				return herr
			}()
		}
		switch {
		case err != nil && !steps.IsPermanent(err):
			return err // retried by the consumer
		case err != nil:
			if _, rerr := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+stepSavepoint); rerr != nil {
				return rerr
			}
			return p.sendReply(ctx, tx, replyTo, key, wire.Reply{Error: refusalText(err), Code: steps.Code(err), InReplyTo: commandID})
		case !fresh:
			// This step ran before (or, forward, was closed by its
			// compensation). Send its reply again: the saga may have
			// missed the first (it came too late, and the saga was
			// resumed).
			return p.resendLast(ctx, tx, replyTo, key, commandID)
		}
		out, err := json.Marshal(result)
		if err != nil {
			return fmt.Errorf("participant: encode reply to %s: %w", key, err)
		}
		return p.sendReply(ctx, tx, replyTo, key, wire.Reply{OK: true, Result: out, InReplyTo: commandID})
	})
	return nil
}

// errHandlerEndsTx is what a handler gets when it tries to end the
// transaction it was given.
var errHandlerEndsTx = errors.New("participant: a handler may not commit or roll back its transaction " +
	"(it is the consumer's, which records the step); return an error to undo the handler's writes")

// handlerTx is the transaction a handler is given: the consumer's, which
// the handler may use and open savepoints in (Begin), but not end.
type handlerTx struct{ pgx.Tx }

func (handlerTx) Commit(context.Context) error   { return errHandlerEndsTx }
func (handlerTx) Rollback(context.Context) error { return errHandlerEndsTx }

// stepSavepoint is the savepoint a command's step opens before its key. It
// is not released: the consumer's transaction ends it with the rest, and a
// later command's step in the same transaction opens its own under the same
// name, which a rollback to the name then finds first.
const stepSavepoint = "sagaflow_participant_step"

// openStep opens the savepoint of key's step and records the key, in one
// round trip; it reports whether the key is new (the step is to run).
func (p *Participant) openStep(ctx context.Context, tx pgx.Tx, key steps.Key) (bool, error) {
	var fresh bool
	b := &pgx.Batch{}
	b.Queue("SAVEPOINT " + stepSavepoint)
	p.st.QueueInsertInboxKey(b, p.stepsName, safetext.Key(key.String()), &fresh)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return false, fmt.Errorf("participant: record step %s: %w", key, err)
	}
	return fresh, nil
}

// admit checks a command before it has any effect, and returns its step
// key and reply topic. Its errors are permanent: the consumer dead-letters
// the command, without recording its id, and nothing is replied.
func (p *Participant) admit(msg inbox.Message) (steps.Key, string, error) {
	refuse := func(code, format string, args ...any) (steps.Key, string, error) {
		return steps.Key{}, "", steps.Permanent(steps.WithCode(code, fmt.Errorf("command %q: "+format, append([]any{safetext.Text(msg.ID, 128)}, args...)...)))
	}
	if err := p.keys.Verify(func(name string) string { return msg.Headers[name] }, msg.Value); err != nil {
		return refuse(CodeUnverified, "%w", err)
	}
	keyText, replyTo := msg.Headers[wire.HeaderStepKey], msg.Headers[wire.HeaderReplyTo]
	if keyText == "" || replyTo == "" {
		return refuse(CodeNotASagaCommand, "a saga command has the %s and %s headers", wire.HeaderStepKey, wire.HeaderReplyTo)
	}
	key, err := steps.ParseKey(keyText)
	if err != nil {
		return refuse(CodeNotASagaCommand, "%w", err)
	}
	if v, ok := msg.Headers[wire.HeaderSagaID]; ok && v != key.SagaID.String() {
		return refuse(CodeNotASagaCommand, "%s %q is not the saga of step key %s", wire.HeaderSagaID, safetext.Text(v, 128), keyText)
	}
	if v, ok := msg.Headers[wire.HeaderDirection]; ok && v != string(key.Direction) {
		return refuse(CodeNotASagaCommand, "%s %q is not the direction of step key %s", wire.HeaderDirection, safetext.Text(v, 128), keyText)
	}
	if !p.repliesTo(replyTo) {
		return refuse(CodeReplyTopicRefused, "this participant does not reply to topic %q (Config.ReplyTopics)",
			safetext.Text(replyTo, 256))
	}
	return key, replyTo, nil
}

func (p *Participant) repliesTo(topic string) bool {
	if p.replyTopics == nil {
		return IsDefaultReplyTopic(topic)
	}
	return p.replyTopics[topic]
}

// closeForward records the forward step of a compensation as done, in the
// compensation's transaction. If the forward had not run, it never will:
// its command, should it still arrive (a relay retry reordered them, or the
// compensation was sent after a reply timeout), finds its key and is
// answered with the refusal written here, instead of doing what was just
// undone.
func (p *Participant) closeForward(ctx context.Context, tx pgx.Tx, replyTo string, key steps.Key) error {
	forward := steps.Key{SagaID: key.SagaID, Step: key.Step, Direction: steps.Forward, Epoch: key.Epoch}
	notRun, err := p.steps.ProcessTx(ctx, tx, inbox.Message{ID: forward.String()},
		func(context.Context, pgx.Tx, inbox.Message) error { return nil })
	if err != nil || !notRun {
		return err
	}
	return p.sendReply(ctx, tx, replyTo, forward, wire.Reply{Code: CodeCompensatedBeforeRun,
		Error: "the step's compensation ran before its command arrived; the step was not run"})
}

func refusalText(err error) string {
	var pe *steps.PermanentError
	if errors.As(err, &pe) && pe.Err != nil {
		err = pe.Err
	}
	var ce *steps.CodedError
	if errors.As(err, &ce) && ce.Err != nil {
		err = ce.Err
	}
	return strings.TrimSpace(err.Error())
}

// resendLast sends the latest reply recorded for key's step again, under a
// new message id (and so a new signature), as the answer to command
// commandID.
func (p *Participant) resendLast(ctx context.Context, tx pgx.Tx, replyTo string, key steps.Key, commandID string) error {
	payload, found, err := p.st.LastReply(ctx, tx, key.String())
	if err != nil {
		return fmt.Errorf("participant: read the last reply for %s: %w", key, err)
	}
	if !found {
		// Retention has deleted it.
		p.log.WarnContext(ctx, "sagaflow participant: a step ran before, but its reply is gone; nothing to send again",
			slog.String("step_key", key.String()))
		return nil
	}
	return p.writeReply(ctx, tx, replyTo, key, readdress(payload, commandID))
}

// readdress returns a stored reply's payload as the answer to command
// commandID: its "in_reply_to" set to commandID, or removed when commandID
// is "". A payload that is not a JSON object (none this package wrote) is
// returned as it is.
func readdress(payload []byte, commandID string) []byte {
	var fields map[string]json.RawMessage
	if json.Unmarshal(payload, &fields) != nil || fields == nil {
		return payload
	}
	delete(fields, "in_reply_to")
	if commandID != "" {
		fields["in_reply_to"], _ = json.Marshal(commandID)
	}
	out, err := json.Marshal(fields)
	if err != nil {
		return payload
	}
	return out
}

// sendReply writes r to the outbox, for the relay to publish to topic. The
// text of a refusal is made storable first: it comes from a handler.
func (p *Participant) sendReply(ctx context.Context, tx pgx.Tx, topic string, key steps.Key, r wire.Reply) error {
	r.Error = safetext.Text(r.Error, wire.MaxReplyErrorBytes)
	r.Code = safetext.Text(r.Code, wire.MaxReplyCodeBytes)
	noteReply(ctx, r)
	payload, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("participant: encode reply to %s: %w", key, err)
	}
	return p.writeReply(ctx, tx, topic, key, payload)
}

// writeReply writes a reply's row, signed when signing is on. The relay
// sets the message id, type, saga id and step key headers from the row's
// columns, to the values signed here, and copies the signature header.
func (p *Participant) writeReply(ctx context.Context, tx pgx.Tx, topic string, key steps.Key, payload []byte) error {
	id := uuid.Must(uuid.NewV7())
	keyText := key.String()
	headers := map[string]string{wire.HeaderMessageID: id.String(), wire.HeaderType: wire.TypeReply,
		wire.HeaderSagaID: key.SagaID.String(), wire.HeaderStepKey: keyText}
	p.keys.SignMap(headers, payload)
	telemetry.Inject(ctx, headers) // the handler's span: the saga's trace goes on
	// The relay wakes when the transaction commits.
	return p.st.InsertMessageNotify(ctx, tx, &store.Message{
		ID: id, Topic: topic, Delivery: store.DeliveryRelay, AggregateType: "saga.reply", AggregateID: key.SagaID.String(),
		Type: wire.TypeReply, Payload: payload, SagaID: &key.SagaID, StepKey: &keyText, Headers: headers,
	})
}
