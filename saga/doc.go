// Package saga runs durable sagas on PostgreSQL: multi-step business
// processes whose every step commits its effects, its state transition and
// its next command in one transaction, and whose completed steps are
// compensated in reverse order when a later step fails for good.
//
// # A saga
//
// A saga is a [Definition] over a state type S, stored as JSON between
// steps. Each [Step] has an Action, an optional Compensate, a [RetryPolicy]
// and a Timeout:
//
//	type Checkout struct {
//		OrderID  string `json:"order_id"`
//		ChargeID string `json:"charge_id,omitempty"`
//	}
//
//	var checkout = saga.Define("checkout",
//		saga.Step[Checkout]{Name: "reserve", Action: reserveStock, Compensate: releaseStock},
//		saga.Step[Checkout]{Name: "charge", Action: chargeCard, Compensate: refundCard},
//		saga.Step[Checkout]{Name: "ship", Action: createShipment},
//	)
//
//	func reserveStock(ctx context.Context, run *saga.StepRun, c *Checkout) error {
//		// run.Tx is the step's transaction: this row commits with the step.
//		_, err := run.Tx.Exec(ctx, `UPDATE stock SET reserved = reserved + 1 WHERE sku = $1`, c.OrderID)
//		return err
//	}
//
// Register the definition with an [Engine], start the engine's workers, and
// start sagas, inside your own transaction if you like:
//
//	engine, err := saga.New(pool, &saga.Config{Schema: "sagaflow"})
//	if err != nil { ... }
//	if err := engine.Register(checkout); err != nil { ... }
//	if err := engine.Start(ctx); err != nil { ... }
//	defer engine.Stop(context.Background())
//
//	tx, _ := pool.Begin(ctx)
//	tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, orderID)
//	started, err := saga.StartTx(ctx, engine, tx, checkout, Checkout{OrderID: orderID},
//		&saga.StartOpts{BusinessKey: orderID})
//	tx.Commit(ctx)
//
// The tables come from package migrations: run migrations.Migrate (or apply
// migrations.Script, or each version's Migration.Script, with your own tool)
// before the engine.
//
// # Guarantees
//
// These hold for any number of engines sharing one database, and are each
// proven by a test against a real PostgreSQL.
//
//  1. Atomic start. [StartTx] writes the saga, its first history entry and
//     its first command in the caller's transaction: they commit together
//     with the caller's rows or not at all. With a [StartOpts.BusinessKey],
//     starting twice returns the first saga ([Started.Existing]).
//
//  2. One transaction per step. A step's handler runs inside a transaction
//     ([StepRun.Tx]); the rows it writes there, the saga's new state and
//     version, the step-scoped key in the inbox, a history entry and the
//     next command (or the saga's end) commit together or not at all.
//     Nothing is sent to a broker inside that transaction.
//
//  3. Effects in PostgreSQL happen once. Commands may be delivered more
//     than once (a crash before commit, a duplicate row, a re-drive). A
//     command runs only while the saga still has the version it was written
//     for, and a step whose key is already in the inbox is skipped, so the
//     rows a handler writes through run.Tx exist exactly once.
//
//  4. Effects outside PostgreSQL happen at least once. An HTTP call to a
//     payment provider cannot join the transaction: if the process dies
//     after the call and before the commit, the step runs again. Every
//     attempt and every duplicate of a step carries the same
//     [StepRun.Key] (saga_id/step/direction/epoch); pass it to the provider
//     as its idempotency key. That is the only honest guarantee for
//     external side effects, and it is the user's part of the contract.
//
//  5. Fenced execution. At most one worker runs a step of a given saga at a
//     time (a transaction-scoped advisory lock taken without waiting), and
//     a worker whose saga moved on meanwhile (cancelled, re-driven) cannot
//     commit: every outcome is a conditional update on the saga's version,
//     and a refused outcome rolls back the step's own writes too. Leases
//     are in database time: a worker that stops talking to PostgreSQL
//     loses its session, its claims and its uncommitted step.
//
//  6. Compensation. A permanent error ([steps.Permanent]), exhausted
//     retries or repeated timeouts switch the saga to compensating: the
//     compensations of the completed steps run in reverse order, each as
//     its own fenced, deduplicated, retried step. A saga ends completed,
//     compensated, or failed (a compensation gave up, or its state cannot be
//     read): failed sagas are parked with their error, visible through
//     [Engine.List], for an operator. Nothing ends silently.
//
//  7. Order. The engine never runs two steps of one saga at once, and a
//     saga's commands share its id as their partition key.
//
//  8. Bad input is parked, never dropped, and never holds back other work.
//     A command that cannot be decoded, names a saga that does not exist,
//     or belongs to a saga or step no engine knows (after
//     [Config.UnknownSagaGrace], counted in database time) is marked dead
//     in the outbox, or dead-lettered with its raw bytes in Kafka mode,
//     with its reason; state that no longer decodes, or grows past
//     [Config.MaxStateBytes], fails or compensates the saga with a coded
//     error. Bytes PostgreSQL refuses (a NUL, invalid UTF-8, an id past the
//     index limit) in any field of a message, a handler's error code or a
//     reply are made storable or dead-lettered, never retried; an outcome
//     PostgreSQL refuses all the same as data (a data exception or a program
//     limit: bytes a step left in its state, a value past a limit) parks its
//     saga ([CodeInvalidOutcome]) after one attempt, the step's own writes
//     undone, instead of losing the batch. (Other errors of a step's writes,
//     a user's trigger that raises, say, are the step's failure: retried,
//     then compensated.) In Kafka mode a command that cannot run
//     yet (its saga busy, its saga type unknown here during a deploy) is
//     moved back to the outbox rather than held in its partition. Workers
//     keep serving everything else.
//
//  9. No saga left behind. Every running saga has a deadline in database
//     time: greatest(next_check_at, due_at), where next_check_at, indexed,
//     is a lower bound that the rescuer moves up to due_at when it passes
//     first (see [RescueResult].Rechecked). The rescuer finds sagas past the
//     deadline: one whose
//     command still waits in the queue is left waiting (no attempt spent);
//     one whose command was lost is re-driven under the same step-scoped
//     key, or, its attempts spent, compensated (or failed, if it was
//     compensating). A rescue never overwrites progress made since it read
//     the saga: its update is guarded on the version it read. A saga that
//     waits ([Wait]) counts as healthy until its wait's end; one that waits
//     without a time limit has no deadline, as what it waits for wakes it.
//     If that wake-up is lost (deleted, or parked as dead), the rescuer sends
//     another once the signal has been pending, or the child ended, for
//     RescueSlack ([RescueResult].Woken). A parallel step's branch has no
//     deadline either: once its saga has not moved for RescueSlack, a
//     running branch whose command was lost is sent again under the same
//     key, counting the lost attempt, or, its attempts spent, fails the
//     group; a remote branch's lost timeout is sent again due when it was
//     due ([RescueResult].Redriven, [RescueResult].FailedOver).
//
//  10. Cancel lands. [Engine.Cancel] and [Engine.RequestCancel] record a
//     request that is durable until applied ([EventCancelRequested]). It
//     goes ahead of the saga's next command, whatever that is, so no step
//     after it runs (a batch that read the saga more than 100 ms before
//     its command's turn reads its request and pauses again, so a step
//     whose engine has not heard of a request yet starts at most 100 ms
//     after the request committed); the engine running a step
//     of the saga (in any process) learns of it through a notification or
//     its next poll and cancels the step's context, and the request takes
//     the step's place: the step is rolled back, unless it returned
//     success anyway, and is then compensated too. Applying it is recorded ([EventSagaCancelled]), and
//     so is refusing it because the saga ended or was compensating first
//     ([EventCancelRefused]). One exception: a parallel step's branch that
//     runs when the cancel lands is not interrupted; it runs on until it
//     returns or its Branch.Timeout ends its context, then finds the group
//     gone and is rolled back (see "Parallel steps").
//
//  11. The bus is a trust boundary. A command runs only while it carries
//     the saga's current version, step, direction and epoch, and is the
//     command the saga wrote; a cancel message does nothing without a
//     request in the database. With [KafkaConfig.SigningKey], what the
//     engine writes is signed and what it consumes is verified before any
//     effect. See docs/security.md.
//
//  12. Waits end once, and none is missed. A step with a [Wait] holds no
//     worker and no connection while it waits: the saga's row records what
//     it waits for and until when, in database time, and its command is an
//     outbox row due then (in Kafka mode the relay publishes it when it is
//     due). A timer fires once, by the database's clock against the stored
//     end, whatever delivers its command and however often. A signal is
//     recorded in its sender's transaction ([Engine.SignalTx]) with a
//     wake-up command; the step that awaits it and the wake-up both hold the
//     saga's execution lock, so a signal is delivered whether it arrives
//     before the saga reaches the await (it is kept, and signals of one
//     name are delivered oldest first, by Seq among those committed) or
//     after; a wake-up judges the saga as it is once it holds the lock,
//     not as its claim read it. The signal is marked delivered in the
//     step's transaction, so it takes effect once, and a
//     second signal with the same ID is recorded once. A signal that no
//     saga can take is recorded as rejected, with an error
//     ([ErrSignalRejected]). A child saga ([Child]) is started in its
//     parent's step transaction under an id derived from the step's key,
//     and its end (in its own transaction) wakes the parent; a parent that
//     stops waiting (cancelled, past its deadline or its wait's timeout)
//     asks the child to cancel in the same transaction. A saga past its
//     deadline ([Definition.WithDeadline], [StartOpts.Deadline]) is
//     cancelled by the rescuer as [Engine.Cancel] would, with code
//     [CodeDeadline].
//
// # What a step should know
//
// A step that fails is rolled back: its writes through run.Tx are undone
// before the failure is recorded. Compensations run only for steps that
// completed; a step that made an external call and then failed for good
// must leave no effect behind, or be retried until it succeeds (its
// idempotency key makes retrying safe).
//
// Handlers must honour ctx. An attempt that runs past its Timeout and
// returns an error fails with code step_timeout (the step's clock stops
// while its first statement waits for the batch to send earlier steps'
// writes: a step is charged only for its own time); one that returns nil,
// its transaction intact, succeeded late and counts. A statement the handler runs on run.Tx with ctx
// when ctx ends (its Timeout, a cancel request) is cancelled on the server
// (SQLSTATE 57014): the step's writes are undone with its savepoint and
// the attempt is recorded, while the batch's connection and the other
// steps of its batch go on; a statement begun after ctx ended is not sent.
// A handler that ignores the cancellation for
// [Config.HandlerGrace] is abandoned: its connection is closed (rolling the
// transaction back) and the attempt is recorded as failed; until it is, the
// engine's workers leave the saga's commands alone, and for a few seconds
// after they read the saga again before they run one, so that the attempt
// is in the history before the retry and counts (another engine sharing the
// work may still take the step first: the attempt is then recorded after
// it, and does not count). The handler's statements on run.Tx fail from the
// moment it is given up. A step run at
// once after a reply or a wait's end (see below) takes the reply or the
// wait's end with it when it is abandoned: that attempt is recorded by its
// history entry only and does not count against the step's MaxAttempts. The
// command or message that brought the reply or the wait's end runs again at
// once, and the step is then not run at once but left to be claimed on its
// own, where its attempts count: a step that never returns fails for good,
// after one attempt more than MaxAttempts (more when several engines share
// the work, as each engine remembers only its own abandonments).
//
// Several steps of different sagas may share one transaction
// ([Config.BatchSize]), each under its own savepoint, to save commits. A
// slow step delays the commit of the steps batched with it; engines whose
// steps are slow should use a small BatchSize. An abandoned handler takes
// the whole batch's transaction with it: the other steps of the batch,
// whatever their outcome, are not recorded and run again.
//
// A step's command that finds its saga held by another transaction (a
// step of it still running, an operator's transaction) is deferred: tried
// again after a few milliseconds, then twice as long each time up to 2 s,
// so it runs within about 2 s of the saga being free (in Kafka mode it is
// moved back to the outbox with the same cap). When a retry, a deferred
// command or a short timer comes due, the engine that wrote it wakes one of
// its workers (or, in Kafka mode, tells the relays); an engine stopped
// before then tells the other engines to look again, and if it dies they
// find the command at their next poll ([Config.PollInterval]).
//
// Starts share commits too. [Start] (not [StartTx], whose transaction is the
// caller's) sends its saga's statement at once when no other start of the
// engine is committing; starts made while one is committing wait for it, then
// commit together, up to 128 in one transaction, each still returning only
// once its saga has committed ([Stats.StartsGrouped] counts them); a start
// with a [StartOpts.ConcurrencyKey] (without NoWait) takes its place under
// the key in the same transaction. A group
// that fails for any reason, a start that PostgreSQL refuses or one that
// waits more than 50 ms for a business key another transaction holds, runs
// each of its starts again on a connection of its own, concurrently, so that
// each gets its own answer and no start waits for another's lock, as long as
// the pool has a connection free (a start blocked on a key holds one). A
// start whose context ends before its statement is sent starts nothing; one
// whose context ends after may have started its saga, and its error says so
// (see [Start]).
//
// # Concurrency keys
//
// [Definition.WithConcurrency] limits the sagas of a definition that run at
// once per key ([StartOpts.ConcurrencyKey]). A saga counts from its start until
// it ends (completed, compensated or failed, including by a cancel). A start
// beyond the limit returns at once. Its saga waits, in start order, at its
// first step, with that step's command held. No worker claims it, and it holds
// back nothing of other keys. [Engine.Get] shows its place
// ([Instance.Concurrency]). With [StartOpts.NoWait], such a start fails with
// [ErrConcurrencyLimit] instead.
//
// The slot is released in the transaction that writes the saga's end, and the
// next waiting saga is admitted in that same transaction. A crash therefore
// neither leaks nor doubles a slot. [StartTx] takes the slot in the caller's
// transaction: a rollback takes none. Resuming or rerunning a failed saga takes
// a slot again at once, ahead of the queue.
//
// # Pivots
//
// A saga in Garcia-Molina's sense is compensatable steps, then a pivot, then
// retriable steps. Mark the step after which the saga can no longer be
// undone with [Step.Pivot] (the card is charged), and every step after it
// with [Step.Retriable]. The rule, checked by [Engine.Register], which names
// the step that breaks it:
//
//   - at most one step is the pivot, and it has no compensation (it would
//     never run);
//   - every step after the pivot is Retriable and has no compensation, local
//     or remote; none waits for a child saga, and no wait after it has a
//     Timeout that compensates (use TimeoutThen);
//   - no Retriable step comes before the pivot.
//
// Compensation never crosses the pivot. Until the pivot has completed, the
// saga behaves as any other: a failure, a cancel or a deadline compensates
// the completed steps before it. Once the pivot has completed, the saga only
// goes forward: a retriable step is retried past its MaxAttempts, with its
// backoff, until it succeeds (a remote one is sent again under the same step
// key when no reply comes in time); a permanent error, a participant's
// refusal or a state that cannot be decoded ends the saga failed, not
// compensated, for an operator to [Engine.Resume] once the cause is fixed.
// [Engine.Cancel] refuses a saga past its pivot with [ErrPastPivot]; a
// cancel request recorded without the definition (the operator CLI) is
// refused and recorded ([EventCancelRefused]) when an engine applies it, and
// never interrupts the running step; a saga deadline that passes after the
// pivot is cleared ([EventDeadlineCleared]). A deadline that passes while
// the pivot itself runs is a cancel of the running pivot, as an operator's
// would be: the pivot's context is cancelled, and a pivot that returns its
// error is rolled back and the steps before it compensated, while one that
// completes anyway (the charge went through) commits, the request is
// refused at the next step ([EventCancelRefused]) and the saga goes forward.
//
// # Pause
//
// [Engine.Pause] pauses one saga that has not ended, [Engine.PauseType] every
// saga of a type (including those started while the pause lasts). A paused
// saga starts no new step, compensation, retry, timer or signal delivery; a
// step that runs when the pause commits finishes and records its outcome,
// and the command it writes next waits. [Engine.Unpause] (or
// [Engine.ResumeType]) lifts the pause, as [Engine.Resume] does (Resume also
// replays a failed saga; Unpause never does): each held command becomes due when
// it was due before, or at once when that time has passed, so a timer that
// fell due during the pause fires once, after it. A pause is a row in the
// database, not a status: [Instance.Paused] shows it, [ListOpts.Paused]
// finds paused sagas. A cancel of a paused saga is applied at once (the saga
// turns compensating) and its compensations wait for the resume; a saga
// with nothing to compensate ends compensated at once. The rescuer leaves
// paused sagas alone (their deadline starts again at resume), and a saga
// deadline (Definition.WithDeadline) that passes during a pause is applied
// after the resume, not during it. A saga that ends is no longer paused.
//
// How it holds: the step commands of a paused saga wait in the outbox, due
// at 'infinity' (a trigger holds those written during the pause), and an
// engine that claims one (a command that escaped the hold by racing the
// pause, or one consumed from Kafka in Kafka mode) writes it back held
// instead of running it. A batch of several steps that claimed a command
// before the pause committed hears of the pause (Pause and PauseType notify
// the engines when they commit) and looks at the pauses again before each
// step it has yet to run: a step whose saga is paused then waits. Only a step
// that starts in the moment between the pause's commit and its notification
// reaching the engine runs. Other sagas, of this type or any other, are not
// held back. A command written held just as its pause was lifted (by a step,
// or a batch, that committed after the release had looked) is released by
// the rescuer's next run ([RescueResult.Released]); it never releases a
// command that a pause covers.
//
// A step with [Step.PauseWhenExhausted] pauses its saga, instead of
// compensating (or, if Retriable, instead of retrying on), when its
// retries are spent: the on-call engineer decides. The saga keeps its
// position and last error ([PauseCodeExhausted]); Resume runs the step again
// with its attempts counted afresh. A permanent error still compensates.
//
// # Parallel steps
//
// A step with [Step.Parallel] is a group of [Branch]es that run at once, on
// several workers (and engines), and complete together: the step completes
// when every branch has completed. Each branch is a step of its own: its own
// transaction (run.Tx), its own step-scoped key ("<step>.<branch>", e.g.
// "prepare.card"), its own attempts and backoff ([Branch].Retry), its own row
// ([Engine.Branches]) and its own history entries (step_completed and
// step_failed under "<step>.<branch>").
//
// The state rule, which keeps concurrent branches from overwriting each
// other: a branch's Action gets the saga's state by value, as it was when
// the group started, and cannot change it; it returns a result instead,
// stored with the branch. Once the last branch completes, [Parallel].Join
// applies every result to the state, in that branch's transaction, under
// the saga's row lock: branches end one at a time, so exactly one of them
// sees all the others complete and joins.
//
// If a branch fails for good (a permanent error, or its attempts spent), or
// Join fails, the group fails: branches still running are cancelled (their
// rows say so at once; one that is mid-attempt is not interrupted: it runs
// until it returns or its Branch.Timeout ends its context, holding a worker
// meanwhile, then finds the group gone, and its effects are rolled back
// with its transaction), the completed branches are
// compensated (each branch's Compensate gets its result; the last branch in
// the definition first, in one transaction), and then the steps before the
// group, in reverse. A cancel during the group does the same. A resumed saga
// that failed at a group runs again only the branches that had not
// completed. A parallel step cannot be the pivot or come after it, and needs
// the Postgres-only or hybrid mode (branch commands stay in PostgreSQL).
//
// A branch can call another service instead ([Branch].Remote, a
// [RemoteBranch]): the commands of all remote branches go out when the group
// starts, to several participants at once, and each reply completes its
// branch with the reply's result (a refusal fails the group). A remote
// branch with no reply within its Timeout fails the group too, and is
// compensated with the others, with a null result, since the participant may
// have acted. Its Compensate runs locally (to undo the participant's work,
// write a command for it with package outbox in run.Tx).
//
// # Versions
//
// A definition has a version ([Definition.WithVersion]; 1 when never set),
// and a saga runs to its end on the version it started with
// ([Instance.DefinitionVersion]). During a deploy, register the old version
// beside the new one: [Engine.Register] takes several versions of a name,
// new sagas start on the version passed to [Start], and each saga's steps
// run on its own version. An engine that lacks a saga's version does not
// claim its commands: engines that have it run them, and nothing else waits
// (after Config.UnknownSagaGrace with no such engine, the commands are
// parked as for any saga no engine knows). [Engine.Versions] (the CLI's
// `sagaflow versions`) counts the sagas on each version, so an old version
// can be dropped once nothing runs on it.
//
// [MigrateSagas] moves in-flight sagas to another version instead: a typed
// function of the old state and position gives the new ones, applied per
// saga in one transaction (new state, position and version, the command of
// the new position, the old position's pending commands deleted, a
// saga_migrated history entry), with a dry run that computes the same moves
// and writes nothing. A saga whose step runs at that moment, that waits for
// a remote reply, a child saga or its parallel step's branches, or that Map
// refuses is skipped with the reason. The epoch is kept, so a step the saga completed under the same name
// and direction is not run again ([SagaMove].KeyReused says so in advance).
//
// # Kafka, remote steps, and the two modes
//
// With [Config.Kafka] set, the engine reaches other services over Kafka. In
// the hybrid mode (the default) only remote steps' commands and their
// replies cross the broker: local steps are claimed from PostgreSQL exactly
// as without Kafka. With [KafkaConfig.AllSteps] (Kafka mode) the engine
// carries every step command over Kafka: they are still written to the
// outbox in the step's transaction, a relay (package relay) publishes them
// to one topic per saga type, keyed by saga id, and the engine's workers
// consume them in one consumer group, committing an offset only after the
// transaction that ran its message. Like the commands a worker claims from
// the outbox, the messages a worker's kafka-go reader holds ready at once
// (up to [Config.BatchSize]) run in one transaction, each under its own
// savepoint, so a step's transaction-local settings (SET LOCAL) last to
// the end of the batch. Their sagas are read and locked together before
// the first runs (unless two messages name one saga), and count as running
// on this engine from then on, so that a cancel asked meanwhile reaches
// them as it reaches a claimed command's saga. A poison message is
// dead-lettered, and a step's failure recorded, within the batch. If any
// of them cannot run now (its saga is busy, or of a saga type or step this
// engine does not know), a handler overran, or the transaction failed
// (PostgreSQL refused a message's bytes, say), nothing of the batch is
// committed and they run one at a time, each step once more (its effects
// in PostgreSQL still happen once; a call to another system may repeat, as
// after a crash; [Stats].BusBatchesRerun counts such batches). BatchSize 1
// runs one message per transaction. In both modes the guarantees above
// hold unchanged; malformed messages go to the dead_letters table.
//
// A step with a [Remote] instead of an Action calls another service: the
// step sends a command to the service's topic and the saga waits for the
// reply, which the service (a participant.Participant) writes to its own outbox.
// A successful reply completes the step; a refusal, or no reply within the
// step's Timeout, fails it for good and the saga compensates (after a
// timeout, the step's own compensation included: the service may have done
// it). A remote compensation whose reply is late is sent again under the
// same step key until its CompensateRetry attempts are spent; only then does
// the saga end failed. A refusal that names another command than the one
// the saga waits for (steps.Reply.InReplyTo: a copy of a refusal from
// before [Engine.Resume], or the answer to a command since sent again) is
// dropped as stale. Remote steps need [Config.Kafka] (either mode).
//
// A remote step costs no claim of its own: when a local step succeeds and
// the next step is remote, its command is built at once and written with
// the local step's success, in the same update of the saga's row (when the
// remote step's Command uses [StepRun].Tx, the local step is written first,
// and the send follows under a savepoint of its own); when a reply
// completes a step and the next one runs forward
// (a local action, or another remote step's send), that step runs at once
// in the reply's transaction, with its own savepoint, key and history, as
// after a wait (see "Sagas that wait"); a local action's outcome, or the
// next remote step's command, is then written in the same update as the
// reply, and no command is written for a worker to claim (a local action's
// failure undoes only its own writes, not OnReply's). A saga that
// is paused (also by a pause that committed while the reply was applied),
// or asked to cancel, takes the usual way instead: the next step's command
// waits. [Stats].Chained counts the steps run so.
//
// The step run after a reply runs on the Kafka worker that applied the
// reply, and the replies behind it in its partition wait for it; so it may
// run there for [KafkaConfig.ReplyStepLimit] only (200 ms by default). A
// step still running then is given up: its context is cancelled, its
// transaction's connection closed (its writes undone), and nothing of it
// recorded, not even as an attempt; the reply is applied again on its own,
// with the step's command, and an engine worker runs the step, with its
// Timeout and its attempts counted as usual. For a minute after, that step
// of that saga type goes to a worker straight from its reply, on that
// engine. [Stats].StepsHandedOff counts the steps given up so. A step that
// is usually slower than the limit thus costs one more claim and commit,
// as it did before steps ran after replies; a replies' partition is held
// up by one slow step for the limit at most, and by none while the step is
// handed off. With a negative limit the step runs to its Timeout (plus
// HandlerGrace when it ignores its ctx) on the reply worker: give remote
// steps a Timeout well above the longest step that follows a reply, or a
// reply waiting behind it can time out (the step is then compensated, and
// the late reply dropped as stale).
//
// # Sagas that wait
//
// A step with a [Wait] instead of an Action waits: for a time ([Sleep],
// [SleepFor], [SleepUntil]), for a signal ([OnSignal], sent with
// [Engine.Signal], [Engine.SignalTx], or from any Kafka topic through an
// inbox consumer with [SignalOn]), or for a child saga ([Child]). A signal or
// child wait may have a time limit with its own outcome: compensate
// ([Wait.Timeout]), a handler, or go on ([Wait.TimeoutThen]). Retries use
// the same mechanism: a retry's backoff is its command's due time, so a
// long backoff holds nothing either. When a wait ends and the next step is
// a local action, that step runs at once in the same transaction (a
// second step of the same saga, with its own savepoint, key and history),
// and its outcome is written in the same update as the wait's end, with no
// command written for it (its failure undoes only its own writes, not the
// wait handler's): a signal's effect does not wait for another claim. A
// saga paused meanwhile, or asked to cancel, takes the usual way: the
// step's command waits. [Instance.Wait] says what a saga waits
// for, and [ListOpts.Waiting] lists the sagas that wait.
//
// # The scheduler
//
// A started engine runs a robfig/cron scheduler with three kinds of jobs,
// all safe on any number of engines at once, so no leader is elected:
//
//   - the rescuer, every [Config.RescueInterval] ([Engine.RescueNow] runs
//     it at once): it takes each stuck saga with a lock it never waits for
//     and guards its update on the version it read, then records a cancel
//     request for each saga past its deadline; first, it releases the
//     commands held for a pause that no longer exists (see "Pause");
//   - retention, every [Config.RetentionInterval] ([Engine.RunRetention]):
//     published outbox rows after [Config.OutboxRetention], inbox keys
//     after [Config.InboxRetention] (which must be longer: it is what makes
//     replayed messages harmless), completed and compensated sagas with
//     their history and signals after [Config.SagaRetention] (and signals
//     that matched no saga after as long), in statements of at most
//     [Config.RetentionBatch] rows. Failed sagas are kept.
//   - sagas started by [Schedule] at every slot of a cron spec, in
//     [Config.Location]: the slot is part of the business key, so each slot
//     starts one saga however many engines fire it.
//
// # Reading, steering, replaying
//
// [Engine.Get] returns a saga with its timeline in database time,
// [Engine.List] filters and pages through sagas, [Engine.Cancel]
// compensates a running saga, interrupting its running step
// ([Engine.RequestCancel] from a tool that does not know the definition),
// and [Engine.Pause] holds one (see "Pause").
// [Engine.DeadMessages], [Engine.DeadLetters] and [Engine.RequeueDead] list
// and send again what was parked. Once the cause of a failure is fixed,
// [Engine.Resume] restarts a failed saga where it failed, [Engine.Rerun]
// runs an ended saga again from a chosen step under a new epoch (fresh
// keys), and [Engine.ReplayBulk] does either for every saga a filter
// selects, capped, rate limited, or as a dry run. [Engine.ReplayOutbox]
// re-publishes already published messages; consumers deduplicate them.
package saga
