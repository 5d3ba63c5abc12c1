package review6_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// order returns what saga id recorded, oldest first.
func (v *env) order(t *testing.T, id uuid.UUID) []string {
	t.Helper()
	rows, err := v.Pool.Query(context.Background(), `SELECT what FROM `+
		v.fx.Table()+` WHERE saga_id = $1 ORDER BY at`, id)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

func branchStatus(t *testing.T, e *saga.Engine, id uuid.UUID) map[string]saga.BranchInfo {
	t.Helper()
	bs, err := e.Branches(context.Background(), id)
	require.NoError(t, err)
	out := map[string]saga.BranchInfo{}
	for _, b := range bs {
		out[b.Branch] = b
	}
	return out
}

// doc.go "Parallel steps": "A step with [Step.Parallel] is a group of
// [Branch]es that run at once, on several workers ... Each branch is a step
// of its own: ... its own step-scoped key ("<step>.<branch>" ...), its own
// row ([Engine.Branches]) and its own history entries". "a branch's Action
// gets the saga's state by value, as it was when the group started, and
// cannot change it; it returns a result instead ... [Parallel].Join applies
// every result to the state".
func TestParallelBranchesOverlap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	var inside atomic.Int32
	var keys sync.Map
	branch := func(name string, val int) saga.Branch[st] {
		return saga.Branch[st]{Name: name, Action: func(ctx context.Context, run *saga.StepRun, s st) (any, error) {
			keys.Store(name, run.Key.String())
			if s.N != 5 {
				return nil, steps.Permanent(fmt.Errorf("branch %s saw N=%d, want the state as the group started", name, s.N))
			}
			s.N = 1000 // a copy: cannot change the saga's state
			if err := v.fx.Record(ctx, run, name); err != nil {
				return nil, err
			}
			// All three must be inside at once: a barrier with a deadline.
			inside.Add(1)
			deadline := time.Now().Add(20 * time.Second)
			for inside.Load() < 3 {
				if time.Now().After(deadline) || ctx.Err() != nil {
					return nil, steps.Permanent(errors.New("branches did not overlap"))
				}
				time.Sleep(5 * time.Millisecond)
			}
			return map[string]int{"v": val}, nil
		}}
	}
	d := saga.Define("par-overlap",
		saga.Step[st]{Name: "before", Action: func(_ context.Context, _ *saga.StepRun, s *st) error { s.N = 5; return nil }},
		saga.Step[st]{Name: "prep", Parallel: &saga.Parallel[st]{
			Branches: []saga.Branch[st]{branch("x", 1), branch("y", 10), branch("z", 100)},
			Join: func(_ context.Context, _ *saga.StepRun, s *st, results map[string]json.RawMessage) error {
				for _, raw := range results {
					var r struct{ V int }
					if err := json.Unmarshal(raw, &r); err != nil {
						return err
					}
					s.Sum += r.V
				}
				return nil
			}}},
		saga.Step[st]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "after")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	var out st
	require.NoError(t, in.DecodeState(&out))
	require.Equal(t, 111, out.Sum)
	require.Equal(t, 5, out.N, "a branch cannot change the state")
	require.Equal(t, map[string]int{"x": 1, "y": 1, "z": 1, "after": 1}, v.fx.Counts(t, s.ID))
	for _, name := range []string{"x", "y", "z"} {
		k, ok := keys.Load(name)
		require.True(t, ok)
		require.Contains(t, k.(string), "/prep."+name+"/forward/", "step key <step>.<branch>")
		require.Equal(t, 1, events(in, "step_completed:prep."+name), sagatest.Describe(in))
	}
	require.Equal(t, 1, events(in, saga.EventBranchesStarted))
	bs := branchStatus(t, e, s.ID)
	require.Len(t, bs, 3)
	for name, b := range bs {
		require.Equal(t, "prep", b.Step)
		require.Equal(t, "completed", b.Status, name)
		require.NotEmpty(t, b.Result)
		require.NotNil(t, b.EndedAt)
	}
	require.JSONEq(t, `{"v":10}`, string(bs["y"].Result))
}

