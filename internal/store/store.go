package store

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/sagaflow/sagaflow/wire"
)

// DBTX is what the statements run on: *pgxpool.Pool, *pgx.Conn and pgx.Tx
// satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Saga statuses as stored.
const (
	StatusRunning      = "running"
	StatusCompensating = "compensating"
	StatusCompensated  = "compensated"
	StatusCompleted    = "completed"
	StatusFailed       = "failed"
)

// Outbox row statuses and deliveries as stored.
const (
	OutboxPending   = "pending"
	OutboxPublished = "published"
	OutboxDead      = "dead"

	// DeliveryRelay rows are published to a broker by the relay.
	DeliveryRelay = "relay"
	// DeliveryDirect rows are consumed from the table by engine workers
	// (the Postgres-only transport).
	DeliveryDirect = "direct"
)

// InboxConsumerEngine is the inbox consumer name under which engine workers
// record step-scoped keys.
const InboxConsumerEngine = "sagaflow.engine"

// Saga is a row of saga_instances.
type Saga struct {
	ID            uuid.UUID
	Name          string
	BusinessKey   *string
	Status        string
	StepIndex     int
	StepName      string
	Direction     string
	Epoch         int
	Attempt       int
	State         []byte
	Version       int64
	NextCheckAt   *time.Time
	CommandID     *uuid.UUID
	AwaitingReply bool
	LastError     *string
	LastErrorCode *string
	FailedStep    *string
	CreatedAt     time.Time
	UpdatedAt     time.Time
	EndedAt       *time.Time
	// WaitKind is what the saga waits for at its current step (WaitTimer,
	// WaitSignal or WaitChild), nil when it does not wait; WaitFor names
	// the signal or the child saga; WaitUntil ends the wait, nil for none.
	WaitKind  *string
	WaitFor   *string
	WaitUntil *time.Time
	// DeadlineAt is when the whole saga must have ended, or nil.
	DeadlineAt *time.Time
	// ParentID, ParentName and ParentKey name, for a child saga, the saga
	// that started it and the key of its step that waits for it.
	ParentID   *uuid.UUID
	ParentName *string
	ParentKey  *string
	// TraceContext is the W3C trace context the saga was started under:
	// the traceparent value, then, when there is one, a newline and the
	// tracestate value. nil when the saga has none.
	TraceContext *string
	// DefVersion is the version of the saga's definition it runs on;
	// ParentVersion is, for a child saga, its parent's.
	DefVersion    int
	ParentVersion *int
	// ConcurrencyKey is the saga's concurrency key (concurrency.go), written
	// by StartSaga only.
	ConcurrencyKey *string
}

// Kinds of wait (saga_instances.wait_kind).
const (
	WaitTimer  = "timer"
	WaitSignal = "signal"
	WaitChild  = "child"
)

// History is a row of saga_history.
type History struct {
	ID        int64
	SagaID    uuid.UUID
	Event     string
	StepName  *string
	Direction *string
	Epoch     *int
	Attempt   *int
	Error     *string
	ErrorCode *string
	Detail    []byte
	At        time.Time
}

// Message is an outbox row to insert.
type Message struct {
	ID            uuid.UUID
	Topic         string
	Delivery      string // DeliveryRelay or DeliveryDirect
	AggregateType string
	AggregateID   string // the partition key
	Type          string
	Payload       []byte
	Headers       map[string]string
	SagaID        *uuid.UUID
	StepKey       *string
	Delay         time.Duration // available this long after the database's now()
}

// Claimed is a direct command claimed by an engine worker.
type Claimed struct {
	ID            uuid.UUID
	AggregateType string
	Type          string
	Payload       []byte
	SagaID        *uuid.UUID // the row's saga_id column
	Attempts      int
	Age           time.Duration // since the row was written, by the database's clock
	// MessageID is the message id as received, for a message from Kafka,
	// which may carry any string there.
	MessageID string
	// TraceParent and TraceState are the command's W3C trace context
	// headers, "" when absent; untrusted text.
	TraceParent, TraceState string
}

// IDText is c's message id as text: as received from Kafka, else the
// outbox row's id.
func (c *Claimed) IDText() string {
	if c.MessageID != "" {
		return c.MessageID
	}
	return c.ID.String()
}

// LockedSaga is a saga read by [Store.LockSagas].
type LockedSaga struct {
	Saga
	// Locked is true when this transaction holds the saga's execution lock.
	Locked bool
	// Processed is true when the inbox already holds the key of the saga's
	// current step, and the command being run has that key (the key of a
	// command in the outbox is its step_key column; of a command from
	// Kafka, the one given to [Store.LockSagas]).
	Processed bool
	// CancelRequest is the saga's pending cancel request, or nil.
	CancelRequest *CancelRequest
	// Paused is true while the saga, or its type, is paused (see
	// [Store.InsertPause]): its step commands must be held, not run.
	Paused bool
	// ReadAt is when the read that filled CancelRequest and Paused
	// returned; [Store.OperatorState] reads them again.
	ReadAt time.Time
}

// CancelRequest is a durable request to cancel a saga, recorded by
// [Store.RequestCancel] and deleted by the transition that applies it.
type CancelRequest struct {
	Epoch  int
	Reason string
	// Code is the error code the cancel records: "" for an operator's
	// request (the engine records its own cancel code).
	Code string
}

func cancelRequest(epoch *int, reason, code *string) *CancelRequest {
	if epoch == nil || reason == nil {
		return nil
	}
	r := &CancelRequest{Epoch: *epoch, Reason: *reason}
	if code != nil {
		r.Code = *code
	}
	return r
}

// Transition is a fenced update of a saga row with the rows that go with it:
// it applies only while the row still has version Version, and the history
// entries, inbox key and messages are written only if it applies.
type Transition struct {
	ID            uuid.UUID
	Version       int64
	Status        string
	StepIndex     int
	StepName      string
	Direction     string
	Epoch         int
	Attempt       int
	State         []byte // nil keeps the stored state
	CheckAfter    time.Duration
	LastError     *string
	LastErrorCode *string
	FailedStep    *string

	// AwaitingReply marks a saga whose step sent a command to another
	// service and waits for its reply.
	AwaitingReply bool
	// ExactDeadline sets next_check_at to exactly CheckAfter from now (a
	// reply timeout), instead of only moving it when it would come too
	// early.
	ExactDeadline bool

	History  []HistoryEntry
	Messages []Message
	// InboxConsumer and InboxKey, when InboxKey is set, record a processed
	// key with the transition.
	InboxConsumer, InboxKey string
	// EarlierInboxKeys are the engine's (InboxConsumerEngine) keys of steps
	// whose transitions this one carries too, written with it.
	EarlierInboxKeys []string
	// ClearCancel deletes the saga's cancel request with the transition:
	// the transition applies it, or refuses it.
	ClearCancel bool

	// WaitKind and WaitFor say what the saga waits for at its step ("" for
	// nothing); see [Saga]. They are cleared whatever they say when the
	// saga ends.
	WaitKind, WaitFor string
	// SetWaitUntil sets wait_until to WaitDelay from now, or to NULL when
	// WaitDelay is negative; otherwise a saga that still waits keeps its
	// wait_until. A wait without a time limit has no deadline for the
	// rescuer either (next_check_at is NULL): what it waits for wakes it.
	SetWaitUntil bool
	WaitDelay    time.Duration
	// Supersede deletes these pending outbox rows with the transition: a
	// wait's timer command that is no longer needed.
	Supersede []uuid.UUID
	// DeliverSignal, when not 0, marks that signal (its seq) delivered at
	// step DeliverStep (the step the saga leaves); with RejectSignal set,
	// it marks it rejected instead, with that reason (the step that took
	// it failed for good).
	DeliverSignal int64
	DeliverStep   string
	RejectSignal  string
	// Pause, when set, pauses the saga (kind PauseSaga) with the
	// transition, before its messages are written: its next command is
	// written held (a step that asked to pause when its retries ran out).
	Pause *Pause
	// EnterGroup, when set, starts the branches of the parallel step
	// EnterGroup.Step (their commands are among Messages).
	EnterGroup *GroupEntry
	// CancelBranches, when set, ends the still running branches of that
	// parallel step of the saga (in the transition's epoch).
	CancelBranches string
	// DefVersion, when not 0, moves the saga to that version of its
	// definition (a migration of in-flight sagas).
	DefVersion int
	// CancelChild, when set, records a cancel request for a child saga
	// that the saga no longer waits for (the caller adds, to Messages, a
	// command that makes an engine look at it).
	CancelChild *ChildCancel
}

// ChildCancel is a cancel request for a child saga, written with its
// parent's transition.
type ChildCancel struct {
	ID     uuid.UUID
	Reason string
	Code   string
}

// Store holds sagaflow's statements for one schema.
type Store struct {
	room    time.Duration // see SetDeadlineRoom
	schema  string
	channel string
	lockNS  int64
	q       statements
	ops     opsStatements
	w       waitStatements
}

