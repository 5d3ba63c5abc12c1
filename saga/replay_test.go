package saga_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

func TestFailedSagaResumesAfterItsCauseIsFixed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var warehouseUp atomic.Bool
	def := threeSteps(b, "resumable", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("no carrier"))
		},
		"charge/compensate": func(context.Context, *saga.StepRun, *order) error {
			if !warehouseUp.Load() {
				return steps.Permanent(steps.WithCode("refund_rejected", errors.New("payment provider rejects refunds")))
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, "refund_rejected", in.LastError.Code)

	warehouseUp.Store(true) // the cause is fixed
	require.NoError(t, b.engine.Resume(ctx, st.ID, "refunds work again"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "charge/compensate", "reserve/compensate"}, b.effects(t, st.ID))
	types := eventTypes(in)
	require.Equal(t, []string{"saga_failed:charge", "saga_resumed:charge", "compensation_completed:charge",
		"compensation_completed:reserve", "saga_compensated"}, types[len(types)-5:])

	err = b.engine.Resume(ctx, st.ID, "again")
	require.ErrorIs(t, err, saga.ErrNotReplayable)
	require.ErrorContains(t, err, "status is compensated, and only failed sagas resume")
	require.ErrorIs(t, b.engine.Resume(ctx, uuid.New(), "x"), saga.ErrNotFound)
}

func TestForwardFailureResumesAndCompletes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "decode", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	// A bad deploy wrote state this version cannot read: the saga is parked.
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET state = '{"order_id": 7}' WHERE id = $1`, st.ID)
	require.NoError(t, err)
	b.start(t)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, saga.CodeStateDecode, in.LastError.Code)

	// The operator repairs the state and resumes: the saga completes.
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET state = '{"order_id": "7"}' WHERE id = $1`, st.ID)
	require.NoError(t, err)
	require.NoError(t, b.engine.Resume(ctx, st.ID, "state repaired"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

func TestRerunFromAStepUsesNewKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "rerun", nil)
	require.NoError(t, b.engine.Register(def))
	blocked := threeStepsBlocked(t, b)
	defer blocked.release()
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)

	err = b.engine.Rerun(ctx, st.ID, "refund", "x")
	require.ErrorContains(t, err, `saga "rerun" has no step "refund" (its steps: [reserve charge ship])`)
	require.NoError(t, b.engine.Rerun(ctx, st.ID, "charge", "provider lost the charges"))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, in.Epoch)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "ship/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
	// Steps from "charge" on ran again under epoch 1 keys.
	var keys []string
	rows, err := b.pool.Query(ctx, "SELECT key FROM "+b.table("effects")+" WHERE saga_id = $1 ORDER BY seq", st.ID)
	require.NoError(t, err)
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, k)
	}
	require.NoError(t, rows.Err())
	p := st.ID.String()
	require.Equal(t, []string{p + "/reserve/forward/0", p + "/charge/forward/0", p + "/ship/forward/0",
		p + "/charge/forward/1", p + "/ship/forward/1"}, keys)

	// A running saga does not re-run; an engine without the definition
	// checks the step against the saga's history.
	running, err := saga.Start(ctx, b.engine, blocked.def, order{}, nil)
	require.NoError(t, err)
	require.ErrorIs(t, b.engine.Rerun(ctx, running.ID, "charge", "x"), saga.ErrNotReplayable)
	tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.ErrorContains(t, tool.Rerun(ctx, st.ID, "refund", "x"), `never ran a step "refund"`)
}

// blockedSaga is a registered saga whose first step blocks until released.
type blockedSaga struct {
	def     *saga.Definition[order]
	entered chan struct{} // receives when the first step starts
	release func()        // lets every blocked step return (an error); call it before the test ends
}

func threeStepsBlocked(t *testing.T, b *bundle) *blockedSaga {
	bs := &blockedSaga{entered: make(chan struct{}, 16)}
	ch := make(chan struct{})
	var once atomic.Bool
	bs.release = func() {
		if once.CompareAndSwap(false, true) {
			close(ch)
		}
	}
	bs.def = threeSteps(b, "blocked", map[string]saga.StepFunc[order]{
		"reserve/forward": func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			select {
			case bs.entered <- struct{}{}:
			default:
			}
			select {
			case <-ch:
			case <-ctx.Done():
			}
			return errors.New("released")
		},
	})
	require.NoError(t, b.engine.Register(bs.def))
	return bs
}