// doc.go "Parallel steps": "If a branch fails for good ... the group fails:
// branches still running are cancelled (one that is mid-attempt finishes
// it, finds the group gone, and its effects are rolled back with its
// transaction), the completed branches are compensated (each branch's
// Compensate gets its result ...), and then the steps before the group, in
// reverse." Here the running branch even returns success after the group
// failed.
func TestParallelBranchFailureCompensatesExactlyTheCompleted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	var e *saga.Engine
	release := make(chan struct{})
	var releaseOnce sync.Once
	var gotResult atomic.Value
	undo := func(name string) func(context.Context, *saga.StepRun, st, json.RawMessage) error {
		return func(ctx context.Context, run *saga.StepRun, _ st, result json.RawMessage) error {
			if name == "ok" {
				gotResult.Store(string(result))
			}
			return v.fx.Record(ctx, run, "undo-"+name)
		}
	}
	d := saga.Define("par-fail",
		saga.Step[st]{Name: "before",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "before") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "undo-before") }},
		saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{Branches: []saga.Branch[st]{
			{Name: "ok", Compensate: undo("ok"), Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
				return "charge-17", v.fx.Record(ctx, run, "ok")
			}},
			{Name: "bad", Compensate: undo("bad"), Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
				// Fail only once ok has completed, so "the completed" is ok.
				deadline := time.Now().Add(20 * time.Second)
				for branchStatus(t, e, run.SagaID)["ok"].Status != "completed" {
					if time.Now().After(deadline) {
						return nil, errors.New("ok never completed")
					}
					time.Sleep(10 * time.Millisecond)
				}
				if err := v.fx.Record(ctx, run, "bad"); err != nil {
					return nil, err
				}
				return nil, steps.Permanent(errors.New("card declined"))
			}},
			{Name: "slow", Compensate: undo("slow"), Timeout: 20 * time.Second,
				Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
					if err := v.fx.Record(ctx, run, "slow"); err != nil {
						return nil, err
					}
					select {
					case <-release:
					case <-ctx.Done():
					}
					return "slow-done", nil // success, after the group failed
				}},
		}}},
		saga.Step[st]{Name: "never", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "never")
		}})
	e = v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, e, s.ID, sagatest.Event("step_failed:grp.bad"), nil)
	releaseOnce.Do(func() { close(release) })
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, map[string]int{"before": 1, "ok": 1, "undo-ok": 1, "undo-before": 1}, v.fx.Counts(t, s.ID),
		"bad's and slow's writes roll back; only ok and before are compensated")
	require.Equal(t, `"charge-17"`, gotResult.Load(), "Compensate gets the branch's result")
	order := v.order(t, s.ID)
	require.Equal(t, []string{"undo-ok", "undo-before"}, order[len(order)-2:])
	bs := branchStatus(t, e, s.ID)
	require.Equal(t, "failed", bs["bad"].Status)
	require.NotNil(t, bs["bad"].LastError)
	require.Contains(t, bs["bad"].LastError.Message, "card declined")
	require.NotEqual(t, "completed", bs["slow"].Status, "%+v", bs["slow"])
}

// doc.go: "or Join fails, the group fails: ... the completed branches are
// compensated (each branch's Compensate gets its result; the last branch in
// the definition first, in one transaction), and then the steps before the
// group, in reverse." Parallel.Join: "An error from Join fails the group for
// good".
func TestParallelJoinFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	var joins atomic.Int32
	br := func(name string) saga.Branch[st] {
		return saga.Branch[st]{Name: name,
			Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
				return name + "-res", v.fx.Record(ctx, run, name)
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ st, res json.RawMessage) error {
				if string(res) != `"`+name+`-res"` {
					return steps.Permanent(fmt.Errorf("%s got result %s", name, res))
				}
				return v.fx.Record(ctx, run, "undo-"+name)
			}}
	}
	d := saga.Define("par-join",
		saga.Step[st]{Name: "before",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "before") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "undo-before") }},
		saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{
			Branches: []saga.Branch[st]{br("a"), br("b"), br("c")},
			Join: func(_ context.Context, _ *saga.StepRun, _ *st, results map[string]json.RawMessage) error {
				joins.Add(1)
				if len(results) != 3 {
					return fmt.Errorf("join got %d results", len(results))
				}
				return errors.New("totals disagree")
			}}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, int32(1), joins.Load(), "a failing Join is not retried")
	order := v.order(t, s.ID)
	require.Len(t, order, 8, "%v", order)
	require.ElementsMatch(t, []string{"a", "b", "c"}, order[1:4])
	require.Equal(t, "before", order[0])
	require.Equal(t, []string{"undo-c", "undo-b", "undo-a", "undo-before"}, order[4:],
		"the last branch in the definition first, then the steps before")
	require.NotNil(t, in.LastError)
	require.Contains(t, in.LastError.Message, "totals disagree")
}