type statements struct {
	startSaga, startSagaOne, sagaByKey, insertHistory, insertOutbox, insertOutboxNotify, notify, claimDirect, claimAndLock, lockSagas, lockSaga, updateSaga string
	insertInbox, recordInbox, recordInboxKeys, deleteDelivered, deferMessages, markDead, nextDue, getSaga                                                   string
	getSagaForUpdate, history, listBase                                                                                                                     string
	insertCancel, deleteCancel, cancelRequests, cancelRequest1, holdMessage, refuseCancel                                                                   string
	nextRelayDue, nextRelayDueInClaim                                                                                                                       string
	historyRows                                                                                                                                             [maxHistoryRows + 1]string
}

// maxHistoryRows is the most history entries one statement inserts.
const maxHistoryRows = 4

// sagaColumnList names the columns a [Saga] is read from. The deadline is
// read as [deadlineOf] (see [prefixColumns]).
const sagaColumnList = `id, saga_name, business_key, status, step_index, step_name, direction, epoch, attempt,
	state, version, next_check_at, command_id, awaiting_reply, last_error, last_error_code, failed_step, created_at, updated_at, ended_at,
	wait_kind, wait_for, wait_until, deadline_at, parent_id, parent_name, parent_key, trace_context, def_version, parent_version`

// deadlineOf is a saga's rescue deadline, from the table aliased p ("s."
// say, or ""): the later of next_check_at and due_at, and none when
// next_check_at is NULL (a saga that waits without a time limit, or for a
// concurrency slot). See migration 013.
func deadlineOf(p string) string {
	return "CASE WHEN " + p + "next_check_at IS NOT NULL THEN greatest(" + p + "next_check_at, " + p + "due_at) END"
}

// newDeadline is the deadline a transition gives a saga that goes on (see
// updateSaga): exactly $10 from now for a reply timeout ($17); else the
// current deadline when it is at least $10 and at most $10 plus twice the
// room ($11) away; else $10 plus the room from now. The upper bound keeps
// the promise that a lost command is found at most its step's timeout plus
// twice the room after it was written, also after a step with a longer
// timeout (found by review10).
//
// $10 and $11 are microseconds as bigint: `2 * $11` alone would type $11 as
// an int4, whose 2^31 microseconds are under 36 minutes, and a RescueSlack
// over that failed every transition.
var newDeadline = `CASE
				WHEN $17 THEN clock_timestamp() + $10::bigint * interval '1 microsecond'
				WHEN ` + deadlineOf("") + ` BETWEEN clock_timestamp() + $10::bigint * interval '1 microsecond'
						AND clock_timestamp() + ($10::bigint + 2 * $11::bigint) * interval '1 microsecond'
					THEN ` + deadlineOf("") + `
				ELSE clock_timestamp() + ($10::bigint + $11::bigint) * interval '1 microsecond' END`

// historyRows and messageRows expand parallel arrays into rows, so one
// statement shape serves any number of history entries and messages.
const historyRows = `unnest($%d::text[], $%d::text[], $%d::text[], $%d::int[], $%d::int[], $%d::text[], $%d::text[], $%d::text[])
	AS h(event, step_name, direction, epoch, attempt, error, error_code, detail)`
const messageRows = `unnest($%d::uuid[], $%d::text[], $%d::text[], $%d::text[], $%d::text[], $%d::text[], $%d::bytea[], $%d::text[], $%d::text[], $%d::int8[])
	AS m(id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, step_key, delay_us)`

func seq(from, n int) []any {
	out := make([]any, n)
	for i := range out {
		out[i] = from + i
	}
	return out
}

