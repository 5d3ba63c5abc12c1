package relay

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/wire"
)

// Writer publishes messages to Kafka. *kafka.Writer satisfies it.
//
// WriteMessages must be synchronous: it returns once the broker
// acknowledged every message (nil), or with the outcome of each message as
// kafka.WriteErrors (nil entries were acknowledged), or with another error
// when the batch failed as a whole. The relay calls it once per batch and
// never concurrently with itself on one Relay.
//
// The relay never closes its Writer: whoever made it closes it after
// [Relay.Stop] (Close is part of the seam so that one value can serve both).
type Writer interface {
	WriteMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

var _ Writer = (*kafka.Writer)(nil)

// Writer option defaults.
const (
	// WriterBatchTimeoutDefault is how long the writer waits to fill a
	// partition's batch. The relay hands it whole batches, so any wait only
	// adds latency: kafka-go puts every message of one WriteMessages call
	// for a partition in the same batch however short the timeout, and a
	// millisecond here was a millisecond more on every hop of a Kafka-mode
	// saga. A writer that several goroutines share, and that should merge
	// their messages, wants a longer one.
	WriterBatchTimeoutDefault = time.Microsecond
	// WriterBatchSizeDefault is how many messages the writer sends to one
	// partition per produce request; at least the relay's BatchSize, so that
	// one relay batch goes to each partition in one request.
	WriterBatchSizeDefault = 1000
	// WriterBatchBytesDefault bounds a produce request per partition:
	// Kafka's default message.max.bytes.
	WriterBatchBytesDefault = 1 << 20
	// WriterMaxAttemptsDefault is how many times kafka-go itself tries a
	// produce request before it reports the failure; the relay then retries
	// the rows later with its own backoff.
	WriterMaxAttemptsDefault = 3
	// WriterTimeoutDefault bounds each network read and write.
	WriterTimeoutDefault = 10 * time.Second
	// WriterMetadataTTLDefault is how often the writer refreshes cluster
	// metadata.
	WriterMetadataTTLDefault = 6 * time.Second
)

// WriterOpts configures [NewKafkaWriter]. A nil *WriterOpts, and every zero
// field, means the default.
type WriterOpts struct {
	// AllowAutoTopicCreation lets the writer create a missing topic, when
	// the brokers allow it. Defaults to false: a row for a topic that does
	// not exist fails, is retried, and is parked once its attempts are spent.
	AllowAutoTopicCreation bool
	// Balancer picks a message's partition from its key (the row's
	// aggregateid). Defaults to &kafka.Hash{} (FNV-1a, as Sarama). Use
	// &JavaPartitioner{} to place keys as the Java client's default
	// partitioner does (wire.Partition: murmur2), or
	// kafka.CRC32Balancer{} as librdkafka's, when other producers write
	// the same topics: then a saga's messages share a partition whoever
	// wrote them.
	Balancer kafka.Balancer
	// BatchTimeout is how long the writer waits to fill a partition's
	// batch. Defaults to WriterBatchTimeoutDefault (1µs).
	BatchTimeout time.Duration
	// BatchSize is the most messages per partition in one produce request.
	// Defaults to WriterBatchSizeDefault; a larger value than BatchSizeMax
	// (the most rows a relay batch holds) is taken as BatchSizeMax (kafka-go
	// sizes a buffer by it: int's largest made the first write panic).
	BatchSize int
	// BatchBytes bounds a produce request per partition; keep it at least
	// the relay's MaxMessageBytes and at most the brokers'
	// message.max.bytes. Defaults to WriterBatchBytesDefault (1 MiB).
	BatchBytes int
	// MaxAttempts is how many times kafka-go tries a produce request before
	// it reports the failure. Defaults to WriterMaxAttemptsDefault.
	MaxAttempts int
	// ReadTimeout and WriteTimeout bound each network read and write.
	// Default to WriterTimeoutDefault (10s).
	ReadTimeout, WriteTimeout time.Duration
	// MetadataTTL is how often cluster metadata is refreshed. A writer
	// that could not reach the cluster when it first tried keeps failing
	// until the next refresh. Defaults to WriterMetadataTTLDefault (6s).
	MetadataTTL time.Duration
	// Compression compresses batches. Defaults to none.
	Compression kafka.Compression
	// Dialer sets the dial timeout, client id, TLS and SASL. Defaults to
	// kafka.DefaultDialer.
	Dialer *kafka.Dialer
}

// NewKafkaWriter returns a kafka-go writer set up for an outbox relay: it
// waits for every in-sync replica (RequiredAcks: kafka.RequireAll), puts
// messages with the same key (the row's aggregateid: the saga id, or the
// aggregate the user named) in the same partition (kafka.Hash), flushes a
// batch at once (each WriteMessages call's messages for a partition
// form one batch), and is synchronous, so WriteMessages
// reports each message's outcome. Topics come from the messages (each row's
// topic column).
//
// kafka-go has no idempotent producer: a retried produce request may store
// a message twice. The relay is at-least-once by design; consumers
// deduplicate by the sagaflow-message-id header.
//
// Close the writer after stopping the relays that use it; Close releases
// its connections. It panics when brokers is empty, as kafka.NewWriter does.
func NewKafkaWriter(brokers []string, opts *WriterOpts) *kafka.Writer {
	var o WriterOpts
	if opts != nil {
		o = *opts
	}
	if o.Balancer == nil {
		o.Balancer = &kafka.Hash{}
	}
	setDefault(&o.BatchTimeout, WriterBatchTimeoutDefault)
	setDefault(&o.BatchSize, WriterBatchSizeDefault)
	o.BatchSize = min(o.BatchSize, BatchSizeMax)
	setDefault(&o.BatchBytes, WriterBatchBytesDefault)
	setDefault(&o.MaxAttempts, WriterMaxAttemptsDefault)
	setDefault(&o.ReadTimeout, WriterTimeoutDefault)
	setDefault(&o.WriteTimeout, WriterTimeoutDefault)
	setDefault(&o.MetadataTTL, WriterMetadataTTLDefault)
	if len(brokers) == 0 {
		panic("relay: NewKafkaWriter: no brokers")
	}
	// kafka.NewWriter, unlike a Writer literal, gives the writer a
	// transport of its own that Close shuts down; a literal would share
	// kafka.DefaultTransport, whose connections and goroutines outlive the
	// writer.
	w := kafka.NewWriter(kafka.WriterConfig{
		Brokers:           brokers,
		Dialer:            o.Dialer,
		Balancer:          o.Balancer,
		MaxAttempts:       o.MaxAttempts,
		BatchSize:         o.BatchSize,
		BatchBytes:        o.BatchBytes,
		BatchTimeout:      o.BatchTimeout,
		ReadTimeout:       o.ReadTimeout,
		WriteTimeout:      o.WriteTimeout,
		RebalanceInterval: o.MetadataTTL,
		RequiredAcks:      int(kafka.RequireAll),
		Async:             false,
	})
	w.AllowAutoTopicCreation = o.AllowAutoTopicCreation
	w.Compression = o.Compression
	w.WriteBackoffMin = 50 * time.Millisecond
	w.WriteBackoffMax = 500 * time.Millisecond
	return w
}

func setDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// JavaPartitioner is a kafka.Balancer that puts a message with a key on the
// partition the Apache Kafka Java client's default partitioner picks for
// it: toPositive(murmur2(key)) % the number of partitions (see
// [wire.Partition]). Set it as WriterOpts.Balancer when Java services (or
// any client that partitions as Java does) write to the same topics, so
// that all messages of one saga, keyed by its id, land on one partition.
// Messages without a key are spread round robin. Its zero value is ready;
// use it by pointer.
type JavaPartitioner struct {
	next atomic.Uint64
}

var _ kafka.Balancer = (*JavaPartitioner)(nil)

// Balance implements kafka.Balancer. partitions are the topic's partitions
// in order, as kafka-go passes them.
func (b *JavaPartitioner) Balance(msg kafka.Message, partitions ...int) int {
	if msg.Key == nil {
		return partitions[int((b.next.Add(1)-1)%uint64(len(partitions)))]
	}
	return partitions[wire.Partition(msg.Key, len(partitions))]
}
