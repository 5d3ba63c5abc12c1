// Package rabbitbus carries sagaflow's messages over RabbitMQ (AMQP 0-9-1,
// with github.com/rabbitmq/amqp091-go) behind the same seams as Kafka: a
// [Writer] is a relay.Writer, so a relay.Relay publishes an outbox through
// it, and a [Reader] is what an inbox.Consumer, a participant's consumer and
// the engine (saga.KafkaConfig.NewReader) consume from. The messages are the
// same kafka.Message values, with the same headers (package wire), so the
// consume loop, the inbox's deduplication and dead-lettering, signing and
// the engine's fencing work unchanged. Tested against RabbitMQ 3.10.
//
// # Topology
//
// Kafka's topics and partitions are modelled on one durable topic exchange
// ([Topology.Exchange]) and quorum queues:
//
//   - a message of topic T whose key hashes to partition p (the Kafka Java
//     client's placement, [wire.Partition], over [Topology.Partitions]) is
//     published with routing key "T.p" ([RoutingKey]);
//   - a consumer group G has one quorum queue per topic and partition,
//     "G/T/p" ([QueueName]), bound to the exchange with "T.p". Every group
//     bound to a topic receives each of its messages, as Kafka's groups do;
//   - each queue has x-single-active-consumer: all readers of a group
//     subscribe, one at a time receives a partition's messages, in order,
//     and when its channel closes the next takes over with what the first
//     had not acknowledged, delivered again first.
//
// The queues have no message TTL, no length limit that drops messages (a
// bound, [SetupOpts.MaxLength], refuses new publishes instead:
// x-overflow reject-publish, which the relay retries), no delivery limit
// and no dead-letter exchange. A message leaves its queue only when a
// reader acknowledges it, which the consume loop does after the inbox
// processed it, or dead-lettered it in PostgreSQL after
// inbox.ConsumerConfig.MaxAttempts: sagaflow's dead-lettering, with the
// reason and the raw bytes, never the broker's silent drop. (This was
// tested on RabbitMQ 3.10, whose quorum queues have no delivery limit
// unless one is set. RabbitMQ 4 sets a default one: lift it for these
// queues with a policy, as your version's documentation says, or a
// message delivered again after enough reader crashes would be dropped.)
//
// [Setup] declares the exchange, the queues and their bindings, and is
// idempotent. A [Reader] declares its own group's queues when it connects,
// and a [Writer] the exchange. A group receives only what is published
// after its queues are bound, unlike a new Kafka group reading from the
// first offset: run Setup for every consumer group before the first
// message is published.
//
// # Writing
//
// The [Writer] keeps one connection and one channel in confirm mode. It
// publishes a batch (persistent, mandatory, the key in the [KeyHeader]
// header, the sagaflow-message-id as the AMQP message-id as well), then
// waits for the broker's answer to every message:
//
//   - confirmed: published;
//   - returned as unroutable (no queue bound for its topic and partition),
//     or nacked (a full queue): an error the relay retries with backoff and
//     counts as an attempt, so a message nobody consumes is parked as dead
//     after MaxAttempts, never lost;
//   - the connection or the channel closed, the broker could not be
//     reached, or the relay's PublishTimeout passed (a broker that blocks
//     publishers under a memory or disk alarm, say): relay.PublishError
//     with Outage, which spends no attempt; the next write connects again;
//   - a message that cannot be carried: an illegal topic name, a header
//     name longer than 255 bytes, the key header set by the caller, more
//     than [WriterOpts.MaxMessageBytes], or headers that do not fit one
//     frame of the connection (AMQP cannot split them): relay.PublishError
//     with Permanent (relay.CodeInvalidTopic, relay.CodeRejected,
//     relay.CodeTooLarge), checked before anything is sent, so one bad
//     message never breaks the connection under the others. A message the
//     broker still refuses as larger than its max_message_size closes the
//     channel; the writer parks it as too large and the others wait.
//
// Headers become an AMQP table of byte values; a name used more than once
// becomes an array of its values. A table from another producer may hold
// other types: a Reader gives them as text (numbers in decimal, booleans as
// true or false, times in RFC 3339 UTC, nil as empty, tables and anything
// else as Go's %v formats them, e.g. "map[k:v]"). A [Reader] gives them back sorted by
// name (a table has no order), repeated names in their order.
//
// # Reading
//
// A [Reader] subscribes to its group's queues of its topics with manual
// acknowledgements and a small prefetch per queue ([ReaderOpts.Prefetch]).
// FetchMessage returns the next message of any of its partitions, each
// partition in order; CommitMessages acknowledges exactly the messages it is
// given, each on the channel it came from. The consume loop fetches,
// processes in a PostgreSQL transaction and only then commits, one message
// at a time.
//
// The fields of a fetched kafka.Message: Topic and Partition from the
// queue; Key from [KeyHeader] (nil when the publisher sent none); Value
// and Headers as published; Time the publisher's timestamp; Offset is the
// reader's own, taken from the clock in nanoseconds and growing per
// partition, so that no two deliveries share one, even across readers (dead
// letters are recorded once per position); it is not a position in the
// queue: a message delivered again gets a new one. So a message with neither
// a sagaflow-message-id header nor an AMQP message-id has no identity that
// survives a redelivery, and an inbox consumer dead-letters it rather than
// process it twice (Reader.OffsetsNotKept); a dead letter requeued gets an
// id. For the same reason a poison message delivered again (its
// acknowledgement lost) can be dead-lettered twice.
// HighWaterMark is 0 (RabbitMQ does not tell a consumer how far behind it
// is), so the consumers' lag gauges stay empty. A message from a producer
// that set the AMQP message-id but no sagaflow-message-id header gets that
// header from the message-id, so that the inbox deduplicates it.
//
// # Where it differs from Kafka
//
//   - Failover, not rebalancing. A partition's queue has one active
//     consumer at a time; the others stand by. Readers do not share
//     partitions by themselves: the first to subscribe gets them. Start
//     readers with [ReaderOpts.Members] and [ReaderOpts.Member] to give each
//     a share, subscribing to the rest as a standby after
//     [ReaderOpts.StandbyDelay]. A partition does not move back when its
//     first reader returns.
//   - Redelivery. Kafka redelivers what a consumer had not committed when
//     the group rebalances (its session timed out). RabbitMQ delivers again
//     what a consumer had not acknowledged as soon as its channel or
//     connection closes (a crash, a cut connection, missed heartbeats:
//     about two heartbeat intervals with [Dial]), to the next consumer of
//     the queue; the Redelivered flag is set. A commit that was lost with
//     the connection makes the message come again, and the inbox skips it.
//   - The ack wait. Kafka lets a consumer hold a message as long as it
//     keeps its session. RabbitMQ closes a channel whose oldest
//     unacknowledged delivery is older than consumer_timeout (30 minutes by
//     default); the message is then delivered again and the reader
//     reconnects. A message whose handler keeps failing for longer (the
//     inbox's default MaxAttempts and backoff add up to about an hour) is
//     therefore tried again from the start by a new delivery: raise
//     consumer_timeout above the inbox's retry span, or lower MaxAttempts.
//   - Ordering across partitions and keys is the same as Kafka's: per key,
//     as long as every writer uses the same Topology.Partitions. Keyless
//     messages all go to the empty key's partition, in order.
//   - No replay from an offset: an acknowledged message is gone from the
//     broker. Replays come from the outbox (published rows are kept for
//     the relay's Retention).
//
// # Example
//
//	dial := rabbitbus.Dial("amqp://guest:guest@127.0.0.1:5672/")
//	topo := rabbitbus.Topology{Partitions: 8}
//	conn, err := dial()
//	if err != nil { ... }
//	err = rabbitbus.Setup(ctx, conn, []string{"payments.commands"},
//		&rabbitbus.SetupOpts{Topology: topo, Groups: []string{"payments"}})
//	conn.Close()
//
//	// The service's relay publishes its outbox to RabbitMQ.
//	w, err := rabbitbus.NewWriter(dial, &rabbitbus.WriterOpts{Topology: topo})
//	rl, err := relay.New(pool, w, &relay.Config{Schema: "sagaflow"})
//
//	// Its consumer reads the group's partitions.
//	r, err := rabbitbus.NewReader(dial, "payments", []string{"payments.commands"},
//		&rabbitbus.ReaderOpts{Topology: topo})
//	c, err := in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: handlers})
//
//	// An engine consumes its replies (and, with AllSteps, its commands)
//	// through readers too; no Kafka brokers are needed.
//	cfg.Kafka = &saga.KafkaConfig{
//		NewReader: func(group string, topics []string) saga.KafkaReader {
//			r, err := rabbitbus.NewReader(dial, group, topics, &rabbitbus.ReaderOpts{Topology: topo})
//			if err != nil { panic(err) } // only bad options fail here
//			return r
//		}}
package rabbitbus
