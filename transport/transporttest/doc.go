// Package transporttest is the conformance suite every sagaflow transport
// must pass: Kafka (kafka-go on kfake, in this package's own tests), NATS
// JetStream (package natsbus), RabbitMQ (package rabbitbus) and any
// transport of your own behind the relay's writer and the consumers' reader
// seams.
//
// [Run] runs each case end to end through the real seams: rows written to
// an outbox in a real PostgreSQL schema, a relay publishing them with the
// transport's writer, the broker, inbox consumers reading through the
// transport's reader in one consumer group, and an effects table that each
// processed message writes a row to in its transaction. Each case asserts
// exact counts:
//
//  1. at least once: every message has an effect, and none has two;
//  2. per-key order: several keys interleaved over fewer partitions, two
//     members: each key's effects come in the order written;
//  3. duplicates: a message a producer published twice, and once more by an
//     operator's replay, has one effect;
//  4. poison parked: a message the handler refuses, bodies PostgreSQL
//     refuses (NUL, invalid UTF-8), an id of invalid UTF-8 with a 10 kB header
//     holding NUL, and a type holding NUL are dead-lettered with a reason,
//     and the messages behind them on their key still have their effects;
//  5. broker restart: messages written before and after a restart of the
//     broker each have one effect;
//  6. consumer killed mid-batch: a member that processed messages and died
//     before committing them; another member gets them again, and nothing is
//     lost or doubled;
//  7. redelivery after the ack wait: a member that fetched a message and
//     hangs; after [Bus].RedeliveryAfter another member processes it, once;
//  8. a new reader after a restart: a consumer and its reader stop and a new
//     reader of the group takes over; no message is skipped as a duplicate
//     of one the earlier reader saw, and a poison message is dead-lettered
//     even where an earlier one was (readers whose offsets restart from 0
//     fail it);
//  9. an unroutable message: one for a topic the broker does not have,
//     written among others, is refused by the writer for itself alone and
//     parked dead by the relay after its attempts; the others, written
//     before, with and after it, each have their effect, in order per key.
//
// Describe a transport with a [Bus]: how to start a broker for one case,
// and, through the [Broker] it returns, how to create a topic, make writers
// and readers (dialing through the [Link] the suite hands over, so that it
// can freeze one member) and restart the broker. Then:
//
//	func TestMain(m *testing.M) { transporttest.Main(m) }
//
//	func TestConformance(t *testing.T) {
//		transporttest.Run(t, transporttest.Bus{
//			Name:            "mybus",
//			Start:           startMyBroker,
//			RedeliveryAfter: 2 * time.Second,
//		})
//	}
//
// Cases run in parallel, each with its own broker, schema and topic. The
// suite needs PostgreSQL, found as sagaflow's own tests find it
// (TEST_DATABASE_URL, else a local server on 127.0.0.1:5432, else a
// throwaway server); keep redelivery short in tests (an ack wait or a
// session timeout of a second or two) so the suite stays quick.
package transporttest
