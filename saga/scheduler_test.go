package saga_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

func TestCronSlotsStartOneSagaEachAcrossEngines(t *testing.T) {
	t.Parallel()
	zone := time.FixedZone("UTC+1", 3600)
	b := setup(t, &saga.Config{Location: zone})
	def := threeSteps(b, "nightly", nil)
	require.NoError(t, b.engine.Register(def))
	other, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Location: zone, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, other.Register(def))
	// Every second (a six-field spec, seconds first), on both engines.
	for _, e := range []*saga.Engine{b.engine, other} {
		require.NoError(t, saga.Schedule(e, "* * * * * *", def, order{OrderID: "batch"}, &saga.ScheduleOpts{Name: "settle"}))
	}
	require.ErrorContains(t, saga.Schedule(b.engine, "not a spec", def, order{}, nil), `saga: schedule "not a spec"`)

	b.start(t)
	(&bundle{pool: b.pool, schema: b.schema, engine: other}).start(t)
	waitFor(t, 20*time.Second, func() bool {
		s1, s2 := b.engine.Stats(), other.Stats()
		return s1.CronStarted+s2.CronStarted >= 3 && s1.CronDuplicates+s2.CronDuplicates >= 2
	}, "three slots fired on both engines")
	require.ErrorIs(t, saga.Schedule(b.engine, "@hourly", def, order{}, nil), saga.ErrEngineStarted)

	ctx := context.Background()
	rows, err := b.pool.Query(ctx, "SELECT business_key FROM "+b.table("saga_instances")+" ORDER BY business_key")
	require.NoError(t, err)
	var keys []string
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, k)
	}
	require.NoError(t, rows.Err())
	// Both engines fired the same slots (duplicates were refused by the
	// business key, so the sagas are exactly the starts that succeeded),
	// and each key names its slot in the configured zone.
	s1, s2 := b.engine.Stats(), other.Stats()
	require.Len(t, keys, int(s1.CronStarted+s2.CronStarted))
	var slots []time.Time
	for _, k := range keys {
		require.True(t, strings.HasPrefix(k, "cron:settle:"), k)
		require.True(t, strings.HasSuffix(k, "+01:00"), k)
		slot, err := time.Parse(time.RFC3339, strings.TrimPrefix(k, "cron:settle:"))
		require.NoError(t, err, k)
		slots = append(slots, slot)
	}
	// Every second from the first slot to the last has its saga: no slot
	// was skipped.
	require.Equal(t, len(slots)-1, int(slots[len(slots)-1].Sub(slots[0])/time.Second), "slots: %v", slots)
	t.Logf("slots: %d, started by engine 1: %d, by engine 2: %d, duplicates seen: %d",
		len(keys), s1.CronStarted, s2.CronStarted, s1.CronDuplicates+s2.CronDuplicates)
}

func TestScheduledRescuerRunsByItself(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{RescueInterval: time.Second})
	def := threeSteps(b, "self-rescue", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.deleteCommands(t, st.ID)
	b.overdue(t, st.ID)
	b.start(t) // no RescueNow: the scheduler finds it
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	require.Equal(t, int64(1), b.engine.Stats().Rescued)
}

