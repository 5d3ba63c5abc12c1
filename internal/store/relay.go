package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The relay's statements: it claims pending relay rows, publishes them to a
// broker while holding their row locks, and marks them in the same
// transaction. The statements are built per call from the schema (like
// [Store.PublishedMessages]); pgx caches their prepared form by text. Each
// has a Queue… twin that adds it to a pgx.Batch, so that the relay sends
// BEGIN and its claim in one round trip, and its marks and COMMIT in another.

// RelayMessage is an outbox row claimed by [Store.ClaimRelayBatch].
type RelayMessage struct {
	ID            uuid.UUID
	Topic         string
	AggregateType string
	AggregateID   string // the partition key
	Type          string
	Payload       []byte
	// Headers is the headers column as stored: JSON that should be an
	// object of strings. The relay checks it; a row whose headers are
	// anything else is parked as dead.
	Headers   []byte
	SagaID    *uuid.UUID
	StepKey   *string
	Attempts  int // publish attempts before this claim
	CreatedAt time.Time
	// AvailableAt is when the row became due: with ID, its place in the
	// claim's order (see [RelayPosition]).
	AvailableAt time.Time
}

// RelayPosition is a place in the relay's claim order (available_at, then
// id): a claim after it starts its index scan there, not at the oldest
// entry. While a relay drains a backlog, the entries before the rows it
// claims last are those of rows it has published since the last vacuum,
// which every claim from the start would walk again.
type RelayPosition struct {
	AvailableAt time.Time
	ID          uuid.UUID
}

// Position returns the place of m in the claim order.
func (m *RelayMessage) Position() *RelayPosition {
	return &RelayPosition{AvailableAt: m.AvailableAt, ID: m.ID}
}

// RelayFailure is a claimed row that was not published, for
// [Store.MarkFailed].
type RelayFailure struct {
	ID  uuid.UUID
	Err string // recorded as last_error
	// Delay is how long after the database's clock_timestamp() the row
	// becomes due again. Ignored when Dead.
	Delay time.Duration
	// Dead parks the row (status 'dead') instead of retrying it.
	Dead bool
	// Outage records a failure that says nothing about the row (the broker
	// was down): the row is due again after Delay without spending an
	// attempt. Ignored when Dead.
	Outage bool
}

// ClaimRelayBatch locks up to limit due rows that the relay publishes
// (delivery 'relay', status 'pending', available_at reached by the
// database's clock) for the transaction tx, skipping rows another relay
// holds, oldest available_at first. Rows commit out of id order, so the
// outbox is never paged by id: every claim takes whatever is due and
// unlocked.
func (s *Store) ClaimRelayBatch(ctx context.Context, tx pgx.Tx, limit int) ([]RelayMessage, error) {
	var out []RelayMessage
	b := &pgx.Batch{}
	s.QueueClaimRelayBatch(b, limit, nil, &out)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, err
	}
	return out, nil
}

// QueueClaimRelayBatch queues on b the claim of [Store.ClaimRelayBatch], so
// that it can travel in one round trip with the BEGIN before it (see
// pgx.Batch.BeginTx). The claimed rows are stored in *out when b's results
// are read; an error names the claim.
func (s *Store) QueueClaimRelayBatch(b *pgx.Batch, limit int, after *RelayPosition, out *[]RelayMessage) {
	query := `SELECT id, topic, aggregatetype, aggregateid, type, payload, headers::text, saga_id, step_key,
			attempts, created_at, available_at
		FROM ` + quoteSchema(s.schema) + `.outbox
		WHERE status = 'pending' AND delivery = 'relay' AND available_at <= now()`
	args := []any{limit}
	if after != nil {
		// Only rows after it: rows before it that are still pending (held
		// by another relay, or committed late) wait for a claim from the
		// start, which the relay makes every few batches.
		query += ` AND (available_at, id) > ($2, $3)`
		args = append(args, after.AvailableAt, after.ID)
	}
	query += `
		ORDER BY available_at, id
		LIMIT $1
		FOR UPDATE SKIP LOCKED`
	b.Queue(query, args...).Query(func(rows pgx.Rows) error {
		ms, err := collectRelayMessages(rows)
		if err != nil {
			return fmt.Errorf("store: claim %d relay messages: %w", limit, err)
		}
		*out = ms
		return nil
	})
}

