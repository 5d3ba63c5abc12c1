package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// checkout is the state of the parallel sagas: what the join gathered.
type checkout struct {
	OrderID     string `json:"order_id"`
	Reservation string `json:"reservation"`
	AuthCode    string `json:"auth_code"`
}

// span is when a branch's handler ran.
type span struct{ from, to time.Time }

type spans struct {
	mu sync.Mutex
	m  map[string]span
}

func (s *spans) record(name string, from time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]span{}
	}
	s.m[name] = span{from, time.Now()}
}

// parallelSaga is reserve-customer (compensable), then a parallel step
// "prepare" with the branches stock and card (each records its effect and
// returns a result; each compensable), joined into the state, then ship.
// fn, when set, runs first in each branch.
func parallelSaga(b *bundle, name string, fn func(ctx context.Context, branch string) error) *saga.Definition[checkout] {
	rec := func(ctx context.Context, run *saga.StepRun, _ *checkout) error {
		return recordEffect(ctx, run, b.schema)
	}
	branch := func(name, result string) saga.Branch[checkout] {
		return saga.Branch[checkout]{Name: name,
			Action: func(ctx context.Context, run *saga.StepRun, o checkout) (any, error) {
				if fn != nil {
					if err := fn(ctx, name); err != nil {
						return nil, err
					}
				}
				if err := recordEffect(ctx, run, b.schema); err != nil {
					return nil, err
				}
				return result + "-" + o.OrderID, nil
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ checkout, res json.RawMessage) error {
				var got string
				if err := json.Unmarshal(res, &got); err != nil {
					return err
				}
				_, err := run.Tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{b.schema}.Sanitize()+
					".effects (saga_id, step, direction, key) VALUES ($1, $2, 'compensate', $3)", run.SagaID, name, got)
				return err
			},
			Retry: fastRetry,
		}
	}
	return saga.Define(name,
		saga.Step[checkout]{Name: "customer", Action: rec, Compensate: rec},
		saga.Step[checkout]{Name: "prepare", Parallel: &saga.Parallel[checkout]{
			Branches: []saga.Branch[checkout]{branch("stock", "res"), branch("card", "auth")},
			Join: func(_ context.Context, _ *saga.StepRun, o *checkout, results map[string]json.RawMessage) error {
				if err := json.Unmarshal(results["stock"], &o.Reservation); err != nil {
					return err
				}
				return json.Unmarshal(results["card"], &o.AuthCode)
			}}},
		saga.Step[checkout]{Name: "ship", Action: rec},
	)
}

// Two branches that each take 300 ms run at the same time, each once, and
// the join gathers both results into the state.
func TestParallelBranchesOverlapAndJoin(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 4})
	var sp spans
	def := parallelSaga(b, "parallel-ok", func(_ context.Context, branch string) error {
		from := time.Now()
		// Long enough that the second branch's worker, woken by the same
		// commit, starts it before the first ends even on a loaded machine
		// (with 50 ms, a full race-detector run of every package at once
		// sometimes ran them one after the other).
		time.Sleep(300 * time.Millisecond)
		sp.record(branch, from)
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "o1"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	var got checkout
	require.NoError(t, in.DecodeState(&got))
	require.Equal(t, checkout{OrderID: "o1", Reservation: "res-o1", AuthCode: "auth-o1"}, got)
	effects := b.effects(t, st.ID)
	require.ElementsMatch(t, []string{"customer/forward", "prepare.stock/forward", "prepare.card/forward", "ship/forward"}, effects)
	require.Equal(t, "customer/forward", effects[0])
	require.Equal(t, "ship/forward", effects[3])

	s, c := sp.m["stock"], sp.m["card"]
	require.True(t, s.from.Before(c.to) && c.from.Before(s.to), "the branches overlap in time: stock %v–%v, card %v–%v", s.from, s.to, c.from, c.to)

	require.True(t, hasEvent(in, saga.EventBranchesStarted))
	branches, err := b.engine.Branches(ctx, st.ID)
	require.NoError(t, err)
	require.Len(t, branches, 2)
	for _, br := range branches {
		require.Equal(t, "completed", br.Status)
		require.Equal(t, 1, br.Attempts)
	}
	in, err = b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Contains(t, eventTypes(in), "step_completed:prepare.stock")
	require.Contains(t, eventTypes(in), "step_completed:prepare")
}

// One branch failing for good compensates exactly what completed: the
// other completed branch (with its result) and the step before the group,
// in reverse; a branch still running when the group failed has its effects
// rolled back and is not compensated.
func TestParallelBranchFailureCompensatesExactlyTheCompletedOnes(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 4})
	rec := func(ctx context.Context, run *saga.StepRun, _ *checkout) error {
		return recordEffect(ctx, run, b.schema)
	}
	stockDone := make(chan struct{})
	var slowDone atomic.Bool
	comp := func(name string) func(ctx context.Context, run *saga.StepRun, _ checkout, _ json.RawMessage) error {
		return func(ctx context.Context, run *saga.StepRun, _ checkout, _ json.RawMessage) error {
			_, err := run.Tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{b.schema}.Sanitize()+
				".effects (saga_id, step, direction) VALUES ($1, $2, 'compensate')", run.SagaID, name)
			return err
		}
	}
	def := saga.Define("parallel-fail",
		saga.Step[checkout]{Name: "customer", Action: rec, Compensate: rec},
		saga.Step[checkout]{Name: "prepare", Parallel: &saga.Parallel[checkout]{Branches: []saga.Branch[checkout]{
			{Name: "stock", Compensate: comp("stock"), Action: func(ctx context.Context, run *saga.StepRun, _ checkout) (any, error) {
				defer close(stockDone)
				return "r1", recordEffect(ctx, run, b.schema)
			}},
			{Name: "card", Compensate: comp("card"), Action: func(ctx context.Context, run *saga.StepRun, _ checkout) (any, error) {
				<-stockDone
				time.Sleep(100 * time.Millisecond) // stock has committed
				return nil, steps.Permanent(errors.New("card declined"))
			}},
			{Name: "fraud", Compensate: comp("fraud"), Action: func(ctx context.Context, run *saga.StepRun, _ checkout) (any, error) {
				if err := recordEffect(ctx, run, b.schema); err != nil {
					return nil, err
				}
				time.Sleep(600 * time.Millisecond) // still running when card fails
				slowDone.Store(true)
				return "ok", nil
			}},
		}}},
		saga.Step[checkout]{Name: "ship", Action: rec},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "o2"}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	require.Equal(t, "card declined", in.LastError.Message)
	require.Equal(t, "prepare.card", in.LastError.Step)
	waitFor(t, 5*time.Second, slowDone.Load, "the slow branch to return")
	time.Sleep(200 * time.Millisecond) // its transaction ends
	require.Equal(t, []string{"customer/forward", "prepare.stock/forward", "stock/compensate", "customer/compensate"}, b.effects(t, st.ID),
		"fraud's effect is rolled back; only stock and customer are compensated")
	branches, err := b.engine.Branches(ctx, st.ID)
	require.NoError(t, err)
	status := map[string]string{}
	for _, br := range branches {
		status[br.Branch] = br.Status
	}
	require.Equal(t, map[string]string{"stock": "completed", "card": "failed", "fraud": "cancelled"}, status)
}

