// Package chaos attacks a running sagaflow system and checks what survives.
//
// A system here is real: a throwaway PostgreSQL server, an in-process Kafka
// broker (kfake) and worker processes (nodes) started from the caller's own
// binary, running the orders engine in Kafka mode, the payments participant
// and the two relays (see [RunNode]), with every command and reply signed
// ([SigningKey]). The workload is an order saga whose steps write an effects
// ledger and call a fake external service (see [Definitions], [Service]).
// Some orders fail a step through PostgreSQL (a unique violation a few
// times, or a division by zero for good), some are cancelled by an operator
// (while a step runs, from a transaction that holds the saga, or as the CLI
// does), some dawdle in the step after the remote one, past the reply
// worker's limit, so that the step is handed from the reply worker to an
// engine worker (see [DawdleFor]), some stall in a statement past their
// step's timeout, which must cut it and undo the step's writes (see
// [StallFor]), and sagas of a type no node registers ([ForeignSagaName])
// send commands the engines must hold and then park.
//
// Parcels are sagas that wait (see [ParcelDefinitions]): for a timer, for a
// signal and for a child saga. The nodes send the signals ([RoleSignals]),
// as an at-least-once sender does: under one signal ID per parcel, again
// after a send that was not acknowledged, and sometimes twice on purpose;
// some arrive before the parcel reaches its await.
//
// # Poison
//
// [Env.InjectPoison] writes bad messages with a raw Kafka client (franz-go,
// so that no client cleans them up) to the engine's command and reply
// topics and the participant's topic: NUL bytes, invalid UTF-8 and 10 kB of
// random hex in header names and values, message ids, step keys, reply
// topics, keys and values, carried by forgeries of real messages (an "ok"
// reply for a step in flight, a command naming another step, a
// compensation) and by copies of real ones. Each is recorded with its Kafka
// position: the checkers find it in the dead letters with the bytes sent,
// or, for a copy whose signature still holds, prove that processing it
// changed nothing.
//
// # Attacks and checkers
//
// [RunCell] is one cell of the crash-point matrix: a node armed at one of
// the points of package fault is attacked there (SIGKILL, PostgreSQL
// restarted without a checkpoint, the broker taken away), the system
// recovers, and every saga must end. [RunSoak] attacks several nodes at
// random for a set time. [Env.Check] is the checkers: they use the engine's
// tables only for each saga's final status and history (cancels applied or
// refused), and the ledger, the external service's counts, the parent's own
// order book, the dead letters by Kafka position and a plain reader of the
// topics for the rest; for the parcels, the history says that each wait
// ended once. Three negative controls run broken systems (effects written
// outside the step's transaction; a bus without signing; signals whose
// wake-up is lost) that the checkers must report.
//
// # Over NATS
//
// With [BusNATS] ([SoakConfig].Bus, the soak command's -bus nats) the same
// system runs over a throwaway nats-server with JetStream instead of kfake,
// in the hybrid mode (Kafka mode stays Kafka-only): every topic gets a
// stream (package transport/natsbus), the relays publish with its writer,
// the engines read their replies and the participant its commands with its
// reader, with a short ack wait ([NATSAckWait]). The poison is written with
// the NATS protocol itself, past nats.go (which refuses header names that
// are not tokens), and recorded by stream sequence; the checkers read every
// stream by sequence where they read the Kafka topics. The broker outage
// kills the server and starts it again on its store, and nodes are killed
// while they hold messages they have not acknowledged, each of which
// another node must then acknowledge after JetStream redelivers it.
//
// The matrix needs a build with -tags sagaflow_faults. The tests of this
// package (make test) and the command in cmd/chaos (make chaos, make
// chaos/matrix) run both. docs/reliability.md records the figures.
package chaos
