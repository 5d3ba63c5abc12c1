package sagatest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/steps"
)

// ConsumerDefault names a fake [Participant] in its schema's inbox when its
// config names none.
const ConsumerDefault = "sagatest"

// participantPoll is how often the participant's relay looks for replies
// when no notification wakes it, and how long its reader waits for a fetch.
const participantPoll = 50 * time.Millisecond

// Answer is how a fake [Participant] answers one type of command. Make one
// with [Reply], [Refuse], [NoReply] or [AnswerFunc].
type Answer struct {
	fn     func(ctx context.Context, call Call) (any, error)
	silent bool
}

// valid reports whether a was made by Reply, Refuse, NoReply or
// AnswerFunc with a function: the zero Answer, and AnswerFunc(nil), answer
// nothing.
func (a Answer) valid() bool { return a.silent || a.fn != nil }

// answerProblem says what is wrong with the Answer for commandType, or "".
func answerProblem(commandType string, a Answer) string {
	if a.valid() {
		return ""
	}
	return fmt.Sprintf("the Answer for %q is the zero Answer or AnswerFunc(nil): make it with Reply, Refuse, NoReply or AnswerFunc", commandType)
}

// Reply answers with success, result (encoded as JSON) being the reply's
// result, which the saga's Remote.OnReply receives.
func Reply(result any) Answer {
	return Answer{fn: func(context.Context, Call) (any, error) { return result, nil }}
}

// Refuse answers with a refusal with code and message: the step fails for
// good and the saga compensates (a refused compensation fails the saga).
func Refuse(code, message string) Answer {
	return Answer{fn: func(context.Context, Call) (any, error) {
		return nil, steps.Permanent(steps.WithCode(code, errors.New(message)))
	}}
}

// NoReply answers nothing: the command is consumed and recorded, and no
// reply is sent, as from a service that lost it. The saga's step then ends
// by its reply timeout (see [Clock.Advance] to make it pass).
func NoReply() Answer { return Answer{silent: true} }

// AnswerFunc answers with what fn returns, as a participant.Handle handler would:
// a result, an error marked steps.Permanent (a refusal), or another error,
// which leaves the command to be retried by the consumer.
func AnswerFunc(fn func(ctx context.Context, call Call) (any, error)) Answer {
	return Answer{fn: fn}
}

// Call is a command a fake [Participant] received.
type Call struct {
	Type      string
	Key       steps.Key
	Direction steps.Direction
	// Command is the command's payload, as the saga's Remote.Command built it.
	Command json.RawMessage
	// Answered is false for a command answered with NoReply.
	Answered bool
}

// ParticipantConfig configures a fake [Participant].
type ParticipantConfig struct {
	// Brokers of the Kafka cluster the saga's engine uses. Required.
	Brokers []string
	// Topic is the command topic the participant serves (the steps'
	// Remote.Topic). Required.
	Topic string
	// Pool and Schema hold the participant's inbox and outbox: a migrated
	// schema, the engine's own or (as a real service would have) another.
	// Required.
	Pool   *pgxpool.Pool
	Schema string
	// Answers says how each command type (a Remote's Type or
	// CompensateType) is answered. Only these types are served: a command
	// of another type is dead-lettered. Required.
	Answers map[string]Answer
	// Consumer names the participant in its inbox, and with the topic its
	// consumer group (Consumer + "." + Topic). Defaults to ConsumerDefault.
	Consumer string
	// ReplyTopics and SigningKey are those of participant.Config: set
	// them as the engine needs (its KafkaConfig.ReplyTopic, its
	// SigningKey).
	ReplyTopics []string
	SigningKey  []byte
	// Logger receives the participant's logs. Defaults to warnings and
	// errors written to the test's log.
	Logger *slog.Logger
}

// Participant is a fake service for a saga's remote steps: it answers the
// commands of its topic as configured, over Kafka, through the real
// participant runtime (participant.Participant, an inbox.Consumer and a relay on
// its schema that publishes its replies). It records what it received.
type Participant struct {
	tb      testing.TB
	mu      sync.Mutex
	answers map[string]Answer
	calls   []Call
}

