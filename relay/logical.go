package relay

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/migrations"
)

// The log-based relay lives in package relay, not a package of its own, so
// that it publishes through the same message building, size checks and
// error classification as the polling relay instead of a copy of them.

// LogicalConfig defaults.
const (
	// SlotDefault names the replication slot of a [LogicalRelay].
	SlotDefault = "sagaflow_relay"
	// PublicationDefault names the publication a [LogicalRelay] reads.
	PublicationDefault = "sagaflow_relay"
	// StatusIntervalDefault is how often the relay reports its position to
	// the server when nothing else happens.
	StatusIntervalDefault = 10 * time.Second
	// StatusIntervalMin is the shortest StatusInterval: the relay waits
	// for the stream at most until its next report, and a shorter wait
	// would end before anything streamed in.
	StatusIntervalMin = 100 * time.Millisecond
	// publicationMaxBytes is PostgreSQL's longest name (NAMEDATALEN - 1):
	// a longer one is cut, and two relays whose names share their first
	// 63 bytes would share a publication.
	publicationMaxBytes = 63
	// LogicalGatherWait is the longest a [LogicalRelay] holds the rows it
	// gathered while it waits for more of the stream. The server usually
	// says sooner that it has sent everything (a keepalive that asks for
	// the relay's position), and then they are written at once.
	LogicalGatherWait = 2 * time.Millisecond
)

// LogicalConfig configures a [LogicalRelay]. A nil *LogicalConfig, and
// every zero field, means the default.
type LogicalConfig struct {
	// Schema holds sagaflow's tables. Defaults to migrations.SchemaDefault.
	Schema string
	// Slot is the logical replication slot (plugin pgoutput). Defaults to
	// SlotDefault.
	Slot string
	// Publication carries the outbox's relay inserts: a name of at most
	// 63 bytes, without NUL, used as it is spelled (upper case included).
	// Defaults to PublicationDefault.
	Publication string
	// MaxMessageBytes bounds a message, as for [Config]. Defaults to
	// MaxMessageBytesDefault.
	MaxMessageBytes int
	// PublishTimeout bounds one write to the broker: at least
	// PublishTimeoutMin. Defaults to PublishTimeoutDefault.
	PublishTimeout time.Duration
	// OutageBackoffMax caps the wait between writes while the broker is
	// down; not negative. Defaults to OutageBackoffMaxDefault.
	OutageBackoffMax time.Duration
	// StatusInterval: see StatusIntervalDefault; at least
	// StatusIntervalMin.
	StatusInterval time.Duration
	// BatchSize is how many rows the relay gathers, from consecutive
	// committed transactions that stream in together, before it writes
	// them with one call (a transaction is never split, so a larger one
	// goes as one write). Defaults to BatchSizeDefault; at most
	// BatchSizeMax.
	BatchSize int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// MeterProvider makes the relay's metrics: sagaflow.outbox.slot.lag
	// (bytes of WAL the slot holds back, read from pg_replication_slots at
	// each collection) and sagaflow.outbox.published. Defaults to the
	// global provider.
	MeterProvider metric.MeterProvider
}

// LogicalRelay publishes the outbox's relay rows from PostgreSQL's logical
// replication stream (pgoutput) instead of claiming them: see
// docs/relays.md for what it does and what it leaves to the polling
// [Relay]. It reads transactions in commit order and waits until other
// sessions can see each one. Consecutive transactions that stream in
// together (a backlog, or a busy writer) are gathered, up to
// LogicalConfig.BatchSize rows; the gathered rows are written with one
// WriteMessages call, in commit order, as soon as the stream has nothing
// more to give at once (the server, having sent all it has, asks for the
// relay's position, or nothing came for [LogicalGatherWait]), then
// marked published (or bad rows parked dead) in one transaction, and only
// then is the last transaction's end confirmed to the slot. A crash before
// the confirmation streams those transactions again: consumers deduplicate
// on sagaflow-message-id.
type LogicalRelay struct {
	pool      *pgxpool.Pool
	connStr   string
	w         Writer
	cfg       LogicalConfig
	st        *store.Store
	log       *slog.Logger
	outages   atomic.Int64
	running   atomic.Bool
	confirms  atomic.Uint64 // the last LSN confirmed to the slot
	published atomic.Int64
}