// New returns the statements for schema, which must pass [ValidateSchema].
func New(schema string) (*Store, error) {
	if err := ValidateSchema(schema); err != nil {
		return nil, err
	}
	s := quoteSchema(schema)
	h := fnv.New64a()
	h.Write([]byte("sagaflow.saga\x00" + schema))
	st := &Store{schema: schema, channel: schema + "_sagaflow", lockNS: int64(h.Sum64()), room: DeadlineRoomDefault}
	insertHistoryFrom := func(src string, first int) string {
		return `INSERT INTO ` + s + `.saga_history (saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail)
			SELECT ` + src + `.id, h.event, h.step_name, h.direction, h.epoch, h.attempt, h.error, h.error_code, h.detail::jsonb
			FROM ` + src + `, ` + fmt.Sprintf(historyRows, seq(first, 8)...)
	}
	insertMessagesFrom := func(src string, first int) string {
		return `INSERT INTO ` + s + `.outbox (id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, created_at, available_at)
			SELECT m.id, m.topic, m.delivery, m.aggregatetype, m.aggregateid, m.type, m.payload, m.headers::jsonb, ` + src + `.id,
				m.step_key, c.t, c.t + m.delay_us * interval '1 microsecond'
			FROM ` + src + `, (SELECT clock_timestamp() AS t) c, ` + fmt.Sprintf(messageRows, seq(first, 10)...)
	}
	st.ops = newOpsStatements(s)
	st.w = newWaitStatements(s)
	st.q = statements{
		// One statement starts a saga: row, first history entry, first
		// command and the wake-up, or nothing when the business key exists.
		startSaga: `WITH s AS (
				INSERT INTO ` + s + `.saga_instances
				(id, saga_name, business_key, status, step_index, step_name, direction, epoch, attempt, state, next_check_at, due_at, command_id,
				 deadline_at, parent_id, parent_name, parent_key, trace_context, concurrency_key, def_version, parent_version)
				VALUES ($1, $2, $3, $4, $5, $6, $7, 0, 0, $8, clock_timestamp() + $38::int8 * interval '1 microsecond',
				 clock_timestamp() + $9 * interval '1 microsecond', ($20::uuid[])[1],
				 clock_timestamp() + $30 * interval '1 microsecond', $31, $32, $33, $34::text, $35::text, $36::int, $37::int)
				ON CONFLICT DO NOTHING
				RETURNING id
			), h AS (` + insertHistoryFrom("s", 12) + `
			), o AS (` + insertMessagesFrom("s", 20) + `
			)
			SELECT s.id, CASE WHEN $10::text <> '' THEN pg_notify($10, $11) END FROM s`,
		// startSaga for the usual start: one history entry and one message,
		// as plain parameters rather than arrays to unnest (cheaper for the
		// server to plan and run).
		startSagaOne: `WITH s AS (
				INSERT INTO ` + s + `.saga_instances
				(id, saga_name, business_key, status, step_index, step_name, direction, epoch, attempt, state, next_check_at, due_at, command_id,
				 deadline_at, parent_id, parent_name, parent_key, trace_context, concurrency_key, def_version, parent_version)
				VALUES ($1, $2, $3, $4, $5, $6, $7, 0, 0, $8, clock_timestamp() + $38::int8 * interval '1 microsecond',
				 clock_timestamp() + $9 * interval '1 microsecond', $20::uuid,
				 clock_timestamp() + $30 * interval '1 microsecond', $31, $32, $33, $34::text, $35::text, $36::int, $37::int)
				ON CONFLICT DO NOTHING
				RETURNING id
			), h AS (
				INSERT INTO ` + s + `.saga_history (saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail)
				SELECT s.id, $12::text, $13::text, $14::text, $15::int, $16::int, $17::text, $18::text, $19::jsonb FROM s
			), o AS (
				INSERT INTO ` + s + `.outbox (id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, created_at, available_at)
				SELECT $20::uuid, $21::text, $22::text, $23::text, $24::text, $25::text, $26::bytea, $27::jsonb, s.id, $28::text,
					c.t, c.t + $29::int8 * interval '1 microsecond'
				FROM s, (SELECT clock_timestamp() AS t) c
			)
			SELECT s.id, CASE WHEN $10::text <> '' THEN pg_notify($10, $11) END FROM s`,
		sagaByKey: `SELECT id FROM ` + s + `.saga_instances WHERE saga_name = $1 AND business_key = $2`,
		insertHistory: `INSERT INTO ` + s + `.saga_history
			(saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		// One reading of the clock for both times, so available_at minus
		// created_at is exactly the delay.
		insertOutbox: `INSERT INTO ` + s + `.outbox
			(id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, created_at, available_at)
			SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, c.t, c.t + $11 * interval '1 microsecond'
			FROM (SELECT clock_timestamp() AS t) c`,
		notify: `SELECT pg_notify($1, $2)`,
		nextRelayDue: `SELECT EXTRACT(EPOCH FROM min(available_at) - now()) FROM ` + s + `.outbox
			WHERE status = 'pending' AND delivery = 'relay' AND available_at > now() - $1 * interval '1 microsecond'
				AND available_at > created_at AND available_at < 'infinity'`,
		// In the claim's transaction: now() is when the claim began. A
		// row held at 'infinity' (a paused saga's, a queued concurrency
		// key's) is not due at any time, and would fail the subtraction:
		// this statement runs before the claim's COMMIT.
		nextRelayDueInClaim: `SELECT EXTRACT(EPOCH FROM min(available_at) - clock_timestamp()) FROM ` + s + `.outbox
			WHERE status = 'pending' AND delivery = 'relay' AND available_at > now() AND available_at > created_at
				AND available_at < 'infinity'`,
		// Claim due direct commands of the sagas this engine knows; commands
		// of other sagas are left to engines that know them, until they are
		// older than the grace period ($4) and get parked.
		claimDirect: `SELECT id, aggregatetype, type, payload, saga_id, attempts, EXTRACT(EPOCH FROM now() - created_at)
			FROM ` + s + `.outbox
			WHERE topic = $1 AND delivery = 'direct' AND status = 'pending' AND available_at <= now()
				AND (aggregatetype = ANY($3) OR created_at < now() - $4 * interval '1 microsecond')
			ORDER BY available_at
			LIMIT $2
			FOR UPDATE SKIP LOCKED`,
		// ClaimDirect and LockSagas in one statement: claim the commands,
		// then, per claimed row, read its saga (by the row's saga_id), try
		// its execution lock and probe the inbox for the row's step key (its
		// step_key column, written from Go; Go then checks that it is the
		// saga's current step's key). The lateral join keeps the claim's
		// order and always probes the saga's primary key.
		claimAndLock: `SELECT c.id, c.aggregatetype, c.type, c.payload, c.saga_id, c.attempts, EXTRACT(EPOCH FROM now() - c.created_at),
				` + prefixColumns("s.") + `,
				-- A parallel step's branch takes a lock of its own, so that the
				-- branches of one saga run at once.
				pg_try_advisory_xact_lock(hashtextextended(CASE WHEN c.type = 'sagaflow.branch' THEN c.step_key ELSE s.id::text END, $5)),
				c.step_key, (SELECT true FROM ` + s + `.inbox i WHERE i.consumer = $6 AND i.key = c.step_key LIMIT 1) IS NOT NULL,
				r.epoch, r.reason, r.code, coalesce(c.headers->>'traceparent', ''), coalesce(c.headers->>'tracestate', ''),
				s.id IS NOT NULL AND ` + pausedSQL(s) + `
			FROM (SELECT id, aggregatetype, type, payload, saga_id, attempts, created_at, available_at, step_key, headers
				FROM ` + s + `.outbox
				WHERE topic = $1 AND delivery = 'direct' AND status = 'pending' AND available_at <= now()
					AND (aggregatetype = ANY($3) OR created_at < now() - $4 * interval '1 microsecond')
				ORDER BY available_at
				LIMIT $2
				FOR UPDATE SKIP LOCKED) c
			LEFT JOIN LATERAL (SELECT * FROM ` + s + `.saga_instances WHERE id = c.saga_id) s ON true
			LEFT JOIN ` + s + `.saga_cancel_requests r ON r.saga_id = s.id
			ORDER BY c.available_at`,
		// Read the claimed commands' sagas, take each saga's execution lock
		// without waiting (an advisory transaction lock: no extra commit,
		// gone with the transaction), and see whether the step key $4 (the
		// command's, computed in Go) is already in the inbox.
		// The inbox probe is a subquery with LIMIT 1 so that the planner
		// always probes the primary key; an EXISTS may be planned as a hash
		// of every key of the consumer when statistics are stale.
		// One saga by its primary key ($1 a uuid, not an array): with
		// `s.id = ANY($1)` PostgreSQL judged its generic plan dearer than a
		// plan for the array at hand and planned the statement afresh on
		// every execution (0.5 ms of server CPU, more than running it; one
		// per reply in the hybrid mode).
		lockSagas: `SELECT ` + prefixColumns("s.") + `, pg_try_advisory_xact_lock(hashtextextended(s.id::text, $2)),
				(SELECT true FROM ` + s + `.inbox i WHERE i.consumer = $3 AND i.key = $4 LIMIT 1) IS NOT NULL,
				r.epoch, r.reason, r.code, ` + pausedSQL(s) + `
			FROM ` + s + `.saga_instances s
			LEFT JOIN ` + s + `.saga_cancel_requests r ON r.saga_id = s.id
			WHERE s.id = $1`,
		// The fenced update. Times use clock_timestamp(), not the batch
		// transaction's start. The deadline (greatest(next_check_at,
		// due_at), see migration 013) only moves when it would come too
		// early, and then with room to spare. It moves in due_at, which has
		// no index; next_check_at, the rescuer's indexed lower bound, only
		// moves down (or to NULL when the saga ends or waits without a
		// limit). So a step that pushes the deadline later leaves every
		// indexed column alone, and PostgreSQL updates the row in place
		// (HOT) without touching its indexes.
		updateSaga: `UPDATE ` + s + `.saga_instances SET
			status = $3, step_index = $4, step_name = $5, direction = $6, epoch = $7, attempt = $8,
			state = COALESCE($9, state), version = version + 1,
			next_check_at = CASE
				WHEN $3 NOT IN ('running', 'compensating') THEN NULL
				WHEN $18::text IS NOT NULL AND $20 AND $21::int8 < 0 THEN NULL
				ELSE least(next_check_at, ` + newDeadline + `) END,
			due_at = CASE
				WHEN $3 NOT IN ('running', 'compensating') THEN NULL
				WHEN $18::text IS NOT NULL AND $20 AND $21::int8 < 0 THEN NULL
				ELSE ` + newDeadline + ` END,
			last_error = $12, last_error_code = $13, failed_step = $14, updated_at = clock_timestamp(),
			ended_at = CASE WHEN $3 IN ('running', 'compensating') THEN NULL ELSE clock_timestamp() END,
			command_id = $15, awaiting_reply = $16, def_version = COALESCE($22::int, def_version),
			wait_kind = CASE WHEN $3 IN ('running', 'compensating') THEN $18::text END,
			wait_for = CASE WHEN $3 IN ('running', 'compensating') AND $18::text IS NOT NULL THEN $19::text END,
			wait_until = CASE
				WHEN $3 NOT IN ('running', 'compensating') OR $18::text IS NULL THEN NULL
				WHEN NOT $20 THEN wait_until
				WHEN $21::int8 < 0 THEN NULL
				ELSE clock_timestamp() + $21::int8 * interval '1 microsecond' END
			WHERE id = $1 AND version = $2`,
		lockSaga:    `SELECT pg_advisory_xact_lock(hashtextextended($1::text, $2))`,
		insertInbox: `INSERT INTO ` + s + `.inbox (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		// A duplicate refreshes its key's processed_at: a message that keeps
		// coming back (outbox replays) keeps its key for another
		// InboxRetention. xmax is 0 only for a row this statement inserted.
		recordInbox: `INSERT INTO ` + s + `.inbox (consumer, key) VALUES ($1, $2)
			ON CONFLICT (consumer, key) DO UPDATE SET processed_at = now()
			RETURNING xmax = 0`,
		// recordInbox for several keys, none twice (DO UPDATE may not touch
		// a row twice in one statement).
		recordInboxKeys: `INSERT INTO ` + s + `.inbox (consumer, key) SELECT $1, k FROM unnest($2::text[]) AS k
			ON CONFLICT (consumer, key) DO UPDATE SET processed_at = now()
			RETURNING key, xmax = 0`,
		deleteDelivered: `DELETE FROM ` + s + `.outbox WHERE id = ANY($1)`,
		deferMessages: `WITH d AS (UPDATE ` + s + `.outbox SET attempts = attempts + 1,
				available_at = clock_timestamp() + least($2 * power(2, least(attempts, 20)), $3) * interval '1 microsecond',
				last_error = COALESCE($4, last_error)
				WHERE id = ANY($1)
				RETURNING available_at)
			SELECT EXTRACT(EPOCH FROM min(available_at) - clock_timestamp()) FROM d`,
		markDead: `UPDATE ` + s + `.outbox SET status = 'dead', last_error = $2, attempts = attempts + 1 WHERE id = $1`,
		// ORDER BY ... LIMIT 1 rather than min(): with statistics that
		// do not know the table's future commands yet (a burst of timers
		// before autovacuum analyzed it), the planner reads every one of
		// them for min(); here it reads the first index entry.
		nextDue: `SELECT EXTRACT(EPOCH FROM (SELECT available_at FROM ` + s + `.outbox
			WHERE topic = $1 AND delivery = 'direct' AND status = 'pending' AND available_at > now() - $4 * interval '1 microsecond'
				AND available_at > created_at AND available_at < 'infinity'
				AND (aggregatetype = ANY($2) OR created_at < available_at - $3 * interval '1 microsecond')
			ORDER BY available_at LIMIT 1) - now())`,
		getSaga:          `SELECT ` + sagaColumns + ` FROM ` + s + `.saga_instances WHERE id = $1`,
		getSagaForUpdate: `SELECT ` + sagaColumns + ` FROM ` + s + `.saga_instances WHERE id = $1 FOR NO KEY UPDATE`,
		history: `SELECT id, saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail, at
			FROM ` + s + `.saga_history WHERE saga_id = $1 ORDER BY id`,
		listBase: `SELECT ` + sagaColumns + ` FROM ` + s + `.saga_instances`,
		// A second request for the same saga keeps the first one's reason
		// and time; one for a later epoch replaces one left from an earlier
		// run. Reports whether this request is the one now recorded.
		insertCancel: `INSERT INTO ` + s + `.saga_cancel_requests (saga_id, epoch, reason, code) VALUES ($1, $2, $3, $4)
			ON CONFLICT (saga_id) DO UPDATE SET epoch = EXCLUDED.epoch, reason = EXCLUDED.reason, code = EXCLUDED.code, requested_at = now()
				WHERE saga_cancel_requests.epoch < EXCLUDED.epoch
			RETURNING true`,
		deleteCancel: `DELETE FROM ` + s + `.saga_cancel_requests WHERE saga_id = $1`,
		// Refusing a request deletes it and says why in the saga's history,
		// in one statement.
		refuseCancel: `WITH d AS (DELETE FROM ` + s + `.saga_cancel_requests WHERE saga_id = $1 RETURNING saga_id, epoch, reason)
			INSERT INTO ` + s + `.saga_history (saga_id, event, epoch, error, error_code, detail)
			SELECT d.saga_id, $2, d.epoch, d.reason, $3, jsonb_build_object('refused', $4::text) FROM d`,
		cancelRequests: `SELECT saga_id, epoch, reason, coalesce(code, '') FROM ` + s + `.saga_cancel_requests WHERE saga_id = ANY($1)`,
		// One saga's: on the key, so that PostgreSQL keeps a generic plan
		// (an array parameter is planned afresh each time; see lockSagas).
		cancelRequest1: `SELECT saga_id, epoch, reason, coalesce(code, '') FROM ` + s + `.saga_cancel_requests WHERE saga_id = $1`,
		// A Kafka command that cannot run yet leaves its partition for the
		// outbox, to be published again after a delay: held since $9 (the
		// first hold, in database time), or now; never later than now (least
		// ignores a NULL), so that a header forged into the future cannot
		// keep a message held past its grace. Nothing is written when it
		// has been held longer than $11: then it is parked instead.
		holdMessage: `INSERT INTO ` + s + `.outbox
			(id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, created_at, available_at, last_error)
			SELECT $1, $2, 'relay', $3, $4, $5, $6,
				$7::jsonb || jsonb_build_object('` + HeaderHeldSince + `', to_char(least($9, c.t) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),
				$8, NULL, c.t,
				-- The delay grows with the time held so far, up to $13.
				c.t + least(greatest($10 * interval '1 microsecond', (c.t - least($9, c.t)) / 2), $13 * interval '1 microsecond'), $12
			FROM (SELECT clock_timestamp() AS t) c
			WHERE $11::bigint <= 0 OR least($9, c.t) >= c.t - $11::bigint * interval '1 microsecond'
			RETURNING EXTRACT(EPOCH FROM available_at - created_at)`,
	}
	// The row and the relay's wake-up in one round trip; the notification
	// is delivered when the transaction commits.
	st.q.insertOutboxNotify = "WITH m AS (" + st.q.insertOutbox + " RETURNING topic) SELECT pg_notify($12, m.topic) FROM m"
	for n := 1; n <= maxHistoryRows; n++ {
		var vals []string
		for r := range n {
			b := r * 9
			vals = append(vals, fmt.Sprintf("($%d, $%d, $%d, $%d, $%d, $%d, $%d, $%d, $%d)", b+1, b+2, b+3, b+4, b+5, b+6, b+7, b+8, b+9))
		}
		st.q.historyRows[n] = `INSERT INTO ` + s + `.saga_history
			(saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail) VALUES ` + strings.Join(vals, ", ")
	}
	return st, nil
}

// sagaColumns is the select list of a [Saga].
var sagaColumns = prefixColumns("")

// prefixColumns is the select list of a [Saga] from the table aliased p
// ("s." say). A saga's deadline is read as [deadlineOf].
func prefixColumns(p string) string {
	cols := strings.Split(sagaColumnList, ",")
	for i, c := range cols {
		c = strings.TrimSpace(c)
		if c == "next_check_at" {
			cols[i] = deadlineOf(p)
			continue
		}
		cols[i] = p + c
	}
	return strings.Join(cols, ", ")
}

// Schema returns the schema the statements use.
func (s *Store) Schema() string { return s.schema }

// Channel returns the LISTEN/NOTIFY channel on which new direct commands are
// announced.
func (s *Store) Channel() string { return s.channel }

func micros(d time.Duration) int64 { return d.Microseconds() }

// StartSaga inserts a saga row with its history and messages (the
// Transition's History and Messages; its other fields are ignored) and, when
// notify is set, notifies the schema's channel of topic, in one statement. It reports false, and writes
// nothing, when a saga with the same name and business key, or the same id,
// exists; the caller's transaction stays usable either way.
//
// The saga's rescue deadline is checkAfter from now; its own deadline
// (deadline_at) is deadline from now, or none when deadline is 0. A child
// saga's sg names its parent (ParentID, ParentName, ParentKey).
func (s *Store) StartSaga(ctx context.Context, db DBTX, sg *Saga, check Check, deadline time.Duration, rows *Transition, topic string, notify bool) (bool, error) {
	if notify && DeferWake(ctx, s.channel, topic) {
		notify = false // the transaction's owner notifies after its commit
	}
	q, args := s.startSaga(sg, check, deadline, rows, topic, notify)
	tag, err := db.Exec(ctx, q, args...)
	if err != nil {
		return false, fmt.Errorf("store: start saga %s %s: %w", sg.Name, sg.ID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// QueueStartSaga queues on b the statement of [Store.StartSaga], without a
// notification: several starts then commit in one transaction (see
// pgx.Batch.BeginTx). Whether the saga was inserted is stored in *inserted
// when b's results are read.
func (s *Store) QueueStartSaga(b *pgx.Batch, sg *Saga, check Check, deadline time.Duration, rows *Transition, topic string, inserted *bool) {
	q, args := s.startSaga(sg, check, deadline, rows, topic, false)
	b.Queue(q, args...).Exec(func(tag pgconn.CommandTag) error {
		*inserted = tag.RowsAffected() == 1
		return nil
	})
}

// Check is a new saga's rescue deadline: At from now. From (at most At) is
// when the rescuer may first look at it (next_check_at, a lower bound; see
// migration 013): a first step whose transition pushes the deadline later
// then leaves the indexed column alone.
type Check struct{ From, At time.Duration }

// startSaga returns the statement that starts sg, and its arguments.
func (s *Store) startSaga(sg *Saga, check Check, deadline time.Duration, rows *Transition, topic string, notify bool) (string, []any) {
	channel := ""
	if notify {
		channel = s.channel
	}
	args := []any{pgID(sg.ID), sg.Name, sg.BusinessKey, sg.Status, sg.StepIndex, sg.StepName, sg.Direction, sg.State,
		micros(check.At), channel, topic}
	q := s.q.startSaga
	if len(rows.History) == 1 && len(rows.Messages) == 1 {
		q = s.q.startSagaOne
		h, m := &rows.History[0], &rows.Messages[0]
		var detail *string
		if h.Detail != nil {
			d := string(h.Detail)
			detail = &d
		}
		a := s.outboxArgs(m)
		headers, _ := json.Marshal(a[7]) // map[string]string always encodes
		args = append(args, h.Event, nullStr(h.StepName), nullStr(h.Direction), int32(h.Epoch), int32(h.Attempt),
			nullStr(h.Error), nullStr(h.ErrorCode), detail,
			a[0], a[1], a[2], a[3], a[4], a[5], a[6], string(headers), a[9], a[10])
	} else {
		args = append(args, historyArrays(rows.History)...)
		args = append(args, messageArrays(rows.Messages)...)
	}
	var deadlineUS *int64
	if deadline > 0 {
		d := micros(deadline)
		deadlineUS = &d
	}
	args = append(args, deadlineUS, pgIDPtr(sg.ParentID), sg.ParentName, sg.ParentKey, sg.TraceContext, sg.ConcurrencyKey,
		int32(max(sg.DefVersion, 1)), sg.ParentVersion, micros(min(max(check.From, 0), check.At)))
	return q, args
}

func historyArrays(hs []HistoryEntry) []any {
	var ev, step, dir, errs, codes, detail []*string
	var epoch, attempt []int32
	for i := range hs {
		h := &hs[i]
		ev = append(ev, &h.Event)
		step = append(step, nullStr(h.StepName))
		dir = append(dir, nullStr(h.Direction))
		epoch = append(epoch, int32(h.Epoch))
		attempt = append(attempt, int32(h.Attempt))
		errs = append(errs, nullStr(h.Error))
		codes = append(codes, nullStr(h.ErrorCode))
		var d *string
		if h.Detail != nil {
			t := string(h.Detail)
			d = &t
		}
		detail = append(detail, d)
	}
	return []any{ev, step, dir, epoch, attempt, errs, codes, detail}
}

func messageArrays(ms []Message) []any {
	var ids [][16]byte
	var topic, delivery, aggType, aggID, typ, headers []string
	var stepKey []*string
	var payload [][]byte
	var delay []int64
	for i := range ms {
		m := &ms[i]
		ids = append(ids, m.ID)
		topic = append(topic, m.Topic)
		d := m.Delivery
		if d == "" {
			d = DeliveryRelay
		}
		delivery = append(delivery, d)
		aggType = append(aggType, m.AggregateType)
		aggID = append(aggID, m.AggregateID)
		typ = append(typ, m.Type)
		payload = append(payload, m.Payload)
		h := m.Headers
		if h == nil {
			h = map[string]string{}
		}
		hj, _ := json.Marshal(h) // map[string]string always encodes
		headers = append(headers, string(hj))
		stepKey = append(stepKey, m.StepKey)
		delay = append(delay, micros(m.Delay))
	}
	return []any{ids, topic, delivery, aggType, aggID, typ, payload, headers, stepKey, delay}
}

// SagaIDByKey returns the id of the saga with the given name and business key.
func (s *Store) SagaIDByKey(ctx context.Context, db DBTX, name, key string) (uuid.UUID, error) {
	var id uuid.UUID
	err := db.QueryRow(ctx, s.q.sagaByKey, name, key).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return uuid.Nil, ErrNotFound
	}
	if err != nil {
		return uuid.Nil, fmt.Errorf("store: saga %s by key %q: %w", name, key, err)
	}
	return id, nil
}

// HistoryEntry is a history row to insert.
type HistoryEntry struct {
	SagaID    uuid.UUID
	Event     string
	StepName  string
	Direction string
	Epoch     int
	Attempt   int
	Error     string
	ErrorCode string
	Detail    []byte // JSON, may be nil
}

func (s *Store) historyArgs(h *HistoryEntry) []any {
	var detail any
	if h.Detail != nil {
		detail = h.Detail
	}
	return []any{pgID(h.SagaID), h.Event, nullStr(h.StepName), nullStr(h.Direction), h.Epoch, h.Attempt,
		nullStr(h.Error), nullStr(h.ErrorCode), detail}
}

// InsertHistory appends a history entry.
func (s *Store) InsertHistory(ctx context.Context, db DBTX, h *HistoryEntry) error {
	if _, err := db.Exec(ctx, s.q.insertHistory, s.historyArgs(h)...); err != nil {
		return fmt.Errorf("store: insert history for saga %s: %w", h.SagaID, err)
	}
	return nil
}

func (s *Store) outboxArgs(m *Message) []any {
	headers := m.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	delivery := m.Delivery
	if delivery == "" {
		delivery = DeliveryRelay
	}
	return []any{pgID(m.ID), m.Topic, delivery, m.AggregateType, m.AggregateID, m.Type, m.Payload, headers,
		pgIDPtr(m.SagaID), m.StepKey, micros(m.Delay)}
}

// InsertMessage inserts an outbox row.
func (s *Store) InsertMessage(ctx context.Context, db DBTX, m *Message) error {
	if _, err := db.Exec(ctx, s.q.insertOutbox, s.outboxArgs(m)...); err != nil {
		return fmt.Errorf("store: insert outbox message %s (topic %s): %w", m.ID, m.Topic, err)
	}
	return nil
}

// InsertMessageNotify inserts an outbox row and notifies [Store.Channel] of
// its topic, in one statement: the relay wakes when the transaction
// commits. When ctx carries [Wakes] (the transaction's owner notifies after
// its commit), the notification is recorded there instead.
func (s *Store) InsertMessageNotify(ctx context.Context, db DBTX, m *Message) error {
	if DeferWake(ctx, s.channel, m.Topic) {
		return s.InsertMessage(ctx, db, m)
	}
	if _, err := db.Exec(ctx, s.q.insertOutboxNotify, append(s.outboxArgs(m), s.channel)...); err != nil {
		return fmt.Errorf("store: insert outbox message %s (topic %s): %w", m.ID, m.Topic, err)
	}
	return nil
}

// Notify announces new direct commands on [Store.Channel]; PostgreSQL delivers
// the notification when the transaction commits.
func (s *Store) Notify(ctx context.Context, db DBTX, topic string) error {
	if _, err := db.Exec(ctx, s.q.notify, s.channel, topic); err != nil {
		return fmt.Errorf("store: notify %s: %w", s.channel, err)
	}
	return nil
}

// ClaimDirect locks up to limit due direct commands of topic for the
// transaction tx, skipping rows other workers hold. It claims commands whose
// aggregatetype is in known, and any command older than grace.
func (s *Store) ClaimDirect(ctx context.Context, tx pgx.Tx, topic string, limit int, known []string, grace time.Duration) ([]Claimed, error) {
	rows, err := tx.Query(ctx, s.q.claimDirect, topic, limit, known, micros(grace))
	if err != nil {
		return nil, fmt.Errorf("store: claim commands on %s: %w", topic, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Claimed, error) {
		var c Claimed
		var age float64
		err := r.Scan(&c.ID, &c.AggregateType, &c.Type, &c.Payload, &c.SagaID, &c.Attempts, &age)
		c.Age = time.Duration(age * float64(time.Second))
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: claim commands on %s: %w", topic, err)
	}
	return out, nil
}

// QueueClaimAndLock queues on q (after a BEGIN queued with it, say) what
// [Store.ClaimDirect] and then [Store.LockSagas] do, in one statement: it
// claims up to limit due direct commands and reads the saga each claimed
// row names in its saga_id column, trying the saga's execution lock.
// *claimed and *sagas hold the result once q was sent and its results
// closed without an error; sagas that do not exist are absent from *sagas.
func (s *Store) QueueClaimAndLock(q *pgx.Batch, topic string, limit int, known []string, grace time.Duration,
	claimed *[]Claimed, sagas *map[uuid.UUID]*LockedSaga) {
	q.Queue(s.q.claimAndLock, topic, limit, known, micros(grace), s.lockNS, InboxConsumerEngine).Query(func(rows pgx.Rows) error {
		var err error
		*claimed, *sagas, err = scanClaimAndLock(rows, topic, limit)
		return err
	})
}

func scanClaimAndLock(rows pgx.Rows, topic string, limit int) ([]Claimed, map[uuid.UUID]*LockedSaga, error) {
	defer rows.Close()
	var claimed []Claimed
	sagas := make(map[uuid.UUID]*LockedSaga, limit)
	var n nullSaga
	dest := n.dest()
	for rows.Next() {
		var c Claimed
		var age float64
		var sagaID pgtype.UUID
		var locked *bool
		var stepKey *string
		var processed bool
		var cancelEpoch *int
		var cancelReason, cancelCode *string
		var paused bool
		n = nullSaga{} // pgx fills the pointees it finds: never share them between rows
		args := append([]any{(*[16]byte)(&c.ID), &c.AggregateType, &c.Type, &c.Payload, &sagaID, &c.Attempts, &age}, dest...)
		if err := rows.Scan(append(args, &locked, &stepKey, &processed, &cancelEpoch, &cancelReason, &cancelCode, &c.TraceParent, &c.TraceState, &paused)...); err != nil {
			return nil, nil, fmt.Errorf("store: claim commands on %s: %w", topic, err)
		}
		c.Age = time.Duration(age * float64(time.Second))
		c.SagaID = fromPgID(sagaID)
		claimed = append(claimed, c)
		if !n.ID.Valid {
			continue
		}
		ls := sagas[n.ID.Bytes]
		if ls == nil {
			ls = &LockedSaga{Saga: n.saga(), Locked: locked != nil && *locked, CancelRequest: cancelRequest(cancelEpoch, cancelReason, cancelCode),
				Paused: paused, ReadAt: time.Now()}
			sagas[ls.ID] = ls
		}
		if processed && stepKey != nil && *stepKey == currentKey(&ls.Saga) {
			ls.Processed = true
		}
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("store: claim commands on %s: %w", topic, err)
	}
	return claimed, sagas, nil
}

// nullSaga scans the columns of a saga that may be absent (an outer join).
type nullSaga struct {
	ID                                   pgtype.UUID
	Name, Status, StepName, Direction    *string
	StepIndex, Epoch, Attempt            *int
	Version                              *int64
	AwaitingReply                        *bool
	BusinessKey                          *string
	State                                []byte
	NextCheckAt, EndedAt                 *time.Time
	CreatedAt, UpdatedAt                 *time.Time
	CommandID                            pgtype.UUID
	LastError, LastErrorCode, FailedStep *string
	WaitKind, WaitFor                    *string
	WaitUntil, DeadlineAt                *time.Time
	ParentID                             pgtype.UUID
	ParentName, ParentKey                *string
	TraceContext                         *string
	DefVersion                           *int
	ParentVersion                        *int
}

func (n *nullSaga) dest() []any {
	return []any{&n.ID, &n.Name, &n.BusinessKey, &n.Status, &n.StepIndex, &n.StepName, &n.Direction,
		&n.Epoch, &n.Attempt, &n.State, &n.Version, &n.NextCheckAt, &n.CommandID, &n.AwaitingReply, &n.LastError, &n.LastErrorCode,
		&n.FailedStep, &n.CreatedAt, &n.UpdatedAt, &n.EndedAt,
		&n.WaitKind, &n.WaitFor, &n.WaitUntil, &n.DeadlineAt, &n.ParentID, &n.ParentName, &n.ParentKey, &n.TraceContext,
		&n.DefVersion, &n.ParentVersion}
}

// saga returns the scanned saga; n.ID must be valid. The NOT NULL columns
// are never nil when the id is not.
func (n *nullSaga) saga() Saga {
	sg := Saga{ID: n.ID.Bytes, Name: *n.Name, BusinessKey: n.BusinessKey, Status: *n.Status, StepIndex: *n.StepIndex,
		StepName: *n.StepName, Direction: *n.Direction, Epoch: *n.Epoch, Attempt: *n.Attempt, Version: *n.Version,
		NextCheckAt: n.NextCheckAt, CommandID: fromPgID(n.CommandID), AwaitingReply: *n.AwaitingReply, LastError: n.LastError,
		LastErrorCode: n.LastErrorCode, FailedStep: n.FailedStep, CreatedAt: *n.CreatedAt, UpdatedAt: *n.UpdatedAt, EndedAt: n.EndedAt,
		WaitKind: n.WaitKind, WaitFor: n.WaitFor, WaitUntil: n.WaitUntil, DeadlineAt: n.DeadlineAt, ParentID: fromPgID(n.ParentID),
		ParentName: n.ParentName, ParentKey: n.ParentKey,
		TraceContext: n.TraceContext, DefVersion: *n.DefVersion, ParentVersion: n.ParentVersion}
	sg.State = append([]byte(nil), n.State...)
	return sg
}

// LockSagas reads the given sagas as described on [LockedSaga]. It never
// waits for a lock. Sagas that do not exist are absent from the result.
// stepKey is the step key of the command the caller runs, or "": a saga is
// Processed when stepKey is its current step's key and the inbox holds it.
// Each saga is one statement, all sent in one round trip.
func (s *Store) LockSagas(ctx context.Context, tx pgx.Tx, ids []uuid.UUID, stepKey string) (map[uuid.UUID]*LockedSaga, error) {
	out := make(map[uuid.UUID]*LockedSaga, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	b := &pgx.Batch{}
	for _, id := range ids {
		s.QueueLockSaga(b, id, stepKey, out)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("store: lock sagas: %w", err)
	}
	return out, nil
}

// QueueLockSaga queues on b the read of saga id as [Store.LockSagas] makes
// it, into out[id] (left unset when the saga does not exist).
func (s *Store) QueueLockSaga(b *pgx.Batch, id uuid.UUID, stepKey string, out map[uuid.UUID]*LockedSaga) {
	b.Queue(s.q.lockSagas, id, s.lockNS, InboxConsumerEngine, stepKey).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			ls := &LockedSaga{}
			var cancelEpoch *int
			var cancelReason, cancelCode *string
			if err := rows.Scan(append(sagaDest(&ls.Saga), &ls.Locked, &ls.Processed, &cancelEpoch, &cancelReason, &cancelCode, &ls.Paused)...); err != nil {
				return fmt.Errorf("store: lock saga %s: %w", id, err)
			}
			ls.CancelRequest = cancelRequest(cancelEpoch, cancelReason, cancelCode)
			ls.ReadAt = time.Now()
			ls.Processed = ls.Processed && stepKey != "" && stepKey == currentKey(&ls.Saga)
			out[ls.ID] = ls
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("store: lock saga %s: %w", id, err)
		}
		return nil
	})
}

// currentKey is the step key of sg's current step, written by package wire:
// the only encoder of step keys (SQL compares keys, never builds them).
func currentKey(sg *Saga) string {
	return wire.Key{SagaID: wire.UUID(sg.ID), Step: sg.StepName, Direction: wire.Direction(sg.Direction), Epoch: sg.Epoch}.String()
}

// LockSaga waits for a saga's execution lock and holds it until tx ends.
func (s *Store) LockSaga(ctx context.Context, tx pgx.Tx, id uuid.UUID) error {
	if _, err := tx.Exec(ctx, s.q.lockSaga, id, s.lockNS); err != nil {
		return fmt.Errorf("store: lock saga %s: %w", id, err)
	}
	return nil
}

// DeadlineRoomDefault is added when a saga's deadline has to move, so that
// the next steps of a quick saga can leave it where it is (see
// [Store.SetDeadlineRoom]).
const DeadlineRoomDefault = time.Minute

// SetDeadlineRoom sets the room added when a transition moves a saga's
// deadline; an engine sets it to its RescueSlack, so that short rescue
// settings rescue sooner. Call it before the store is used.
func (s *Store) SetDeadlineRoom(d time.Duration) {
	if d > 0 {
		s.room = d
	}
}

// QueueTransition queues the fenced transition t on b: the saga update, then
// its history entries, inbox key and messages. The returned query's
// RowsAffected is 1 when the fence held and 0 when the saga had moved on; in
// that case the other statements may still have run, and the caller must
// roll them back (to a savepoint taken before).
func (s *Store) QueueTransition(b *pgx.Batch, t *Transition) *pgx.QueuedQuery {
	var state any
	if t.State != nil {
		state = t.State
	}
	var commandID pgtype.UUID
	if len(t.Messages) > 0 {
		commandID = pgIDPtr(&t.Messages[len(t.Messages)-1].ID)
	}
	waitUS := micros(t.WaitDelay)
	if t.WaitDelay < 0 {
		waitUS = -1 // no time limit; a delay under a microsecond would round to 0
	}
	args := []any{pgID(t.ID), t.Version, t.Status, t.StepIndex, t.StepName, t.Direction, t.Epoch, t.Attempt,
		state, micros(t.CheckAfter), micros(s.room), t.LastError, t.LastErrorCode, t.FailedStep, commandID, t.AwaitingReply,
		t.ExactDeadline, nullStr(t.WaitKind), nullStr(t.WaitFor), t.SetWaitUntil, waitUS, defVersion(t.DefVersion)}
	q := b.Queue(s.q.updateSaga, args...)
	for rest := t.History; len(rest) > 0; {
		n := min(len(rest), maxHistoryRows)
		var args []any
		for i := range rest[:n] {
			args = append(args, s.historyArgs(&rest[i])...)
		}
		b.Queue(s.q.historyRows[n], args...)
		rest = rest[n:]
	}
	for _, k := range t.EarlierInboxKeys {
		b.Queue(s.q.insertInbox, InboxConsumerEngine, k)
	}
	if t.InboxKey != "" {
		b.Queue(s.q.insertInbox, t.InboxConsumer, t.InboxKey)
	}
	if t.ClearCancel {
		b.Queue(s.q.deleteCancel, pgID(t.ID))
	}
	if len(t.Supersede) > 0 {
		b.Queue(s.w.deletePending, pgIDs(t.Supersede))
	}
	if t.DeliverSignal != 0 {
		b.Queue(s.w.deliverSignal, t.DeliverSignal, t.DeliverStep, t.Epoch, nullStr(t.RejectSignal))
	}
	if c := t.CancelChild; c != nil {
		b.Queue(s.w.cancelChild, pgID(c.ID), c.Reason, c.Code, EventCancelRequested)
	}
	if g := t.EnterGroup; g != nil {
		s.QueueEnterGroup(b, t.ID, t.Epoch, g.Step, g.Branches)
	}
	if t.CancelBranches != "" {
		s.QueueCancelBranches(b, t.ID, t.Epoch, t.CancelBranches)
	}
	if p := t.Pause; p != nil {
		b.Queue(s.insertSagaPauseSQL(), pgID(t.ID), p.SagaName, p.Code, p.Reason, p.StepName)
	}
	for i := range t.Messages {
		b.Queue(s.q.insertOutbox, s.outboxArgs(&t.Messages[i])...)
	}
	return q
}

// ApplyTransition runs the transition t inside tx and reports whether the
// fence held. When it did not, it rolls back to savepoint, which the caller
// must have taken before.
func (s *Store) ApplyTransition(ctx context.Context, tx pgx.Tx, t *Transition, savepoint string) (bool, error) {
	b := &pgx.Batch{}
	fenced := false
	s.QueueTransition(b, t).Exec(func(tag pgconn.CommandTag) error {
		fenced = tag.RowsAffected() == 1
		return nil
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return false, fmt.Errorf("store: update saga %s at version %d: %w", t.ID, t.Version, err)
	}
	if !fenced {
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+pgx.Identifier{savepoint}.Sanitize()); err != nil {
			return false, fmt.Errorf("store: roll back fenced update of saga %s: %w", t.ID, err)
		}
	}
	return fenced, nil
}

// InsertInboxKey records key for consumer. It reports false when the key was
// already recorded (the message or step was processed before).
//
// A duplicate moves the key's processed_at to now, so retention keeps the key
// for as long as the message keeps being delivered.
func (s *Store) InsertInboxKey(ctx context.Context, db DBTX, consumer, key string) (bool, error) {
	var inserted bool
	if err := db.QueryRow(ctx, s.q.recordInbox, consumer, key).Scan(&inserted); err != nil {
		return false, fmt.Errorf("store: record inbox key %q for %s: %w", key, consumer, err)
	}
	return inserted, nil
}

// InsertInboxKeys is [Store.InsertInboxKey] for several keys of consumer in
// one statement: it returns the keys that were new. keys must not repeat.
func (s *Store) InsertInboxKeys(ctx context.Context, db DBTX, consumer string, keys []string) (map[string]bool, error) {
	rows, err := db.Query(ctx, s.q.recordInboxKeys, consumer, keys)
	if err != nil {
		return nil, fmt.Errorf("store: record %d inbox keys for %s: %w", len(keys), consumer, err)
	}
	fresh := make(map[string]bool, len(keys))
	var key string
	var inserted bool
	if _, err := pgx.ForEachRow(rows, []any{&key, &inserted}, func() error {
		if inserted {
			fresh[key] = true
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("store: record %d inbox keys for %s: %w", len(keys), consumer, err)
	}
	return fresh, nil
}

// QueueInsertInboxKey queues on b the insert of [Store.InsertInboxKey];
// *inserted is set when b's results are read.
func (s *Store) QueueInsertInboxKey(b *pgx.Batch, consumer, key string, inserted *bool) {
	b.Queue(s.q.recordInbox, consumer, key).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(inserted); err != nil {
			return fmt.Errorf("store: record inbox key %q for %s: %w", key, consumer, err)
		}
		return nil
	})
}

// QueueDeleteDelivered queues the deletion of consumed direct commands on
// b. A consumed command's record is the saga's history; deleting it leaves
// no index entries behind.
func (s *Store) QueueDeleteDelivered(b *pgx.Batch, ids []uuid.UUID) {
	b.Queue(s.q.deleteDelivered, pgIDs(ids))
}

// QueueDefer queues on b the deferral of the outbox rows ids: each is due
// again after delay, doubled per attempt it has had, at most maxDelay;
// reason (when not empty) becomes its last error. due is called with how
// long until the first of them is due (when one was deferred).
func (s *Store) QueueDefer(b *pgx.Batch, ids []uuid.UUID, delay, maxDelay time.Duration, reason string, due func(time.Duration)) {
	b.Queue(s.q.deferMessages, pgIDs(ids), micros(delay), micros(maxDelay), nullStr(reason)).QueryRow(func(row pgx.Row) error {
		var secs *float64
		if err := row.Scan(&secs); err != nil {
			return fmt.Errorf("store: defer %d commands: %w", len(ids), err)
		}
		if secs != nil {
			due(max(time.Duration(*secs*float64(time.Second)), time.Millisecond))
		}
		return nil
	})
}

// MarkDead parks an outbox row with the reason it cannot be processed.
func (s *Store) MarkDead(ctx context.Context, db DBTX, id uuid.UUID, reason string) error {
	if _, err := db.Exec(ctx, s.q.markDead, id, reason); err != nil {
		return fmt.Errorf("store: park outbox message %s: %w", id, err)
	}
	return nil
}

// NextDirectDue returns how long until the next direct command of topic that
// [Store.ClaimDirect] would claim with known and grace becomes due, by the
// database's clock; zero or less for one that came due in the last since
// (the time since the caller's last claim began, which it did not take).
// Commands due before that (held by other workers when the caller claimed)
// do not count, nor commands written due at once, whose writers announce
// them. ok is false when there is none.
func (s *Store) NextDirectDue(ctx context.Context, db DBTX, topic string, known []string, grace, since time.Duration) (d time.Duration, ok bool, err error) {
	var secs *float64
	if err := db.QueryRow(ctx, s.q.nextDue, topic, known, micros(grace), micros(since)).Scan(&secs); err != nil {
		return 0, false, fmt.Errorf("store: next due command on %s: %w", topic, err)
	}
	if secs == nil {
		return 0, false, nil
	}
	return time.Duration(*secs * float64(time.Second)), true, nil
}

func sagaDest(sg *Saga) []any {
	return []any{&sg.ID, &sg.Name, &sg.BusinessKey, &sg.Status, &sg.StepIndex, &sg.StepName, &sg.Direction,
		&sg.Epoch, &sg.Attempt, &sg.State, &sg.Version, &sg.NextCheckAt, &sg.CommandID, &sg.AwaitingReply, &sg.LastError, &sg.LastErrorCode,
		&sg.FailedStep, &sg.CreatedAt, &sg.UpdatedAt, &sg.EndedAt,
		&sg.WaitKind, &sg.WaitFor, &sg.WaitUntil, &sg.DeadlineAt, &sg.ParentID, &sg.ParentName, &sg.ParentKey, &sg.TraceContext,
		&sg.DefVersion, &sg.ParentVersion}
}

// GetSaga reads a saga row; forUpdate also locks it until the transaction
// ends. It returns [ErrNotFound] when there is no such saga.
func (s *Store) GetSaga(ctx context.Context, db DBTX, id uuid.UUID, forUpdate bool) (*Saga, error) {
	q := s.q.getSaga
	if forUpdate {
		q = s.q.getSagaForUpdate
	}
	sg := &Saga{}
	err := db.QueryRow(ctx, q, id).Scan(sagaDest(sg)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("store: saga %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: load saga %s: %w", id, err)
	}
	return sg, nil
}

// History returns a saga's history in order.
func (s *Store) History(ctx context.Context, db DBTX, id uuid.UUID) ([]History, error) {
	rows, err := db.Query(ctx, s.q.history, id)
	if err != nil {
		return nil, fmt.Errorf("store: history of saga %s: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (History, error) {
		var h History
		err := r.Scan(&h.ID, &h.SagaID, &h.Event, &h.StepName, &h.Direction, &h.Epoch, &h.Attempt,
			&h.Error, &h.ErrorCode, &h.Detail, &h.At)
		return h, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: history of saga %s: %w", id, err)
	}
	return out, nil
}

// ListFilter selects sagas for [Store.ListSagas]. Zero fields do not filter.
type ListFilter struct {
	Name          string
	Statuses      []string
	BusinessKey   string
	CreatedAfter  time.Time // inclusive
	CreatedBefore time.Time // exclusive
	EndedAfter    time.Time // inclusive
	EndedBefore   time.Time // exclusive
	FailedStep    string
	ErrorCode     string
	Waiting       bool // only sagas that wait
	// Concurrency keys (concurrency.go): sagas with this key; only waiting ones.
	ConcurrencyKey string
	Queued         bool
	Paused         bool   // only sagas paused, by themselves or by their type
	Cursor         string // from a previous page's NextCursor
	Limit          int
	// IDs, when set, keeps only these sagas.
	IDs []uuid.UUID
}

// ListSagas returns sagas matching f, newest first, and the cursor of the next
// page ("" when this is the last).
func (s *Store) ListSagas(ctx context.Context, db DBTX, f ListFilter) ([]Saga, string, error) {
	var where []string
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	if f.Name != "" {
		where = append(where, "saga_name = "+arg(f.Name))
	}
	if f.IDs != nil {
		where = append(where, "id = ANY("+arg(binaryUUIDs(f.IDs))+"::uuid[])")
	}
	if len(f.Statuses) > 0 {
		where = append(where, "status = ANY("+arg(f.Statuses)+")")
	}
	if f.BusinessKey != "" {
		where = append(where, "business_key = "+arg(f.BusinessKey))
	}
	if !f.CreatedAfter.IsZero() {
		where = append(where, "created_at >= "+arg(f.CreatedAfter))
	}
	if !f.CreatedBefore.IsZero() {
		where = append(where, "created_at < "+arg(f.CreatedBefore))
	}
	if !f.EndedAfter.IsZero() {
		where = append(where, "ended_at >= "+arg(f.EndedAfter))
	}
	if !f.EndedBefore.IsZero() {
		where = append(where, "ended_at < "+arg(f.EndedBefore))
	}
	if f.FailedStep != "" {
		where = append(where, "failed_step = "+arg(f.FailedStep))
	}
	if f.ErrorCode != "" {
		where = append(where, "last_error_code = "+arg(f.ErrorCode))
	}
	if f.Waiting {
		where = append(where, "wait_kind IS NOT NULL")
	}
	where = s.concurrencyFilter(where, f, arg)
	if f.Paused {
		p := quoteSchema(s.schema) + ".saga_pauses"
		where = append(where, "(status IN ('running', 'compensating') AND (id IN (SELECT saga_id FROM "+p+" WHERE kind = 'saga')"+
			" OR saga_name IN (SELECT saga_name FROM "+p+" WHERE kind = 'type')))")
	}
	if f.Cursor != "" {
		at, id, err := decodeCursor(f.Cursor)
		if err != nil {
			return nil, "", err
		}
		where = append(where, "(created_at, id) < ("+arg(at)+", "+arg(id)+")")
	}
	q := s.q.listBase
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	q += " ORDER BY created_at DESC, id DESC LIMIT " + arg(f.Limit+1)
	out, err := querySagas(ctx, db, "list sagas", q, args...)
	if err != nil {
		return nil, "", err
	}
	next := ""
	if len(out) > f.Limit {
		out = out[:f.Limit]
		last := out[len(out)-1]
		next = encodeCursor(last.CreatedAt, last.ID)
	}
	return out, next, nil
}

// querySagas runs q, whose select list is [prefixColumns]'s, and reads
// the sagas it returns; what names the query in its error.
func querySagas(ctx context.Context, db DBTX, what, q string, args ...any) ([]Saga, error) {
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("store: %s: %w", what, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Saga, error) {
		var sg Saga
		return sg, r.Scan(sagaDest(&sg)...)
	})
	if err != nil {
		return nil, fmt.Errorf("store: %s: %w", what, err)
	}
	return out, nil
}

func encodeCursor(at time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(at.UTC().Format(time.RFC3339Nano) + "|" + id.String()))
}

func decodeCursor(c string) (time.Time, uuid.UUID, error) {
	raw, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return time.Time{}, uuid.Nil, fmt.Errorf("%w %q", ErrMalformedCursor, c)
	}
	ts, idText, ok := strings.Cut(string(raw), "|")
	at, err1 := time.Parse(time.RFC3339Nano, ts)
	id, err2 := uuid.Parse(idText)
	if !ok || err1 != nil || err2 != nil {
		return time.Time{}, uuid.Nil, fmt.Errorf("%w %q", ErrMalformedCursor, c)
	}
	return at, id, nil
}