func TestBulkReplayHonoursFiltersCapRateAndDryRun(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var fixed atomic.Bool
	failing := func(code string) saga.StepFunc[order] {
		return func(context.Context, *saga.StepRun, *order) error {
			if fixed.Load() {
				return nil
			}
			return steps.Permanent(steps.WithCode(code, errors.New(code)))
		}
	}
	// Sagas that fail while compensating "reserve" (code a) or "charge"
	// (code b): all end failed.
	def := threeSteps(b, "bulk", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("no"))
		},
		"charge/compensate": func(ctx context.Context, r *saga.StepRun, s *order) error {
			if s.OrderID == "b" {
				return failing("b")(ctx, r, s)
			}
			return nil
		},
		"reserve/compensate": failing("a"),
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	var ids []uuid.UUID
	for _, kind := range []string{"a", "a", "a", "a", "b", "b"} {
		st, err := saga.Start(ctx, b.engine, def, order{OrderID: kind}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for _, id := range ids {
		require.Equal(t, saga.StatusFailed, b.waitTerminal(t, id).Status)
	}
	historyLen := func() int { return b.count(t, "SELECT count(*) FROM "+b.table("saga_history")) }

	// Dry run: reports, changes nothing.
	before := historyLen()
	res, err := b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{Name: "bulk", ErrorCode: "a", DryRun: true})
	require.NoError(t, err)
	require.True(t, res.DryRun)
	require.Len(t, res.Matched, 4)
	require.Empty(t, res.Replayed)
	require.Equal(t, before, historyLen())
	require.Equal(t, 6, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE status = 'failed'"))

	// Filters: failed step and error code select the b sagas only.
	res, err = b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{FailedStep: "charge", DryRun: true})
	require.NoError(t, err)
	require.ElementsMatch(t, ids[4:], res.Matched)
	res, err = b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{Name: "other", DryRun: true})
	require.NoError(t, err)
	require.Empty(t, res.Matched)

	// The cause is fixed. Cap 3 at 5 per second: three sagas resume, at
	// least 2 × 200ms apart, the others stay failed.
	fixed.Store(true)
	started := time.Now()
	res, err = b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{ErrorCode: "a", Max: 3, RatePerSecond: 5, Reason: "provider fixed"})
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(started), 400*time.Millisecond)
	require.Len(t, res.Replayed, 3)
	require.Empty(t, res.Errors)
	for _, id := range res.Replayed {
		require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, id).Status)
	}
	require.Equal(t, 3, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE status = 'failed'"))

	_, err = b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{Max: saga.BulkReplayMaxLimit + 1})
	require.ErrorContains(t, err, "Max 10001 is outside 0..10000")
}

func TestOutboxReplayRepublishesPublishedMessages(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	// Published 0, 1, 2 and 3 minutes ago; "agg-2" is the oldest "orders".
	for i, topic := range []string{"orders", "orders", "orders", "payments"} {
		_, err := b.pool.Exec(ctx, "INSERT INTO "+b.table("outbox")+` (id, topic, aggregateid, type, payload, status, published_at)
			VALUES ($1, $2, $3, 'order.created', '{}', 'published', now() - $4 * interval '1 minute')`, uuid.New(), topic, fmt.Sprintf("agg-%d", i), i)
		require.NoError(t, err)
	}
	_, err := b.pool.Exec(ctx, "INSERT INTO "+b.table("outbox")+` (id, topic, aggregateid, type, payload) VALUES ($1, 'orders', 'x', 't', '{}')`, uuid.New())
	require.NoError(t, err)
	status, err := b.engine.OutboxStatus(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), status.Pending)
	require.Equal(t, int64(4), status.Published)

	res, err := b.engine.ReplayOutbox(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Topic: "orders"}, DryRun: true})
	require.NoError(t, err)
	require.Len(t, res.Matched, 3)
	require.Zero(t, res.Republished)
	res, err = b.engine.ReplayOutbox(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Topic: "orders"}, Max: 2, RatePerSecond: 100})
	require.NoError(t, err)
	require.Equal(t, int64(2), res.Republished)
	status, err = b.engine.OutboxStatus(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), status.Pending)
	require.Equal(t, int64(2), status.Published)
	// Oldest first: the two oldest "orders" messages went back to pending.
	rows, err := b.pool.Query(ctx, "SELECT aggregateid FROM "+b.table("outbox")+
		" WHERE topic = 'orders' AND status = 'pending' AND aggregateid LIKE 'agg-%' ORDER BY aggregateid")
	require.NoError(t, err)
	again, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"agg-1", "agg-2"}, again)
}

