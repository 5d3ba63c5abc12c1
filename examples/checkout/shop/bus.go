package shop

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/transport/natsbus"
)

// Bus carries the services' messages between them: Kafka (the default) or
// NATS JetStream (NATSBus). Everything else (outboxes, inboxes, the
// engines) is the same whichever it is.
type Bus interface {
	// Name is what the demo prints.
	Name() string
	// Writer is a relay's writer.
	Writer() (relay.Writer, error)
	// Reader reads topic as a member of group, for an inbox consumer.
	Reader(group, topic string) (BusReader, error)
	// EngineKafka is the orders engine's bus configuration (the hybrid
	// mode: only remote commands and replies cross the bus).
	EngineKafka(replyTopic string) *saga.KafkaConfig
}

// BusReader is what a consumer reads from.
type BusReader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

// kafkaBus is Kafka through kafka-go.
type kafkaBus struct {
	brokers []string
	dialer  *kafka.Dialer
}

func (b kafkaBus) Name() string { return fmt.Sprintf("Kafka at %v", b.brokers) }

func (b kafkaBus) Writer() (relay.Writer, error) {
	return relay.NewKafkaWriter(b.brokers, &relay.WriterOpts{Dialer: b.dialer}), nil
}

func (b kafkaBus) Reader(group, topic string) (BusReader, error) {
	return kafka.NewReader(kafka.ReaderConfig{Brokers: b.brokers, Dialer: b.dialer, GroupID: group, Topic: topic,
		MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 100 * time.Millisecond, StartOffset: kafka.FirstOffset,
		HeartbeatInterval: 200 * time.Millisecond, SessionTimeout: 6 * time.Second, RebalanceTimeout: 2 * time.Second}), nil
}

func (b kafkaBus) EngineKafka(replyTopic string) *saga.KafkaConfig {
	return &saga.KafkaConfig{Brokers: b.brokers, Dialer: b.dialer, ReplyTopic: replyTopic}
}

// NATSBus is NATS JetStream through package natsbus, on js; SetupNATS
// creates its streams.
type NATSBus struct {
	JS  jetstream.JetStream
	URL string // for the demo's output
}

// SetupNATS creates the streams of Topics (three partitions each).
func SetupNATS(ctx context.Context, js jetstream.JetStream) error {
	return natsbus.Setup(ctx, js, Topics, &natsbus.SetupOpts{Partitions: 3})
}

// natsReaderOpts: a member that dies hands its messages over after two
// seconds.
var natsReaderOpts = &natsbus.ReaderOpts{AckWait: 2 * time.Second, PullWait: 200 * time.Millisecond}

func (b NATSBus) Name() string { return "NATS JetStream at " + b.URL }

func (b NATSBus) Writer() (relay.Writer, error) { return natsbus.NewWriter(b.JS, nil) }

func (b NATSBus) Reader(group, topic string) (BusReader, error) {
	return natsbus.NewReader(b.JS, group, []string{topic}, natsReaderOpts)
}

func (b NATSBus) EngineKafka(replyTopic string) *saga.KafkaConfig {
	return &saga.KafkaConfig{ReplyTopic: replyTopic, NewReader: func(group string, topics []string) saga.KafkaReader {
		r, err := natsbus.NewReader(b.JS, group, topics, natsReaderOpts)
		if err != nil {
			panic(fmt.Sprintf("shop: NATS reader: %v", err)) // the group and topics are the engine's own, valid
		}
		return r
	}}
}
