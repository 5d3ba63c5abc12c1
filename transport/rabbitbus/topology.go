package rabbitbus

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/wire"
)

// Topology defaults.
const (
	// ExchangeDefault is the topic exchange every message goes through.
	ExchangeDefault = "sagaflow"
	// PartitionsDefault is how many partitions (queues per group) a topic
	// has.
	PartitionsDefault = 8
	// PartitionsMax bounds Partitions: each is a quorum queue per group.
	PartitionsMax = 1024
)

// ErrInvalidConfig is returned for options or names this package refuses;
// the error names what was wrong.
var ErrInvalidConfig = errors.New("rabbitbus: invalid config")

// maxShortString is AMQP 0-9-1's limit of a short string: names of
// exchanges, queues and routing keys, header names, the message-id
// property.
const maxShortString = 255

// Topology is how topics map onto RabbitMQ. The writers and the readers of
// one set of topics must agree on it: a message is routed by its topic and
// its partition (a hash of its key over Partitions), and a group's reader
// consumes one queue per topic and partition.
type Topology struct {
	// Exchange is the durable topic exchange messages are published to.
	// Defaults to ExchangeDefault.
	Exchange string
	// Partitions is how many partitions each topic has. Defaults to
	// PartitionsDefault; at most PartitionsMax. Changing it moves keys to
	// other partitions (as adding partitions to a Kafka topic does): drain
	// the queues first.
	Partitions int
}

func (t Topology) withDefaults() (Topology, error) {
	if t.Exchange == "" {
		t.Exchange = ExchangeDefault
	}
	if err := checkName("Exchange", t.Exchange); err != nil {
		return t, err
	}
	if strings.HasPrefix(t.Exchange, "amq.") {
		return t, fmt.Errorf("%w: Exchange %q: names starting with amq. are reserved by the broker", ErrInvalidConfig, t.Exchange)
	}
	if t.Partitions < 0 || t.Partitions > PartitionsMax {
		return t, fmt.Errorf("%w: Partitions must be between 1 and %d, not %d", ErrInvalidConfig, PartitionsMax, t.Partitions)
	}
	if t.Partitions == 0 {
		t.Partitions = PartitionsDefault
	}
	return t, nil
}

// checkName refuses a name AMQP cannot carry as a short string or that is
// not printable text.
func checkName(field, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: %s is empty", ErrInvalidConfig, field)
	case len(s) > maxShortString:
		return fmt.Errorf("%w: %s is %d bytes, more than AMQP's %d", ErrInvalidConfig, field, len(s), maxShortString)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidConfig, field)
	case strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return fmt.Errorf("%w: %s %q contains a control character", ErrInvalidConfig, field, s)
	}
	return nil
}

// checkTopic refuses a topic that is not a legal Kafka topic name: the
// routing key and the queue names are built from it, and a legal name
// holds neither the exchange's wildcards (* and #) nor the queue name's
// separator (/).
func checkTopic(topic string) error {
	if !store.LegalTopic(topic) {
		return fmt.Errorf("%w: topic %q is not a legal topic name (1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')",
			ErrInvalidConfig, topic)
	}
	return nil
}

// checkGroup refuses a group name that cannot be part of a queue name.
func checkGroup(group string) error {
	if err := checkName("group", group); err != nil {
		return err
	}
	if strings.Contains(group, "/") {
		return fmt.Errorf("%w: group %q contains '/', the separator of queue names", ErrInvalidConfig, group)
	}
	return nil
}

// RoutingKey is the routing key of a message of topic on partition:
// "<topic>.<partition>". A topic never holds the exchange's wildcards, and
// the partition is always the last word, so the mapping is one to one.
func RoutingKey(topic string, partition int) string {
	return topic + "." + strconv.Itoa(partition)
}

// Partition is the partition of a message with key, of partitions: the
// Kafka Java client's placement ([wire.Partition]). A message without a
// key is placed as the empty key, so keyless messages keep their order on
// one partition.
func Partition(key []byte, partitions int) int { return wire.Partition(key, partitions) }

// QueueName is the quorum queue of group for topic's partition:
// "<group>/<topic>/<partition>". Neither a group nor a topic holds '/', so
// the mapping is one to one.
func QueueName(group, topic string, partition int) string {
	return group + "/" + topic + "/" + strconv.Itoa(partition)
}

// SetupOpts configures [Setup].
type SetupOpts struct {
	Topology
	// Groups are the consumer groups whose queues are declared and bound:
	// one per group, topic and partition. A group receives only what is
	// published after its queues are bound, so declare the groups before
	// the first message is published (a [Reader] declares its own group's
	// queues when it connects; a message published while no queue is bound
	// comes back to the [Writer] and is retried).
	Groups []string
	// MaxLength, when positive, bounds each queue's ready messages; a
	// publish to a full queue is refused (x-overflow reject-publish: the
	// publisher gets a nack and the relay retries the row later), never
	// dropped. Defaults to no bound. Every declaration of a queue must use
	// the same value (the broker refuses a declaration whose arguments
	// differ from the queue's).
	MaxLength int
}