// NewParticipant starts a fake participant; it stops when the test ends.
// The engine must be in Kafka mode, and the topic must exist (or the
// cluster create topics).
func NewParticipant(tb testing.TB, cfg ParticipantConfig) *Participant {
	tb.Helper()
	switch {
	case len(cfg.Brokers) == 0:
		tb.Fatalf("sagatest: participant: ParticipantConfig.Brokers is required")
	case cfg.Topic == "":
		tb.Fatalf("sagatest: participant: ParticipantConfig.Topic is required")
	case cfg.Pool == nil || cfg.Schema == "":
		tb.Fatalf("sagatest: participant: ParticipantConfig.Pool and Schema are required")
	case len(cfg.Answers) == 0:
		tb.Fatalf("sagatest: participant: ParticipantConfig.Answers is required")
	}
	for typ, a := range cfg.Answers {
		if p := answerProblem(typ, a); p != "" {
			tb.Fatalf("sagatest: participant: ParticipantConfig.Answers: %s", p)
		}
	}
	if err := migrations.Check(context.Background(), cfg.Pool, cfg.Schema); err != nil {
		tb.Fatalf("sagatest: participant: ParticipantConfig.Schema %q: %v", cfg.Schema, err)
	}
	if cfg.Consumer == "" {
		cfg.Consumer = ConsumerDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(tbWriter{tb}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	p := &Participant{tb: tb, answers: map[string]Answer{}}
	sp, err := participant.New(cfg.Pool, &participant.Config{Consumer: cfg.Consumer, Schema: cfg.Schema,
		Logger: cfg.Logger, ReplyTopics: cfg.ReplyTopics, SigningKey: cfg.SigningKey})
	if err != nil {
		tb.Fatalf("sagatest: participant: %v", err)
	}
	for typ, a := range cfg.Answers {
		p.answers[typ] = a
		err := participant.Handle(sp, typ, func(ctx context.Context, _ pgx.Tx, c participant.Call[json.RawMessage]) (json.RawMessage, error) {
			call := Call{Type: c.Type, Key: c.Key, Direction: c.Direction, Command: c.Command, Answered: true}
			a, _ := ctx.Value(answerKey{}).(Answer) // decided once per message, below
			p.mu.Lock()
			p.calls = append(p.calls, call)
			p.mu.Unlock()
			result, err := a.fn(ctx, call)
			if err != nil {
				return nil, err
			}
			out, err := json.Marshal(result)
			if err != nil {
				return nil, steps.Permanent(fmt.Errorf("sagatest: encode the result for %s: %w", typ, err))
			}
			return out, nil
		})
		if err != nil {
			tb.Fatalf("sagatest: participant: %v", err)
		}
	}
	// The answer is decided once per message, before the participant sees
	// it (NoReply never lets it), and handed to the handler above.
	handlers := map[string]inbox.HandlerFunc{}
	for typ, h := range sp.Handlers() {
		handlers[typ] = func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			p.mu.Lock()
			a := p.answers[typ]
			if a.silent {
				call := Call{Type: msg.Type, Command: json.RawMessage(msg.Value)}
				if k, err := steps.ParseKey(msg.Headers[store.HeaderStepKey]); err == nil {
					call.Key, call.Direction = k, k.Direction
				}
				p.calls = append(p.calls, call)
			}
			p.mu.Unlock()
			if a.silent {
				return nil
			}
			return h(context.WithValue(ctx, answerKey{}, a), tx, msg)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	w := relay.NewKafkaWriter(cfg.Brokers, nil)
	r, err := relay.New(cfg.Pool, w, &relay.Config{Schema: cfg.Schema, PollInterval: participantPoll, Logger: cfg.Logger})
	if err == nil {
		err = r.Start(ctx)
	}
	if err != nil {
		cancel()
		_ = w.Close()
		tb.Fatalf("sagatest: participant: start its relay: %v", err)
	}
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Brokers, GroupID: cfg.Consumer + "." + cfg.Topic, Topic: cfg.Topic,
		MinBytes: 1, MaxBytes: 1 << 20, MaxWait: participantPoll, StartOffset: kafka.FirstOffset, CommitInterval: 0})
	consumer, err := sp.Inbox().NewConsumer(reader, &inbox.ConsumerConfig{Handlers: handlers})
	if err != nil {
		cancel()
		_ = reader.Close()
		tb.Fatalf("sagatest: participant: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- consumer.Run(ctx) }()
	tb.Cleanup(func() {
		cancel()
		errs := []error{<-done, reader.Close()}
		stopCtx, stop := context.WithTimeout(context.Background(), 10*time.Second)
		defer stop()
		errs = append(errs, r.Stop(stopCtx), w.Close())
		if err := errors.Join(errs...); err != nil {
			tb.Errorf("sagatest: participant: stop: %v", err)
		}
	})
	return p
}

// Answer changes how commands of type commandType are answered from now
// on. The type must be one of ParticipantConfig.Answers.
func (p *Participant) Answer(commandType string, a Answer) {
	p.tb.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.answers[commandType]; !ok {
		p.tb.Fatalf("sagatest: participant: %q is not one of the command types in ParticipantConfig.Answers", commandType)
	}
	if problem := answerProblem(commandType, a); problem != "" {
		p.tb.Fatalf("sagatest: participant: Answer: %s", problem)
	}
	p.answers[commandType] = a
}

// Calls returns the commands received so far, in order, once per time an
// answer was given (a command retried by the consumer, or sent again by the
// saga, appears again; one deduplicated by its step key does not).
func (p *Participant) Calls() []Call {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Call(nil), p.calls...)
}

// answerKey carries the Answer chosen for a message to its handler.
type answerKey struct{}

// tbWriter writes log lines to a test's log.
type tbWriter struct{ tb testing.TB }

func (w tbWriter) Write(b []byte) (int, error) {
	w.tb.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}
