// Package natsbus carries sagaflow's messages over NATS JetStream instead
// of Kafka, behind the same seams: a [Writer] for the relay
// (relay.Writer), and a [Reader] for inbox consumers, participants and the
// engine's replies and commands (saga.KafkaConfig.NewReader). Nothing else
// changes: the outbox, the inbox's deduplication, the dead letters and the
// engine's keys and fencing are the same as over Kafka.
//
// # How topics map onto JetStream
//
// Each topic has a stream of its own, named by [StreamName]
// ("orders.events" → "sagaflow_orders_2eevents"), whose subjects are the
// topic's partitions: topic.0 … topic.n-1 ([Subject]). The [Writer] puts a
// message on the partition Kafka's Java client would pick for its key
// (murmur2, wire.Partition) over the stream's partitions, so one key (one
// saga) stays on one partition.
//
// Each consumer group has one durable pull consumer per partition
// ([ConsumerName]), with explicit acks, MaxAckPending 1 and no delivery
// limit. MaxAckPending 1 is what keeps a key's order while several
// processes consume: a partition's next message is delivered only once its
// previous one is acknowledged, to whichever member pulls first. There is
// no rebalancing to wait for, and no member owns a partition.
//
// Create the streams with [Setup] before publishing (a message to a topic
// without a stream is retried by the relay and parked after its
// MaxAttempts). Setup is idempotent and safe to run at every start:
//
//	nc, err := nats.Connect(url)
//	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
//	err = natsbus.Setup(ctx, js, []string{"payments.commands", "payments.replies"},
//		&natsbus.SetupOpts{Partitions: 8, Replicas: 3})
//
//	w, err := natsbus.NewWriter(js, nil)          // the relay's writer
//	rl, err := relay.New(pool, w, &relay.Config{Schema: "shop"})
//
//	r, err := natsbus.NewReader(js, "payments", []string{"payments.commands"}, nil)
//	c, err := in.NewConsumer(r, &inbox.ConsumerConfig{Handlers: handlers})
//
// # What to configure
//
//   - Partitions ([SetupOpts].Partitions): as with Kafka, the most members
//     of a group that consume a topic at once. Fixed once the stream
//     exists: Setup refuses to change it, since that would move keys.
//   - Replicas: 3 on a cluster (1 on a single server).
//   - AckWait ([ReaderOpts].AckWait, default 30 s): how long a message held
//     by a member that died, hung or lost its connection waits before
//     another member gets it. A running reader keeps the messages it holds
//     alive however long their handling takes (it sends "in progress"), so
//     AckWait is a failure detector like Kafka's session timeout, not a
//     bound on handling.
//   - Retention ([SetupOpts].MaxAge, MaxBytes): a stream keeps messages
//     by limits, consumed or not, as a Kafka topic keeps its log (default
//     seven days, unbounded size). Keep them longer than a group may be
//     down.
//   - Deduplication window ([SetupOpts].Duplicates, default two minutes):
//     the writer sets Nats-Msg-Id from the sagaflow-message-id header, so
//     a relay that publishes a message again within the window (a retry
//     after a lost acknowledgement) stores it once. Consumers still
//     deduplicate by the message id in their inbox, for everything outside
//     the window (an operator's replay a day later).
//   - The JetStream context: create it with
//     jetstream.WithPublishAsyncTimeout, so that an acknowledgement the
//     server never sends ends as an outage instead of waiting forever.
//
// # Where it differs from Kafka
//
//   - Offsets. A message's kafka.Message.Offset is its stream sequence,
//     which counts every partition of the stream: offsets grow within a
//     partition but are not consecutive. HighWaterMark is set so that
//     HighWaterMark-Offset-1 is the number of messages still waiting on the
//     partition (the consumer lag).
//   - Keys. NATS messages have no key: it travels in the [KeyHeader]
//     header and comes back as kafka.Message.Key.
//   - Headers. NATS keeps the order of values of one header but not the
//     order between names: a [Reader] returns headers sorted by name. NATS
//     cannot carry a header value with CR or LF or with leading or trailing
//     blanks, nor a name that is not a token; the writer refuses such a
//     message for good (relay.CodeMalformedHeaders) rather than let NATS
//     alter it, and refuses headers named Nats-…, which would steer the
//     server. A message another producer published with a header block the
//     client cannot parse arrives with no headers at all (nats.go drops the
//     block): the inbox dead-letters it as having no type, without those
//     header bytes; the stored original stays in the stream until MaxAge.
//   - Delivery. Kafka redelivers from the last committed offset after a
//     rebalance; JetStream redelivers each unacknowledged message on its own
//     after AckWait, or at once when a [Reader] is closed (it gives back
//     what it held). CommitMessages acknowledges exactly the messages given,
//     not "everything up to".
//   - Poison. The broker never drops a message (MaxDeliver is unlimited):
//     sagaflow's own rules decide, as over Kafka (the inbox dead-letters a
//     message after its MaxAttempts, or at once when it can never succeed).
//   - Errors. The writer reports each failure as a relay.PublishError: no
//     stream for the topic is retried and spends an attempt; a server that
//     cannot be reached or does not answer, or no responders, is an outage
//     that spends none; a message larger than the server's max_payload or
//     the stream's MaxMsgSize is parked at once (relay.CodeTooLarge).
//
// The transport passes the conformance suite of package transporttest,
// run against a throwaway nats-server in this package's tests, including
// a server killed and restarted and a member that hangs mid-message.
package natsbus