func TestCancelFromAnEngineWithoutTheDefinition(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	blocked := threeStepsBlocked(t, b)
	defer blocked.release()
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, blocked.def, order{}, nil)
	require.NoError(t, err)
	<-blocked.entered

	// An operator tool has no definitions: it records a request. The engine
	// running the saga's step learns of it, cancels the step's context
	// (this handler honours it) and applies the request in the step's place.
	tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	err = tool.Cancel(ctx, st.ID, "operator")
	require.ErrorIs(t, err, saga.ErrNotRegistered)
	require.ErrorContains(t, err, "use RequestCancel")
	require.NoError(t, tool.RequestCancel(ctx, st.ID, "operator"))
	in := b.waitTerminal(t, st.ID)
	require.NotContains(t, eventTypes(in), "step_failed:reserve", "the interrupted step is not retried")
	require.Contains(t, eventTypes(in), "cancel_requested:reserve")
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.ErrorInfo{Code: saga.CodeCancelled, Message: "operator"}, *in.LastError)
	require.Contains(t, eventTypes(in), "saga_cancelled:reserve")
	require.Equal(t, "saga_compensated", in.History[len(in.History)-1].Type)
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND status <> 'pending'", st.ID))
	require.ErrorIs(t, tool.RequestCancel(ctx, st.ID, "again"), saga.ErrNotRunning)
}

func TestRerunOfACompensatedSagaStartsFromTheFirstStep(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var declined atomic.Bool
	declined.Store(true)
	def := threeSteps(b, "undone", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			if declined.Load() {
				return steps.Permanent(errors.New("no carrier"))
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, st.ID).Status)

	// Re-running from "charge" would leave "reserve" undone, and a later
	// failure would compensate it a second time.
	err = b.engine.Rerun(ctx, st.ID, "charge", "x")
	require.ErrorIs(t, err, saga.ErrNotReplayable)
	require.ErrorContains(t, err, `it can only re-run from its first step "reserve", not "charge"`)
	tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.ErrorIs(t, tool.Rerun(ctx, st.ID, "charge", "x"), saga.ErrNotReplayable, "also without the definition")

	declined.Store(false)
	require.NoError(t, b.engine.Rerun(ctx, st.ID, "reserve", "carrier found"))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"reserve/forward", "charge/forward", "charge/compensate", "reserve/compensate",
		"reserve/forward", "charge/forward", "ship/forward"}, b.effects(t, st.ID))
}

func TestBulkReplaySkipsSagasThatChangedSinceSelection(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var fixed atomic.Bool
	def := threeSteps(b, "changing", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) },
		"reserve/compensate": func(context.Context, *saga.StepRun, *order) error {
			if fixed.Load() {
				return nil
			}
			return steps.Permanent(errors.New("stuck"))
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	var ids []uuid.UUID
	for range 2 {
		st, err := saga.Start(ctx, b.engine, def, order{}, nil)
		require.NoError(t, err)
		require.Equal(t, saga.StatusFailed, b.waitTerminal(t, st.ID).Status)
		ids = append(ids, st.ID)
	}
	fixed.Store(true)
	// One per second: while the bulk replay waits for its second turn, an
	// operator resumes that saga by hand and it ends.
	done := make(chan *saga.BulkReplayResult, 1)
	go func() {
		res, err := b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{Name: "changing", RatePerSecond: 1})
		require.NoError(t, err)
		done <- res
	}()
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_history")+" WHERE event = 'saga_resumed'") == 1
	}, "the bulk replay's first resume")
	var first uuid.UUID
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT saga_id FROM "+b.table("saga_history")+" WHERE event = 'saga_resumed'").Scan(&first))
	other := ids[0]
	if other == first {
		other = ids[1]
	}
	require.NoError(t, b.engine.Resume(ctx, other, "by hand"))
	res := <-done
	require.Equal(t, []uuid.UUID{first}, res.Replayed)
	require.Len(t, res.Errors, 1)
	require.Equal(t, other, res.Errors[0].ID)
	require.ErrorIs(t, res.Errors[0].Err, saga.ErrNotReplayable)
	require.ErrorContains(t, res.Errors[0].Err, "changed since it was selected")
	require.Equal(t, 2, b.count(t, "SELECT count(*) FROM "+b.table("saga_history")+" WHERE event = 'saga_resumed'"), "resumed once each")
}

