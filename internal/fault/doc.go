// Package fault holds sagaflow's named crash points: places in the engine,
// the relay, the inbox and the rescuer where a crash, a database restart or
// a broker outage is most likely to break a guarantee if the code were
// wrong (after the broker acknowledged and before the rows were marked,
// say). The crash-point matrix in internal/chaos stops a worker process at
// each of them and attacks it there.
//
// In a normal build [Hit] is an empty function the compiler removes, and
// nothing can be armed. Only a build with the tag sagaflow_faults can stop
// at a point: there, a process started with
//
//	SAGAFLOW_FAULT=<point>@<n>
//
// stops at the n-th time it reaches <point>: it writes "<point>\n" to file
// descriptor 3 and waits for one line on file descriptor 4 before going
// on. The parent that started it does its worst in between (SIGKILL the
// process, restart PostgreSQL, take the broker away) and then lets it go,
// if it still lives. Each point fires at most once per process.
//
// The engine reaches its points with [At], which also calls the [Hook] that
// its context carries ([WithHook]), in every build: sagatest.CrashMatrix
// crashes one engine in a user's plain go test that way.
package fault

// The points. Each names the last thing that happened before it.
const (
	// EngineAfterClaim: a worker's transaction has claimed commands and
	// locked their sagas; no handler has run.
	EngineAfterClaim = "engine.after-claim"
	// EngineAfterHandler: a step's handler returned (its effects are in the
	// step's uncommitted transaction); its outcome is not written yet.
	EngineAfterHandler = "engine.after-handler"
	// EngineBeforeCommit: the whole batch is written; COMMIT is next.
	EngineBeforeCommit = "engine.before-commit"
	// EngineAfterCommit: the batch committed. In Kafka mode the message's
	// offset is not committed yet.
	EngineAfterCommit = "engine.after-commit"
	// EngineAfterHold: in Kafka mode, a command that could not run yet was
	// moved back to the outbox (committed); its offset is not committed yet.
	EngineAfterHold = "engine.after-hold"
	// RelayAfterClaim: the relay has claimed a batch of outbox rows and not
	// sent them.
	RelayAfterClaim = "relay.after-claim"
	// RelayAfterAck: the broker acknowledged the batch; the rows are not
	// marked published yet.
	RelayAfterAck = "relay.after-ack"
	// InboxBeforeCommit: a consumed message's handler ran and its inbox key
	// is written, in a transaction not yet committed.
	InboxBeforeCommit = "inbox.before-commit"
	// InboxAfterCommit: the message's transaction committed; the relay has
	// not been woken for the rows it wrote, and its offset is not committed
	// yet.
	InboxAfterCommit = "inbox.after-commit"
	// RescueAfterRead: the rescuer has read a stuck saga and decided what to
	// do; its guarded update is next.
	RescueAfterRead = "rescue.after-read"
	// RescueWakeBeforeCommit: the rescuer has written a new wake-up for a
	// saga that waits without a time limit for what has happened (a signal
	// pending, a child ended), its wake-up lost; COMMIT is next.
	RescueWakeBeforeCommit = "rescue.wake-before-commit"
	// RescueBranchBeforeCommit: the rescuer has written, for a parallel
	// step's branch whose command was lost, the command again (or the
	// group's failure, its attempts spent); COMMIT is next.
	RescueBranchBeforeCommit = "rescue.branch-before-commit"
	// EngineWaitBeforeCommit: a batch in which a wait ended (a timer fired,
	// a signal was delivered, a child's end was seen) is written; COMMIT is
	// next.
	EngineWaitBeforeCommit = "engine.wait-before-commit"
	// EngineWaitAfterCommit: that batch committed; the step after the wait
	// has not run.
	EngineWaitAfterCommit = "engine.wait-after-commit"
	// SignalBeforeCommit: Engine.Signal wrote the signal and its wake-up;
	// COMMIT is next.
	SignalBeforeCommit = "signal.before-commit"
	// SignalAfterCommit: the signal committed; no engine has seen it.
	SignalAfterCommit = "signal.after-commit"
	// EngineBranchCompleted: a parallel step's branch completed (its row,
	// inbox key and history are written, with its effects, uncommitted);
	// the join, if it is the last, is next.
	EngineBranchCompleted = "engine.branch-completed"
)

// Points lists every point, in the order of a saga's life.
var Points = []string{
	EngineAfterClaim, EngineAfterHandler, EngineBeforeCommit, EngineAfterCommit,
	EngineAfterHold,
	RelayAfterClaim, RelayAfterAck,
	InboxBeforeCommit, InboxAfterCommit,
	RescueAfterRead, RescueWakeBeforeCommit, RescueBranchBeforeCommit,
	EngineWaitBeforeCommit, EngineWaitAfterCommit,
	SignalBeforeCommit, SignalAfterCommit,
	EngineBranchCompleted,
}

// Env is the environment variable that arms a point in a sagaflow_faults build.
const Env = "SAGAFLOW_FAULT"
