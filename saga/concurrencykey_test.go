package saga_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// keyed returns a two-step definition limited to limit sagas per key whose
// steps record their interval (database time) in the intervals table, and
// block while hold returns a channel.
func keyed(b *bundle, name string, limit int, hold func(orderID string) <-chan struct{}) *saga.Definition[order] {
	step := func(ctx context.Context, run *saga.StepRun, s *order) error {
		var started time.Time
		if err := run.Tx.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&started); err != nil {
			return err
		}
		if hold != nil {
			if ch := hold(s.OrderID); ch != nil {
				select {
				case <-ch:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		if s.OrderID == "fail" && run.Step == "b" {
			return steps.Permanent(errors.New("declined"))
		}
		_, err := run.Tx.Exec(ctx, "INSERT INTO "+b.table("intervals")+" (saga_id, step, started, ended) VALUES ($1, $2, $3, clock_timestamp())",
			run.SagaID, run.Step, started)
		return err
	}
	noop := func(context.Context, *saga.StepRun, *order) error { return nil }
	return saga.Define(name,
		saga.Step[order]{Name: "a", Action: step, Compensate: noop, Retry: fastRetry},
		saga.Step[order]{Name: "b", Action: step, Compensate: noop, Retry: fastRetry},
	).WithConcurrency(limit)
}

func setupKeyed(t *testing.T) *bundle {
	b := setup(t, &saga.Config{PollInterval: 50 * time.Millisecond})
	_, err := b.pool.Exec(context.Background(), "CREATE TABLE "+b.table("intervals")+
		" (saga_id uuid, step text, started timestamptz, ended timestamptz)")
	require.NoError(t, err)
	return b
}

// slots checks that nothing is held or queued for any key any more.
func (b *bundle) requireKeysFree(t *testing.T) {
	t.Helper()
	require.Zero(t, b.count(t, "SELECT coalesce(sum(running), 0) FROM "+b.table("saga_concurrency_keys")), "slots still counted")
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_concurrency_keys")), "keys still in use")
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_concurrency_queue")), "sagas still queued")
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE available_at = 'infinity'"), "held commands left")
}

func concurrencyOf(t *testing.T, b *bundle, id uuid.UUID) *saga.ConcurrencyInfo {
	t.Helper()
	in, err := b.engine.Get(context.Background(), id)
	require.NoError(t, err)
	return in.Concurrency
}

// TestConcurrencyKeyHundredStartsNeverOverlap starts 100 sagas on one key
// with limit 1 from four goroutines, so that their starts commit in groups:
// every saga finishes, no two sagas' step intervals overlap, and each
// goroutine's sagas run in its start order.
func TestConcurrencyKeyHundredStartsNeverOverlap(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	def := keyed(b, "serial", 1, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	const starters, each = 4, 25
	ids := make([][]uuid.UUID, starters)
	var wg sync.WaitGroup
	errs := make(chan error, starters)
	for g := range starters {
		wg.Go(func() {
			for i := range each {
				st, err := saga.Start(ctx, b.engine, def, order{OrderID: fmt.Sprintf("%d-%d", g, i)},
					&saga.StartOpts{ConcurrencyKey: "customer-1"})
				if err != nil {
					errs <- err
					return
				}
				ids[g] = append(ids[g], st.ID)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	// Before the engine runs: one holds the slot, 99 wait, in order.
	res, err := b.engine.List(ctx, &saga.ListOpts{ConcurrencyKey: "customer-1", Queued: true, Limit: 1000})
	require.NoError(t, err)
	require.Len(t, res.Sagas, starters*each-1)
	positions := map[int]bool{}
	for _, in := range res.Sagas {
		require.NotNil(t, in.Concurrency)
		require.True(t, in.Concurrency.Queued)
		require.Equal(t, 1, in.Concurrency.Limit)
		positions[in.Concurrency.Position] = true
	}
	require.Len(t, positions, starters*each-1, "each waiting saga has its own position")
	// Keyed starts commit in groups, as the others (startgroup.go): four
	// starters at once overlap.
	require.Positive(t, b.engine.Stats().StartsGrouped, "no keyed start was committed in a group")

	b.start(t)
	for _, g := range ids {
		for _, id := range g {
			in := b.waitTerminalWithin(t, id, 2*time.Minute)
			require.Equal(t, saga.StatusCompleted, in.Status)
		}
	}
	type span struct {
		id         uuid.UUID
		start, end time.Time
	}
	rows, err := b.pool.Query(ctx, "SELECT saga_id, min(started), max(ended) FROM "+b.table("intervals")+" GROUP BY saga_id ORDER BY 2")
	require.NoError(t, err)
	spans, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (span, error) {
		var s span
		return s, r.Scan(&s.id, &s.start, &s.end)
	})
	require.NoError(t, err)
	require.Len(t, spans, starters*each)
	rank := map[uuid.UUID]int{}
	for i, s := range spans {
		rank[s.id] = i
		if i > 0 {
			require.False(t, s.start.Before(spans[i-1].end), "saga %s started at %s, before saga %s ended at %s",
				s.id, s.start, spans[i-1].id, spans[i-1].end)
		}
	}
	for g := range ids {
		require.True(t, sort.SliceIsSorted(ids[g], func(i, j int) bool { return rank[ids[g][i]] < rank[ids[g][j]] }),
			"starter %d's sagas ran out of start order", g)
	}
	require.Equal(t, starters*each, b.count(t, "SELECT count(*) FROM "+b.table("intervals")+" WHERE step = 'b'"))
	b.requireKeysFree(t)
}

// TestConcurrencyKeyReleasedByCompensationAndCancel: a saga that
// compensates frees its slot; a cancelled queued saga leaves the queue and
// never runs; a running saga cancelled frees its slot for the next.
func TestConcurrencyKeyReleasedByCompensationAndCancel(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	var mu sync.Mutex
	gates := map[string]chan struct{}{}
	gate := func(id string) chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		if gates[id] == nil {
			gates[id] = make(chan struct{})
		}
		return gates[id]
	}
	def := keyed(b, "release", 1, func(id string) <-chan struct{} {
		if strings.HasPrefix(id, "hold") {
			return gate(id)
		}
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	start := func(id string) uuid.UUID {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: id}, &saga.StartOpts{ConcurrencyKey: "k"})
		require.NoError(t, err)
		return st.ID
	}
	b.start(t)

	// Compensation releases.
	failing := start("fail")
	next := start("after-fail")
	require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, failing).Status)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, next).Status)

	// A queued saga cancelled leaves the queue and runs nothing.
	running := start("hold-1")
	queued := start("queued")
	behind := start("behind")
	c := concurrencyOf(t, b, queued)
	require.Equal(t, &saga.ConcurrencyInfo{Key: "k", Queued: true, Position: 1, Running: 1, Limit: 1}, c)
	require.Equal(t, 2, concurrencyOf(t, b, behind).Position)
	require.NoError(t, b.engine.Cancel(ctx, queued, "not needed"))
	in := b.waitTerminal(t, queued)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("intervals")+" WHERE saga_id = $1", queued))
	require.Equal(t, 1, concurrencyOf(t, b, behind).Position, "the cancelled saga's place is given up")

	// The running saga cancelled while its step runs: the next one runs.
	require.NoError(t, b.engine.Cancel(ctx, running, "stop"))
	require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, running).Status)
	close(gate("hold-1"))
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, behind).Status)
	in, err := b.engine.Get(ctx, behind)
	require.NoError(t, err)
	require.Contains(t, eventTypes(in), saga.EventConcurrencyQueued+":a")
	require.Contains(t, eventTypes(in), saga.EventConcurrencyAdmitted+":a")
	b.requireKeysFree(t)
}