// A branch result that cannot be encoded: Branch.Action "Its result ...
// is encoded as JSON". The docs do not say what happens when it cannot be;
// guarantee 8 says "Nothing ends silently" and bad input is "never
// retried" forever: the saga must end, with an error that says why, and the
// branch's writes roll back. A result whose JSON holds a NUL ("\u0000",
// which jsonb refuses) is stored as sent and reaches Join unchanged.
func TestParallelResultNotJSON(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	results := map[string]any{
		"func": func() {},
		"chan": make(chan int),
		"nul":  "a\x00b",
	}
	for name := range results {
		var joined atomic.Value
		d := saga.Define("par-json-"+name,
			saga.Step[st]{Name: "before",
				Action:     func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "before") },
				Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "undo-before") }},
			saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{Branches: []saga.Branch[st]{
				{Name: "good", Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
					return 1, v.fx.Record(ctx, run, "good")
				}},
				{Name: "weird", Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
					Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
						return results[name], v.fx.Record(ctx, run, "weird")
					}},
			}, Join: func(_ context.Context, _ *saga.StepRun, _ *st, r map[string]json.RawMessage) error {
				joined.Store(string(r["weird"]))
				return nil
			}}})
		e := v.engine(t, true, d)
		s, err := saga.Start(ctx, e, d, st{}, nil)
		require.NoError(t, err)
		in := testkit.WaitEnded(t, e, s.ID)
		t.Logf("%s: %s, last error %+v", name, in.Status, in.LastError)
		c := v.fx.Counts(t, s.ID)
		if name == "nul" {
			require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
			require.Equal(t, `"a\u0000b"`, joined.Load())
			require.Equal(t, 1, c["weird"])
			continue
		}
		require.NotEqual(t, saga.StatusCompleted, in.Status, "%s: %s", name, sagatest.Describe(in))
		require.NotNil(t, in.LastError, name)
		require.Zero(t, c["weird"], "%s: a result that cannot be stored rolls back the branch: %v", name, c)
		if in.Status == saga.StatusCompensated {
			require.Equal(t, 1, c["undo-before"], name)
		}
	}
}

