package natsbus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/sagaflow/sagaflow/internal/safetext"
)

// Setup defaults.
const (
	// PartitionsDefault is how many partitions a topic gets, as Kafka's
	// num.partitions: one, which keeps every key in order but lets one
	// member of a group consume the topic at a time.
	PartitionsDefault = 1
	// PartitionsMax is the most partitions a topic may have: each is a
	// subject of its stream and a consumer per group.
	PartitionsMax = 1024
	// ReplicasDefault is how many servers keep each stream: 1, for a single
	// server. Use 3 on a cluster.
	ReplicasDefault = 1
	// MaxAgeDefault is how long a stream keeps a message, consumed or not,
	// as Kafka's default retention.ms: seven days.
	MaxAgeDefault = 7 * 24 * time.Hour
	// DuplicatesDefault is the stream's deduplication window: a message
	// published again with the same message id within it is stored once.
	DuplicatesDefault = 2 * time.Minute
	// AckWaitDefault is how long the server waits for a reader that holds
	// a message and has gone silent (killed, hung, cut off) before it gives
	// the message to another member of the group.
	AckWaitDefault = 30 * time.Second
)

// Unlimited, as SetupOpts.MaxBytes, puts no bound on a stream's size.
const Unlimited = -1

// ErrInvalidConfig wraps every problem with arguments or options found
// before anything is sent to the server; the error names what is wrong.
var ErrInvalidConfig = errors.New("natsbus: invalid config")

// SetupOpts configures [Setup]. A nil *SetupOpts, and every zero field,
// means the default.
type SetupOpts struct {
	// Partitions is how many partitions (subjects, and consumers per
	// group) each topic has. A key's messages all go to one partition,
	// chosen as Kafka's Java client does, so keys stay in order; each
	// partition is consumed by one member of a group at a time. Setup
	// refuses to change the partitions of an existing stream, since that
	// moves keys. Defaults to PartitionsDefault; at most PartitionsMax.
	Partitions int
	// Replicas is how many servers keep each stream. Defaults to
	// ReplicasDefault.
	Replicas int
	// Storage is where streams keep messages. Defaults to
	// jetstream.FileStorage: a memory stream loses them when the server
	// stops.
	Storage jetstream.StorageType
	// MaxAge is how long a stream keeps a message. Defaults to
	// MaxAgeDefault. Messages older than that are removed whether or not
	// every group consumed them, as in Kafka.
	MaxAge time.Duration
	// MaxBytes bounds each stream's size; the oldest messages go first
	// when it is reached. Defaults to Unlimited.
	MaxBytes int64
	// MaxMsgSize bounds a message (data and headers); a larger one is
	// refused and the relay parks its row. Defaults to the server's
	// max_payload.
	MaxMsgSize int32
	// Duplicates is the deduplication window: a message whose
	// sagaflow-message-id was published within it is stored once. Defaults
	// to DuplicatesDefault, or to MaxAge when that is shorter; a window set
	// longer than MaxAge is refused.
	Duplicates time.Duration
	// Groups are consumer groups whose durable consumers Setup creates
	// too, with AckWait. A [Reader] creates its group's consumers itself,
	// so this is only needed to create them ahead of the first reader.
	Groups []string
	// AckWait is the ack wait of the consumers of Groups. Defaults to
	// AckWaitDefault.
	AckWait time.Duration
}

func (o *SetupOpts) withDefaults() (SetupOpts, error) {
	var out SetupOpts
	if o != nil {
		out = *o
	}
	if out.Partitions < 0 || out.Replicas < 0 || out.MaxAge < 0 || out.Duplicates < 0 || out.AckWait < 0 || out.MaxMsgSize < 0 {
		return out, fmt.Errorf("%w: Partitions, Replicas, MaxAge, MaxMsgSize, Duplicates and AckWait must not be negative", ErrInvalidConfig)
	}
	if out.Partitions > PartitionsMax {
		return out, fmt.Errorf("%w: Partitions %d is more than PartitionsMax (%d)", ErrInvalidConfig, out.Partitions, PartitionsMax)
	}
	if out.MaxBytes < Unlimited {
		return out, fmt.Errorf("%w: MaxBytes must be positive or Unlimited", ErrInvalidConfig)
	}
	setDefault(&out.Partitions, PartitionsDefault)
	setDefault(&out.Replicas, ReplicasDefault)
	setDefault(&out.MaxAge, MaxAgeDefault)
	if out.Duplicates == 0 {
		// The default window, but never longer than the retention a
		// caller chose: a short MaxAge alone is not an error.
		out.Duplicates = min(DuplicatesDefault, out.MaxAge)
	}
	setDefault(&out.AckWait, AckWaitDefault)
	setDefault(&out.MaxBytes, Unlimited)
	if out.MaxMsgSize == 0 {
		out.MaxMsgSize = -1
	}
	if out.Duplicates > out.MaxAge {
		return out, fmt.Errorf("%w: Duplicates (%v) must not exceed MaxAge (%v)", ErrInvalidConfig, out.Duplicates, out.MaxAge)
	}
	return out, nil
}

func setDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// Setup creates the stream of each topic, with opts.Partitions subjects
// (topic.0 … topic.n-1), and the durable consumers of opts.Groups. It is
// idempotent: a stream that exists is left as it is, except that Setup
// fails when its partitions differ from opts.Partitions; a consumer that
// exists gets opts.AckWait.
func Setup(ctx context.Context, js jetstream.JetStream, topics []string, opts *SetupOpts) error {
	o, err := opts.withDefaults()
	if err != nil {
		return err
	}
	if js == nil {
		return fmt.Errorf("%w: js is nil", ErrInvalidConfig)
	}
	if err := checkTopics(topics); err != nil {
		return err
	}
	for _, g := range o.Groups {
		if g == "" {
			return fmt.Errorf("%w: a group is empty", ErrInvalidConfig)
		}
	}
	for _, topic := range topics {
		n, err := ensureStream(ctx, js, topic, &o)
		if err != nil {
			return err
		}
		for _, g := range o.Groups {
			for p := range n {
				if _, err := ensureConsumer(ctx, js, topic, g, p, o.AckWait); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func checkTopics(topics []string) error {
	if len(topics) == 0 {
		return fmt.Errorf("%w: no topics", ErrInvalidConfig)
	}
	for _, t := range topics {
		if p := subjectProblem(t); p != "" {
			return fmt.Errorf("%w: topic %q %s", ErrInvalidConfig, t, p)
		}
	}
	return nil
}

// ensureStream creates topic's stream unless it exists, and returns its
// partitions.
func ensureStream(ctx context.Context, js jetstream.JetStream, topic string, o *SetupOpts) (int, error) {
	name := StreamName(topic)
	subjects := make([]string, o.Partitions)
	for p := range subjects {
		subjects[p] = Subject(topic, p)
	}
	s, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		s, err = js.CreateStream(ctx, jetstream.StreamConfig{
			Name:        name,
			Description: "sagaflow topic " + topic,
			Subjects:    subjects,
			Retention:   jetstream.LimitsPolicy,
			Discard:     jetstream.DiscardOld,
			MaxAge:      o.MaxAge,
			MaxBytes:    o.MaxBytes,
			MaxMsgs:     -1,
			MaxMsgSize:  o.MaxMsgSize,
			Storage:     o.Storage,
			Replicas:    o.Replicas,
			Duplicates:  o.Duplicates,
		})
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = js.Stream(ctx, name) // created meanwhile by another Setup
		}
	}
	if err != nil {
		return 0, fmt.Errorf("natsbus: stream %s of topic %s: %w", name, topic, err)
	}
	have := s.CachedInfo().Config.Subjects
	if !slices.Equal(have, subjects) {
		return 0, fmt.Errorf("natsbus: stream %s of topic %s has subjects %q, not the %d partitions asked for: "+
			"changing a topic's partitions moves keys, so Setup does not do it", name, topic, have, o.Partitions)
	}
	return o.Partitions, nil
}

// consumerConfig is the durable consumer of group on one partition of
// topic: explicit acks, one message in flight, redelivered without limit.
func consumerConfig(topic, group string, partition int, ackWait time.Duration) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       ConsumerName(group, partition),
		Description:   fmt.Sprintf("sagaflow group %s, topic %s, partition %d", safetext.Text(group, groupDescribed), topic, partition),
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1,
		MaxAckPending: 1,
		FilterSubject: Subject(topic, partition),
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
	}
}

func ensureConsumer(ctx context.Context, js jetstream.JetStream, topic, group string, partition int, ackWait time.Duration) (jetstream.Consumer, error) {
	c, err := js.CreateOrUpdateConsumer(ctx, StreamName(topic), consumerConfig(topic, group, partition, ackWait))
	if err != nil {
		return nil, fmt.Errorf("natsbus: consumer %s of topic %s: %w", ConsumerName(group, partition), topic, err)
	}
	return c, nil
}