// NewLogical returns a LogicalRelay that reads the stream over a
// replication connection to replConnString (a connection string for the
// database the pool reaches; "replication=database" is added) and marks
// rows through pool.
func NewLogical(pool *pgxpool.Pool, replConnString string, w Writer, cfg *LogicalConfig) (*LogicalRelay, error) {
	c := LogicalConfig{}
	if cfg != nil {
		c = *cfg
	}
	if c.Schema == "" {
		c.Schema = migrations.SchemaDefault
	}
	if c.Slot == "" {
		c.Slot = SlotDefault
	}
	if c.Publication == "" {
		c.Publication = PublicationDefault
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = MaxMessageBytesDefault
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = PublishTimeoutDefault
	}
	if c.OutageBackoffMax == 0 {
		c.OutageBackoffMax = OutageBackoffMaxDefault
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = StatusIntervalDefault
	}
	if c.BatchSize == 0 {
		c.BatchSize = BatchSizeDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch {
	case pool == nil:
		return nil, errors.New("relay: NewLogical: pool is nil")
	case w == nil:
		return nil, errors.New("relay: NewLogical: writer is nil")
	case c.MaxMessageBytes < 0:
		return nil, fmt.Errorf("relay: LogicalConfig.MaxMessageBytes %d is negative", c.MaxMessageBytes)
	case c.BatchSize < 0 || c.BatchSize > BatchSizeMax:
		return nil, fmt.Errorf("relay: LogicalConfig.BatchSize %d is outside 1..%d", c.BatchSize, BatchSizeMax)
	case c.PublishTimeout < PublishTimeoutMin:
		return nil, fmt.Errorf("relay: LogicalConfig.PublishTimeout %v is shorter than PublishTimeoutMin (%v)", c.PublishTimeout, PublishTimeoutMin)
	case c.OutageBackoffMax < 0:
		return nil, fmt.Errorf("relay: LogicalConfig.OutageBackoffMax %v is negative", c.OutageBackoffMax)
	case c.StatusInterval < StatusIntervalMin:
		return nil, fmt.Errorf("relay: LogicalConfig.StatusInterval %v is shorter than StatusIntervalMin (%v)", c.StatusInterval, StatusIntervalMin)
	case len(c.Publication) > publicationMaxBytes || strings.ContainsRune(c.Publication, 0):
		return nil, fmt.Errorf("relay: LogicalConfig.Publication %q is longer than %d bytes or holds NUL", safetext.Text(c.Publication, 80), publicationMaxBytes)
	}
	if err := migrations.ValidateSchema(c.Schema); err != nil {
		return nil, fmt.Errorf("relay: LogicalConfig.Schema: %w", err)
	}
	sep := "?"
	if strings.Contains(replConnString, "?") {
		sep = "&"
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("relay: LogicalConfig.Schema: %w", err)
	}
	r := &LogicalRelay{
		pool: pool, connStr: replConnString + sep + "replication=database", w: w, cfg: c,
		st: st, log: c.Logger,
	}
	if err := r.instrument(); err != nil {
		return nil, fmt.Errorf("relay: logical relay metrics: %w", err)
	}
	return r, nil
}

func (r *LogicalRelay) instrument() error {
	m := telemetry.Meter(r.cfg.MeterProvider)
	lag, err := m.Int64ObservableGauge("sagaflow.outbox.slot.lag", metric.WithUnit("By"),
		metric.WithDescription("Bytes of WAL the log-based relay's replication slot holds back."))
	if err != nil {
		return err
	}
	published, err := m.Int64ObservableCounter("sagaflow.outbox.published", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows this relay published."))
	if err != nil {
		return err
	}
	slot := attribute.String("slot", r.cfg.Slot)
	_, err = m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		o.ObserveInt64(published, r.published.Load())
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if n, err := r.SlotLag(ctx); err == nil {
			o.ObserveInt64(lag, n, metric.WithAttributes(slot))
		}
		return nil
	}, lag, published)
	return err
}

