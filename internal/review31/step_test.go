package review31_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/saga"
)

// txStep is an action that honours ctx: it runs a statement on run.Tx with
// it and returns its error, counting its calls.
func txStep(calls *atomic.Int32) saga.StepFunc[order] {
	return func(ctx context.Context, run *saga.StepRun, _ *order) error {
		calls.Add(1)
		_, err := run.Tx.Exec(ctx, `select 1`)
		return err
	}
}

// ctxStep is an action that honours ctx without a statement: it returns
// ctx's error once ctx ends, counting its calls.
func ctxStep(calls *atomic.Int32) saga.StepFunc[order] {
	return func(ctx context.Context, _ *saga.StepRun, _ *order) error {
		calls.Add(1)
		<-ctx.Done()
		return ctx.Err()
	}
}

func ms(int) time.Duration { return time.Millisecond }

// TestStepTimeoutsOfANanosecondAndAMicrosecond: "Timeout bounds one attempt
// (its context is cancelled then). An attempt that runs out of time fails
// with code step_timeout and is retried like any other failure." With 1 ns
// and 1 µs, a handler that honours ctx (it returns ctx's error when ctx
// ends; one that runs a statement on run.Tx is F1) fails each of its MaxAttempts
// attempts (3, and 1) with step_timeout, and the saga compensates the step
// before it once: it neither completes, hangs nor spins past its attempts.
func TestStepTimeoutsOfANanosecondAndAMicrosecond(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	lg := &logs{}
	type tc struct {
		name     string
		timeout  time.Duration
		attempts int
	}
	cases := []tc{{"1ns-3", 1, 3}, {"1us-3", time.Microsecond, 3}, {"1ns-1", 1, 1}, {"1us-1", time.Microsecond, 1}}
	calls := make([]*atomic.Int32, len(cases))
	undone := make([]*atomic.Int32, len(cases))
	var defs []*saga.Definition[order]
	var any []saga.AnyDefinition
	for i, c := range cases {
		calls[i], undone[i] = new(atomic.Int32), new(atomic.Int32)
		u := undone[i]
		d := saga.Define("r31-timeout-"+c.name,
			saga.Step[order]{Name: "a", Action: noop, Compensate: func(context.Context, *saga.StepRun, *order) error { u.Add(1); return nil }},
			saga.Step[order]{Name: "tiny", Action: ctxStep(calls[i]), Timeout: c.timeout,
				Retry: &saga.RetryPolicy{MaxAttempts: c.attempts, Backoff: ms}},
			saga.Step[order]{Name: "after", Action: noop})
		defs = append(defs, d)
		any = append(any, d)
	}
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), any...)
	ctx := context.Background()
	for i, c := range cases {
		st, err := saga.Start(ctx, e, defs[i], order{ID: c.name}, nil)
		if err != nil {
			t.Fatal(err)
		}
		in := waitEnded(t, e, st.ID, 20*time.Second)
		failed := events(in, saga.EventStepFailed, "tiny")
		if in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeTimeout ||
			failed != c.attempts || undone[i].Load() != 1 || int(calls[i].Load()) != c.attempts {
			t.Errorf("%s: ended %s, last error %+v, %d step_failed (want %d), handler ran %d times, a compensated %d times:\n%s",
				c.name, in.Status, in.LastError, failed, c.attempts, calls[i].Load(), undone[i].Load(), timeline(in))
		}
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged errors: %q", errs[:min(3, len(errs))])
	}
}

