// Package inbox makes consumers safe against the duplicates that
// at-least-once delivery brings: a relay that crashed after the broker
// acknowledged, a consumer that left its group before committing its offset.
//
// # Process
//
// [Inbox.Process] runs a handler inside a transaction whose first statement
// records the message's id in the inbox table. The handler's writes commit
// together with that record, or neither does; a second delivery of the same
// message finds the id and is skipped without running the handler; a
// concurrent second delivery waits on the first's record and then skips.
// That is what makes a message's database effects happen once:
//
//	in, err := inbox.New(pool, &inbox.Config{Consumer: "payments"})
//	processed, err := in.Process(ctx, msg, func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
//		_, err := tx.Exec(ctx, `INSERT INTO payments.charges (order_id) VALUES ($1)`, msg.Key)
//		return err
//	})
//
// [Inbox.ProcessTx] does the same inside the caller's transaction.
//
// A handler that writes outbox rows with outbox.InsertTx, passing on its
// context, wakes the relay once Process (or the [Consumer]) has committed,
// by a notification of its own, not inside the transaction: PostgreSQL
// keeps the commits of notifying transactions from sharing a WAL flush.
// Under ProcessTx, whose transaction is the caller's, the notification goes
// with the caller's commit.
//
// A message's id is its sagaflow-message-id header, which the relay sets
// from the outbox row; a message from another producer without that header
// is identified by topic/partition/offset, which a redelivery keeps on
// Kafka and NATS. A reader whose redeliveries get a new offset (package
// rabbitbus; see [OffsetsNotKept]) gives such a message no identity that
// lasts, so a [Consumer] of it dead-letters the message instead of risking
// a second effect.
//
// # Consumer
//
// [Consumer] is a Kafka consume loop built on Process, for a kafka-go Reader
// in a consumer group: it routes messages by type (the sagaflow-type
// header) to handlers, commits a message's offset only after its
// transaction committed, and keeps the partition moving past poison. A
// message is dead-lettered with the reason and its original bytes, and the
// next message is processed, when:
//
//   - it is oversized, or has no handler for its type;
//   - it carries one of sagaflow's own headers (sagaflow-…) more than once,
//     so that it could be read two ways;
//   - its handler refuses it for good (an error marked with
//     steps.Permanent, or any error with a Permanent() bool method, such as
//     a payload that does not decode);
//   - PostgreSQL refuses its content (a data exception or a program limit:
//     a NUL byte or invalid UTF-8 written to text, a value past the index
//     size limit), which would fail the same way on every retry.
//
// Other handler errors are retried with backoff, in order, up to
// MaxAttempts (about an hour by default); a message that still fails is
// dead-lettered with its last error, so that it cannot hold its partition
// forever.
//
// Each message is processed in a transaction of its own unless
// [ConsumerConfig].BatchSize asks for more: then the messages a
// *kafka.Reader holds ready at once (a backlog) are processed in one
// transaction, their ids recorded together before the first handler runs
// (a copy later in the batch is a duplicate), and their offsets committed
// together. Their handlers share that transaction and whatever one leaves
// in it (SET LOCAL, set_config(..., true), advisory locks of the
// transaction); a poison message or a failing handler sends the batch back
// to one message per transaction, its handlers running once more.
//
// # Untrusted bytes
//
// A [Message] holds what came off the wire, untouched; [Message.RawHeaders]
// keeps every header in order. Any message id can be recorded: one that is
// not valid UTF-8, holds a NUL byte or is longer than 512 bytes is recorded
// as its SHA-256. A handler that writes a message's strings to text
// columns must make them safe itself, or PostgreSQL refuses them and the
// message is dead-lettered.
//
// Dead letters live in the dead_letters table with the raw bytes of the
// message's key, value and headers. A Consumer stores a dead letter once
// per Kafka position, so a redelivered poison message is not dead-lettered
// twice; it does not record a dead letter's id in the inbox, so a poison
// message that copied a genuine message's id cannot make the genuine one
// look like a duplicate. [Inbox.DeadLetter], for callers outside a
// Consumer, does record the id.
package inbox
