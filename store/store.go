package store

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	LastError     *string
	LastErrorCode *string
	FailedStep    *string
	CreatedAt     time.Time
	UpdatedAt     time.Time
	EndedAt       *time.Time
}

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

// Claimed is an outbox row claimed by an engine worker.
type Claimed struct {
	ID       uuid.UUID
	Type     string
	Payload  []byte
	SagaID   *uuid.UUID
	Attempts int
}

// Transition is a fenced update of a saga row: it applies only while the row
// still has version Version.
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
}

// Store holds sagaflow's statements for one schema.
type Store struct {
	schema  string
	channel string
	lockNS  int64
	q       statements
}

type statements struct {
	insertSaga, sagaByKey, insertHistory, insertOutbox, notify                     string
	claimDirect, lockSagas, updateSaga, insertInbox, markDelivered, deferMessages  string
	markDead, nextDue, getSaga, getSagaForUpdate, history, listBase, pendingBySaga string
}

const sagaColumns = `id, saga_name, business_key, status, step_index, step_name, direction, epoch, attempt,
	state, version, next_check_at, last_error, last_error_code, failed_step, created_at, updated_at, ended_at`

// New returns the statements for schema, which must pass [ValidateSchema].
func New(schema string) (*Store, error) {
	if err := ValidateSchema(schema); err != nil {
		return nil, err
	}
	s := quoteSchema(schema)
	h := fnv.New64a()
	h.Write([]byte("sagaflow.saga\x00" + schema))
	st := &Store{schema: schema, channel: schema + "_sagaflow", lockNS: int64(h.Sum64())}
	st.q = statements{
		insertSaga: `INSERT INTO ` + s + `.saga_instances
			(id, saga_name, business_key, status, step_index, step_name, direction, epoch, attempt, state, next_check_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, 0, 0, $8, now() + $9 * interval '1 microsecond')
			ON CONFLICT (saga_name, business_key) DO NOTHING`,
		sagaByKey: `SELECT id FROM ` + s + `.saga_instances WHERE saga_name = $1 AND business_key = $2`,
		insertHistory: `INSERT INTO ` + s + `.saga_history
			(saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		insertOutbox: `INSERT INTO ` + s + `.outbox
			(id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key, available_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now() + $11 * interval '1 microsecond')`,
		notify: `SELECT pg_notify($1, $2)`,
		claimDirect: `SELECT id, type, payload, saga_id, attempts FROM ` + s + `.outbox
			WHERE topic = $1 AND delivery = 'direct' AND status = 'pending' AND available_at <= now()
			ORDER BY available_at
			LIMIT $2
			FOR UPDATE SKIP LOCKED`,
		// The try-lock is an advisory transaction lock per saga: it keeps two
		// workers from running steps of one saga at once without blocking,
		// without an extra commit, and it vanishes with the transaction.
		lockSagas: `SELECT ` + prefixColumns("s.") + `, pg_try_advisory_xact_lock(hashtextextended(s.id::text, $2))
			FROM ` + s + `.saga_instances s WHERE s.id = ANY($1) ORDER BY s.id`,
		updateSaga: `UPDATE ` + s + `.saga_instances SET
			status = $3, step_index = $4, step_name = $5, direction = $6, epoch = $7, attempt = $8,
			state = COALESCE($9, state), version = version + 1,
			next_check_at = CASE WHEN $3 IN ('running', 'compensating') THEN now() + $10 * interval '1 microsecond' END,
			last_error = $11, last_error_code = $12, failed_step = $13, updated_at = now(),
			ended_at = CASE WHEN $3 IN ('running', 'compensating') THEN NULL ELSE now() END
			WHERE id = $1 AND version = $2`,
		insertInbox:      `INSERT INTO ` + s + `.inbox (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		markDelivered:    `UPDATE ` + s + `.outbox SET status = 'published', published_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`,
		deferMessages:    `UPDATE ` + s + `.outbox SET available_at = now() + $2 * interval '1 microsecond' WHERE id = ANY($1)`,
		markDead:         `UPDATE ` + s + `.outbox SET status = 'dead', last_error = $2, attempts = attempts + 1 WHERE id = $1`,
		nextDue:          `SELECT EXTRACT(EPOCH FROM min(available_at) - now()) FROM ` + s + `.outbox WHERE topic = $1 AND delivery = 'direct' AND status = 'pending'`,
		getSaga:          `SELECT ` + sagaColumns + ` FROM ` + s + `.saga_instances WHERE id = $1`,
		getSagaForUpdate: `SELECT ` + sagaColumns + ` FROM ` + s + `.saga_instances WHERE id = $1 FOR NO KEY UPDATE`,
		history: `SELECT id, saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail, at
			FROM ` + s + `.saga_history WHERE saga_id = $1 ORDER BY id`,
		listBase:      `SELECT ` + sagaColumns + ` FROM ` + s + `.saga_instances`,
		pendingBySaga: `SELECT count(*) FROM ` + s + `.outbox WHERE saga_id = $1 AND status = 'pending'`,
	}
	return st, nil
}

func prefixColumns(p string) string {
	cols := strings.Split(sagaColumns, ",")
	for i, c := range cols {
		cols[i] = p + strings.TrimSpace(c)
	}
	return strings.Join(cols, ", ")
}

// Schema returns the schema the statements use.
func (s *Store) Schema() string { return s.schema }

// Channel returns the LISTEN/NOTIFY channel on which new direct commands are
// announced.
func (s *Store) Channel() string { return s.channel }

func micros(d time.Duration) int64 { return d.Microseconds() }

// InsertSaga inserts a saga row. It reports false, and inserts nothing, when
// a saga with the same name and business key exists.
func (s *Store) InsertSaga(ctx context.Context, db DBTX, sg *Saga, checkAfter time.Duration) (bool, error) {
	tag, err := db.Exec(ctx, s.q.insertSaga, sg.ID, sg.Name, sg.BusinessKey, sg.Status, sg.StepIndex,
		sg.StepName, sg.Direction, sg.State, micros(checkAfter))
	if err != nil {
		return false, fmt.Errorf("store: insert saga %s: %w", sg.ID, err)
	}
	return tag.RowsAffected() == 1, nil
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
	return []any{h.SagaID, h.Event, nullStr(h.StepName), nullStr(h.Direction), h.Epoch, h.Attempt,
		nullStr(h.Error), nullStr(h.ErrorCode), detail}
}

// InsertHistory appends a history entry.
func (s *Store) InsertHistory(ctx context.Context, db DBTX, h *HistoryEntry) error {
	if _, err := db.Exec(ctx, s.q.insertHistory, s.historyArgs(h)...); err != nil {
		return fmt.Errorf("store: insert history for saga %s: %w", h.SagaID, err)
	}
	return nil
}

// QueueHistory queues [Store.InsertHistory] on b.
func (s *Store) QueueHistory(b *pgx.Batch, h *HistoryEntry) {
	b.Queue(s.q.insertHistory, s.historyArgs(h)...)
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
	return []any{m.ID, m.Topic, delivery, m.AggregateType, m.AggregateID, m.Type, m.Payload, headers,
		m.SagaID, m.StepKey, micros(m.Delay)}
}

// InsertMessage inserts an outbox row.
func (s *Store) InsertMessage(ctx context.Context, db DBTX, m *Message) error {
	if _, err := db.Exec(ctx, s.q.insertOutbox, s.outboxArgs(m)...); err != nil {
		return fmt.Errorf("store: insert outbox message %s (topic %s): %w", m.ID, m.Topic, err)
	}
	return nil
}

// QueueMessage queues [Store.InsertMessage] on b.
func (s *Store) QueueMessage(b *pgx.Batch, m *Message) {
	b.Queue(s.q.insertOutbox, s.outboxArgs(m)...)
}

// Notify announces new direct commands on [Store.Channel]; PostgreSQL delivers
// the notification when the transaction commits.
func (s *Store) Notify(ctx context.Context, db DBTX, topic string) error {
	if _, err := db.Exec(ctx, s.q.notify, s.channel, topic); err != nil {
		return fmt.Errorf("store: notify %s: %w", s.channel, err)
	}
	return nil
}

// QueueNotify queues [Store.Notify] on b.
func (s *Store) QueueNotify(b *pgx.Batch, topic string) {
	b.Queue(s.q.notify, s.channel, topic)
}

// ClaimDirect locks up to limit due direct commands of topic for the
// transaction tx, skipping rows other workers hold.
func (s *Store) ClaimDirect(ctx context.Context, tx pgx.Tx, topic string, limit int) ([]Claimed, error) {
	rows, err := tx.Query(ctx, s.q.claimDirect, topic, limit)
	if err != nil {
		return nil, fmt.Errorf("store: claim commands on %s: %w", topic, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Claimed, error) {
		var c Claimed
		err := r.Scan(&c.ID, &c.Type, &c.Payload, &c.SagaID, &c.Attempts)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: claim commands on %s: %w", topic, err)
	}
	return out, nil
}

// LockedSaga is a saga row read by [Store.LockSagas] and whether this
// transaction holds the saga's execution lock.
type LockedSaga struct {
	Saga
	Locked bool
}

// LockSagas reads the given sagas and tries to take, for each, the
// transaction-scoped execution lock that keeps two workers from running steps
// of one saga at once. It never waits: a saga another transaction holds comes
// back with Locked false. Sagas that do not exist are absent from the result.
func (s *Store) LockSagas(ctx context.Context, tx pgx.Tx, ids []uuid.UUID) (map[uuid.UUID]*LockedSaga, error) {
	rows, err := tx.Query(ctx, s.q.lockSagas, ids, s.lockNS)
	if err != nil {
		return nil, fmt.Errorf("store: lock sagas: %w", err)
	}
	defer rows.Close()
	out := make(map[uuid.UUID]*LockedSaga, len(ids))
	for rows.Next() {
		ls := &LockedSaga{}
		if err := rows.Scan(append(sagaDest(&ls.Saga), &ls.Locked)...); err != nil {
			return nil, fmt.Errorf("store: lock sagas: %w", err)
		}
		out[ls.ID] = ls
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: lock sagas: %w", err)
	}
	return out, nil
}

func (s *Store) transitionArgs(t *Transition) []any {
	var state any
	if t.State != nil {
		state = t.State
	}
	return []any{t.ID, t.Version, t.Status, t.StepIndex, t.StepName, t.Direction, t.Epoch, t.Attempt,
		state, micros(t.CheckAfter), t.LastError, t.LastErrorCode, t.FailedStep}
}

// QueueTransition queues the fenced saga update t on b. Its result's
// RowsAffected is 1 when the fence held and 0 when the saga had moved on.
func (s *Store) QueueTransition(b *pgx.Batch, t *Transition) *pgx.QueuedQuery {
	return b.Queue(s.q.updateSaga, s.transitionArgs(t)...)
}

// ApplyTransition runs the fenced saga update t and reports whether the fence
// held.
func (s *Store) ApplyTransition(ctx context.Context, db DBTX, t *Transition) (bool, error) {
	tag, err := db.Exec(ctx, s.q.updateSaga, s.transitionArgs(t)...)
	if err != nil {
		return false, fmt.Errorf("store: update saga %s at version %d: %w", t.ID, t.Version, err)
	}
	return tag.RowsAffected() == 1, nil
}

// InsertInboxKey records key for consumer. It reports false when the key was
// already recorded (the message or step was processed before).
func (s *Store) InsertInboxKey(ctx context.Context, db DBTX, consumer, key string) (bool, error) {
	tag, err := db.Exec(ctx, s.q.insertInbox, consumer, key)
	if err != nil {
		return false, fmt.Errorf("store: record inbox key %q for %s: %w", key, consumer, err)
	}
	return tag.RowsAffected() == 1, nil
}

// QueueInboxKey queues [Store.InsertInboxKey] on b; the result's
// RowsAffected is 0 for a key that was already recorded.
func (s *Store) QueueInboxKey(b *pgx.Batch, consumer, key string) *pgx.QueuedQuery {
	return b.Queue(s.q.insertInbox, consumer, key)
}

// MarkDelivered marks direct commands as consumed.
func (s *Store) MarkDelivered(ctx context.Context, db DBTX, ids []uuid.UUID) error {
	if _, err := db.Exec(ctx, s.q.markDelivered, ids); err != nil {
		return fmt.Errorf("store: mark %d commands delivered: %w", len(ids), err)
	}
	return nil
}

// QueueMarkDelivered queues [Store.MarkDelivered] on b.
func (s *Store) QueueMarkDelivered(b *pgx.Batch, ids []uuid.UUID) {
	b.Queue(s.q.markDelivered, ids)
}

// DeferMessages makes pending messages available again later: after delay
// the first time, doubling with each deferral of the same message up to
// maxDelay.
func (s *Store) DeferMessages(ctx context.Context, db DBTX, ids []uuid.UUID, delay, maxDelay time.Duration) error {
	if _, err := db.Exec(ctx, s.q.deferMessages, ids, micros(delay), micros(maxDelay)); err != nil {
		return fmt.Errorf("store: defer %d messages: %w", len(ids), err)
	}
	return nil
}

// QueueDefer queues [Store.DeferMessages] on b.
func (s *Store) QueueDefer(b *pgx.Batch, ids []uuid.UUID, delay, maxDelay time.Duration) {
	b.Queue(s.q.deferMessages, ids, micros(delay), micros(maxDelay))
}

// MarkDead parks an outbox row with the reason it cannot be processed.
func (s *Store) MarkDead(ctx context.Context, db DBTX, id uuid.UUID, reason string) error {
	if _, err := db.Exec(ctx, s.q.markDead, id, reason); err != nil {
		return fmt.Errorf("store: park outbox message %s: %w", id, err)
	}
	return nil
}

// NextDirectDue returns how long until the next pending direct command of
// topic is due, by the database's clock; ok is false when none is pending.
func (s *Store) NextDirectDue(ctx context.Context, db DBTX, topic string) (d time.Duration, ok bool, err error) {
	var secs *float64
	if err := db.QueryRow(ctx, s.q.nextDue, topic).Scan(&secs); err != nil {
		return 0, false, fmt.Errorf("store: next due command on %s: %w", topic, err)
	}
	if secs == nil {
		return 0, false, nil
	}
	return time.Duration(*secs * float64(time.Second)), true, nil
}

func sagaDest(sg *Saga) []any {
	return []any{&sg.ID, &sg.Name, &sg.BusinessKey, &sg.Status, &sg.StepIndex, &sg.StepName, &sg.Direction,
		&sg.Epoch, &sg.Attempt, &sg.State, &sg.Version, &sg.NextCheckAt, &sg.LastError, &sg.LastErrorCode,
		&sg.FailedStep, &sg.CreatedAt, &sg.UpdatedAt, &sg.EndedAt}
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

// PendingMessages counts a saga's pending outbox rows.
func (s *Store) PendingMessages(ctx context.Context, db DBTX, id uuid.UUID) (int, error) {
	var n int
	if err := db.QueryRow(ctx, s.q.pendingBySaga, id).Scan(&n); err != nil {
		return 0, fmt.Errorf("store: pending messages of saga %s: %w", id, err)
	}
	return n, nil
}

// ListFilter selects sagas for [Store.ListSagas]. Zero fields do not filter.
type ListFilter struct {
	Name          string
	Statuses      []string
	BusinessKey   string
	CreatedAfter  time.Time // inclusive
	CreatedBefore time.Time // exclusive
	Cursor        string    // from a previous page's NextCursor
	Limit         int
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
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, "", fmt.Errorf("store: list sagas: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Saga, error) {
		var sg Saga
		err := r.Scan(sagaDest(&sg)...)
		return sg, err
	})
	if err != nil {
		return nil, "", fmt.Errorf("store: list sagas: %w", err)
	}
	next := ""
	if len(out) > f.Limit {
		out = out[:f.Limit]
		last := out[len(out)-1]
		next = encodeCursor(last.CreatedAt, last.ID)
	}
	return out, next, nil
}

func encodeCursor(at time.Time, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString([]byte(at.UTC().Format(time.RFC3339Nano) + "|" + id.String()))
}

func decodeCursor(c string) (time.Time, uuid.UUID, error) {
	raw, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return time.Time{}, uuid.Nil, fmt.Errorf("store: list sagas: malformed cursor %q", c)
	}
	ts, idText, ok := strings.Cut(string(raw), "|")
	at, err1 := time.Parse(time.RFC3339Nano, ts)
	id, err2 := uuid.Parse(idText)
	if !ok || err1 != nil || err2 != nil {
		return time.Time{}, uuid.Nil, fmt.Errorf("store: list sagas: malformed cursor %q", c)
	}
	return at, id, nil
}

func nullStr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