// TestAQuickHandlerUnderATimeoutOfOneNanosecondEnds: a handler that returns
// nil at once, without looking at ctx, under a Timeout of 1 ns: whether the
// attempt counts as a success or a timeout, the saga ends (completed, the
// next step once; or compensated after MaxAttempts) and does not spin.
func TestAQuickHandlerUnderATimeoutOfOneNanosecondEnds(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	var calls, after atomic.Int32
	def := saga.Define("r31-quick",
		saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "quick", Action: func(context.Context, *saga.StepRun, *order) error { calls.Add(1); return nil },
			Timeout: 1, Retry: &saga.RetryPolicy{MaxAttempts: 4, Backoff: ms}},
		saga.Step[order]{Name: "after", Action: func(context.Context, *saga.StepRun, *order) error { after.Add(1); return nil }})
	e := startEngine(t, pool, engineCfg(schema, nil), def)
	st, err := saga.Start(context.Background(), e, def, order{ID: "q"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := waitEnded(t, e, st.ID, 20*time.Second)
	t.Logf("ended %s after %d calls:\n%s", in.Status, calls.Load(), timeline(in))
	switch in.Status {
	case saga.StatusCompleted:
		if after.Load() != 1 {
			t.Errorf("completed, but the step after ran %d times", after.Load())
		}
	case saga.StatusCompensated:
		if calls.Load() > 4 || after.Load() != 0 {
			t.Errorf("compensated after %d calls (MaxAttempts 4), the step after ran %d times", calls.Load(), after.Load())
		}
	default:
		t.Errorf("ended %s", in.Status)
	}
}

// TestHugeMaxAttemptsWithATinyTimeoutKeepsItsBackoff: MaxAttempts of int's
// largest with a Timeout of 1 µs and the default backoff (1 s doubling,
// ±20%): the step is retried with backoff, not at once: within 2.5 s at
// most 3 attempts run (at about 0, 1 and 3 s), at least 2. A cancel then
// compensates the saga.
func TestHugeMaxAttemptsWithATinyTimeoutKeepsItsBackoff(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	var calls, undone atomic.Int32
	def := saga.Define("r31-huge-attempts",
		saga.Step[order]{Name: "a", Action: noop, Compensate: func(context.Context, *saga.StepRun, *order) error { undone.Add(1); return nil }},
		saga.Step[order]{Name: "tiny", Action: ctxStep(&calls), Timeout: time.Microsecond,
			Retry: &saga.RetryPolicy{MaxAttempts: math.MaxInt}})
	e := startEngine(t, pool, engineCfg(schema, nil), def)
	ctx := context.Background()
	st, err := saga.Start(ctx, e, def, order{ID: "h"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the first attempt", func() bool { return calls.Load() >= 1 })
	time.Sleep(2500 * time.Millisecond)
	if n := calls.Load(); n < 2 || n > 3 {
		t.Errorf("%d attempts in about 2.5 s with the default backoff, want 2 or 3", n)
	}
	if err := e.Cancel(ctx, st.ID, "review31"); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	in := waitEnded(t, e, st.ID, 15*time.Second)
	if in.Status != saga.StatusCompensated || undone.Load() != 1 {
		t.Errorf("cancelled: %s, a compensated %d times:\n%s", in.Status, undone.Load(), timeline(in))
	}
}

// TestANegativeStepTimeout: Timeout's doc names no meaning for a negative
// value; Register may refuse it (naming the timeout), else the step must
// not fail every attempt without a word: it either runs with the default
// (the saga completes) or times out as the doc of 1 ns would have it.
func TestANegativeStepTimeout(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	for _, d := range []time.Duration{-1, math.MinInt64} {
		var calls atomic.Int32
		def := saga.Define(fmt.Sprintf("r31-neg-timeout-%d", d),
			saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
			saga.Step[order]{Name: "neg", Action: txStep(&calls), Timeout: d, Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: ms}})
		e, err := saga.New(pool, engineCfg(schema, nil))
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Register(def); err != nil {
			t.Logf("%v: Register refused: %v", d, err)
			if !errors.Is(err, saga.ErrInvalidDefinition) {
				t.Errorf("%v: refusal does not wrap ErrInvalidDefinition", d)
			}
			continue
		}
		if err := e.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		st, err := saga.Start(context.Background(), e, def, order{ID: "n"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		in := waitEnded(t, e, st.ID, 20*time.Second)
		t.Logf("%v: accepted; the saga ended %s:\n%s", d, in.Status, timeline(in))
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if err := e.Stop(ctx); err != nil {
			t.Errorf("stop: %v", err)
		}
		cancel()
	}
}

// ---- parallel ----------------------------------------------------------------

// TestBranchTimeoutOfANanosecondFailsTheGroupCleanly: a branch whose
// Timeout is 1 ns (and that honours ctx without a statement) fails each of its Retry.MaxAttempts (2) attempts with
// step_timeout; "A branch whose attempts are spent ... fails the group":
// the sibling that completed is compensated once with its result, the
// step before the group once, and the saga ends compensated.
func TestBranchTimeoutOfANanosecondFailsTheGroupCleanly(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	lg := &logs{}
	var tinyCalls, okUndone, beforeUndone atomic.Int32
	var gotResult atomic.Value
	def := saga.Define("r31-branch-1ns",
		saga.Step[order]{Name: "before", Action: noop, Compensate: func(context.Context, *saga.StepRun, *order) error { beforeUndone.Add(1); return nil }},
		saga.Step[order]{Name: "p", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{
			{Name: "ok", Action: func(context.Context, *saga.StepRun, order) (any, error) { return map[string]int{"v": 7}, nil },
				Compensate: func(_ context.Context, _ *saga.StepRun, _ order, r json.RawMessage) error {
					okUndone.Add(1)
					gotResult.Store(string(r))
					return nil
				}},
			{Name: "tiny", Timeout: 1, Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: ms},
				Action: func(ctx context.Context, _ *saga.StepRun, _ order) (any, error) {
					tinyCalls.Add(1)
					<-ctx.Done()
					return nil, ctx.Err()
				}},
		}}},
		saga.Step[order]{Name: "after", Action: noop})
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), def)
	ctx := context.Background()
	st, err := saga.Start(ctx, e, def, order{ID: "b"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := waitEnded(t, e, st.ID, 20*time.Second)
	if in.Status != saga.StatusCompensated || beforeUndone.Load() != 1 || tinyCalls.Load() != 2 {
		t.Fatalf("ended %s; before compensated %d times; tiny ran %d times (want 2):\n%s\nlogs %q", in.Status, beforeUndone.Load(), tinyCalls.Load(), timeline(in), lg.all())
	}
	bs, err := e.Branches(ctx, st.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bs {
		t.Logf("branch %s: %s attempts=%d err=%+v", b.Branch, b.Status, b.Attempts, b.LastError)
		if b.Branch == "tiny" && (b.Status != "failed" || b.Attempts != 2 || b.LastError == nil || b.LastError.Code != saga.CodeTimeout) {
			t.Errorf("tiny: %s after %d attempts, %+v; want failed after 2 by step_timeout", b.Status, b.Attempts, b.LastError)
		}
	}
	// ok may not have completed before the group failed (then it is not
	// compensated); if it did, it is compensated once with its result.
	if n := okUndone.Load(); n > 1 || (n == 1 && gotResult.Load() != `{"v": 7}` && gotResult.Load() != `{"v":7}`) {
		t.Errorf("ok compensated %d times with %v", n, gotResult.Load())
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged errors: %q", errs[:min(3, len(errs))])
	}
}

// TestBranchExtremes: a branch with Retry.MaxAttempts 1 that always fails
// runs once and fails the group; a negative branch Timeout is refused by
// Register or runs.
func TestBranchExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	var once atomic.Int32
	def := saga.Define("r31-branch-once",
		saga.Step[order]{Name: "before", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "p", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{
			{Name: "fail", Retry: &saga.RetryPolicy{MaxAttempts: 1}, Action: func(context.Context, *saga.StepRun, order) (any, error) {
				once.Add(1)
				return nil, errors.New("always")
			}},
		}}})
	neg := saga.Define("r31-branch-neg",
		saga.Step[order]{Name: "p", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{
			{Name: "neg", Timeout: -1, Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: ms}, Action: func(context.Context, *saga.StepRun, order) (any, error) { return nil, nil }},
		}}})
	probe, err := saga.New(pool, engineCfg(schema, nil))
	if err != nil {
		t.Fatal(err)
	}
	defs := []saga.AnyDefinition{def}
	if err := probe.Register(neg); err != nil {
		t.Logf("a negative branch Timeout is refused: %v", err)
	} else {
		defs = append(defs, neg)
	}
	e := startEngine(t, pool, engineCfg(schema, nil), defs...)
	ctx := context.Background()
	st, err := saga.Start(ctx, e, def, order{ID: "o"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := waitEnded(t, e, st.ID, 20*time.Second)
	if in.Status != saga.StatusCompensated || once.Load() != 1 {
		t.Errorf("MaxAttempts 1: ended %s after %d attempts:\n%s", in.Status, once.Load(), timeline(in))
	}
	if len(defs) == 2 {
		st, err := saga.Start(ctx, e, neg, order{ID: "n"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		in := waitEnded(t, e, st.ID, 20*time.Second)
		t.Logf("a negative branch Timeout is accepted; the saga ended %s:\n%s", in.Status, timeline(in))
	}
}

// TestManyBranches: Parallel's doc bounds the branches below only ("At
// least one"): a group of 150 branches completes, every branch once, Join
// gets 150 results, and Branches lists 150 completed rows. (1000 branches
// completed in about 10 s without the race detector in a probe; 150 keep
// the package's run short.)
func TestManyBranches(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	lg := &logs{}
	const n = 150
	var ran atomic.Int32
	var joined atomic.Int32
	branches := make([]saga.Branch[order], n)
	for i := range branches {
		branches[i] = saga.Branch[order]{Name: fmt.Sprintf("b%d", i), Action: func(context.Context, *saga.StepRun, order) (any, error) {
			ran.Add(1)
			return i, nil
		}}
	}
	def := saga.Define("r31-thousand",
		saga.Step[order]{Name: "p", Parallel: &saga.Parallel[order]{Branches: branches,
			Join: func(_ context.Context, _ *saga.StepRun, s *order, results map[string]json.RawMessage) error {
				joined.Add(1)
				s.N = len(results)
				return nil
			}}})
	cfg := engineCfg(schema, lg.logger())
	cfg.Workers = 4
	e := startEngine(t, pool, cfg, def)
	ctx := context.Background()
	start := time.Now()
	st, err := saga.Start(ctx, e, def, order{ID: "k"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := waitEnded(t, e, st.ID, 50*time.Second)
	t.Logf("%d branches took %v", n, time.Since(start))
	var s order
	if err := in.DecodeState(&s); err != nil {
		t.Fatal(err)
	}
	if in.Status != saga.StatusCompleted || ran.Load() != n || joined.Load() != 1 || s.N != n {
		t.Fatalf("ended %s; %d branch runs, %d joins, join saw %d results", in.Status, ran.Load(), joined.Load(), s.N)
	}
	bs, err := e.Branches(ctx, st.ID)
	if err != nil {
		t.Fatal(err)
	}
	done := 0
	for _, b := range bs {
		if b.Status == "completed" && b.Attempts <= 1 {
			done++
		}
	}
	if len(bs) != n || done != n {
		t.Errorf("Branches: %d rows, %d completed at one attempt", len(bs), done)
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged errors: %q", errs[:min(3, len(errs))])
	}
}