// Setup creates the publication (inserts of delivery 'relay' rows only,
// PostgreSQL 15 or later) and the slot when they do not exist. It needs
// ownership of the outbox and the REPLICATION privilege.
func (r *LogicalRelay) Setup(ctx context.Context) error {
	var n int
	err := r.pool.QueryRow(ctx, `SELECT count(*) FROM pg_publication WHERE pubname = $1`, r.cfg.Publication).Scan(&n)
	if err == nil && n == 0 {
		_, err = r.pool.Exec(ctx, `CREATE PUBLICATION `+pgx.Identifier{r.cfg.Publication}.Sanitize()+
			` FOR TABLE `+migrations.QuoteSchema(r.cfg.Schema)+`.outbox WHERE (delivery = 'relay') WITH (publish = 'insert')`)
	}
	if err != nil {
		return fmt.Errorf("relay: create publication %s: %w", r.cfg.Publication, err)
	}
	err = r.pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, r.cfg.Slot).Scan(&n)
	if err == nil && n == 0 {
		_, err = r.pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, r.cfg.Slot)
	}
	if err != nil {
		return fmt.Errorf("relay: create replication slot %s: %w", r.cfg.Slot, err)
	}
	return nil
}

// SlotLag returns how many bytes of WAL the slot holds back: the server's
// current position minus the slot's confirmed flush position.
func (r *LogicalRelay) SlotLag(ctx context.Context) (int64, error) {
	var lag *int64
	err := pgerr.RetryRead(ctx, func(ctx context.Context) error {
		return r.pool.QueryRow(ctx, `SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::int8
		FROM pg_replication_slots WHERE slot_name = $1`, r.cfg.Slot).Scan(&lag)
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("relay: slot %s does not exist", r.cfg.Slot)
	}
	if err != nil {
		return 0, fmt.Errorf("relay: lag of slot %s: %w", r.cfg.Slot, err)
	}
	if lag == nil {
		return 0, nil
	}
	return *lag, nil
}

// Check reports the log-based relay's health: it runs, the broker took its
// last writes, and the slot's lag (not OK beyond maxLag bytes).
func (r *LogicalRelay) Check(ctx context.Context, maxLag int64) health.Report {
	running := health.Check{Name: "running", OK: r.running.Load(), Detail: "streaming"}
	if !running.OK {
		running.Detail = "the relay is not streaming"
	}
	outages := r.outages.Load()
	broker := health.Check{Name: "broker", OK: outages == 0, Detail: "the last writes got through"}
	if outages > 0 {
		broker.Detail = fmt.Sprintf("unreachable for the last %d writes", outages)
	}
	slot := health.Check{Name: "slot", OK: true}
	if lag, err := r.SlotLag(ctx); err != nil {
		slot = health.Check{Name: "slot", Detail: err.Error()}
	} else {
		slot.OK = lag <= maxLag
		slot.Detail = fmt.Sprintf("slot %s holds back %d bytes of WAL (limit %d)", r.cfg.Slot, lag, maxLag)
	}
	return health.NewReport("logical-relay", false, running, broker, slot)
}

// Run streams and publishes until ctx ends (it then returns nil) or the
// replication connection fails (it returns the error; call Run again to
// resume from the slot's confirmed position). It never runs twice at once
// on one LogicalRelay.
func (r *LogicalRelay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("relay: LogicalRelay.Run is already running")
	}
	defer r.running.Store(false)
	err := r.stream(ctx)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func (r *LogicalRelay) stream(ctx context.Context) error {
	conn, err := pgconn.Connect(ctx, r.connStr)
	if err != nil {
		return fmt.Errorf("relay: replication connection: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	err = pglogrepl.StartReplication(ctx, conn, r.cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + strings.ReplaceAll(pgx.Identifier{r.cfg.Publication}.Sanitize(), "'", "''") + "'"},
	})
	if err != nil {
		return fmt.Errorf("relay: start replication on slot %s: %w", r.cfg.Slot, err)
	}
	relations := map[uint32]*pglogrepl.RelationMessage{}
	nextStatus := time.Now().Add(r.cfg.StatusInterval)
	var txRows []store.RelayMessage
	var confirmed pglogrepl.LSN
	// The rows of committed transactions gathered for one write, and the
	// end of the last of those transactions (0: nothing gathered).
	var group []store.RelayMessage
	var groupEnd pglogrepl.LSN
	var groupSince time.Time
	flush := func() error {
		if groupEnd == 0 {
			return nil
		}
		if err := r.publishTx(ctx, group); err != nil {
			return err
		}
		group, confirmed, groupEnd = group[:0], groupEnd, 0
		r.confirms.Store(uint64(confirmed))
		if err := r.confirm(ctx, conn, confirmed); err != nil {
			return err
		}
		nextStatus = time.Now().Add(r.cfg.StatusInterval)
		return nil
	}
	// Before PostgreSQL 17 a restart may forget confirmations made since
	// the last checkpoint, and a relay killed after its mark replays what
	// it marked: until the first transaction still pending, rows already
	// published are skipped (one query per replayed transaction).
	replaying := true
	inTx := false
	var xid uint32  // the transaction being read
	var seen string // the last snapshot awaitVisible read
	for {
		if time.Now().After(nextStatus) && confirmed != 0 {
			if err := r.confirm(ctx, conn, confirmed); err != nil {
				return err
			}
			nextStatus = time.Now().Add(r.cfg.StatusInterval)
		}
		deadline := nextStatus
		if gathered := groupSince.Add(LogicalGatherWait); groupEnd != 0 && gathered.Before(deadline) {
			deadline = gathered
		}
		rctx, cancel := context.WithDeadline(ctx, deadline)
		raw, err := conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() == nil && pgconn.Timeout(err) {
				if groupEnd != 0 && !time.Now().Before(groupSince.Add(LogicalGatherWait)) {
					// Nothing more came at once: write what was gathered.
					if err := flush(); err != nil {
						return err
					}
					continue
				}
				nextStatus = time.Now() // report and go on
				continue
			}
			return fmt.Errorf("relay: receive from slot %s: %w", r.cfg.Slot, err)
		}
		if er, ok := raw.(*pgproto3.ErrorResponse); ok {
			return fmt.Errorf("relay: slot %s: %s", r.cfg.Slot, er.Message)
		}
		cd, ok := raw.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 {
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return fmt.Errorf("relay: keepalive: %w", err)
			}
			// The server sends one when it has sent everything and waits
			// for the relay's position: what was gathered goes now.
			if err := flush(); err != nil {
				return err
			}
			// Between transactions, everything the server sent up to
			// ServerWALEnd has been handled: confirming it lets an idle slot
			// (or one whose WAL is all other tables) move on. A transaction
			// still open commits later, so it is not skipped on a restart.
			if !inTx && ka.ServerWALEnd > confirmed {
				confirmed = ka.ServerWALEnd
				r.confirms.Store(uint64(confirmed))
			}
			if ka.ReplyRequested {
				nextStatus = time.Now()
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return fmt.Errorf("relay: xlog data: %w", err)
			}
			msg, err := pglogrepl.Parse(xld.WALData)
			if err != nil {
				return fmt.Errorf("relay: decode pgoutput: %w", err)
			}
			switch m := msg.(type) {
			case *pglogrepl.RelationMessage:
				relations[m.RelationID] = m
			case *pglogrepl.BeginMessage:
				txRows = txRows[:0]
				inTx = true
				xid = m.Xid
			case *pglogrepl.InsertMessage:
				rel := relations[m.RelationID]
				if rel == nil {
					return fmt.Errorf("relay: insert for unknown relation %d", m.RelationID)
				}
				row, publish, err := decodeOutboxRow(rel, m.Tuple)
				if err != nil {
					// A row we cannot read from the stream is left pending:
					// the polling relay (which reads it by SQL) handles it.
					r.log.WarnContext(ctx, "sagaflow logical relay: row left to the polling relay", slog.String("error", err.Error()))
					continue
				}
				if publish {
					txRows = append(txRows, row)
				}
			case *pglogrepl.CommitMessage:
				if len(txRows) > 0 {
					// Published, checked and marked only once other
					// sessions can see them.
					if err := r.awaitVisible(ctx, conn, xid, confirmed, &seen); err != nil {
						return err
					}
				}
				if replaying && len(txRows) > 0 {
					n := len(txRows)
					if txRows, err = r.stillPending(ctx, txRows); err != nil {
						return err
					}
					replaying = len(txRows) < n
				}
				if groupEnd == 0 {
					groupSince = time.Now()
				}
				group = append(group, txRows...)
				groupEnd = m.TransactionEndLSN
				txRows = txRows[:0]
				inTx = false
				// Written at once when the batch is full; else when the
				// stream pauses: the server, having sent all it has, asks
				// for the relay's position (a keepalive), or nothing new
				// comes for LogicalGatherWait. (A logical stream's headers
				// carry the record's position, not the server's end of WAL,
				// so they cannot tell that this commit was the last.)
				if len(group) >= r.cfg.BatchSize {
					if err := flush(); err != nil {
						return err
					}
				}
			}
		}
	}
}