// TestConcurrencyKeyStartTx: a rolled-back StartTx takes no slot; a start
// on the same key waits for an open StartTx's commit (no deadlock), then
// queues behind it; NoWait refuses with the key and the limit named.
func TestConcurrencyKeyStartTx(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	release := make(chan struct{})
	def := keyed(b, "intx", 1, func(id string) <-chan struct{} {
		if id == "first" {
			return release
		}
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	opts := &saga.StartOpts{ConcurrencyKey: "acct-9"}

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "rolled-back"}, opts)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))

	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	first, err := saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "first"}, opts)
	require.NoError(t, err)
	type result struct {
		st  saga.Started
		err error
	}
	second := make(chan result, 1)
	go func() {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: "second"}, opts)
		second <- result{st, err}
	}()
	require.NoError(t, tx.Commit(ctx))
	r := <-second
	require.NoError(t, r.err)
	require.False(t, concurrencyOf(t, b, first.ID).Queued, "the committed StartTx holds the slot; the rolled-back one took none")
	require.True(t, concurrencyOf(t, b, r.st.ID).Queued)

	_, err = saga.Start(ctx, b.engine, def, order{OrderID: "refused"}, &saga.StartOpts{ConcurrencyKey: "acct-9", NoWait: true})
	require.ErrorIs(t, err, saga.ErrConcurrencyLimit)
	require.ErrorContains(t, err, `"acct-9"`)
	require.ErrorContains(t, err, "1 of 1")
	// Another key is not held back by a full one.
	other, err := saga.Start(ctx, b.engine, def, order{OrderID: "other"}, &saga.StartOpts{ConcurrencyKey: "acct-10", NoWait: true})
	require.NoError(t, err)

	b.start(t)
	waitFor(t, 30*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("intervals")+" WHERE saga_id = $1", first.ID) == 0 &&
			b.count(t, "SELECT count(*) FROM "+b.table("saga_history")+" WHERE saga_id = $1 AND event = 'step_completed'", first.ID) == 0
	}, "first running")
	require.Equal(t, saga.StatusRunning, concurrencyStatus(t, b, r.st.ID))
	require.True(t, concurrencyOf(t, b, r.st.ID).Queued)
	close(release)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, other.ID).Status)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, first.ID).Status)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, r.st.ID).Status)
	b.requireKeysFree(t)
}