// Branch.Name: "letters, digits, '.', '-' and '_'; with the step's name and
// a '.', at most 64 bytes." Parallel.Branches: "At least one; names unique
// within the step." Branch.Action: "Required." doc.go: "A parallel step
// cannot be the pivot or come after it". ErrInvalidDefinition "is wrapped by
// every definition problem found by [Engine.Register]".
func TestParallelRegistrationRules(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	act := func(context.Context, *saga.StepRun, st) (any, error) { return nil, nil }
	grp := func(names ...string) *saga.Parallel[st] {
		p := &saga.Parallel[st]{}
		for _, n := range names {
			p.Branches = append(p.Branches, saga.Branch[st]{Name: n, Action: act})
		}
		return p
	}
	step := strings.Repeat("s", 30)
	cases := map[string]struct {
		steps []saga.Step[st]
		names string // what the error must name
	}{
		"space":       {[]saga.Step[st]{{Name: "g", Parallel: grp("ok", "bad name")}}, "bad name"},
		"slash":       {[]saga.Step[st]{{Name: "g", Parallel: grp("a/b")}}, "a/b"},
		"empty":       {[]saga.Step[st]{{Name: "g", Parallel: grp("")}}, "g"},
		"nul":         {[]saga.Step[st]{{Name: "g", Parallel: grp("a\x00")}}, "g"},
		"non-ascii":   {[]saga.Step[st]{{Name: "g", Parallel: grp("carté")}}, "g"},
		"too long":    {[]saga.Step[st]{{Name: step, Parallel: grp(strings.Repeat("b", 34))}}, step},
		"duplicate":   {[]saga.Step[st]{{Name: "g", Parallel: grp("a", "a")}}, "a"},
		"no branches": {[]saga.Step[st]{{Name: "g", Parallel: grp()}}, "g"},
		"nil action": {[]saga.Step[st]{{Name: "g", Parallel: &saga.Parallel[st]{
			Branches: []saga.Branch[st]{{Name: "a"}}}}}, "a"},
		"action and parallel": {[]saga.Step[st]{{Name: "g", Action: noop, Parallel: grp("a")}}, "g"},
		"pivot":               {[]saga.Step[st]{{Name: "g", Pivot: true, Parallel: grp("a")}}, "g"},
		"after pivot": {[]saga.Step[st]{{Name: "p", Pivot: true, Action: noop},
			{Name: "g", Retriable: true, Parallel: grp("a")}}, "g"},
		"negative attempts": {[]saga.Step[st]{{Name: "g", Parallel: &saga.Parallel[st]{Branches: []saga.Branch[st]{
			{Name: "a", Action: act, Retry: &saga.RetryPolicy{MaxAttempts: -1}}}}}}, "a"},
	}
	for name, c := range cases {
		e := v.engine(t, false)
		err := e.Register(saga.Define("reg", c.steps...))
		require.ErrorIs(t, err, saga.ErrInvalidDefinition, name)
		require.Contains(t, err.Error(), c.names, name)
		require.NotContains(t, err.Error(), "\x00", "%s: the error is printable", name)
	}
	// Exactly 64 bytes is allowed: 30 + 1 + 33.
	e := v.engine(t, false)
	require.NoError(t, e.Register(saga.Define("reg", saga.Step[st]{Name: step, Parallel: grp(strings.Repeat("b", 33))})))
	// Branch names may repeat across steps (unique within the step).
	e = v.engine(t, false)
	require.NoError(t, e.Register(saga.Define("reg2",
		saga.Step[st]{Name: "g1", Parallel: grp("a", "b")}, saga.Step[st]{Name: "g2", Parallel: grp("a", "b")})))
}

// doc.go: "A cancel during the group does the same": branches still running
// are cancelled and their effects rolled back, the completed branches are
// compensated, then the steps before. Cancel: "No later step runs."
func TestParallelCancelDuringBranches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	g := newGate()
	d := saga.Define("par-cancel",
		saga.Step[st]{Name: "before",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "before") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "undo-before") }},
		saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{Branches: []saga.Branch[st]{
			{Name: "fast", Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
				return 7, v.fx.Record(ctx, run, "fast")
			}, Compensate: func(ctx context.Context, run *saga.StepRun, _ st, res json.RawMessage) error {
				return v.fx.Record(ctx, run, "undo-fast:"+string(res))
			}},
			// A short Timeout: a cancel does not end a running branch's
			// context before it (see FINDINGS.md, F2).
			{Name: "stuck", Timeout: 2 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
				if err := v.fx.Record(ctx, run, "stuck"); err != nil {
					return nil, err
				}
				return nil, g.wait(ctx)
			}, Compensate: func(ctx context.Context, run *saga.StepRun, _ st, _ json.RawMessage) error {
				return v.fx.Record(ctx, run, "undo-stuck")
			}},
		}}},
		saga.Step[st]{Name: "never", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "never")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	g.waitEntered(t)
	testkit.WaitFor(t, 20*time.Second, "fast completes", func() bool {
		return branchStatus(t, e, s.ID)["fast"].Status == "completed"
	})
	start := time.Now()
	require.NoError(t, e.Cancel(ctx, s.ID, "customer left"))
	in := testkit.WaitEnded(t, e, s.ID)
	require.Less(t, time.Since(start), 15*time.Second, "the cancel ends the saga")
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, map[string]int{"before": 1, "fast": 1, "undo-fast:7": 1, "undo-before": 1}, v.fx.Counts(t, s.ID))
	require.Equal(t, 1, events(in, saga.EventSagaCancelled))
}