// awaitVisible returns once transaction xid, whose commit the stream has
// delivered, is visible to new snapshots. PostgreSQL writes a commit to the
// WAL, where the walsender can decode and send it, before it makes the
// transaction visible to other sessions; a committing backend that is slow
// (a loaded machine) or waits for a synchronous standby leaves a gap. In
// that gap the rows are not there for SQL: marking them published would
// update nothing and leave them pending for a sweeper to publish again, and
// the replay check would take them for rows already published. While it
// waits, the relay keeps reporting the last confirmed position, so that the
// server does not drop the connection after wal_sender_timeout.
//
// seen is the last snapshot it read: a transaction finished in it is
// finished for good, so a relay that streams a backlog asks the server
// only when a transaction is newer than what it saw last.
func (r *LogicalRelay) awaitVisible(ctx context.Context, conn *pgconn.PgConn, xid uint32, confirmed pglogrepl.LSN, seen *string) error {
	if *seen != "" {
		if done, err := finishedIn(xid, *seen); err == nil && done {
			return nil
		}
	}
	wait := 100 * time.Microsecond // the gap is usually shorter than a round trip
	nextStatus := time.Now().Add(r.cfg.StatusInterval)
	for {
		if err := r.pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(seen); err != nil {
			return fmt.Errorf("relay: wait for transaction %d to be visible: %w", xid, err)
		}
		done, err := finishedIn(xid, *seen)
		if err != nil || done {
			return err
		}
		if time.Now().After(nextStatus) && confirmed != 0 {
			if err := r.confirm(ctx, conn, confirmed); err != nil {
				return err
			}
			nextStatus = time.Now().Add(r.cfg.StatusInterval)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// finishedIn reports whether the snapshot snap (pg_snapshot's text form,
// xmin:xmax:xip,...) sees transaction xid as finished. xid is the 32-bit id
// pgoutput sends; it is placed in the epoch that puts it nearest xmax.
func finishedIn(xid uint32, snap string) (bool, error) {
	parts := strings.Split(snap, ":")
	if len(parts) != 3 {
		return false, fmt.Errorf("relay: snapshot %q", snap)
	}
	xmin, err1 := strconv.ParseUint(parts[0], 10, 64)
	xmax, err2 := strconv.ParseUint(parts[1], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return false, fmt.Errorf("relay: snapshot %q: %w", snap, err)
	}
	full := int64(xmax) + int64(int32(xid-uint32(xmax)))
	switch {
	case full < int64(xmin):
		return true, nil
	case full >= int64(xmax):
		return false, nil
	}
	if parts[2] == "" {
		return true, nil
	}
	for _, s := range strings.Split(parts[2], ",") {
		x, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return false, fmt.Errorf("relay: snapshot %q: %w", snap, err)
		}
		if int64(x) == full {
			return false, nil
		}
	}
	return true, nil
}

// stillPending returns the rows of rows that are still pending.
func (r *LogicalRelay) stillPending(ctx context.Context, rows []store.RelayMessage) ([]store.RelayMessage, error) {
	ids := make([]uuid.UUID, len(rows))
	for i := range rows {
		ids[i] = rows[i].ID
	}
	q, err := r.pool.Query(ctx, `SELECT id FROM `+migrations.QuoteSchema(r.cfg.Schema)+`.outbox
		WHERE id = ANY($1) AND status = 'pending'`, ids)
	if err != nil {
		return nil, fmt.Errorf("relay: read the status of %d replayed rows: %w", len(ids), err)
	}
	pending, err := pgx.CollectRows(q, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("relay: read the status of %d replayed rows: %w", len(ids), err)
	}
	out := rows[:0]
	for _, row := range rows {
		for _, id := range pending {
			if id == row.ID {
				out = append(out, row)
				break
			}
		}
	}
	return out, nil
}

func (r *LogicalRelay) confirm(ctx context.Context, conn *pgconn.PgConn, lsn pglogrepl.LSN) error {
	err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn, WALFlushPosition: lsn, WALApplyPosition: lsn,
	})
	if err != nil {
		return fmt.Errorf("relay: confirm %s to slot %s: %w", lsn, r.cfg.Slot, err)
	}
	return nil
}