// QueueClaimSweepBatch queues on b the claim of a sweeper, a relay beside a
// log-based one, as [Store.QueueClaimRelayBatch] does for a relay that is
// not a sweeper: only the rows a log-based relay leaves to it (rows due later
// than they were written, rows with attempts: failed, requeued, replayed;
// and rows pending longer than after).
func (s *Store) QueueClaimSweepBatch(b *pgx.Batch, limit int, after time.Duration, out *[]RelayMessage) {
	b.Queue(`SELECT id, topic, aggregatetype, aggregateid, type, payload, headers::text, saga_id, step_key,
			attempts, created_at, available_at
		FROM `+quoteSchema(s.schema)+`.outbox
		WHERE status = 'pending' AND delivery = 'relay' AND available_at <= now()
			AND (available_at > created_at OR attempts > 0 OR created_at < now() - $2 * interval '1 microsecond')
		ORDER BY available_at, id
		LIMIT $1
		FOR UPDATE SKIP LOCKED`, limit, micros(after)).Query(func(rows pgx.Rows) error {
		ms, err := collectRelayMessages(rows)
		if err != nil {
			return fmt.Errorf("store: claim %d relay messages to sweep: %w", limit, err)
		}
		*out = ms
		return nil
	})
}

// collectRelayMessages reads the rows of a relay claim. The ids are read
// as [16]byte, which pgx decodes from the binary uuid at once; a uuid.UUID
// is read through its sql.Scanner, from text.
func collectRelayMessages(rows pgx.Rows) ([]RelayMessage, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (RelayMessage, error) {
		var m RelayMessage
		var id [16]byte
		var sagaID pgtype.UUID
		err := r.Scan(&id, &m.Topic, &m.AggregateType, &m.AggregateID, &m.Type, &m.Payload, &m.Headers,
			&sagaID, &m.StepKey, &m.Attempts, &m.CreatedAt, &m.AvailableAt)
		m.ID = id
		if sagaID.Valid {
			sid := uuid.UUID(sagaID.Bytes)
			m.SagaID = &sid
		}
		return m, err
	})
}

// MarkPublished records that the broker acknowledged the rows ids: status
// 'published', published_at now (clock_timestamp()), one more attempt, no
// last error. Rows that are no longer pending are left alone.
func (s *Store) MarkPublished(ctx context.Context, db DBTX, ids []uuid.UUID) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := db.Exec(ctx, s.markPublishedSQL(), binaryUUIDs(ids)); err != nil {
		return fmt.Errorf("store: mark %d messages published: %w", len(ids), err)
	}
	return nil
}

// QueueMarkPublished queues on b the one statement of [Store.MarkPublished],
// so that it can travel in one round trip with the rest of a relay's batch
// and its COMMIT. It queues nothing when ids is empty.
func (s *Store) QueueMarkPublished(b *pgx.Batch, ids []uuid.UUID) {
	if len(ids) > 0 {
		b.Queue(s.markPublishedSQL(), binaryUUIDs(ids))
	}
}

// binaryUUIDs converts ids to what pgx encodes straight into a binary uuid
// array: it encodes a uuid.UUID through its driver.Valuer, as text that the
// server parses again, which cost the relay more CPU than any other part of
// its marks.
func binaryUUIDs(ids []uuid.UUID) [][16]byte {
	out := make([][16]byte, len(ids))
	for i, id := range ids {
		out[i] = id
	}
	return out
}

func (s *Store) markPublishedSQL() string {
	return `UPDATE ` + quoteSchema(s.schema) + `.outbox
		SET status = 'published', published_at = clock_timestamp(), attempts = attempts + 1, last_error = NULL
		WHERE id = ANY($1) AND status = 'pending'`
}

// MarkFailed records failed publish attempts: each row gets its error as
// last_error and one more attempt (none for an Outage), and either becomes
// due again Delay after clock_timestamp() or, when Dead, is parked with
// status 'dead'. Rows that are no longer pending are left alone. Rows
// with the same Delay get the same available_at.
func (s *Store) MarkFailed(ctx context.Context, db DBTX, failures []RelayFailure) error {
	if len(failures) == 0 {
		return nil
	}
	if _, err := db.Exec(ctx, s.markFailedSQL(), markFailedArgs(failures)...); err != nil {
		return fmt.Errorf("store: mark %d messages failed: %w", len(failures), err)
	}
	return nil
}

// QueueMarkFailed queues on b the one statement of [Store.MarkFailed]. It
// queues nothing when failures is empty.
func (s *Store) QueueMarkFailed(b *pgx.Batch, failures []RelayFailure) {
	if len(failures) > 0 {
		b.Queue(s.markFailedSQL(), markFailedArgs(failures)...)
	}
}

func markFailedArgs(failures []RelayFailure) []any {
	ids := make([][16]byte, len(failures))
	errs := make([]string, len(failures))
	delays := make([]int64, len(failures))
	dead := make([]bool, len(failures))
	counted := make([]bool, len(failures))
	for i, f := range failures {
		ids[i], errs[i], delays[i], dead[i] = f.ID, f.Err, micros(max(f.Delay, 0)), f.Dead
		counted[i] = f.Dead || !f.Outage
	}
	return []any{ids, errs, delays, dead, counted}
}