// Many sagas with parallel steps at once: guarantee 3, "the rows a handler
// writes through run.Tx exist exactly once", per branch; "exactly one of
// them sees all the others complete and joins".
func TestParallelManySagas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	var joins sync.Map
	br := func(name string) saga.Branch[st] {
		return saga.Branch[st]{Name: name, Action: func(ctx context.Context, run *saga.StepRun, s st) (any, error) {
			return s.N, v.fx.Record(ctx, run, name)
		}}
	}
	d := saga.Define("par-many",
		saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{
			Branches: []saga.Branch[st]{br("a"), br("b"), br("c"), br("d")},
			Join: func(ctx context.Context, run *saga.StepRun, s *st, results map[string]json.RawMessage) error {
				n, _ := joins.LoadOrStore(run.SagaID, new(atomic.Int32))
				n.(*atomic.Int32).Add(1)
				for _, r := range results {
					var x int
					if err := json.Unmarshal(r, &x); err != nil {
						return err
					}
					s.Sum += x
				}
				return v.fx.Record(ctx, run, "join")
			}}},
		saga.Step[st]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "after")
		}})
	e := v.engine(t, true, d)
	ids := make([]uuid.UUID, 50)
	for i := range ids {
		s, err := saga.Start(ctx, e, d, st{N: i}, nil)
		require.NoError(t, err)
		ids[i] = s.ID
	}
	for i, id := range ids {
		in := testkit.WaitEnded(t, e, id)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		var out st
		require.NoError(t, in.DecodeState(&out))
		require.Equal(t, 4*i, out.Sum)
		require.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1, "d": 1, "join": 1, "after": 1}, v.fx.Counts(t, id))
	}
}

// Pause during the branches: "A paused saga starts no new step,
// compensation, retry"; a branch is "a step of its own" with "its own
// attempts and backoff". A branch's retry waits for the resume; nothing is
// doubled.
func TestParallelPauseDuringBranches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	g := newGate()
	var flakyCalls atomic.Int32
	d := saga.Define("par-pause",
		saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{Branches: []saga.Branch[st]{
			{Name: "held", Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
				if err := v.fx.Record(ctx, run, "held"); err != nil {
					return nil, err
				}
				return nil, g.wait(ctx)
			}},
			// The retry's backoff must outlast the test's reaction (seeing
			// the failure, then Pause): with 200 ms a loaded CI paused 215 ms
			// after the failure, when the retry was already due and running.
			// It is due within the hold below.
			{Name: "flaky", Retry: &saga.RetryPolicy{MaxAttempts: 5, Backoff: func(int) time.Duration { return 700 * time.Millisecond }},
				Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
					if flakyCalls.Add(1) == 1 {
						<-g.entered // the held branch runs first; then fail once
						g.entered <- struct{}{}
						return nil, errors.New("transient")
					}
					return nil, v.fx.Record(ctx, run, "flaky")
				}},
		}}},
		saga.Step[st]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "after")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, e, s.ID, sagatest.Event("step_failed:grp.flaky"), nil)
	failedBy := time.Now() // the failure, and its retry's 700 ms, began before this
	require.NoError(t, e.Pause(ctx, s.ID, "hold the group"))
	g.waitEntered(t)
	close(g.release)
	testkit.WaitFor(t, 20*time.Second, "the held branch completes", func() bool {
		return branchStatus(t, e, s.ID)["held"].Status == "completed"
	})
	pausedAt := time.Now()
	testkit.Hold(t, 1500*time.Millisecond, "the flaky branch's retry waits for the resume", func() bool {
		if flakyCalls.Load() != 1 || v.fx.Count(t, s.ID, "after") != 0 {
			in := get(t, e, s.ID)
			t.Logf("%s after the pause: calls=%d effects=%v paused=%+v\n%s", time.Since(pausedAt), flakyCalls.Load(),
				v.fx.Counts(t, s.ID), in.Paused, sagatest.Describe(in))
			return false
		}
		return true
	})
	require.Greater(t, time.Since(failedBy), 700*time.Millisecond, "the retry was due while the hold watched")
	require.NoError(t, e.Resume(ctx, s.ID, "go"))
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, map[string]int{"held": 1, "flaky": 1, "after": 1}, v.fx.Counts(t, s.ID))
	require.Equal(t, int32(2), flakyCalls.Load())
}
