package store

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
)

// Dead outbox rows and dead letters: what an operator lists and puts back.
//
// A dead outbox row is a message sagaflow could not send (the relay parked
// it, or the engine parked a command); requeueing it makes it pending again.
// A dead letter is a message a consumer received and could not process;
// requeueing it publishes its original bytes to its topic again, through the
// outbox, and forgets that the consumer saw it.

// ErrNotRequeueable is wrapped by the error of a dead outbox row or dead
// letter that cannot be requeued: it is gone, was requeued already, or holds
// what an outbox row cannot. The error names the row and the reason.
var ErrNotRequeueable = errors.New("store: not requeueable")

// RequeueError says why a dead letter cannot be requeued. It matches
// [ErrNotRequeueable].
type RequeueError struct {
	Letter int64
	Reason string
}

func (e *RequeueError) Error() string {
	return fmt.Sprintf("store: dead letter %d cannot be requeued: %s", e.Letter, e.Reason)
}

// Is makes errors.Is(err, ErrNotRequeueable) hold.
func (e *RequeueError) Is(target error) bool { return target == ErrNotRequeueable }

// RawHeadersKey is the one entry of an outbox row's headers that carries a
// message's headers exactly as another producer sent them: a JSON array of
// {"k": base64 name, "v": base64 value}, in order, duplicates included (see
// [EncodeRawHeaders]). The relay publishes such a row with exactly those
// headers and adds none of its own, so the message keeps its original
// sagaflow-message-id. Requeued dead letters are written this way.
const RawHeadersKey = "sagaflow-raw-headers"

// AggregateTypeDeadLetter is the aggregatetype of the outbox row that
// requeues a dead letter.
const AggregateTypeDeadLetter = "sagaflow.dead_letter"

type rawHeaderJSON struct {
	K string `json:"k"`
	V string `json:"v"`
}

// EncodeRawHeaders encodes headers as the JSON array that dead_letters'
// raw_headers column and an outbox row's [RawHeadersKey] entry hold.
func EncodeRawHeaders(hs []RawHeader) string {
	out := make([]rawHeaderJSON, len(hs))
	for i, h := range hs {
		out[i] = rawHeaderJSON{K: base64.StdEncoding.EncodeToString(h.Key), V: base64.StdEncoding.EncodeToString(h.Value)}
	}
	b, _ := json.Marshal(out) // strings only: cannot fail
	return string(b)
}

// DecodeRawHeaders decodes what [EncodeRawHeaders] wrote.
func DecodeRawHeaders(s string) ([]RawHeader, error) {
	var in []rawHeaderJSON
	if err := json.Unmarshal([]byte(s), &in); err != nil {
		return nil, fmt.Errorf("raw headers are not a JSON array of {\"k\", \"v\"}: %w", err)
	}
	out := make([]RawHeader, len(in))
	for i, h := range in {
		k, err := base64.StdEncoding.DecodeString(h.K)
		if err != nil {
			return nil, fmt.Errorf("raw header %d: name is not base64: %w", i, err)
		}
		v, err := base64.StdEncoding.DecodeString(h.V)
		if err != nil {
			return nil, fmt.Errorf("raw header %d: value is not base64: %w", i, err)
		}
		out[i] = RawHeader{Key: k, Value: v}
	}
	return out, nil
}

// DeadFilter selects dead outbox rows ([Store.DeadMessages]) or dead
// letters ([Store.DeadLetters]), oldest first. Zero fields do not filter.
type DeadFilter struct {
	// Consumer selects the dead letters of one consumer. Outbox rows have
	// no consumer: DeadMessages refuses a filter that sets it.
	Consumer string
	Topic    string
	// Since selects rows created at or after it.
	Since time.Time
	// IncludeRequeued lists dead letters that were requeued already too.
	IncludeRequeued bool
	// Cursor is a previous page's next cursor.
	Cursor string
	// Limit bounds the page; at least 1.
	Limit int
}

// DeadMessage is an outbox row parked as dead.
type DeadMessage struct {
	ID            uuid.UUID
	Topic         string
	Delivery      string // DeliveryRelay or DeliveryDirect
	AggregateType string
	AggregateID   string
	Type          string
	SagaID        *uuid.UUID
	StepKey       *string
	Attempts      int
	// LastError is why it was parked; relay reasons start with a code
	// (relay.CodeTooLarge, …).
	LastError    string
	PayloadBytes int
	CreatedAt    time.Time
}

