package relay_test

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// logicalEnv is a throwaway server with wal_level=logical, a migrated
// schema on it, a kfake cluster and a log-based relay run by a supervisor
// that restarts it when its stream breaks.
type logicalEnv struct {
	t    *testing.T
	ctx  context.Context
	srv  *pgtest.Server
	pool *pgxpool.Pool
	kc   *kafkatest.Cluster
	lr   *relay.LogicalRelay
	mr   *sdkmetric.ManualReader

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

const cdcSchema = "cdc"

func setupLogical(t *testing.T) *logicalEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	srv, err := pgtest.StartLogicalServer(ctx)
	if err != nil {
		t.Skipf("no throwaway PostgreSQL with wal_level=logical (needs the PostgreSQL server binaries: initdb, postgres): %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop(context.Background()) })
	pool, err := pgxpool.New(ctx, srv.ConnString())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = migrations.Migrate(ctx, pool, cdcSchema)
	require.NoError(t, err)
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, topicOrders))
	w := relay.NewKafkaWriter(kc.Addrs(), &relay.WriterOpts{MaxAttempts: 1, MetadataTTL: 500 * time.Millisecond})
	t.Cleanup(func() { _ = w.Close() })
	mr := sdkmetric.NewManualReader()
	lr, err := relay.NewLogical(pool, srv.ConnString(), w, &relay.LogicalConfig{
		Schema: cdcSchema, Slot: "cdc_test", Publication: "cdc_test", StatusInterval: 200 * time.Millisecond,
		Logger: testLogger(t), MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(mr)),
	})
	require.NoError(t, err)
	require.NoError(t, lr.Setup(ctx))
	e := &logicalEnv{t: t, ctx: ctx, srv: srv, pool: pool, kc: kc, lr: lr, mr: mr}
	t.Cleanup(e.kill) // before the server stops, and before the test's log closes
	return e
}

// start runs the relay until stop, restarting it whenever Run returns an
// error (a PostgreSQL restart breaks the stream).
func (e *logicalEnv) start() {
	e.mu.Lock()
	defer e.mu.Unlock()
	ctx, cancel := context.WithCancel(e.ctx)
	e.cancel, e.done = cancel, make(chan struct{})
	go func(done chan struct{}) {
		defer close(done)
		for ctx.Err() == nil {
			err := e.lr.Run(ctx)
			if err == nil {
				return
			}
			e.t.Logf("%s logical relay: Run: %v; restarting", time.Now().Format("15:04:05.000"), err)
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}(e.done)
}

// kill stops the relay at once: whatever it had not confirmed stays in the
// slot.
func (e *logicalEnv) kill() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.cancel == nil {
		return
	}
	e.cancel()
	<-e.done
}

// insert commits one transaction of relay rows with the given sequence
// numbers as payload, all under one key, retrying while the server restarts.
func (e *logicalEnv) insert(t *testing.T, seqs []int, delivery string) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, len(seqs))
	for i := range ids {
		ids[i] = uuid.New()
	}
	var err error
	for range 100 {
		err = func() error {
			tx, err := e.pool.Begin(e.ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(e.ctx) }()
			for i, s := range seqs {
				if _, err := tx.Exec(e.ctx, `INSERT INTO cdc.outbox (id, topic, delivery, aggregateid, type, payload)
					VALUES ($1, $2, $3, 'k', 'test', $4)`, ids[i], topicOrders, delivery, []byte(strconv.Itoa(s))); err != nil {
					return err
				}
			}
			return tx.Commit(e.ctx)
		}()
		if err == nil {
			return ids
		}
		time.Sleep(50 * time.Millisecond) // the server is restarting
	}
	require.NoError(t, err)
	return nil
}