// publishTx publishes one committed transaction's rows and records the
// outcome; it returns only when every row is either acknowledged (and marked
// published) or parked dead, or ctx ends, or PostgreSQL fails.
func (r *LogicalRelay) publishTx(ctx context.Context, rows []store.RelayMessage) error {
	if len(rows) == 0 {
		return nil
	}
	var dead []store.RelayFailure
	var msgs []kafka.Message
	var ids []uuid.UUID
	for i := range rows {
		m, why := buildMessage(&rows[i], r.cfg.MaxMessageBytes)
		if why != "" {
			dead = append(dead, store.RelayFailure{ID: rows[i].ID, Err: why, Dead: true})
			continue
		}
		msgs = append(msgs, m)
		ids = append(ids, rows[i].ID)
	}
	var acked []uuid.UUID
	tries := make([]int, len(msgs)) // failed attempts that were not an outage
	for outage := 0; len(msgs) > 0; {
		wctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
		err := r.w.WriteMessages(wctx, msgs...)
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err == nil {
			acked = append(acked, ids...)
			r.outages.Store(0)
			break
		}
		var werrs kafka.WriteErrors
		var retryMsgs []kafka.Message
		var retryIDs []uuid.UUID
		var retryTries []int
		for i := range msgs {
			e := err
			if errors.As(err, &werrs) && len(werrs) == len(msgs) {
				e = werrs[i]
			}
			if e == nil {
				acked = append(acked, ids[i])
				continue
			}
			class, code := classify(e)
			if class == classPermanent {
				dead = append(dead, store.RelayFailure{ID: ids[i], Err: reason(code, "%v", e), Dead: true})
				continue
			}
			if class != classOutage {
				// A row-specific failure (an unknown topic, say) must not
				// hold the stream back for good.
				if tries[i]++; tries[i] >= MaxAttemptsDefault {
					dead = append(dead, store.RelayFailure{ID: ids[i], Dead: true,
						Err: reason(CodeAttemptsExhausted, "%d attempts failed, the last: %v", tries[i], e)})
					continue
				}
			}
			retryMsgs, retryIDs = append(retryMsgs, msgs[i]), append(retryIDs, ids[i])
			retryTries = append(retryTries, tries[i])
		}
		msgs, ids, tries = retryMsgs, retryIDs, retryTries
		if len(msgs) > 0 {
			outage++
			r.outages.Store(int64(outage))
			r.log.WarnContext(ctx, "sagaflow logical relay: write failed; the slot waits and the write is retried",
				slog.Int("messages", len(msgs)), slog.String("error", err.Error()))
			d := min(BackoffMinDefault<<min(outage-1, 10), r.cfg.OutageBackoffMax)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(d):
			}
		}
	}
	if err := r.settle(ctx, acked, dead); err != nil {
		return err
	}
	r.published.Add(int64(len(acked)))
	return nil
}