func nullStr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// pgID, pgIDPtr and pgIDs hand uuids to pgx as bytes: a uuid.UUID is a
// driver.Valuer, which pgx turns into text and parses back for every
// parameter, at a cost that shows in the engine's profile.
func pgID(id uuid.UUID) [16]byte { return id }

func pgIDPtr(id *uuid.UUID) pgtype.UUID {
	if id == nil {
		return pgtype.UUID{}
	}
	return pgtype.UUID{Bytes: *id, Valid: true}
}

func pgIDs(ids []uuid.UUID) [][16]byte {
	out := make([][16]byte, len(ids))
	for i, id := range ids {
		out[i] = id
	}
	return out
}

func fromPgID(id pgtype.UUID) *uuid.UUID {
	if !id.Valid {
		return nil
	}
	u := uuid.UUID(id.Bytes)
	return &u
}

// RequestCancel records a durable request to cancel saga id in its epoch,
// in db's transaction. It reports false when a request for the saga was
// already pending (the first one is kept).
func (s *Store) RequestCancel(ctx context.Context, db DBTX, id uuid.UUID, epoch int, reason, code string) (bool, error) {
	var recorded bool
	err := db.QueryRow(ctx, s.q.insertCancel, pgID(id), epoch, reason, nullStr(code)).Scan(&recorded)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("store: request cancel of saga %s: %w", id, err)
	}
	return recorded, nil
}