func concurrencyStatus(t *testing.T, b *bundle, id uuid.UUID) saga.Status {
	in, err := b.engine.Get(context.Background(), id)
	require.NoError(t, err)
	return in.Status
}

// TestConcurrencyKeyTenantsIndependent: the same definition and key in two
// schemas are two keys: a saga holding the key in one does not hold back
// the other; both run their first step at the same time.
func TestConcurrencyKeyTenantsIndependent(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	entered := make(chan struct{}, 8)
	var bs []*bundle
	var ids []uuid.UUID
	for range 2 {
		b := setupKeyed(t)
		def := keyed(b, "tenant", 1, func(string) <-chan struct{} {
			entered <- struct{}{}
			return release
		})
		require.NoError(t, b.engine.Register(def))
		st, err := saga.Start(context.Background(), b.engine, def, order{OrderID: "x"}, &saga.StartOpts{ConcurrencyKey: "same"})
		require.NoError(t, err)
		require.False(t, concurrencyOf(t, b, st.ID).Queued)
		bs, ids = append(bs, b), append(ids, st.ID)
	}
	for i, b := range bs {
		require.Equal(t, 1, b.count(t, "SELECT running FROM "+b.table("saga_concurrency_keys")+" WHERE ckey = 'same'"), "schema %d", i)
		b.start(t)
	}
	<-entered // both tenants' sagas are inside their first step at once
	<-entered
	close(release)
	for i, b := range bs {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, ids[i]).Status)
		b.requireKeysFree(t)
	}
}

// TestConcurrencyKeyBadInput: keys PostgreSQL cannot store, or too long, are
// refused naming the field; a key for a definition without a limit, and a
// limit out of range, are refused too.
func TestConcurrencyKeyBadInput(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	def := keyed(b, "bad", 2, nil)
	plain := saga.Define("plain", saga.Step[order]{Name: "a", Action: func(context.Context, *saga.StepRun, *order) error { return nil }})
	require.NoError(t, b.engine.Register(def, plain))
	ctx := context.Background()
	for name, key := range map[string]string{"nul": "a\x00b", "utf8": "a\xffb", "long": strings.Repeat("k", 10_000)} {
		_, err := saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{ConcurrencyKey: key})
		require.ErrorIs(t, err, saga.ErrInvalidInput, name)
		require.ErrorContains(t, err, "StartOpts.ConcurrencyKey", name)
	}
	_, err := saga.Start(ctx, b.engine, plain, order{}, &saga.StartOpts{ConcurrencyKey: "k"})
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	require.ErrorContains(t, err, "WithConcurrency")
	_, err = saga.Start(ctx, b.engine, def, order{}, &saga.StartOpts{NoWait: true})
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	require.ErrorContains(t, err, "StartOpts.NoWait")
	_, err = b.engine.List(ctx, &saga.ListOpts{ConcurrencyKey: "a\x00"})
	require.ErrorContains(t, err, "ListOpts.ConcurrencyKey")
	err = b.engine.Register(keyed(b, "negative", -1, nil))
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
}

