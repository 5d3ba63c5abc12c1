package steps

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

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/store"
)

// ParticipantConfig configures a [Participant].
type ParticipantConfig struct {
	// Consumer names the service in its inbox (e.g. "payments"). Required.
	Consumer string
	// Schema holds the service's sagaflow tables (inbox, outbox). Defaults
	// to store.SchemaDefault.
	Schema string
	// Logger receives logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// Participant serves the commands that sagas in other services send to this
// service's topic, and replies through this service's own outbox.
//
// Give its [Participant.Handlers] to an inbox.Consumer reading the
// service's command topic, and run a relay on the service's schema to
// publish the replies.
type Participant struct {
	in            *inbox.Inbox
	steps         *inbox.Inbox // step-scoped keys
	stepsConsumer string
	st            *store.Store
	log           *slog.Logger
	handlers      map[string]inbox.HandlerFunc
}

// NewParticipant returns a participant on pool; the schema must have been
// migrated with store.Migrate.
func NewParticipant(pool *pgxpool.Pool, cfg *ParticipantConfig) (*Participant, error) {
	c := ParticipantConfig{}
	if cfg != nil {
		c = *cfg
	}
	if c.Schema == "" {
		c.Schema = store.SchemaDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	in, err := inbox.New(pool, &inbox.Config{Consumer: c.Consumer, Schema: c.Schema, Logger: c.Logger})
	if err != nil {
		return nil, fmt.Errorf("steps: participant: %w", err)
	}
	keys, err := inbox.New(pool, &inbox.Config{Consumer: c.Consumer + "/steps", Schema: c.Schema, Logger: c.Logger})
	if err != nil {
		return nil, fmt.Errorf("steps: participant: %w", err)
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("steps: participant: %w", err)
	}
	return &Participant{in: in, steps: keys, stepsConsumer: c.Consumer + "/steps", st: st, log: c.Logger,
		handlers: map[string]inbox.HandlerFunc{}}, nil
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
	Key       Key
	SagaID    uuid.UUID
	Direction Direction
	Type      string
}

// Handle registers fn for commands of type commandType. fn runs inside the
// transaction that records the command's step-scoped key in the
// participant's inbox, so its database effects happen once per saga step
// whatever the duplicates; its result is sent back to the saga as the reply,
// written to the participant's outbox in the same transaction. An error
// marked [Permanent] is sent back as a refusal (the saga compensates); any
// other error leaves the command to be retried. A refusal is not recorded
// under the step key: a refused compensation, once its cause is fixed, runs
// when the saga is resumed (saga.Engine.Resume). A step that ran before is
// not run again; its reply is sent again instead.
//
// A compensation must tolerate a forward step that never ran (after a reply
// timeout the saga compensates a step whose command may never have arrived):
// the participant records the forward step as seen, so a forward command
// arriving after its compensation does nothing.
func Handle[C, R any](p *Participant, commandType string, fn func(ctx context.Context, tx pgx.Tx, call Call[C]) (R, error)) error {
	if commandType == "" || fn == nil {
		return errors.New("steps: handle: a command type and a function are required")
	}
	if _, dup := p.handlers[commandType]; dup {
		return fmt.Errorf("steps: handle: a handler for %q is already registered", commandType)
	}
	p.handlers[commandType] = func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		replyTo := msg.Headers[store.HeaderReplyTo]
		key, err := ParseKey(msg.Headers[store.HeaderStepKey])
		if err != nil || replyTo == "" {
			return Permanent(fmt.Errorf("command %s is not a saga command: it needs the %s and %s headers (%v)",
				msg.ID, store.HeaderStepKey, store.HeaderReplyTo, err))
		}
		call := Call[C]{Key: key, SagaID: key.SagaID, Direction: key.Direction, Type: msg.Type}
		// A savepoint around the step key and the handler's writes: a
		// refusal undoes both, so once its cause is fixed the saga can send
		// the same step again (Resume) and it runs.
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		var result R
		// Deduplicate by the step-scoped key, not only the message id: one
		// saga step's command may reach the participant as more than one
		// message.
		fresh, err := p.steps.ProcessTx(ctx, sp, inbox.Message{ID: key.String()}, func(ctx context.Context, sptx pgx.Tx, _ inbox.Message) error {
			if err := json.Unmarshal(msg.Value, &call.Command); err != nil {
				return Permanent(WithCode("malformed_command", fmt.Errorf("decode command: %w", err)))
			}
			if key.Direction == Compensate {
				// Record the forward step as seen: if its command arrives
				// after this compensation (a relay retry reordered them), it
				// is skipped instead of doing what was just undone.
				forward := Key{SagaID: key.SagaID, Step: key.Step, Direction: Forward, Epoch: key.Epoch}
				if _, err := p.st.InsertInboxKey(ctx, sptx, p.stepsConsumer, forward.String()); err != nil {
					return err
				}
			}
			var herr error
			func() {
				defer func() {
					if v := recover(); v != nil {
						// A bug in the handler: refuse rather than crash the
						// service (and crash again on every redelivery).
						herr = Permanent(WithCode("panic", fmt.Errorf("handler for %q panicked: %v", commandType, v)))
					}
				}()
				result, herr = fn(ctx, sptx, call)
			}()
			return herr
		})
		switch {
		case err != nil && !IsPermanent(err):
			return err // retried by the consumer
		case err != nil:
			if rerr := sp.Rollback(ctx); rerr != nil {
				return rerr
			}
			return p.sendReply(ctx, tx, replyTo, key, Reply{Error: refusalText(err), Code: Code(err)})
		case !fresh:
			// This step ran before. Send its reply again: the saga may have
			// missed the first (it came too late, and the saga was resumed).
			if err := sp.Commit(ctx); err != nil {
				return err
			}
			if _, err := p.st.ResendLast(ctx, tx, key.String(), ReplyType, uuid.Must(uuid.NewV7())); err != nil {
				return err
			}
			return p.st.Notify(ctx, tx, replyTo)
		}
		if err := sp.Commit(ctx); err != nil {
			return err
		}
		out, err := json.Marshal(result)
		if err != nil {
			return fmt.Errorf("steps: encode reply to %s: %w", key, err)
		}
		return p.sendReply(ctx, tx, replyTo, key, Reply{OK: true, Result: out})
	}
	return nil
}

func refusalText(err error) string {
	var pe *PermanentError
	if errors.As(err, &pe) && pe.Err != nil {
		err = pe.Err
	}
	var ce *CodedError
	if errors.As(err, &ce) && ce.Err != nil {
		err = ce.Err
	}
	return strings.TrimSpace(err.Error())
}

func (p *Participant) sendReply(ctx context.Context, tx pgx.Tx, topic string, key Key, r Reply) error {
	payload, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("steps: encode reply to %s: %w", key, err)
	}
	id := uuid.Must(uuid.NewV7())
	keyText := key.String()
	// Wake the service's relay when the transaction commits.
	if err := p.st.Notify(ctx, tx, topic); err != nil {
		return err
	}
	return p.st.InsertMessage(ctx, tx, &store.Message{
		ID: id, Topic: topic, Delivery: store.DeliveryRelay, AggregateType: "saga.reply", AggregateID: key.SagaID.String(),
		Type: ReplyType, Payload: payload, SagaID: &key.SagaID, StepKey: &keyText,
		Headers: map[string]string{store.HeaderMessageID: id.String(), store.HeaderType: ReplyType,
			store.HeaderSagaID: key.SagaID.String(), store.HeaderStepKey: keyText},
	})
}