// CancelRequests returns the pending cancel requests of the given sagas.
func (s *Store) CancelRequests(ctx context.Context, db DBTX, ids []uuid.UUID) (map[uuid.UUID]CancelRequest, error) {
	rows, err := db.Query(ctx, s.q.cancelRequests, pgIDs(ids))
	if err != nil {
		return nil, fmt.Errorf("store: read cancel requests: %w", err)
	}
	out := map[uuid.UUID]CancelRequest{}
	if err := scanCancelRequests(rows, func(id uuid.UUID, r CancelRequest) { out[id] = r }); err != nil {
		return nil, fmt.Errorf("store: read cancel requests: %w", err)
	}
	return out, nil
}

// QueueCancelRequest queues on b the read of saga id's pending cancel
// request, into req (left nil when there is none).
func (s *Store) QueueCancelRequest(b *pgx.Batch, id uuid.UUID, req **CancelRequest) {
	b.Queue(s.q.cancelRequest1, id).Query(func(rows pgx.Rows) error {
		if err := scanCancelRequests(rows, func(_ uuid.UUID, r CancelRequest) { *req = &r }); err != nil {
			return fmt.Errorf("store: read the cancel request of saga %s: %w", id, err)
		}
		return nil
	})
}

// scanCancelRequests calls each with every row of a cancelRequests query.
func scanCancelRequests(rows pgx.Rows, each func(id uuid.UUID, r CancelRequest)) error {
	var id uuid.UUID
	var r CancelRequest
	_, err := pgx.ForEachRow(rows, []any{(*[16]byte)(&id), &r.Epoch, &r.Reason, &r.Code}, func() error {
		each(id, r)
		return nil
	})
	return err
}