// A cancel while the branches run compensates the branch that completed,
// and the step before the group; the running branch's effects are rolled
// back.
func TestCancelDuringAParallelStep(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 4})
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	def := parallelSaga(b, "parallel-cancel", func(ctx context.Context, branch string) error {
		if branch == "card" {
			started <- struct{}{}
			<-release
		}
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "o3"}, nil)
	require.NoError(t, err)
	<-started
	waitFor(t, 10*time.Second, func() bool {
		brs, err := b.engine.Branches(ctx, st.ID)
		require.NoError(t, err)
		for _, br := range brs {
			if br.Branch == "stock" && br.Status == "completed" {
				return true
			}
		}
		return false
	}, "stock to complete")
	require.NoError(t, b.engine.Cancel(ctx, st.ID, "customer changed their mind"))
	close(release)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, "history: %v", eventTypes(in))
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, []string{"customer/forward", "prepare.stock/forward", "stock/compensate", "customer/compensate"}, b.effects(t, st.ID))
}

// A commit that fails after a branch's work (a crash at the commit) loses
// and doubles nothing: the branch runs again, and every effect is there
// once.
func TestParallelBranchCommitFailuresLoseAndDoubleNothing(t *testing.T) {
	t.Parallel()
	allowErrorLogs(t)
	b := setup(t, &saga.Config{Workers: 4})
	def := parallelSaga(b, "parallel-crash", nil)
	require.NoError(t, b.engine.Register(def))
	var crashes atomic.Int32
	b.engine.SetBeforeCommit(func(context.Context, pgx.Tx) error {
		if crashes.Add(1) <= 4 {
			return errors.New("crash before commit")
		}
		return nil
	})
	b.start(t)
	ctx := context.Background()
	var ids []saga.Started
	for range 5 {
		st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "o"}, nil)
		require.NoError(t, err)
		ids = append(ids, st)
	}
	for _, st := range ids {
		in := b.waitTerminal(t, st.ID)
		require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
		require.ElementsMatch(t, []string{"customer/forward", "prepare.stock/forward", "prepare.card/forward", "ship/forward"}, b.effects(t, st.ID))
	}
	require.Greater(t, crashes.Load(), int32(4), "the crashes happened")
}

// A saga whose branches run is not migrated (its branches would be
// orphaned): the migration skips it with the reason, and it completes on
// its version.
func TestMigrationSkipsASagaInAParallelStep(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 4})
	release := make(chan struct{})
	v1 := parallelSaga(b, "parallel-migrate", func(context.Context, string) error {
		<-release
		return nil
	})
	v2 := parallelSaga(b, "parallel-migrate", nil).WithVersion(2)
	require.NoError(t, b.engine.Register(v1, v2))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, v1, checkout{OrderID: "m"}, nil)
	require.NoError(t, err)
	waitFor(t, 10*time.Second, func() bool {
		in, err := b.engine.Get(ctx, st.ID)
		return err == nil && in.Wait != nil && in.Wait.Kind == "branches"
	}, "the branches to start")
	res, err := saga.MigrateSagas(ctx, b.engine, saga.Migration[checkout, checkout]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, c *checkout, at saga.Position) (*checkout, saga.Position, error) {
			return c, at, nil
		}}, nil)
	require.NoError(t, err)
	require.Len(t, res.Moves, 1)
	require.Contains(t, res.Moves[0].Skipped, "parallel step")
	close(release)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, in.DefinitionVersion)
}