func (e *logicalEnv) published(t *testing.T) int {
	var n int
	for range 100 {
		if err := e.pool.QueryRow(e.ctx, `SELECT count(*) FROM cdc.outbox WHERE status = 'published'`).Scan(&n); err == nil {
			return n
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("count published rows: the server does not answer")
	return 0
}

// TestLogicalRelayEndToEnd streams the outbox to kfake through a PostgreSQL
// restart and a hard stop of the relay, and counts every message by id.
func TestLogicalRelayEndToEnd(t *testing.T) {
	e := setupLogical(t)
	e.start()

	var want []uuid.UUID
	seq := 0
	batch := func(n int) {
		seqs := make([]int, n)
		for i := range seqs {
			seq++
			seqs[i] = seq
		}
		want = append(want, e.insert(t, seqs, "relay")...)
	}
	for range 10 {
		batch(5)
	}
	direct := e.insert(t, []int{-1, -2}, "direct")
	var delayed, bad uuid.UUID
	delayed, bad = uuid.New(), uuid.New()
	_, err := e.pool.Exec(e.ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload, available_at)
		VALUES ($1, $2, 'k', 'test', '\x00', now() + interval '1 hour')`, delayed, topicOrders)
	require.NoError(t, err)
	_, err = e.pool.Exec(e.ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload, headers)
		VALUES ($1, $2, 'k', 'test', '\x00', '{"n": 1}')`, bad, topicOrders)
	require.NoError(t, err)
	big, badTopic := uuid.New(), uuid.New()
	_, err = e.pool.Exec(e.ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload)
		VALUES ($1, $2, 'k', 'test', $3)`, big, topicOrders, make([]byte, relay.MaxMessageBytesDefault+1))
	require.NoError(t, err)
	_, err = e.pool.Exec(e.ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload)
		VALUES ($1, 'no/such topic', 'k', 'test', '\x00')`, badTopic)
	require.NoError(t, err)
	batch(5) // after the bad rows: not held back
	waitFor(t, time.Minute, "first rows published", func() bool { return e.published(t) == len(want) })

	// PostgreSQL restarts while rows are being written.
	batch(25)
	require.NoError(t, e.srv.Restart(e.ctx))
	batch(25)
	waitFor(t, time.Minute, "rows after the restart published", func() bool { return e.published(t) == len(want) })

	// A hard stop: nothing more is confirmed; rows written meanwhile wait
	// in the slot, whose lag health reports.
	e.kill()
	batch(30)
	lag, err := e.lr.SlotLag(e.ctx)
	require.NoError(t, err)
	require.Positive(t, lag, "the slot lags while the relay is stopped")
	rep := e.lr.Check(e.ctx, 0)
	require.False(t, rep.Ready, "health flags a slot that lags: %+v", rep)
	require.Equal(t, "slot", rep.Checks[2].Name)
	require.False(t, rep.Checks[2].OK, "the slot check fails: %+v", rep.Checks[2])
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.mr.Collect(e.ctx, &rm))
	var gauge int64 = -1
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == "sagaflow.outbox.slot.lag" && len(g.DataPoints) == 1 {
				gauge = g.DataPoints[0].Value
			}
		}
	}
	require.GreaterOrEqual(t, gauge, lag, "the slot lag gauge reports the lag")
	e.start()
	waitFor(t, time.Minute, "rows written while stopped published", func() bool { return e.published(t) == len(want) })

	// WAL of other tables only: the idle relay still moves its slot on,
	// past it, so an idle slot does not look behind.
	_, err = e.pool.Exec(e.ctx, `CREATE TABLE cdc.other AS SELECT g FROM generate_series(1, 10000) g`)
	require.NoError(t, err)
	var after string
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&after))
	waitFor(t, time.Minute, "the slot to move past other tables' WAL", func() bool {
		var past bool
		require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots
			WHERE slot_name = 'cdc_test'`, after).Scan(&past))
		return past
	})
	e.kill()

	msgs, err := e.kc.ReadAll(e.ctx, topicOrders)
	require.NoError(t, err)
	n := copies(t, msgs)
	for _, id := range want {
		require.GreaterOrEqual(t, n[id.String()], 1, "message %s lost", id)
	}
	for _, id := range append(direct, delayed, bad, big, badTopic) {
		require.Zero(t, n[id.String()], "message %s must not be published", id)
	}
	require.Len(t, n, len(want), "only the relay rows are published")

	// Commit order: one key, one partition; the first copy of each
	// sequence number comes in increasing order.
	seen := map[string]bool{}
	last := 0
	for _, m := range msgs {
		id, _ := header(m, store.HeaderMessageID)
		if seen[id] {
			continue
		}
		seen[id] = true
		s, err := strconv.Atoi(string(m.Value))
		require.NoError(t, err)
		require.Greater(t, s, last, "message %d published after %d", s, last)
		last = s
	}

	var status, lastErr string
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT status, last_error FROM cdc.outbox WHERE id = $1`, bad).Scan(&status, &lastErr))
	require.Equal(t, "dead", status)
	require.Contains(t, lastErr, relay.CodeMalformedHeaders)
	for id, code := range map[uuid.UUID]string{big: relay.CodeTooLarge, badTopic: relay.CodeInvalidTopic} {
		require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT status, last_error FROM cdc.outbox WHERE id = $1`, id).Scan(&status, &lastErr))
		require.Equal(t, "dead", status, "row %s", id)
		require.Contains(t, lastErr, code)
	}
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT status FROM cdc.outbox WHERE id = $1`, delayed).Scan(&status))
	require.Equal(t, "pending", status, "a delayed row is left to the polling relay")
	t.Logf("%d rows, %d messages read (%d duplicates), 0 lost", len(want), len(msgs), len(msgs)-len(want))
}