func TestRerunOfASagaThatFailedCompensating(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "half-undone", map[string]saga.StepFunc[order]{
		"ship/forward":       func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) },
		"reserve/compensate": func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("stuck")) },
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, b.waitTerminal(t, st.ID).Status)
	// reserve is still in effect (its compensation gave up), charge was undone.
	err = b.engine.Rerun(ctx, st.ID, "reserve", "x")
	require.ErrorIs(t, err, saga.ErrNotReplayable)
	require.ErrorContains(t, err, `failed while compensating step "reserve"`)
	tool, err := saga.New(b.pool, &saga.Config{Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	require.ErrorContains(t, tool.Rerun(ctx, st.ID, "charge", "x"), "only an engine that knows saga")
	require.NoError(t, b.engine.Rerun(ctx, st.ID, "charge", "charge again"))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status, "ship still fails, and reserve's compensation still gives up")
	// reserve's compensation keeps failing, so its writes keep rolling back.
	require.Equal(t, []string{"reserve/forward", "charge/forward", "charge/compensate",
		"charge/forward", "charge/compensate"}, b.effects(t, st.ID))
}

func TestBulkReplayDryRunListsOnlyWhatItCanReplay(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	blocked := threeStepsBlocked(t, b)
	defer blocked.release()
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, blocked.def, order{}, nil)
	require.NoError(t, err)
	<-blocked.entered
	res, err := b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{Statuses: []saga.Status{saga.StatusRunning}, DryRun: true})
	require.NoError(t, err)
	require.Empty(t, res.Matched, "a running saga cannot resume")
	require.Len(t, res.Errors, 1)
	require.Equal(t, st.ID, res.Errors[0].ID)
	require.ErrorIs(t, res.Errors[0].Err, saga.ErrNotReplayable)
}

// TestOperatorActionsInTheCallersTransaction: ResumeTx, RerunTx, PauseTx
// and GetTx act in the caller's transaction: nothing happens unless it
// commits, a refused action leaves it usable, and GetTx sees its writes.
func TestOperatorActionsInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var fixed atomic.Bool
	def := threeSteps(b, "intx", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("no carrier"))
		},
		"charge/compensate": func(context.Context, *saga.StepRun, *order) error {
			if !fixed.Load() {
				return steps.Permanent(errors.New("refunds down"))
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	blocked := threeStepsBlocked(t, b)
	defer blocked.release()
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, b.waitTerminal(t, st.ID).Status)
	fixed.Store(true)

	// Rolled back: nothing happened.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.engine.ResumeTx(ctx, tx, st.ID, "in a tx"))
	require.NoError(t, tx.Rollback(ctx))
	time.Sleep(300 * time.Millisecond) // an engine that saw a resume would have moved it
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.NotContains(t, eventTypes(in), "saga_resumed:charge")

	// A second resume in the same transaction is refused (the first one's
	// write shows in it), and the transaction goes on to commit the first.
	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.engine.ResumeTx(ctx, tx, st.ID, "in a tx"))
	inTx, err := b.engine.GetTx(ctx, tx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompensating, inTx.Status)
	require.ErrorIs(t, b.engine.ResumeTx(ctx, tx, st.ID, "twice"), saga.ErrNotReplayable)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, saga.StatusCompensated, b.waitTerminal(t, st.ID).Status)

	// Rerun: a step the saga lacks is refused, the transaction stays usable.
	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	require.ErrorContains(t, b.engine.RerunTx(ctx, tx, st.ID, "refund", "x"), `has no step "refund"`)
	require.NoError(t, b.engine.RerunTx(ctx, tx, st.ID, "reserve", "again"))
	inTx, err = b.engine.GetTx(ctx, tx, st.ID)
	require.NoError(t, err)
	require.Equal(t, 1, inTx.Epoch)
	out, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, 0, out.Epoch, "not committed yet")
	require.NoError(t, tx.Commit(ctx))
	waitFor(t, 30*time.Second, func() bool {
		in, err = b.engine.Get(ctx, st.ID)
		require.NoError(t, err)
		return in.Epoch == 1 && in.Status.Terminal()
	}, "the rerun to end")
	require.Contains(t, eventTypes(in), "saga_rerun:reserve")

	// Pause a running saga: rolled back, it runs on; committed, it is paused.
	running, err := saga.Start(ctx, b.engine, blocked.def, order{}, nil)
	require.NoError(t, err)
	<-blocked.entered
	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.engine.PauseTx(ctx, tx, running.ID, "hold on"))
	require.NoError(t, tx.Rollback(ctx))
	in, err = b.engine.Get(ctx, running.ID)
	require.NoError(t, err)
	require.Nil(t, in.Paused)
	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.engine.PauseTx(ctx, tx, running.ID, "hold on"))
	require.NoError(t, tx.Commit(ctx))
	in, err = b.engine.Get(ctx, running.ID)
	require.NoError(t, err)
	require.NotNil(t, in.Paused)
	require.Equal(t, "hold on", in.Paused.Reason)
	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.engine.ResumeTx(ctx, tx, running.ID, "go on"))
	require.NoError(t, tx.Commit(ctx))
	in, err = b.engine.Get(ctx, running.ID)
	require.NoError(t, err)
	require.Nil(t, in.Paused)

	for _, err := range []error{
		b.engine.ResumeTx(ctx, nil, st.ID, "x"), b.engine.RerunTx(ctx, nil, st.ID, "reserve", "x"),
		b.engine.PauseTx(ctx, nil, st.ID, "x"),
	} {
		require.ErrorContains(t, err, "tx is nil")
	}
	_, err = b.engine.GetTx(ctx, nil, st.ID)
	require.ErrorContains(t, err, "tx is nil")
}