// Held is a Kafka command to move back into the outbox: see
// [Store.HoldMessage].
type Held struct {
	ID            uuid.UUID
	Topic         string
	AggregateType string
	AggregateID   string
	Type          string
	Payload       []byte
	Headers       map[string]string
	SagaID        *uuid.UUID
	// HeldSince is when it was first held, from its held-since header; nil
	// for the first hold.
	HeldSince *time.Time
	Delay     time.Duration
	// MaxDelay caps the delay, which grows with the time held so far; 0
	// means a minute.
	MaxDelay time.Duration
	Reason   string
}

// HoldMessage writes h to the outbox as a relay row due after h.Delay, or
// after half the time it has been held so far if that is longer (at most
// h.MaxDelay), so that its Kafka partition can move on, and returns the
// delay it was given. It reports false, writing nothing, when h has been
// held for longer than grace (in the database's time); a grace of 0 holds
// it however long.
func (s *Store) HoldMessage(ctx context.Context, db DBTX, h *Held, grace time.Duration) (held bool, delay time.Duration, err error) {
	headers := h.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	maxDelay := h.MaxDelay
	if maxDelay <= 0 {
		maxDelay = time.Minute
	}
	var secs float64
	err = db.QueryRow(ctx, s.q.holdMessage, pgID(h.ID), h.Topic, h.AggregateType, h.AggregateID, h.Type, h.Payload, headers,
		pgIDPtr(h.SagaID), h.HeldSince, micros(h.Delay), micros(grace), nullStr(h.Reason), micros(maxDelay)).Scan(&secs)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("store: hold message on %s: %w", h.Topic, err)
	}
	return true, time.Duration(secs * float64(time.Second)), nil
}