// TestSweeperBesideALogicalRelay: a polling relay in sweeper mode beside the
// log-based relay publishes what the stream does not carry (a delayed row,
// a row requeued after it failed) and never races the stream for a row due
// at once: every row reaches the topic exactly once.
func TestSweeperBesideALogicalRelay(t *testing.T) {
	e := setupLogical(t)
	e.start()
	w := relay.NewKafkaWriter(e.kc.Addrs(), &relay.WriterOpts{MaxAttempts: 1})
	t.Cleanup(func() { _ = w.Close() })
	sweeper, err := relay.New(e.pool, w, &relay.Config{Schema: cdcSchema, Sweeper: true, PollInterval: 50 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, sweeper.Start(e.ctx))
	t.Cleanup(func() { _ = sweeper.Stop(context.Background()) })

	var want []uuid.UUID
	for i := range 20 {
		want = append(want, e.insert(t, []int{3 * i, 3*i + 1, 3*i + 2}, "relay")...)
		// The engine's and outbox.InsertTx's wake-up: a relay that listened
		// would race the stream for these rows.
		_, err := e.pool.Exec(e.ctx, `SELECT pg_notify($1, $2)`, cdcSchema+"_sagaflow", topicOrders)
		require.NoError(t, err)
	}
	delayed := uuid.New()
	_, err = e.pool.Exec(e.ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload, available_at)
		VALUES ($1, $2, 'k', 'test', '\x00', now() + interval '300 milliseconds')`, delayed, topicOrders)
	require.NoError(t, err)
	want = append(want, delayed)
	waitFor(t, time.Minute, "every row published", func() bool { return e.published(t) == len(want) })
	time.Sleep(500 * time.Millisecond) // a duplicate would have been written by now

	msgs, err := e.kc.ReadAll(e.ctx, topicOrders)
	require.NoError(t, err)
	seen := map[string]int{}
	for _, m := range msgs {
		for _, h := range m.Headers {
			if h.Key == "sagaflow-message-id" {
				seen[string(h.Value)]++
			}
		}
	}
	for _, id := range want {
		require.Equal(t, 1, seen[id.String()], "row %s published once", id)
	}
	require.Len(t, seen, len(want))
	h, err := sweeper.Health(e.ctx)
	require.NoError(t, err)
	require.Positive(t, h.Published, "the sweeper published the delayed row")
}

// TestLogicalRelayMarksACommitOnceVisible holds a transaction in the gap
// between its commit record reaching the WAL, where the stream decodes it,
// and its becoming visible to other sessions: a loaded server leaves that
// gap open for a moment, a commit waiting for a synchronous standby (here
// one that does not exist) for as long as it waits. The relay publishes and
// marks the rows only once it can see them: an UPDATE in the gap finds
// nothing, the rows stay pending and a sweeper publishes them again after
// SweepAfter (CI saw a row published twice after 31 s beside a sweeper,
// and waited 60 s in vain for rows marked published without one).
//
// The held transaction comes either after one the relay has published or
// first: at start-up the relay checks replayed rows by SQL, and took rows
// it could not see yet for rows already published, which it skipped.
func TestLogicalRelayMarksACommitOnceVisible(t *testing.T) {
	t.Run("after a first row", func(t *testing.T) { testCommitOnceVisible(t, true) })
	t.Run("first", func(t *testing.T) { testCommitOnceVisible(t, false) })
}

func testCommitOnceVisible(t *testing.T, warm bool) {
	e := setupLogical(t)
	e.start()
	var want []uuid.UUID
	if warm {
		want = e.insert(t, []int{1}, "relay")
		waitFor(t, time.Minute, "the stream to publish a first row", func() bool { return e.published(t) == 1 })
	}
	countedBefore := e.publishedMetric(t)

	// Every commit that writes now waits for the standby 'nobody', once
	// the checkpointer has taken the setting up: a probe's commit shows
	// when.
	_, err := e.pool.Exec(e.ctx, `CREATE TABLE cdc.probe (n int)`)
	require.NoError(t, err)
	_, err = e.pool.Exec(e.ctx, `ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	require.NoError(t, err)
	_, err = e.pool.Exec(e.ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	released := false
	release := func() {
		if released {
			return
		}
		released = true
		_, err := e.pool.Exec(e.ctx, `ALTER SYSTEM RESET synchronous_standby_names`)
		require.NoError(t, err)
		_, err = e.pool.Exec(e.ctx, `SELECT pg_reload_conf()`)
		require.NoError(t, err)
	}
	t.Cleanup(release)
	hold := func(what, sql string, args ...any) <-chan error {
		t.Helper()
		conn, err := pgx.Connect(e.ctx, e.srv.ConnString())
		require.NoError(t, err)
		var pid int
		require.NoError(t, conn.QueryRow(e.ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		done, finished := make(chan error, 1), make(chan struct{})
		go func() {
			defer close(finished)
			_, err := conn.Exec(e.ctx, sql, args...)
			done <- err
		}()
		t.Cleanup(func() {
			release()
			<-finished
			_ = conn.Close(context.Background())
		})
		committed := false
		waitFor(t, time.Minute, what+" to wait for the standby", func() bool {
			select {
			case err := <-done:
				require.NoError(t, err)
				committed = true
				return true
			default:
			}
			var waiting bool
			require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
				WHERE pid = $1 AND wait_event = 'SyncRep')`, pid).Scan(&waiting))
			return waiting
		})
		if committed {
			return nil
		}
		return done
	}
	for hold("a probe", `INSERT INTO cdc.probe VALUES (1)`) == nil {
	}

	held := uuid.New()
	insertDone := hold("the outbox insert", `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload)
		VALUES ($1, $2, 'k', 'test', '\x00')`, held, topicOrders)
	require.NotNil(t, insertDone, "the insert waits for the standby")
	want = append(want, held)
	var visible bool
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT EXISTS (SELECT FROM cdc.outbox WHERE id = $1)`, held).Scan(&visible))
	require.False(t, visible, "the held row is not visible yet")
	// The stream carries the commit at once; a relay that published or
	// marked the row before it could see it would do so within
	// milliseconds.
	watch := time.NewTimer(time.Second)
	defer watch.Stop()
	for tick := time.NewTicker(10 * time.Millisecond); ; {
		msgs, err := e.kc.ReadAll(e.ctx, topicOrders)
		require.NoError(t, err)
		require.Zero(t, copies(t, msgs)[held.String()], "the relay published a row it could not see")
		require.Equal(t, countedBefore, e.publishedMetric(t), "the relay marked rows it could not see")
		select {
		case <-tick.C:
			continue
		case <-watch.C:
		}
		tick.Stop()
		break
	}

	release()
	require.NoError(t, <-insertDone)
	waitFor(t, time.Minute, "the held row marked published", func() bool { return e.published(t) == len(want) })
	e.kill()
	msgs, err := e.kc.ReadAll(e.ctx, topicOrders)
	require.NoError(t, err)
	n := copies(t, msgs)
	for _, id := range want {
		require.Equal(t, 1, n[id.String()], "message %s", id)
	}
}

// publishedMetric returns the relay's sagaflow.outbox.published counter.
func (e *logicalEnv) publishedMetric(t *testing.T) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.mr.Collect(e.ctx, &rm))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if s, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "sagaflow.outbox.published" && len(s.DataPoints) == 1 {
				return s.DataPoints[0].Value
			}
		}
	}
	return 0
}

