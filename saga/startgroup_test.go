package saga_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
)

// refuseBoom makes PostgreSQL refuse the insert of a saga whose business
// key is "boom", which no check in Go catches first.
func refuseBoom(t *testing.T, b *bundle) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), fmt.Sprintf(`
		CREATE FUNCTION %[1]s.refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.business_key = 'boom' THEN RAISE EXCEPTION 'boom is refused'; END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_boom BEFORE INSERT ON %[1]s.saga_instances
			FOR EACH ROW EXECUTE FUNCTION %[1]s.refuse_boom()`, pgx.Identifier{b.schema}.Sanitize()))
	require.NoError(t, err)
}

// Starts at the same time commit together; each still gets its own result,
// a business key held by another transaction holds back only its own start,
// and a start that PostgreSQL refuses fails alone.
func TestConcurrentStartsCommitTogetherAndFailAlone(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "grouped", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	// A start PostgreSQL refuses, which no check in Go catches first.
	refuseBoom(t, b)
	b.start(t)

	// A caller's transaction holds the business key "held" and does not
	// commit yet: a start with that key waits for it.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	heldID, err := saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "held"}, &saga.StartOpts{BusinessKey: "held"})
	require.NoError(t, err)
	heldDone := make(chan saga.Started, 1)
	go func() {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: "held"}, &saga.StartOpts{BusinessKey: "held"})
		if err != nil {
			t.Errorf("start with the held key: %v", err)
		}
		heldDone <- st
	}()

	// Meanwhile: 60 starts, 20 business keys each started three times, and
	// one start that is refused. They queue behind the waiting start, so
	// most of them go in groups.
	type result struct {
		key string
		st  saga.Started
		err error
	}
	results := make(chan result, 61)
	var wg sync.WaitGroup
	for i := range 60 {
		key := fmt.Sprintf("k-%02d", i%20)
		wg.Go(func() {
			st, err := saga.Start(ctx, b.engine, def, order{OrderID: key}, &saga.StartOpts{BusinessKey: key})
			results <- result{key, st, err}
		})
	}
	wg.Go(func() {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: "boom"}, &saga.StartOpts{BusinessKey: "boom"})
		results <- result{"boom", st, err}
	})
	wg.Wait()
	close(results)

	// All of them returned while the held key's transaction is still open.
	select {
	case <-heldDone:
		t.Fatal("the start with the held key returned before its holder committed")
	default:
	}
	byKey := map[string]uuid.UUID{}
	fresh := map[string]int{}
	for r := range results {
		if r.key == "boom" {
			require.ErrorContains(t, r.err, "boom is refused")
			require.Equal(t, saga.Started{}, r.st)
			continue
		}
		require.NoError(t, r.err, r.key)
		if id, ok := byKey[r.key]; ok {
			require.Equal(t, id, r.st.ID, "two sagas for key %s", r.key)
		}
		byKey[r.key] = r.st.ID
		if !r.st.Existing {
			fresh[r.key]++
		}
	}
	require.Len(t, byKey, 20)
	for key, n := range fresh {
		require.Equal(t, 1, n, "starts that report having started key %s", key)
	}
	require.Len(t, fresh, 20)
	// Those went in one group with the refused start, and then each alone.
	// Again, without it: now they commit in groups.
	tx2, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx2.Rollback(ctx) }()
	_, err = saga.StartTx(ctx, b.engine, tx2, def, order{OrderID: "held2"}, &saga.StartOpts{BusinessKey: "held2"})
	require.NoError(t, err)
	go func() {
		_, _ = saga.Start(ctx, b.engine, def, order{OrderID: "held2"}, &saga.StartOpts{BusinessKey: "held2"})
	}()
	// Once it waits for the key, it is in no group with the starts below.
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '%'||$1||'%saga_instances%'`, b.schema) > 0
	}, "the start with the key held2 to wait for its holder")
	var more sync.Map
	for i := range 30 {
		wg.Go(func() {
			st, err := saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{BusinessKey: fmt.Sprintf("m-%02d", i)})
			if err != nil {
				t.Errorf("start m-%02d: %v", i, err)
			}
			more.Store(st.ID, true)
		})
	}
	wg.Wait()
	require.Positive(t, b.engine.Stats().StartsGrouped, "no start was committed in a group")
	require.NoError(t, tx2.Commit(ctx))
	more.Range(func(k, _ any) bool { byKey["m-"+k.(uuid.UUID).String()] = k.(uuid.UUID); return true })

	require.NoError(t, tx.Commit(ctx))
	select {
	case st := <-heldDone:
		require.Equal(t, saga.Started{ID: heldID.ID, Existing: true}, st)
	case <-time.After(10 * time.Second):
		t.Fatal("the start with the held key did not return after its holder committed")
	}
	for _, id := range byKey {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, id).Status)
	}
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, heldID.ID).Status)
	// One saga per key, each step once.
	require.Equal(t, 52, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
	require.Equal(t, 52*3, b.count(t, "SELECT count(*) FROM "+b.table("effects")))
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE business_key = 'boom'"))
}

// A start whose caller has given up before it is committed writes nothing.
func TestStartWithAnEndedContextWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "given-up", nil)
	require.NoError(t, b.engine.Register(def))
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := saga.Start(cctx, b.engine, def, order{}, &saga.StartOpts{BusinessKey: "given-up"})
	require.ErrorIs(t, err, context.Canceled)
	time.Sleep(100 * time.Millisecond)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
}

// StartTx under outbox.WakeAfterCommit does not notify in the caller's
// transaction: the engines hear of the saga when wake is called after the
// commit (or at their next poll).
func TestStartTxWakesAfterCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{PollInterval: time.Hour})
	def := threeSteps(b, "wake-after", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	// Past the engine's first look (its listener, once connected, wakes
	// every worker).
	waitFor(t, 10*time.Second, func() bool { return b.engine.Health(ctx).Ready }, "the engine to be ready")
	time.Sleep(300 * time.Millisecond)

	wctx, wake := outbox.WakeAfterCommit(ctx)
	tx, err := b.pool.Begin(wctx)
	require.NoError(t, err)
	st, err := saga.StartTx(wctx, b.engine, tx, def, order{OrderID: "w-1"}, nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(wctx))
	time.Sleep(500 * time.Millisecond)
	require.Empty(t, b.effects(t, st.ID), "the commit woke the engine")

	require.NoError(t, wake(ctx, b.pool))
	require.Equal(t, saga.StatusCompleted, b.waitTerminalWithin(t, st.ID, 10*time.Second).Status)
	require.Len(t, b.effects(t, st.ID), 3)
}

// Keyed starts in a group that fails (one start PostgreSQL refuses) run
// again alone, each with its admission in its own transaction: the others
// start, each once, under their key's limit, and the refused one fails
// alone, leaving no slot or queue entry.
func TestKeyedStartsInAFailedGroupRunAlone(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	def := keyed(b, "keyed-grouped", 1, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	refuseBoom(t, b)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var ids []uuid.UUID
	for round := range 5 {
		for i := range 12 {
			wg.Go(func() {
				bk, ckey := fmt.Sprintf("r%d-%02d", round, i), fmt.Sprintf("customer-%d", i%3)
				if i == 5 {
					bk = "boom"
				}
				st, err := saga.Start(ctx, b.engine, def, order{OrderID: bk}, &saga.StartOpts{BusinessKey: bk, ConcurrencyKey: ckey})
				if bk == "boom" {
					if err == nil || !strings.Contains(err.Error(), "boom is refused") {
						t.Errorf("the refused start returned %v, %v", st, err)
					}
					return
				}
				if err != nil || st.Existing {
					t.Errorf("start %s: %+v, %v", bk, st, err)
					return
				}
				mu.Lock()
				ids = append(ids, st.ID)
				mu.Unlock()
			})
		}
		wg.Wait()
	}
	require.Len(t, ids, 5*11)
	// Three keys, limit 1: one saga of each holds its key's slot, the rest
	// wait in its queue.
	require.Equal(t, 3, b.count(t, "SELECT coalesce(sum(running), 0) FROM "+b.table("saga_concurrency_keys")))
	require.Equal(t, 5*11-3, b.count(t, "SELECT count(*) FROM "+b.table("saga_concurrency_queue")))
	b.start(t)
	for _, id := range ids {
		require.Equal(t, saga.StatusCompleted, b.waitTerminalWithin(t, id, time.Minute).Status)
	}
	require.Equal(t, 5*11*2, b.count(t, "SELECT count(*) FROM "+b.table("intervals")), "each step once")
	b.requireKeysFree(t)
}