func TestRetentionDeletesOnlyWhatIsPastItsWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{RetentionBatch: 2, OutboxRetention: time.Hour, InboxRetention: 2 * time.Hour, SagaRetention: 3 * time.Hour})
	def := threeSteps(b, "retained", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := b.pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	// Published messages: 5 past the window, 2 inside it, 1 pending and 1
	// dead that are old but never deleted.
	for _, age := range []string{"61 minutes", "2 hours", "3 hours", "1 day", "30 days", "59 minutes", "1 minute"} {
		exec("INSERT INTO "+b.table("outbox")+` (id, topic, aggregateid, type, payload, status, published_at)
			VALUES ($1, 't', 'a', 'x', '{}', 'published', now() - $2::interval)`, uuid.New(), age)
	}
	exec("INSERT INTO "+b.table("outbox")+` (id, topic, aggregateid, type, payload, created_at) VALUES ($1, 't', 'a', 'x', '{}', now() - interval '30 days')`, uuid.New())
	exec("INSERT INTO "+b.table("outbox")+` (id, topic, aggregateid, type, payload, status, created_at) VALUES ($1, 't', 'a', 'x', '{}', 'dead', now() - interval '30 days')`, uuid.New())
	// Inbox keys: 3 past the 2h window, 1 inside.
	for i, age := range []string{"3 hours", "5 hours", "9 days", "90 minutes"} {
		exec("INSERT INTO "+b.table("inbox")+` (consumer, key, processed_at) VALUES ('c', $1, now() - $2::interval)`, "k"+string(rune('a'+i)), age)
	}
	// Sagas: finished long ago (deleted with their history), finished
	// recently, failed long ago (kept for an operator), and running.
	b.start(t)
	var ids []uuid.UUID
	for range 4 {
		st, err := saga.Start(ctx, b.engine, def, order{}, nil)
		require.NoError(t, err)
		b.waitTerminal(t, st.ID)
		ids = append(ids, st.ID)
	}
	exec("UPDATE "+b.table("saga_instances")+" SET ended_at = now() - interval '4 hours' WHERE id = ANY($1)", ids[:2])
	exec("UPDATE "+b.table("saga_instances")+" SET ended_at = now() - interval '4 hours', status = 'failed' WHERE id = $1", ids[2])

	// Signals: one for each of the sagas deleted (they go with them), and
	// three for no saga: two past the window, one inside it.
	for _, id := range ids {
		exec("INSERT INTO "+b.table("saga_signals")+` (saga_id, target, name, signal_id, payload, status)
			VALUES ($1, $2, 'n', 'i', '\x', 'rejected')`, id, id.String())
	}
	for i, age := range []string{"4 hours", "9 days", "1 hour"} {
		exec("INSERT INTO "+b.table("saga_signals")+` (target, name, signal_id, payload, status, created_at)
			VALUES ('x/y', 'n', $1, '\x', 'rejected', now() - $2::interval)`, "s"+string(rune('a'+i)), age)
	}

	// One statement deletes at most RetentionBatch rows.
	st, err := store.New(b.schema)
	require.NoError(t, err)
	n, err := st.DeleteInboxKeys(ctx, b.pool, "", 2*time.Hour, 2)
	require.NoError(t, err)
	require.Equal(t, int64(2), n)

	res, err := b.engine.RunRetention(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RetentionResult{Messages: 5, InboxKeys: 1, Sagas: 2, Signals: 2}, res)
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("saga_signals")+" WHERE saga_id = ANY($1)", ids[:2]))
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("saga_signals")+" WHERE saga_id = ANY($1)", ids[2:]))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("saga_signals")+" WHERE saga_id IS NULL"))
	require.Equal(t, 4, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE status = 'published'"))
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("inbox")+" WHERE consumer = 'c'"))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE id = ANY($1)", ids[:2]))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("saga_history")+" WHERE saga_id = ANY($1)", ids[:2]))
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE id = ANY($1)", ids[2:]))
	require.Positive(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_history")+" WHERE saga_id = $1", ids[2]))

	again, err := b.engine.RunRetention(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RetentionResult{}, again)
}

func TestSchedulerConfigIsValidated(t *testing.T) {
	t.Parallel()
	_, err := saga.New(dummyPool(t), &saga.Config{OutboxRetention: 48 * time.Hour, InboxRetention: 24 * time.Hour})
	require.ErrorIs(t, err, saga.ErrInvalidConfig)
	require.ErrorContains(t, err, "InboxRetention (24h0m0s) must be longer than OutboxRetention (48h0m0s), the replay window")
	_, err = saga.New(dummyPool(t), &saga.Config{OutboxRetention: 30 * 24 * time.Hour})
	require.ErrorContains(t, err, "InboxRetention (336h0m0s) must be longer than OutboxRetention (720h0m0s)",
		"the default inbox window is checked against a longer replay window")
	_, err = saga.New(dummyPool(t), &saga.Config{RescueInterval: 100 * time.Millisecond})
	require.ErrorContains(t, err, "RescueInterval must be at least 1s")
	_, err = saga.New(dummyPool(t), &saga.Config{RetentionBatch: -1})
	require.ErrorContains(t, err, "RetentionBatch must not be negative")
}