// TestConcurrencyKeyResumeTakesSlotAgain: a failed saga gave its slot back;
// resumed, it takes one again at once (above the limit, ahead of the
// queue), and gives it back when it ends.
func TestConcurrencyKeyResumeTakesSlotAgain(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	allowErrorLogs(t)
	var mu sync.Mutex
	brokenComp := true
	release := make(chan struct{})
	compGate := make(chan struct{})
	step := func(ctx context.Context, run *saga.StepRun, s *order) error {
		switch {
		case s.OrderID == "hold":
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		case s.OrderID == "failing" && run.Step == "b":
			return steps.Permanent(errors.New("declined"))
		}
		return nil
	}
	comp := func(context.Context, *saga.StepRun, *order) error {
		mu.Lock()
		defer mu.Unlock()
		if brokenComp {
			return steps.Permanent(errors.New("compensation broken"))
		}
		<-compGate
		return nil
	}
	def := saga.Define("resumable",
		saga.Step[order]{Name: "a", Action: step, Compensate: comp, Retry: fastRetry},
		saga.Step[order]{Name: "b", Action: step, Compensate: comp, Retry: fastRetry},
	).WithConcurrency(1)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	opts := &saga.StartOpts{ConcurrencyKey: "k"}
	failing, err := saga.Start(ctx, b.engine, def, order{OrderID: "failing"}, opts)
	require.NoError(t, err)
	hold, err := saga.Start(ctx, b.engine, def, order{OrderID: "hold"}, opts)
	require.NoError(t, err)
	b.start(t)
	require.Equal(t, saga.StatusFailed, b.waitTerminal(t, failing.ID).Status)
	// The failed saga released its slot: the next one runs (and holds).
	waitFor(t, 30*time.Second, func() bool { return !concurrencyOf(t, b, hold.ID).Queued }, "hold admitted")
	queued, err := saga.Start(ctx, b.engine, def, order{OrderID: "queued"}, opts)
	require.NoError(t, err)
	require.True(t, concurrencyOf(t, b, queued.ID).Queued)

	mu.Lock()
	brokenComp = false
	mu.Unlock()
	require.NoError(t, b.engine.Resume(ctx, failing.ID, "fixed"))
	c := concurrencyOf(t, b, failing.ID)
	require.False(t, c.Queued)
	require.Equal(t, 2, c.Running, "the resumed saga holds a slot above the limit")
	close(compGate)
	require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, failing.ID).Status)
	require.True(t, concurrencyOf(t, b, queued.ID).Queued, "the queue waits until the key is under its limit")
	close(release)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, hold.ID).Status)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, queued.ID).Status)
	b.requireKeysFree(t)
}

// TestConcurrencyKeyCrashMatrix crashes the engine at each commit boundary
// while sagas of one key (limit 2) run and end: every saga ends, nothing is
// lost or doubled, and afterwards no slot is held and nothing is queued,
// so a crash at a terminal commit neither leaked nor doubled a slot (a
// doubled release would break the counter's CHECK (running >= 0)).
func TestConcurrencyKeyCrashMatrix(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	allowErrorLogs(t)
	def := keyed(b, "crashy", 2, nil)
	sagatest.CrashMatrix(t, b.pool, def, &sagatest.CrashOpts{
		Config: &saga.Config{Schema: b.schema, PollInterval: 50 * time.Millisecond},
		Sagas:  12,
		Start: func(ctx context.Context, e *saga.Engine, bd sagatest.Round, i int) (uuid.UUID, error) {
			st, err := saga.Start(ctx, e, def, order{OrderID: fmt.Sprintf("%s-%d", bd, i)},
				&saga.StartOpts{ConcurrencyKey: "key-" + bd.String()})
			return st.ID, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			out := map[sagatest.Effect]int{}
			for _, s := range []string{"a", "b"} {
				var n int
				if err := b.pool.QueryRow(ctx, "SELECT count(*) FROM "+b.table("intervals")+" WHERE saga_id = $1 AND step = $2",
					in.ID, s).Scan(&n); err != nil {
					return nil, err
				}
				out[sagatest.Effect{Step: s}] = n
			}
			return out, nil
		},
	})
	b.requireKeysFree(t)
}

