// Package chaos attacks a running sagaflow system and checks what survives.
//
// A system here is real: a throwaway PostgreSQL server, an in-process Kafka
// broker (kfake) and worker processes (nodes) started from the caller's own
// binary, running the orders engine in Kafka mode, the payments participant
// and the two relays (see [RunNode]). The workload is an order saga whose
// steps write an effects ledger and call a fake external service (see
// [Definitions], [Service]).
//
// [RunCell] is one cell of the crash-point matrix: a node armed at one of
// the points of package fault is attacked there (SIGKILL, PostgreSQL
// restarted without a checkpoint, the broker taken away), the system
// recovers, and every saga must end. [RunSoak] attacks several nodes at
// random for a set time. [Env.Check] is the checkers: they use the engine's
// tables only for each saga's final status, and the ledger, the external
// service's counts, the parent's own order book and a plain reader of the
// topics for the rest.
//
// The matrix needs a build with -tags sagaflow_faults. The tests of this
// package (make test) and the command in cmd/chaos (make chaos, make
// chaos/matrix) run both. docs/reliability.md records the figures.
package chaos