// A backlog of one-row transactions is published in writes of several
// transactions each, at most LogicalConfig.BatchSize rows, in commit order
// per key, each row once; a row written once the backlog is gone, with
// nothing after it, is published too (the relay does not wait for a full
// batch). One write's per-message failure parks only its own row.
func TestLogicalRelayGathersTransactions(t *testing.T) {
	e := setupLogical(t)
	ctx := e.ctx
	kw := relay.NewKafkaWriter(e.kc.Addrs(), &relay.WriterOpts{MaxAttempts: 1, MetadataTTL: 500 * time.Millisecond})
	t.Cleanup(func() { _ = kw.Close() })
	w := &hookWriter{inner: kw}
	const batch = 10
	lr, err := relay.NewLogical(e.pool, e.srv.ConnString(), w, &relay.LogicalConfig{
		Schema: cdcSchema, Slot: "cdc_gather", Publication: "cdc_gather", BatchSize: batch, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, lr.Setup(ctx))
	_, err = relay.NewLogical(e.pool, e.srv.ConnString(), w, &relay.LogicalConfig{BatchSize: relay.BatchSizeMax + 1})
	require.ErrorContains(t, err, "BatchSize")

	const rows = 300
	var want []uuid.UUID
	for i := 1; i <= rows; i++ {
		id := uuid.New()
		_, err := e.pool.Exec(ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload) VALUES ($1, $2, $3, 'test', $4)`,
			id, topicOrders, "k"+strconv.Itoa(i%3), []byte(strconv.Itoa(i)))
		require.NoError(t, err)
		want = append(want, id)
		if i == 150 {
			// One row in the middle the broker refuses for good.
			_, err := e.pool.Exec(ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload) VALUES ($1, 'no/such topic', 'k0', 'test', '\x00')`, uuid.New())
			require.NoError(t, err)
		}
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- lr.Run(rctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	waitFor(t, time.Minute, "the backlog published", func() bool { return e.published(t) == rows })

	last := uuid.New()
	_, err = e.pool.Exec(ctx, `INSERT INTO cdc.outbox (id, topic, aggregateid, type, payload) VALUES ($1, $2, 'k0', 'test', $3)`,
		last, topicOrders, []byte(strconv.Itoa(rows+1)))
	require.NoError(t, err)
	waitFor(t, time.Minute, "a lone row published", func() bool { return e.published(t) == rows+1 })
	var dead int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM cdc.outbox WHERE status = 'dead'`).Scan(&dead))
	require.Equal(t, 1, dead, "the refused row is parked, the rest published")

	w.mu.Lock()
	writes := slices.Clone(w.writes)
	w.mu.Unlock()
	most := 0
	for _, ws := range writes {
		most = max(most, len(ws))
	}
	require.LessOrEqual(t, most, batch, "a write holds at most BatchSize one-row transactions")
	require.Less(t, len(writes), rows/2, "the backlog's transactions were written together: %d writes for %d rows", len(writes), rows)

	msgs, err := e.kc.ReadAll(ctx, topicOrders)
	require.NoError(t, err)
	n := copies(t, msgs)
	for _, id := range append(want, last) {
		require.Equal(t, 1, n[id.String()], "message %s", id)
	}
	lastOf := map[string]int{}
	for _, m := range msgs {
		s, err := strconv.Atoi(string(m.Value))
		require.NoError(t, err)
		require.Greater(t, s, lastOf[string(m.Key)], "key %s: %d published after %d", m.Key, s, lastOf[string(m.Key)])
		lastOf[string(m.Key)] = s
	}
	t.Logf("%d rows in %d writes (the largest %d)", rows+1, len(writes), most)
}