// markFailedSQL reads the clock once for the statement (a materialized
// CTE), not once per row: rows of one key that failed together with the
// same delay must stay in their claim order (available_at, id), which a
// per-row clock_timestamp() would shuffle by the join's row order.
func (s *Store) markFailedSQL() string {
	return `WITH t AS MATERIALIZED (SELECT clock_timestamp() AS ts)
		UPDATE ` + quoteSchema(s.schema) + `.outbox o SET
			attempts = o.attempts + CASE WHEN f.counted THEN 1 ELSE 0 END,
			last_error = f.err,
			status = CASE WHEN f.dead THEN 'dead' ELSE o.status END,
			available_at = CASE WHEN f.dead THEN o.available_at
				ELSE t.ts + f.delay_us * interval '1 microsecond' END
		FROM t, unnest($1::uuid[], $2::text[], $3::int8[], $4::bool[], $5::bool[]) AS f(id, err, delay_us, dead, counted)
		WHERE o.id = f.id AND o.status = 'pending'`
}

// RelayOutboxStatus is [Store.OutboxStatus] for the rows the relay
// publishes (delivery 'relay') only: pending rows (due or waiting for a
// retry), the age of the oldest by the database's clock, dead rows, and the
// dead letters not requeued. Published is not counted (0): counting it would
// read every published row; use OutboxStatus for that.
func (s *Store) RelayOutboxStatus(ctx context.Context, db DBTX) (OutboxStatus, error) {
	var st OutboxStatus
	var age *float64
	q := quoteSchema(s.schema) + `.outbox`
	err := db.QueryRow(ctx, `SELECT p.n, p.age,
			(SELECT count(*) FROM `+q+` WHERE status = 'dead' AND delivery = 'relay'),
			(SELECT count(*) FROM `+quoteSchema(s.schema)+`.dead_letters WHERE requeued_at IS NULL)
		FROM (SELECT count(*) AS n, EXTRACT(EPOCH FROM now() - min(created_at)) AS age
			FROM `+q+` WHERE status = 'pending' AND delivery = 'relay') p`).Scan(&st.Pending, &age, &st.Dead, &st.DeadLetters)
	if err != nil {
		return st, fmt.Errorf("store: relay outbox status: %w", err)
	}
	if age != nil {
		st.OldestPendingAge = time.Duration(*age * float64(time.Second))
	}
	return st, nil
}

// NextRelayDue returns how long until the next pending relay row that was
// not due when the caller last claimed (one waiting for a retry, or written
// with a delay) becomes due, by the database's clock; zero or less for one
// that came due in the last since (the time since that claim began). Rows
// due before that (claimed by another relay) do not count, nor rows written
// due at once, whose writers announce them. ok is false when there is none.
func (s *Store) NextRelayDue(ctx context.Context, db DBTX, since time.Duration) (d time.Duration, ok bool, err error) {
	var secs *float64
	err = db.QueryRow(ctx, s.q.nextRelayDue, micros(since)).Scan(&secs)
	if err != nil {
		return 0, false, fmt.Errorf("store: next due relay message: %w", err)
	}
	d, ok = dueIn(secs)
	return d, ok, nil
}

// QueueNextRelayDueInClaim queues on q, which runs in the transaction of a
// relay's claim, what [Store.NextRelayDue] asks with since the time that
// claim began: the transaction's start, by the database's clock, so that a
// claim's own round trip need not be followed by one more. *d and *ok hold
// the answer, relative to when the statement ran, once q was sent and
// closed without an error.
func (s *Store) QueueNextRelayDueInClaim(q *pgx.Batch, d *time.Duration, ok *bool) {
	q.Queue(s.q.nextRelayDueInClaim).QueryRow(func(row pgx.Row) error {
		var secs *float64
		if err := row.Scan(&secs); err != nil {
			return fmt.Errorf("store: next due relay message: %w", err)
		}
		*d, *ok = dueIn(secs)
		return nil
	})
}

func dueIn(secs *float64) (time.Duration, bool) {
	if secs == nil {
		return 0, false
	}
	return time.Duration(*secs * float64(time.Second)), true
}

// QueueCommit queues COMMIT on b, ending a transaction begun on the same
// batch or before it, and makes the batch fail when the server answered
// with a rollback instead (a transaction an earlier statement aborted);
// committed, when not nil, runs once the commit is confirmed.
func QueueCommit(b *pgx.Batch, committed func()) {
	b.Queue("COMMIT").Exec(func(ct pgconn.CommandTag) error {
		if ct.String() != "COMMIT" {
			return fmt.Errorf("the transaction was rolled back (%s)", ct)
		}
		if committed != nil {
			committed()
		}
		return nil
	})
}