// DeadMessages returns a page of dead outbox rows matching f, oldest first,
// and the cursor of the next page ("" on the last).
func (s *Store) DeadMessages(ctx context.Context, db DBTX, f DeadFilter) ([]DeadMessage, string, error) {
	if f.Consumer != "" {
		return nil, "", errors.New("store: dead messages: outbox rows have no consumer; Consumer filters dead letters")
	}
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	where := []string{"status = 'dead'"}
	if f.Topic != "" {
		where = append(where, "topic = "+arg(f.Topic))
	}
	if !f.Since.IsZero() {
		where = append(where, "created_at >= "+arg(f.Since))
	}
	if f.Cursor != "" {
		at, id, err := decodeCursor(f.Cursor)
		if err != nil {
			return nil, "", err
		}
		where = append(where, "(created_at, id) > ("+arg(at)+", "+arg(id)+")")
	}
	limit := max(f.Limit, 1)
	rows, err := db.Query(ctx, `SELECT id, topic, delivery, aggregatetype, aggregateid, type, saga_id, step_key, attempts,
			COALESCE(last_error, ''), length(payload), created_at
		FROM `+quoteSchema(s.schema)+`.outbox WHERE `+strings.Join(where, " AND ")+`
		ORDER BY created_at, id LIMIT `+arg(limit+1), args...)
	if err != nil {
		return nil, "", fmt.Errorf("store: list dead messages: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadMessage, error) {
		var m DeadMessage
		err := r.Scan(&m.ID, &m.Topic, &m.Delivery, &m.AggregateType, &m.AggregateID, &m.Type, &m.SagaID, &m.StepKey,
			&m.Attempts, &m.LastError, &m.PayloadBytes, &m.CreatedAt)
		return m, err
	})
	if err != nil {
		return nil, "", fmt.Errorf("store: list dead messages: %w", err)
	}
	next := ""
	if len(out) > limit {
		out = out[:limit]
		last := out[limit-1]
		next = encodeCursor(last.CreatedAt, last.ID)
	}
	return out, next, nil
}

// RequeueDeadMessages makes the dead outbox rows ids pending again, due
// now, with their attempts reset; their last_error keeps why they were
// parked, after "requeued; was: ". It notifies the schema's channel, so a
// relay or engine worker takes them at once. It returns the ids it
// requeued, and for every other id why not: it is not dead, does not exist,
// or was superseded on purpose (the rescuer parks a command its saga no
// longer waits for with a reason that starts "superseded:"; sending it now
// could run a step after its saga moved on).
func (s *Store) RequeueDeadMessages(ctx context.Context, db DBTX, ids []uuid.UUID) ([]uuid.UUID, map[uuid.UUID]string, error) {
	if len(ids) == 0 {
		return nil, nil, nil
	}
	q := quoteSchema(s.schema) + ".outbox"
	rows, err := db.Query(ctx, `UPDATE `+q+`
		SET status = 'pending', attempts = 0, available_at = now(), published_at = NULL,
			-- A direct command's grace for engines that lack its saga or
			-- version counts from the requeue, not from its first writing.
			created_at = CASE WHEN delivery = 'direct' THEN now() ELSE created_at END,
			last_error = 'requeued; was: ' || COALESCE(last_error, '(no reason recorded)')
		WHERE id = ANY($1) AND status = 'dead' AND COALESCE(last_error, '') NOT LIKE '`+supersededPrefix+`%'
		RETURNING id, topic`, pgIDs(ids))
	if err != nil {
		return nil, nil, fmt.Errorf("store: requeue %d dead messages: %w", len(ids), err)
	}
	var done []uuid.UUID
	var topics []string
	var id uuid.UUID
	var topic string
	_, err = pgx.ForEachRow(rows, []any{&id, &topic}, func() error {
		done = append(done, id)
		topics = append(topics, topic)
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("store: requeue %d dead messages: %w", len(ids), err)
	}
	seen := make(map[uuid.UUID]bool, len(ids))
	for _, id := range done {
		seen[id] = true
	}
	var rest []uuid.UUID
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			rest = append(rest, id)
		}
	}
	why := make(map[uuid.UUID]string, len(rest))
	if len(rest) > 0 {
		for _, id := range rest {
			why[id] = "no such outbox message"
		}
		rows, err := db.Query(ctx, `SELECT id, status, COALESCE(last_error, '') FROM `+q+` WHERE id = ANY($1)`, pgIDs(rest))
		if err != nil {
			return nil, nil, fmt.Errorf("store: requeue %d dead messages: %w", len(ids), err)
		}
		var status, lastErr string
		_, err = pgx.ForEachRow(rows, []any{&id, &status, &lastErr}, func() error {
			if status == OutboxDead {
				why[id] = "it was superseded on purpose, and sending it now could run a step after its saga moved on (" +
					safetext.Text(lastErr, 200) + ")"
			} else {
				why[id] = "its status is " + status + ", not dead"
			}
			return nil
		})
		if err != nil {
			return nil, nil, fmt.Errorf("store: requeue %d dead messages: %w", len(ids), err)
		}
	}
	return done, why, s.notifyTopics(ctx, db, topics)
}