// A pause taken while branches run lets them finish; the branch command not
// yet started waits, and so does the step after the join, until Resume.
func TestPauseDuringAParallelStep(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 1}) // one worker: the second branch waits for the first
	release := make(chan struct{})
	started := make(chan string, 2)
	def := parallelSaga(b, "parallel-pause", func(_ context.Context, branch string) error {
		started <- branch
		<-release
		return nil
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "pp"}, nil)
	require.NoError(t, err)
	first := <-started
	require.NoError(t, b.engine.Pause(ctx, st.ID, "hold the group"))
	close(release)
	waitFor(t, 10*time.Second, func() bool {
		brs, err := b.engine.Branches(ctx, st.ID)
		require.NoError(t, err)
		for _, br := range brs {
			if br.Branch == first && br.Status == "completed" {
				return true
			}
		}
		return false
	}, "the running branch to finish")
	stays(t, 400*time.Millisecond, func() bool { return len(b.effects(t, st.ID)) == 2 }, "the other branch may not start while paused")
	require.NoError(t, b.engine.Resume(ctx, st.ID, ""))
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "history: %v", eventTypes(in))
	require.ElementsMatch(t, []string{"customer/forward", "prepare.stock/forward", "prepare.card/forward", "ship/forward"}, b.effects(t, st.ID))
}

// A copy of a branch's command, sent again after the branch completed (a
// forged or replayed command), has no second effect.
func TestADuplicateBranchCommandHasNoSecondEffect(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{Workers: 2})
	def := parallelSaga(b, "parallel-dup", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, checkout{OrderID: "d"}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)
	// The command row of the stock branch, written again as it was.
	_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("outbox")+` (id, topic, delivery, aggregatetype, aggregateid, type, payload, saga_id, step_key)
		VALUES (gen_random_uuid(), 'sagaflow.commands.branches', 'direct', 'saga.parallel-dup', $1::text, 'sagaflow.branch',
		convert_to(json_build_object('saga_id', $1::text, 'saga', 'parallel-dup', 'step', 'prepare.stock', 'direction', 'forward',
			'epoch', 0, 'version', 3)::text, 'UTF8'), $1::uuid, $1::text || '/prepare.stock/forward/0')`, st.ID.String())
	require.NoError(t, err)
	waitFor(t, 10*time.Second, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND type = 'sagaflow.branch'", st.ID) == 0
	}, "the copy to be consumed")
	require.ElementsMatch(t, []string{"customer/forward", "prepare.stock/forward", "prepare.card/forward", "ship/forward"}, b.effects(t, st.ID))
}

// A branch whose result cannot be encoded fails the group for good with a
// message that names the branch; bad branch definitions are refused at
// registration, naming the step.
func TestParallelBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	nop := func(context.Context, *saga.StepRun, checkout) (any, error) { return nil, nil }
	for _, tc := range []struct {
		p    *saga.Parallel[checkout]
		want string
	}{
		{&saga.Parallel[checkout]{}, "Parallel has no branches"},
		{&saga.Parallel[checkout]{Branches: []saga.Branch[checkout]{{Name: "a", Action: nop}, {Name: "a", Action: nop}}}, `two branches named "a"`},
		{&saga.Parallel[checkout]{Branches: []saga.Branch[checkout]{{Name: "a\x00b", Action: nop}}}, "must be letters"},
		{&saga.Parallel[checkout]{Branches: []saga.Branch[checkout]{{Name: strings.Repeat("x", 64), Action: nop}}}, "at most 64 bytes"},
		{&saga.Parallel[checkout]{Branches: []saga.Branch[checkout]{{Name: "a"}}}, `branch "a" has no Action`},
	} {
		err := b.engine.Register(saga.Define("pbad", saga.Step[checkout]{Name: "group", Parallel: tc.p}))
		require.ErrorIs(t, err, saga.ErrInvalidDefinition)
		require.ErrorContains(t, err, tc.want)
		require.ErrorContains(t, err, `step "group"`)
	}
	def := saga.Define("pbad-result",
		saga.Step[checkout]{Name: "group", Parallel: &saga.Parallel[checkout]{Branches: []saga.Branch[checkout]{
			{Name: "chan", Action: func(context.Context, *saga.StepRun, checkout) (any, error) { return make(chan int), nil }},
		}}})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	st, err := saga.Start(context.Background(), b.engine, def, checkout{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Contains(t, in.LastError.Message, `branch "chan"`)
	require.Equal(t, "group.chan", in.LastError.Step)
}