// TestUnpauseOnlyLiftsPauses: Unpause of a saga that is not paused on its
// own is refused; it never replays a failed saga as Resume would (two
// operators unpausing at once: the second would have replayed it).
func TestUnpauseOnlyLiftsPauses(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "unpause", map[string]saga.StepFunc[order]{
		"ship/forward":      func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) },
		"charge/compensate": func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) },
	})
	require.NoError(t, b.engine.Register(def))
	blocked := threeStepsBlocked(t, b)
	defer blocked.release()
	b.start(t)
	ctx := context.Background()
	failed, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, b.waitTerminal(t, failed.ID).Status)
	err = b.engine.Unpause(ctx, failed.ID, "x")
	require.ErrorIs(t, err, saga.ErrNotPaused)
	require.ErrorContains(t, err, "status failed")
	in, err := b.engine.Get(ctx, failed.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.NotContains(t, eventTypes(in), "saga_resumed:charge")
	require.ErrorIs(t, b.engine.Unpause(ctx, uuid.New(), "x"), saga.ErrNotFound)

	running, err := saga.Start(ctx, b.engine, blocked.def, order{}, nil)
	require.NoError(t, err)
	<-blocked.entered
	require.NoError(t, b.engine.Pause(ctx, running.ID, "hold"))
	require.NoError(t, b.engine.Unpause(ctx, running.ID, "go"))
	err = b.engine.Unpause(ctx, running.ID, "again")
	require.ErrorIs(t, err, saga.ErrNotPaused)
	paused, err := b.engine.PauseType(ctx, blocked.def.Name(), "all")
	require.NoError(t, err)
	require.True(t, paused)
	err = b.engine.Unpause(ctx, running.ID, "type")
	require.ErrorIs(t, err, saga.ErrNotPaused)
	require.ErrorContains(t, err, "pause of its type")
	in, err = b.engine.Get(ctx, running.ID)
	require.NoError(t, err)
	require.Contains(t, eventTypes(in), "saga_unpaused:reserve")
}

// TestAStateHoldingTheTextOfANULEscapeRuns: a state whose string holds the
// six characters \u0000 (not a NUL) starts, runs and is stored as it is;
// the check for a NUL once refused it.
func TestAStateHoldingTheTextOfANULEscapeRuns(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "nultext", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{OrderID: `C:\u0000dir`}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	var o order
	require.NoError(t, in.DecodeState(&o))
	require.Equal(t, `C:\u0000dir`, o.OrderID)
	_, err = saga.Start(ctx, b.engine, def, order{OrderID: "C:\x00dir"}, nil)
	require.ErrorIs(t, err, saga.ErrInvalidInput)
}