// RefuseCancel deletes the pending cancel request of saga id, recording in
// its history an entry of the given event and code that says why.
func (s *Store) RefuseCancel(ctx context.Context, db DBTX, id uuid.UUID, event, code, why string) error {
	if _, err := db.Exec(ctx, s.q.refuseCancel, pgID(id), event, code, why); err != nil {
		return fmt.Errorf("store: refuse cancel of saga %s: %w", id, err)
	}
	return nil
}

// CancelPayload starts the payload of a notification that asks the engine
// running a step of a saga to cancel the step's context; the saga id
// follows.
const CancelPayload = "sagaflow.cancel:"

// NotifyCancel tells every engine on the schema, when db's transaction
// commits, that saga id has a cancel request.
func (s *Store) NotifyCancel(ctx context.Context, db DBTX, id uuid.UUID) error {
	return s.Notify(ctx, db, CancelPayload+id.String())
}

// PausePayload is the payload of a notification that a saga or a saga type
// was paused: an engine whose batch holds claimed commands looks at the
// pauses again before it runs the next of them.
const PausePayload = "sagaflow.pause"

// NotifyPause tells every engine on the schema, when db's transaction
// commits, that a pause was written.
func (s *Store) NotifyPause(ctx context.Context, db DBTX) error {
	return s.Notify(ctx, db, PausePayload)
}