// queueArgs are a partition queue's arguments: a quorum queue (replicated,
// durable, ordered), with a single active consumer at a time (a
// partition's order holds across the group's readers, and a standby takes
// over when the active one's channel closes). No message TTL, no length
// limit that drops, no delivery limit and no dead-letter exchange: a
// message leaves the queue only when a reader acknowledges it, after its
// consumer (the inbox) processed or dead-lettered it in PostgreSQL.
func queueArgs(maxLength int) amqp.Table {
	args := amqp.Table{
		amqp.QueueTypeArg:            amqp.QueueTypeQuorum,
		amqp.SingleActiveConsumerArg: true,
	}
	if maxLength > 0 {
		args[amqp.QueueMaxLenArg] = int64(maxLength)
		args[amqp.QueueOverflowArg] = amqp.QueueOverflowRejectPublish
	}
	return args
}

// Setup declares the exchange and, for each group, topic and partition, a
// quorum queue bound to the exchange with the partition's routing key. It
// is idempotent: run it at deployment or at every start. It uses a channel
// of its own on conn and closes it.
//
// A queue that exists with other arguments (a classic queue, another
// MaxLength) is an error that names it: the broker does not change a
// queue's type or arguments; delete it (after draining it) or use another
// Topology.
func Setup(ctx context.Context, conn *amqp.Connection, topics []string, opts *SetupOpts) error {
	if conn == nil {
		return fmt.Errorf("%w: conn is nil", ErrInvalidConfig)
	}
	var o SetupOpts
	if opts != nil {
		o = *opts
	}
	topo, err := o.Topology.withDefaults()
	if err != nil {
		return err
	}
	if o.MaxLength < 0 {
		return fmt.Errorf("%w: MaxLength must not be negative", ErrInvalidConfig)
	}
	if err := checkTopics(topics); err != nil {
		return err
	}
	for _, g := range o.Groups {
		if err := checkGroup(g); err != nil {
			return err
		}
		if err := checkQueueNames(g, topics, topo.Partitions); err != nil {
			return err
		}
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitbus: setup: open channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	if err := declareExchange(ch, topo.Exchange); err != nil {
		return err
	}
	for _, g := range o.Groups {
		if err := declareGroup(ctx, ch, topo, g, topics, o.MaxLength); err != nil {
			return err
		}
	}
	return nil
}

func checkTopics(topics []string) error {
	if len(topics) == 0 {
		return fmt.Errorf("%w: no topics", ErrInvalidConfig)
	}
	for _, t := range topics {
		if err := checkTopic(t); err != nil {
			return err
		}
	}
	return nil
}

func checkQueueNames(group string, topics []string, partitions int) error {
	for _, t := range topics {
		if q := QueueName(group, t, partitions-1); len(q) > maxShortString {
			return fmt.Errorf("%w: queue name %q is %d bytes, more than AMQP's %d: shorten the group or the topic",
				ErrInvalidConfig, q, len(q), maxShortString)
		}
	}
	return nil
}

func declareExchange(ch *amqp.Channel, exchange string) error {
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("rabbitbus: declare exchange %q: %w", exchange, err)
	}
	return nil
}

// declareGroup declares and binds group's queues for topics.
func declareGroup(ctx context.Context, ch *amqp.Channel, topo Topology, group string, topics []string, maxLength int) error {
	args := queueArgs(maxLength)
	for _, t := range topics {
		for p := range topo.Partitions {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("rabbitbus: setup: %w", err)
			}
			q := QueueName(group, t, p)
			if _, err := ch.QueueDeclare(q, true, false, false, false, args); err != nil {
				return fmt.Errorf("rabbitbus: declare queue %q (quorum, single active consumer): %w", q, err)
			}
			if err := ch.QueueBind(q, RoutingKey(t, p), topo.Exchange, false, nil); err != nil {
				return fmt.Errorf("rabbitbus: bind queue %q to exchange %q: %w", q, topo.Exchange, err)
			}
		}
	}
	return nil
}

// DialFunc opens a connection to the broker. A [Writer] and a [Reader] call
// it when they first need a connection and again after theirs was lost.
type DialFunc func() (*amqp.Connection, error)

// Dial returns a DialFunc for an amqp:// or amqps:// URL, with a 10 s
// connect timeout and 10 s heartbeats (a dead peer is noticed within about
// 20 s). Use your own DialFunc for TLS settings or other tuning
// (amqp.DialConfig).
func Dial(url string) DialFunc {
	return func() (*amqp.Connection, error) {
		return amqp.DialConfig(url, amqp.Config{
			Heartbeat: 10 * time.Second,
			Locale:    "en_US",
			Dial:      amqp.DefaultDial(10 * time.Second), // the handshake is bounded too
		})
	}
}