// supersededPrefix starts the reason of a command the rescuer parked
// because its saga no longer waits for it (see saga's rescuer and
// [Store.SupersedeMessage]).
const supersededPrefix = "superseded:"

func (s *Store) notifyTopics(ctx context.Context, db DBTX, topics []string) error {
	slices.Sort(topics)
	topics = slices.Compact(topics)
	if len(topics) == 0 {
		return nil
	}
	if _, err := db.Exec(ctx, `SELECT pg_notify($1, t) FROM unnest($2::text[]) t`, s.channel, topics); err != nil {
		return fmt.Errorf("store: notify %s: %w", s.channel, err)
	}
	return nil
}

// StoredDeadLetter is a row of dead_letters, as [Store.DeadLetters] lists it.
type StoredDeadLetter struct {
	ID        int64
	Consumer  string
	MessageID string // "" when the message had none
	Topic     string
	Partition *int
	Offset    *int64
	Key       []byte
	// ValueBytes is the size of the message's value.
	ValueBytes int
	// Headers is the storable rendering of the message's headers.
	Headers    map[string]string
	Reason     string
	CreatedAt  time.Time
	RequeuedAt *time.Time // nil until requeued
}

// DeadLetters returns a page of dead letters matching f, oldest first, and
// the cursor of the next page ("" on the last). Requeued ones are left out
// unless f.IncludeRequeued.
func (s *Store) DeadLetters(ctx context.Context, db DBTX, f DeadFilter) ([]StoredDeadLetter, string, error) {
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	var where []string
	if !f.IncludeRequeued {
		where = append(where, "requeued_at IS NULL")
	}
	if f.Consumer != "" {
		where = append(where, "consumer = "+arg(f.Consumer))
	}
	if f.Topic != "" {
		where = append(where, "topic = "+arg(f.Topic))
	}
	if !f.Since.IsZero() {
		where = append(where, "created_at >= "+arg(f.Since))
	}
	if f.Cursor != "" {
		after, err := decodeLetterCursor(f.Cursor)
		if err != nil {
			return nil, "", err
		}
		where = append(where, "id > "+arg(after))
	}
	q := `SELECT id, consumer, COALESCE(message_id, ''), topic, kafka_partition, kafka_offset, msg_key,
			COALESCE(length(msg_value), 0), headers, reason, created_at, requeued_at
		FROM ` + quoteSchema(s.schema) + `.dead_letters`
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	limit := max(f.Limit, 1)
	rows, err := db.Query(ctx, q+" ORDER BY id LIMIT "+arg(limit+1), args...)
	if err != nil {
		return nil, "", fmt.Errorf("store: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StoredDeadLetter, error) {
		var d StoredDeadLetter
		err := r.Scan(&d.ID, &d.Consumer, &d.MessageID, &d.Topic, &d.Partition, &d.Offset, &d.Key, &d.ValueBytes,
			&d.Headers, &d.Reason, &d.CreatedAt, &d.RequeuedAt)
		return d, err
	})
	if err != nil {
		return nil, "", fmt.Errorf("store: list dead letters: %w", err)
	}
	next := ""
	if len(out) > limit {
		out = out[:limit]
		next = encodeLetterCursor(out[limit-1].ID)
	}
	return out, next, nil
}

const letterCursorPrefix = "dead_letter|"

