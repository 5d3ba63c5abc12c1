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
// A message's id is its sagaflow-message-id header, which the relay sets
// from the outbox row; a message from another producer without that header
// is identified by topic/partition/offset, which a redelivery keeps.
//
// # Consumer
//
// [Consumer] is a Kafka consume loop built on Process, for a kafka-go Reader
// in a consumer group: it routes messages by type (the sagaflow-type
// header) to handlers, commits a message's offset only after its
// transaction committed, and keeps the partition moving past poison: a
// message that is oversized, has no handler for its type, or that its
// handler refuses for good (an error marked with steps.Permanent, or any error
// with a Permanent() bool method, such as a payload that does not decode) is dead-lettered with the reason and its
// original bytes, and the next message is processed. Other handler errors
// are retried with backoff, in order, up to MaxAttempts (about an hour by
// default); a message that still fails is dead-lettered with its last
// error, so that it cannot hold its partition forever.
//
// Dead letters live in the dead_letters table; the message's id is recorded
// in the inbox with them, so a redelivered poison message is not
// dead-lettered twice.
package inbox