// TestConcurrencyKeyReleaseCommitsWithTheEnd ends a saga holding its key's
// slot in a transaction that rolls back, as a crash before the terminal
// commit would: the admission of the next saga rolls back with it, and
// the slot is still held once. Committed, the end admits the next saga.
func TestConcurrencyKeyReleaseCommitsWithTheEnd(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	def := keyed(b, "atomic", 1, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	opts := &saga.StartOpts{ConcurrencyKey: "k"}
	first, err := saga.Start(ctx, b.engine, def, order{OrderID: "1"}, opts)
	require.NoError(t, err)
	second, err := saga.Start(ctx, b.engine, def, order{OrderID: "2"}, opts)
	require.NoError(t, err)
	end := func(commit bool) {
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET status = 'completed', ended_at = now() WHERE id = $1", first.ID)
		require.NoError(t, err)
		var queued int
		require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM "+b.table("saga_concurrency_queue")).Scan(&queued))
		require.Zero(t, queued, "inside the ending transaction, the next saga is admitted")
		if commit {
			require.NoError(t, tx.Commit(ctx))
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
	}
	end(false)
	require.True(t, concurrencyOf(t, b, second.ID).Queued)
	require.Equal(t, 1, concurrencyOf(t, b, first.ID).Running)
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND available_at <= now()", second.ID))
	end(true)
	c := concurrencyOf(t, b, second.ID)
	require.False(t, c.Queued)
	require.Equal(t, 1, c.Running)
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND available_at <= now()", second.ID))
	b.start(t)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, second.ID).Status)
	b.requireKeysFree(t)
}

// TestConcurrencyKeyStartIsAtomic makes the admission fail after the saga's
// rows were sent (a trigger in the test's schema refuses the slot): the
// start returns the error and leaves no saga, no history and no command.
func TestConcurrencyKeyStartIsAtomic(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	def := keyed(b, "atomic-start", 1, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `CREATE FUNCTION `+b.table("refuse")+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'slot refused by test'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON `+b.table("saga_concurrency_keys")+` FOR EACH ROW EXECUTE FUNCTION `+b.table("refuse")+`()`)
	require.NoError(t, err)
	_, err = saga.Start(ctx, b.engine, def, order{OrderID: "x"}, &saga.StartOpts{ConcurrencyKey: "k", BusinessKey: "order-1"})
	require.ErrorContains(t, err, "slot refused by test")
	for _, table := range []string{"saga_instances", "saga_history", "outbox"} {
		require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table(table)), table)
	}
}

// TestConcurrencyKeyStartTxInSavepoint starts keyed sagas in a savepoint of
// the caller's transaction (pgx's nested transaction): they are admitted
// and queued as in the transaction itself, and a start that finds the
// existing saga by business key takes nothing.
func TestConcurrencyKeyStartTxInSavepoint(t *testing.T) {
	t.Parallel()
	b := setupKeyed(t)
	def := keyed(b, "savepoint", 1, nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	sp, err := tx.Begin(ctx)
	require.NoError(t, err)
	var ids []uuid.UUID
	for i := range 2 {
		st, err := saga.StartTx(ctx, b.engine, sp, def, order{OrderID: fmt.Sprint(i)}, &saga.StartOpts{ConcurrencyKey: "k", BusinessKey: fmt.Sprint("o-", i)})
		require.NoError(t, err)
		require.False(t, st.Existing)
		ids = append(ids, st.ID)
	}
	again, err := saga.StartTx(ctx, b.engine, sp, def, order{OrderID: "0"}, &saga.StartOpts{ConcurrencyKey: "k", BusinessKey: "o-0"})
	require.NoError(t, err)
	require.True(t, again.Existing)
	require.Equal(t, ids[0], again.ID)
	require.NoError(t, sp.Commit(ctx))
	require.NoError(t, tx.Commit(ctx))
	require.False(t, concurrencyOf(t, b, ids[0]).Queued)
	c := concurrencyOf(t, b, ids[1])
	require.Equal(t, &saga.ConcurrencyInfo{Key: "k", Queued: true, Position: 1, Running: 1, Limit: 1}, c)
	b.start(t)
	for _, id := range ids {
		require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, id).Status)
	}
	b.requireKeysFree(t)
}