func encodeLetterCursor(id int64) string {
	return base64.RawURLEncoding.EncodeToString([]byte(letterCursorPrefix + strconv.FormatInt(id, 10)))
}

func decodeLetterCursor(c string) (int64, error) {
	raw, err := base64.RawURLEncoding.DecodeString(c)
	if err == nil {
		if rest, ok := strings.CutPrefix(string(raw), letterCursorPrefix); ok {
			if id, err := strconv.ParseInt(rest, 10, 64); err == nil {
				return id, nil
			}
		}
	}
	return 0, fmt.Errorf("%w %q", ErrMalformedCursor, c)
}

// RequeuedLetter is a dead letter that [Store.RequeueDeadLetter] sent
// again.
type RequeuedLetter struct {
	ID       int64
	Consumer string
	Topic    string
	// OutboxID is the id of the outbox row that publishes it again.
	OutboxID uuid.UUID
	// MessageID is the message id it is published with: the original
	// sagaflow-message-id, or for a message that had none, the id a
	// consumer gave it from its position. "" when it has neither.
	MessageID string
}

// RequeueDeadLetter sends the dead letter id again, in tx: it writes an
// outbox row, under the new id outboxID, that the relay publishes to the
// letter's topic with the letter's key, value and headers exactly as they
// were received (see [RawHeadersKey]), so the message keeps its original
// message id and every consumer that processed it skips it; it deletes the
// letter's consumer's inbox key for that id, so that consumer processes it;
// and it sets requeued_at. A letter whose original headers were not kept
// (raw_headers is NULL: stored before migration 005) is sent with its
// stored headers.
//
// A message without a sagaflow-message-id header is given one: the id
// inbox consumers derived from its position (topic/partition/offset), so
// that consumers which processed the original still recognise it.
//
// It returns a [*RequeueError], naming the letter and the reason, when the letter is gone, was requeued already, or cannot be
// written to the outbox (its key is not valid UTF-8 or holds a NUL byte:
// the outbox keeps the Kafka key as text).
func (s *Store) RequeueDeadLetter(ctx context.Context, tx pgx.Tx, id int64, outboxID uuid.UUID) (*RequeuedLetter, error) {
	q := quoteSchema(s.schema)
	var d deadLetterRow
	var headers map[string]string
	var raw *string
	var requeuedAt *time.Time
	err := tx.QueryRow(ctx, `SELECT consumer, COALESCE(message_id, ''), topic, kafka_partition, kafka_offset, msg_key, msg_value,
			headers, raw_headers::text, requeued_at
		FROM `+q+`.dead_letters WHERE id = $1 FOR UPDATE`, id).
		Scan(&d.consumer, &d.messageID, &d.topic, &d.partition, &d.offset, &d.key, &d.value, &headers, &raw, &requeuedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, &RequeueError{Letter: id, Reason: "no such dead letter"}
	}
	if err != nil {
		return nil, fmt.Errorf("store: requeue dead letter %d: %w", id, err)
	}
	if requeuedAt != nil {
		return nil, &RequeueError{Letter: id, Reason: "requeued already at " + requeuedAt.UTC().Format(time.RFC3339)}
	}
	if raw != nil {
		if d.headers, err = DecodeRawHeaders(*raw); err != nil {
			return nil, &RequeueError{Letter: id, Reason: err.Error()}
		}
	} else {
		d.headers = headersFromMap(headers)
	}
	plan, err := planRequeue(&d)
	if err != nil {
		return nil, &RequeueError{Letter: id, Reason: err.Error()}
	}
	plan.msg.ID = outboxID
	if err := s.InsertMessage(ctx, tx, &plan.msg); err != nil {
		return nil, fmt.Errorf("store: requeue dead letter %d: %w", id, err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM `+q+`.inbox WHERE consumer = $1 AND key = ANY($2)`, d.consumer, plan.inboxKeys); err != nil {
		return nil, fmt.Errorf("store: requeue dead letter %d: forget inbox key: %w", id, err)
	}
	if _, err := tx.Exec(ctx, `UPDATE `+q+`.dead_letters SET requeued_at = now() WHERE id = $1`, id); err != nil {
		return nil, fmt.Errorf("store: requeue dead letter %d: %w", id, err)
	}
	if err := s.notifyTopics(ctx, tx, []string{d.topic}); err != nil {
		return nil, err
	}
	return &RequeuedLetter{ID: id, Consumer: d.consumer, Topic: d.topic, OutboxID: outboxID, MessageID: plan.messageID}, nil
}

// deadLetterRow is what a requeue reads of a dead letter.
type deadLetterRow struct {
	consumer, messageID, topic string
	partition                  *int
	offset                     *int64
	key, value                 []byte
	headers                    []RawHeader // as received, or rebuilt from the stored rendering
}

// requeuePlan is what requeueing a dead letter writes.
type requeuePlan struct {
	msg       Message // its ID is left for the caller
	messageID string
	inboxKeys []string // the consumer's inbox keys to delete
}

// planRequeue decides how a dead letter is sent again, or why it cannot
// be.
func planRequeue(d *deadLetterRow) (requeuePlan, error) {
	var p requeuePlan
	if d.topic == "" {
		return p, errors.New("it has no topic to send it to")
	}
	if why := safetext.Problem(string(d.key), 0); why != "" {
		return p, fmt.Errorf("its key %s, and the outbox keeps the Kafka key as text", why)
	}
	headers := slices.Clone(d.headers)
	var typ string
	hasID := false
	for _, h := range headers {
		switch string(h.Key) {
		case HeaderMessageID:
			p.messageID, hasID = string(h.Value), true // the last one wins, as in consumers
		case HeaderType:
			typ = string(h.Value)
		}
	}
	if !hasID && d.partition != nil && d.offset != nil {
		p.messageID = PositionID(d.topic, *d.partition, *d.offset)
		headers = append(headers, RawHeader{Key: []byte(HeaderMessageID), Value: []byte(p.messageID)})
	}
	if safetext.Problem(typ, 0) != "" {
		typ = "" // informational only: the message keeps its header
	}
	if p.messageID != "" {
		// The key as a consumer stored it: as given, or hashed when it is
		// unsafe or long (safetext.Key). Both forms go.
		if safetext.Problem(p.messageID, 0) == "" {
			p.inboxKeys = append(p.inboxKeys, p.messageID)
		}
		if k := safetext.Key(p.messageID); !slices.Contains(p.inboxKeys, k) {
			p.inboxKeys = append(p.inboxKeys, k)
		}
	}
	value := d.value
	if value == nil {
		value = []byte{}
	}
	p.msg = Message{
		Topic:         d.topic,
		Delivery:      DeliveryRelay,
		AggregateType: AggregateTypeDeadLetter,
		AggregateID:   string(d.key),
		Type:          typ,
		Payload:       value,
		Headers:       map[string]string{RawHeadersKey: EncodeRawHeaders(headers)},
	}
	return p, nil
}

// headersFromMap turns the stored rendering of headers into headers, by
// name.
func headersFromMap(m map[string]string) []RawHeader {
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	slices.Sort(names)
	out := make([]RawHeader, len(names))
	for i, k := range names {
		out[i] = RawHeader{Key: []byte(k), Value: []byte(m[k])}
	}
	return out
}

// PositionID identifies a Kafka message that has no sagaflow-message-id by
// where it is in the log (topic/partition/offset): a redelivery keeps its
// position. Inbox consumers deduplicate such messages under it, and a
// requeued dead letter without an id is sent with it.
func PositionID(topic string, partition int, offset int64) string {
	return topic + "/" + strconv.Itoa(partition) + "/" + strconv.FormatInt(offset, 10)
}

// RecordRequeued writes, for each outbox row of ids that belongs to a saga
// that exists, a history entry event for its saga with the row's id, topic
// and reason: an operator sent a parked command again.
func (s *Store) RecordRequeued(ctx context.Context, db DBTX, ids []uuid.UUID, event, reason string) error {
	if len(ids) == 0 {
		return nil
	}
	q := quoteSchema(s.schema)
	_, err := db.Exec(ctx, `INSERT INTO `+q+`.saga_history (saga_id, event, detail)
		SELECT o.saga_id, $2, jsonb_build_object('message_id', o.id::text, 'topic', o.topic, 'reason', $3::text)
		FROM `+q+`.outbox o JOIN `+q+`.saga_instances si ON si.id = o.saga_id
		WHERE o.id = ANY($1)`, pgIDs(ids), event, reason)
	if err != nil {
		return fmt.Errorf("store: record %d requeued messages: %w", len(ids), err)
	}
	return nil
}