// OperatorState reads saga id's pending cancel request (nil when there is
// none) and whether it, of type name, is paused, by itself or by its type,
// as a statement run now sees them: what [Store.LockSagas] read with the
// saga, read again.
func (s *Store) OperatorState(ctx context.Context, db DBTX, id uuid.UUID, name string) (*CancelRequest, bool, error) {
	q := quoteSchema(s.schema)
	var epoch *int
	var reason, code *string
	var paused bool
	err := db.QueryRow(ctx, `SELECT r.epoch, r.reason, r.code, `+pausedSQL(q)+`
		FROM (SELECT $1::uuid AS id, $2::text AS saga_name) s
		LEFT JOIN `+q+`.saga_cancel_requests r ON r.saga_id = s.id`, pgID(id), name).Scan(&epoch, &reason, &code, &paused)
	if err != nil {
		return nil, false, fmt.Errorf("store: read the cancel request and pauses of saga %s: %w", id, err)
	}
	return cancelRequest(epoch, reason, code), paused, nil
}

// SagaPaused reports whether saga id, of type name, is paused, by itself or
// by its type, as a statement run now sees the pauses.
func (s *Store) SagaPaused(ctx context.Context, db DBTX, id uuid.UUID, name string) (bool, error) {
	var paused bool
	// The claim's own condition (pausedSQL), on the saga's id and name.
	err := db.QueryRow(ctx, `SELECT `+pausedSQL(quoteSchema(s.schema))+`
		FROM (SELECT $1::uuid AS id, $2::text AS saga_name) s`, pgID(id), name).Scan(&paused)
	if err != nil {
		return false, fmt.Errorf("store: is saga %s paused: %w", id, err)
	}
	return paused, nil
}

// defVersion is a Transition's DefVersion as a parameter: NULL keeps the
// stored one.
func defVersion(v int) *int32 {
	if v == 0 {
		return nil
	}
	n := int32(v)
	return &n
}
