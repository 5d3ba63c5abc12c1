// Package relay publishes sagaflow's outbox to Kafka with
// github.com/segmentio/kafka-go.
//
// Rows written to the outbox with delivery 'relay' (by the saga engine, or
// by your own code through outbox.InsertTx in your transaction)
// commit together with the business data that produced them. A [Relay]
// turns them into Kafka messages afterwards:
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	if err != nil {
//		return err
//	}
//	defer pool.Close()
//	if _, err := migrations.Migrate(ctx, pool, "sagaflow"); err != nil {
//		return err
//	}
//
//	w := relay.NewKafkaWriter(strings.Split(os.Getenv("KAFKA_BROKERS"), ","), nil)
//	defer w.Close() // after Stop: the relay never closes its writer
//	r, err := relay.New(pool, w, &relay.Config{Schema: "sagaflow"})
//	if err != nil {
//		return err
//	}
//	if err := r.Start(ctx); err != nil { // returns at once
//		return err
//	}
//	defer r.Stop(context.WithoutCancel(ctx)) // publishes the batch in flight, then returns
//
//	// In a request handler: the order and its event commit together, and
//	// the relay publishes the event once they have.
//	tx, err := pool.Begin(ctx)
//	if err != nil {
//		return err
//	}
//	defer tx.Rollback(ctx)
//	if _, err := tx.Exec(ctx, `INSERT INTO shop.orders (id) VALUES ($1)`, orderID); err != nil {
//		return err
//	}
//	if err := outbox.InsertTx(ctx, tx, outbox.Message{ // wakes the relay at commit
//		Topic:   "orders",
//		Key:     orderID, // the partition key
//		Type:    "order.created",
//		Payload: payload,
//		Headers: map[string]string{"traceparent": traceparent},
//	}); err != nil {
//		return err
//	}
//	if err := tx.Commit(ctx); err != nil {
//		return err
//	}
//
// The package's Example is the same program, compiled with the tests.
//
// # A cycle
//
// One cycle is one PostgreSQL transaction that touches nothing but outbox
// rows: it claims up to BatchSize due rows (SELECT … FOR UPDATE SKIP
// LOCKED, oldest available_at first), builds one Kafka message per row,
// writes the whole batch with one synchronous WriteMessages call, and, in
// the same transaction, marks the acknowledged rows published and the
// others failed, then commits. BEGIN is sent with the claim, and the marks
// with COMMIT, so a cycle costs two round trips to the database. Only when
// that call fails as a whole for a reason that names a topic (an unknown
// topic, say) does the relay write the batch again topic by topic, so that
// one bad topic does not hold up the others. Publishing happens while the
// rows are locked, but never inside a transaction that writes business
// data.
//
// While a backlog drains, a running relay overlaps the database's work with
// the broker's: while batch N is written, batch N-1 is marked and committed
// and batch N+1 is claimed, in a transaction of its own, each on a
// connection of its own (so the relay holds up to four of the pool's
// connections, LISTEN's included; with a pool of three it marks before it
// claims, and with fewer it does not overlap).
// Writes stay serial, in claim order, and never run concurrently. Before
// batch N+1 is written, its rows whose key had a message in batch N that
// was not published (it failed, was parked as dead, or was held back
// itself) are held back: they are neither written nor marked, spend no
// attempt and stay pending as they were, and the next claim comes only
// after batch N+1 committed, so they are claimed again ahead of the later
// rows of their key. A message without a key counts as the empty key. If
// batch N ends in an outage or an error, batch N+1 is released without
// being written. [Relay.RunOnce] runs one cycle and never overlaps.
//
// Within one such drain, each claim starts in the claim order (available_at,
// then id) after the last row the relay claimed, instead of at the oldest
// due row: otherwise every claim would walk again the index entries of the
// rows published since the outbox was last vacuumed, and a drain of a large
// backlog slows as it goes. Every 16th claim of a drain, and the first,
// start from the oldest due row, so that a row before that point (locked by
// another relay when its turn came, or written by a transaction that
// committed late) waits at most 16 batches.
//
// A message has:
//
//   - Topic: the row's topic; Key: its aggregateid (the saga id, or the
//     aggregate the writer named); Value: its payload.
//   - Headers: every entry of the row's headers (a JSON object of strings),
//     W3C traceparent and tracestate among them when present, plus
//     sagaflow-message-id (the row's id), sagaflow-type, and, when the row
//     has them, sagaflow-saga-id and sagaflow-step-key. These four are taken
//     from the row's columns and replace entries of the same name.
//
// # Guarantees
//
// At least once. A row is marked published only after the broker
// acknowledged it (RequiredAcks: all, with [NewKafkaWriter]). A relay that
// crashes after the acknowledgement and before its commit leaves the rows
// pending, and they are published again. The commit that marks them does
// not wait for its WAL to reach the disk (synchronous_commit off for that
// transaction alone): a crash of PostgreSQL itself within about half a
// second of it can undo its marks in the same way (published, retried and
// parked dead alike), and the rows are then claimed and published (or
// parked) again, never lost; in exchange a cycle does not wait for a disk
// flush (20% more rows per second on a 2-core machine whose flush takes
// about a millisecond). kafka-go, which has no idempotent
// producer, may also store a retried produce request twice. Every copy
// carries the same sagaflow-message-id: consumers deduplicate on it, by
// recording it in the transaction of the effects it guards (the inbox
// package does that).
//
// Ordering per key. Messages with the same key go to the same partition
// (kafka.Hash by default; [JavaPartitioner] places keys as the Java
// client does, for topics other clients write too), and one relay writes them in the order it claims
// them: the order in which they became due, which for rows written without
// a delay is the order they were written. Overlapping claims do not change
// that: a later message of a key is never written before the failure of an
// earlier one is recorded (see A cycle). Two things can reorder messages
// of one key, and the relay does not prevent them: a message that failed and
// waits for its retry can be overtaken by a later message of the same key
// (its retry is due later than the rows written after it, and the claim
// takes the oldest due rows first), and several relays publish
// concurrently. Saga commands do not depend on
// either: a saga has at most one command in flight, and the next is written
// only when the step it answers has committed.
//
// Outages. A broker that is down never kills a row. When a write fails
// because the cluster could not be reached or could not take it (a refused,
// reset or cut connection, a DNS failure, PublishTimeout passing, no
// leader, too few in-sync replicas, a request timed out, the cluster
// refusing the relay's credentials or cluster ACL), the batch's rows
// get the error as last_error and an available_at pushed back, by the
// database's clock, and spend no attempt: they wait however long the outage
// lasts. Those rows are then due after rows of their keys that were still
// unclaimed, so an outage can reorder a key's messages, as a retried
// failure can (below): a saga's commands do not mind (a saga has one
// command in flight), but events written with outbox.InsertTx may be
// published out of their order. The wait grows with each cycle that finds the broker down (Backoff
// of the number of such cycles in a row) up to OutageBackoffMax, and the
// relay pauses as long before it claims again, so an outage is probed, not
// hammered. [Health] reports ConsecutiveOutages and OutageWaits. One
// function judges every error, the Kafka error code first: kafka.Error
// satisfies net.Error, so a code such as INVALID_TOPIC must not be taken for
// a connection error.
//
// Dead-lettering. A row that can never be published is parked with status
// 'dead' and a last_error that starts with a stable code: larger than
// MaxMessageBytes ([CodeTooLarge]), headers that are not a JSON object of
// strings ([CodeMalformedHeaders]), a topic name Kafka does not allow
// ([CodeInvalidTopic]), a message the broker refused for good
// ([CodeRejected], [CodeTooLarge], [CodeInvalidTopic]), or MaxAttempts
// failed attempts that were not an outage ([CodeAttemptsExhausted], with the
// last error: a topic that does not exist, an ACL that denies the relay, an
// error the relay does not recognise). Rows are never dropped, and a bad row
// never holds up the rest of its batch: the others are published in the same
// cycle. Dead rows, and the dead letters of consumers, are counted by
// [Relay.Health] and by `sagaflow outbox status`; list them with `sagaflow
// dead list` (or saga.Engine.DeadMessages) and, once the cause is fixed, put
// them back with `sagaflow dead requeue` (saga.Engine.RequeueDead): a dead
// row becomes pending again with its attempts reset.
//
// The outbox's attempts column counts a relay row's publish attempts,
// the one that succeeded included: a row published at the first try shows
// 1, and a row parked after MaxAttempts failures shows MaxAttempts. Waits
// for a broker outage count none. (An engine's direct command counts its
// deferrals there instead.)
//
// Requeued dead letters. A row whose headers column holds only the key
// "sagaflow-raw-headers" carries another producer's headers, byte for byte: the
// relay publishes it with exactly those headers, in order, and adds none of
// its own, so the message keeps its original sagaflow-message-id and the
// consumers that processed it skip it. (A letter that had no message id is
// requeued with a sagaflow-message-id header added by the requeue, not the
// relay: the id its consumer derived from its Kafka position, so that
// consumers that processed the original still skip it.) An empty
// aggregateid is sent as no key. This is how a requeued dead letter is sent again; a CDC pipeline
// that replaces the relay must do the same for such rows.
//
// Many relays. Any number of relays can run on one database: SKIP LOCKED
// gives each a different batch, and a row is published by the relay that
// claimed it, so without crashes every row is published once. Keep them
// few: claimers that step over each other's locks slow each other down.
//
// # The log-based relay
//
// [LogicalRelay] reads the outbox's relay inserts from a pgoutput
// replication slot instead of claiming them, publishes committed
// transactions (consecutive ones that stream in together gathered into one
// write of up to LogicalConfig.BatchSize rows) through the same [Writer],
// message building and dead-letter codes, marks them published, and only
// then confirms the slot. It needs
// wal_level=logical, a slot, a publication with a row filter and the
// REPLICATION privilege ([LogicalRelay.Setup] creates the publication and
// the slot); rows due later and requeued rows are left to a polling relay.
// See docs/relays.md.
//
// # Waking up
//
// A running relay looks for due rows after every cycle that filled its
// batch; otherwise it waits for the first of: a notification on the
// schema's channel (the engine and outbox.InsertTx notify it when they
// write messages, at their commit or, under outbox.WakeAfterCommit and in
// inbox handlers, just after it), [Relay.Wake],
// the next row coming due (a retry, or a row written with a delay), or
// PollInterval. When that next row comes due is asked in the round trip
// that ends the last claim's transaction (with its COMMIT, or with the
// ROLLBACK of a claim that found nothing): a row that came due since that
// claim began counts as due now, rows due before it (another relay holds
// them) do not.
//
// # Lifecycle
//
// [Relay.Start] returns at once; [Relay.Stop] stops claiming, lets the batch
// in flight be published and marked, releases untouched the batch claimed
// behind it, and returns ctx.Err() if its context ends first, after
// cancelling that batch; [Relay.StopAndCancel] cancels it at once. A cancelled batch's rows stay pending and are published again,
// so cancelling never loses a message. Calling either twice or concurrently
// is safe. [Relay.RunOnce] runs one cycle, for tests and tools.
package relay