// settle marks a transaction's published rows and parks its dead ones in
// one transaction and one round trip, whose commit does not wait for its
// WAL to reach the disk (as the polling relay's, see the package doc). A
// crash of PostgreSQL that undoes the marks loses no message (the broker
// acknowledged each before it was marked): the rows are left pending, and
// are streamed and published again from the slot's saved position, which
// is confirmed only after the marks and saved at checkpoints; should it
// ever be saved past marks the crash undid, those rows stay pending and a
// sweeper publishes them again after SweepAfter.
func (r *LogicalRelay) settle(ctx context.Context, acked []uuid.UUID, dead []store.RelayFailure) error {
	if len(acked) == 0 && len(dead) == 0 {
		return nil
	}
	q := &pgx.Batch{}
	q.Queue("BEGIN")
	q.Queue("SET LOCAL synchronous_commit = off")
	r.st.QueueMarkPublished(q, acked)
	r.st.QueueMarkFailed(q, dead)
	store.QueueCommit(q, nil)
	if err := r.pool.SendBatch(ctx, q).Close(); err != nil {
		return fmt.Errorf("relay: mark %d published and %d dead: %w", len(acked), len(dead), err)
	}
	return nil
}

// decodeOutboxRow reads an outbox insert from pgoutput's text tuple. It
// reports publish false for a row the stream must not publish: not a
// relay row, not pending, or due later than it was written (a delayed
// row, left to the polling relay).
func decodeOutboxRow(rel *pglogrepl.RelationMessage, tup *pglogrepl.TupleData) (store.RelayMessage, bool, error) {
	var row store.RelayMessage
	if tup == nil || len(tup.Columns) != len(rel.Columns) {
		return row, false, fmt.Errorf("relay: tuple of %s.%s does not match its relation", rel.Namespace, rel.RelationName)
	}
	var delivery, status, availableAt, createdAt string
	for i, c := range tup.Columns {
		name := rel.Columns[i].Name
		if c.DataType == pglogrepl.TupleDataTypeNull {
			continue
		}
		if c.DataType != pglogrepl.TupleDataTypeText {
			return row, false, fmt.Errorf("relay: column %s of %s.%s is not sent as text", name, rel.Namespace, rel.RelationName)
		}
		v := string(c.Data)
		var err error
		switch name {
		case "id":
			row.ID, err = uuid.Parse(v)
		case "topic":
			row.Topic = v
		case "delivery":
			delivery = v
		case "aggregatetype":
			row.AggregateType = v
		case "aggregateid":
			row.AggregateID = v
		case "type":
			row.Type = v
		case "payload":
			if !strings.HasPrefix(v, `\x`) {
				return row, false, fmt.Errorf("relay: payload of outbox row %s is not hex bytea", row.ID)
			}
			row.Payload, err = hex.DecodeString(v[2:])
		case "headers":
			row.Headers = []byte(v)
		case "saga_id":
			var id uuid.UUID
			id, err = uuid.Parse(v)
			row.SagaID = &id
		case "step_key":
			row.StepKey = &v
		case "status":
			status = v
		case "available_at":
			availableAt = v
		case "created_at":
			createdAt = v
		}
		if err != nil {
			return row, false, fmt.Errorf("relay: column %s of outbox row: %w", name, err)
		}
	}
	if delivery != "relay" || status != "pending" {
		return row, false, nil
	}
	if availableAt != createdAt {
		a, errA := parseTimestamptz(availableAt)
		c, errC := parseTimestamptz(createdAt)
		if errA != nil || errC != nil || a.After(c) {
			return row, false, nil // the polling relay publishes it when due
		}
	}
	return row, true, nil
}

func parseTimestamptz(s string) (time.Time, error) {
	for _, layout := range []string{"2006-01-02 15:04:05.999999-07", "2006-01-02 15:04:05.999999-07:00", "2006-01-02 15:04:05.999999-07:00:00"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("relay: timestamp %q", s)
}
