package review30_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// TestEngineWithHugeBatchesAndRetentions: an engine whose RescueBatch and
// RetentionBatch are int's largest (or 2^31), whose retentions are
// time.Duration's longest or centuries, and whose graces and intervals are
// time.Duration's longest runs sagas to their end, and RescueNow and
// RunRetention work (and delete nothing young), logging no error.
func TestEngineWithHugeBatchesAndRetentions(t *testing.T) {
	t.Parallel()
	for i, mod := range []func(c *saga.Config){
		func(c *saga.Config) {
			c.RescueBatch, c.RetentionBatch = math.MaxInt, math.MaxInt
			c.OutboxRetention, c.InboxRetention, c.SagaRetention = 100*365*24*time.Hour, math.MaxInt64, math.MaxInt64
		},
		func(c *saga.Config) {
			c.RescueBatch, c.RetentionBatch = 1<<31, 1<<31
			c.OutboxRetention, c.InboxRetention, c.SagaRetention = 25*24*time.Hour, 30*24*time.Hour, 37*time.Minute
		},
		func(c *saga.Config) {
			c.RescueBatch, c.RetentionBatch = 1, 1
			c.HandlerGrace, c.UnknownSagaGrace, c.SagaGaugeInterval = math.MaxInt64, math.MaxInt64, math.MaxInt64
			c.RescueInterval, c.RetentionInterval = math.MaxInt64, math.MaxInt64
		},
	} {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			lg := &logs{}
			cfg := engineCfg(schema, lg.logger())
			mod(cfg)
			def := saga.Define("r30-huge",
				saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
				saga.Step[order]{Name: "b", Action: noop})
			e := startEngine(t, pool, cfg, def)
			ctx := context.Background()
			var ids []uuid.UUID
			for j := range 3 {
				st, err := saga.Start(ctx, e, def, order{ID: fmt.Sprint(j)}, nil)
				if err != nil {
					t.Fatalf("start: %v", err)
				}
				ids = append(ids, st.ID)
			}
			for _, id := range ids {
				if in := waitEnded(t, e, id); in.Status != saga.StatusCompleted {
					t.Fatalf("saga ended %s:\n%s", in.Status, timeline(in))
				}
			}
			if _, err := e.RescueNow(ctx); err != nil {
				t.Errorf("RescueNow: %v", err)
			}
			res, err := e.RunRetention(ctx)
			if err != nil {
				t.Errorf("RunRetention: %v", err)
			}
			if res.Sagas != 0 || res.Messages != 0 || res.InboxKeys != 0 {
				t.Errorf("RunRetention deleted young rows: %+v", res)
			}
			if e := lg.errors(); len(e) > 0 {
				t.Errorf("the engine logged errors: %q", e[:min(3, len(e))])
			}
		})
	}
}

// TestRetryMaxAttemptsOfIntsLargest: MaxAttempts "counts every attempt";
// int's largest is a step retried (in effect) forever. A step that fails
// twice and then succeeds completes, and the rescuer works meanwhile.
func TestRetryMaxAttemptsOfIntsLargest(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	var runs atomic.Int64
	def := saga.Define("r30-maxint",
		saga.Step[order]{Name: "flaky", Retry: &saga.RetryPolicy{MaxAttempts: math.MaxInt, Backoff: func(int) time.Duration { return time.Millisecond }},
			Action: func(context.Context, *saga.StepRun, *order) error {
				if runs.Add(1) <= 2 {
					return errors.New("not yet")
				}
				return nil
			}})
	lg := &logs{}
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), def)
	st, err := saga.Start(context.Background(), e, def, order{ID: "x"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.RescueNow(context.Background()); err != nil {
		t.Errorf("RescueNow: %v", err)
	}
	if in := waitEnded(t, e, st.ID); in.Status != saga.StatusCompleted || runs.Load() != 3 {
		t.Fatalf("saga ended %s after %d runs, want completed after 3:\n%s", in.Status, runs.Load(), timeline(in))
	}
	if e := lg.errors(); len(e) > 0 {
		t.Errorf("the engine logged errors: %q", e[:min(3, len(e))])
	}
}

// TestRetryAfterTheLongestDuration: RetryAfter "asks for the step to be
// retried no sooner than d". With d of 30 days or time.Duration's longest,
// the saga is not retried now, its deadline is in the future, and the
// rescuer leaves it alone; with a negative d it is retried at once.
func TestRetryAfterTheLongestDuration(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{30 * 24 * time.Hour, math.MaxInt64, -time.Hour} {
		t.Run(d.String(), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			var runs atomic.Int64
			def := saga.Define("r30-retryafter", saga.Step[order]{Name: "later", Action: func(context.Context, *saga.StepRun, *order) error {
				if runs.Add(1) == 1 {
					return steps.RetryAfter(d, errors.New("come back later"))
				}
				return nil
			}})
			e := startEngine(t, pool, engineCfg(schema, nil), def)
			ctx := context.Background()
			st, err := saga.Start(ctx, e, def, order{ID: "x"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if d < 0 {
				if in := waitEnded(t, e, st.ID); in.Status != saga.StatusCompleted {
					t.Fatalf("ended %s", in.Status)
				}
				return
			}
			waitFor(t, 10*time.Second, "the first attempt", func() bool { return runs.Load() == 1 })
			time.Sleep(300 * time.Millisecond)
			res, err := e.RescueNow(ctx)
			if err != nil {
				t.Fatalf("RescueNow: %v", err)
			}
			in, err := e.Get(ctx, st.ID)
			if err != nil {
				t.Fatal(err)
			}
			if runs.Load() != 1 || in.Status != saga.StatusRunning {
				t.Fatalf("RetryAfter(%v): %d runs, status %s; want 1 run, running", d, runs.Load(), in.Status)
			}
			if in.NextCheckAt == nil || !in.NextCheckAt.After(time.Now().Add(24*time.Hour)) {
				t.Errorf("RetryAfter(%v): deadline %v, want later than a day from now", d, in.NextCheckAt)
			}
			if res.Waiting+res.Redriven+res.FailedOver+res.Rechecked > 0 {
				t.Errorf("RetryAfter(%v): the rescuer looked at the saga: %+v", d, res)
			}
		})
	}
}

// TestDeadlinesAndWaitTimeoutsOfTheLongestDuration: WithDeadline, a
// StartOpts.Deadline and a signal wait's Timeout of time.Duration's longest
// (or 30 days): the saga waits, its Deadline and its wait's Until are in
// the future, the rescuer cancels nothing, and the signal completes it.
func TestDeadlinesAndWaitTimeoutsOfTheLongestDuration(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{30 * 24 * time.Hour, math.MaxInt64} {
		t.Run(d.String(), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			def := saga.Define("r30-deadline",
				saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
				saga.Step[order]{Name: "wait", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil }).Timeout(d)},
				saga.Step[order]{Name: "b", Action: noop},
			).WithDeadline(d)
			e := startEngine(t, pool, engineCfg(schema, nil), def)
			ctx := context.Background()
			st, err := saga.Start(ctx, e, def, order{ID: "x"}, &saga.StartOpts{Deadline: d})
			if err != nil {
				t.Fatal(err)
			}
			var in *saga.Instance
			waitFor(t, 10*time.Second, "the saga to wait", func() bool {
				in, err = e.Get(ctx, st.ID)
				return err == nil && in.Wait != nil
			})
			soon := time.Now().Add(24 * time.Hour)
			if in.Deadline == nil || !in.Deadline.After(soon) {
				t.Errorf("Deadline %v: Instance.Deadline = %v, want far in the future", d, in.Deadline)
			}
			if in.Wait.Until == nil || !in.Wait.Until.After(soon) {
				t.Errorf("Timeout %v: Wait.Until = %v, want far in the future", d, in.Wait.Until)
			}
			res, err := e.RescueNow(ctx)
			if err != nil || res.Deadlines != 0 || res.Redriven != 0 || res.FailedOver != 0 {
				t.Errorf("RescueNow = %+v, %v; want nothing done", res, err)
			}
			if _, err := e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go"}); err != nil {
				t.Fatal(err)
			}
			if in := waitEnded(t, e, st.ID); in.Status != saga.StatusCompleted {
				t.Fatalf("ended %s:\n%s", in.Status, timeline(in))
			}
		})
	}
}

// failedSagas starts n sagas of a definition whose compensation fails for
// good, and waits until they are failed.
func failedSagas(t *testing.T, e *saga.Engine, def *saga.Definition[order], n int) {
	t.Helper()
	var ids []uuid.UUID
	for i := range n {
		st, err := saga.Start(context.Background(), e, def, order{ID: fmt.Sprint(i)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, st.ID)
	}
	for _, id := range ids {
		if in := waitEnded(t, e, id); in.Status != saga.StatusFailed {
			t.Fatalf("ended %s, want failed:\n%s", in.Status, timeline(in))
		}
	}
}

func failingDef(name string, broken *atomic.Bool) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "a", Action: noop, Compensate: func(context.Context, *saga.StepRun, *order) error {
			if broken.Load() {
				return steps.Permanent(errors.New("cannot undo"))
			}
			return nil
		}},
		saga.Step[order]{Name: "b", Action: func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(errors.New("no"))
		}})
}

// TestBulkReplayBounds: "Max caps how many sagas are replayed ... at most
// BulkReplayMaxLimit"; RatePerSecond "limits replays per second". A Max
// above the limit (int's largest among them) is refused; a rate whose
// interval overflows time.Duration still limits.
func TestBulkReplayBounds(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	var broken atomic.Bool
	broken.Store(true)
	def := failingDef("r30-bulk", &broken)
	e := startEngine(t, pool, engineCfg(schema, nil), def)
	failedSagas(t, e, def, 4)
	ctx := context.Background()
	for _, m := range []int{saga.BulkReplayMaxLimit + 1, 1 << 31, math.MaxInt, -1} {
		if res, err := e.ReplayBulk(ctx, saga.BulkReplayOpts{Name: "r30-bulk", Max: m, DryRun: true}); err == nil {
			t.Errorf("ReplayBulk with Max %d accepted: %d matched", m, len(res.Matched))
		}
	}
	res, err := e.ReplayBulk(ctx, saga.BulkReplayOpts{Name: "r30-bulk", Max: saga.BulkReplayMaxLimit, DryRun: true})
	if err != nil || len(res.Matched) != 4 {
		t.Fatalf("ReplayBulk with Max BulkReplayMaxLimit: %v, %v", res, err)
	}
}

// TestBulkReplayTinyRate: see TestReplayRateExtremes (F3), for
// Engine.ReplayBulk.
func TestBulkReplayTinyRate(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	var broken atomic.Bool
	broken.Store(true)
	def := failingDef("r30-bulkrate", &broken)
	e := startEngine(t, pool, engineCfg(schema, nil), def)
	failedSagas(t, e, def, 4)
	broken.Store(false)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	res, err := e.ReplayBulk(ctx, saga.BulkReplayOpts{Name: "r30-bulkrate", Max: 4, RatePerSecond: 1e-12})
	if res != nil && len(res.Replayed) > 1 {
		t.Fatalf("ReplayBulk at 1e-12/s replayed %d sagas within a second (err %v), want at most 1", len(res.Replayed), err)
	}
}

// TestEngineConfigBounds: BatchSize "at most BatchSizeMax", New's errors
// wrap ErrInvalidConfig and name the field; WithConcurrency "n must be
// between 1 and ConcurrencyLimitMax"; a version above VersionMax and a
// negative MaxAttempts are refused by Register; List and Dead listings
// refuse or cap a page size past their maximum.
func TestEngineConfigBounds(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	for _, n := range []int{saga.BatchSizeMax + 1, 1 << 31, math.MaxInt} {
		_, err := saga.New(pool, &saga.Config{Schema: schema, BatchSize: n})
		if !errors.Is(err, saga.ErrInvalidConfig) || !strings.Contains(err.Error(), "BatchSize") {
			t.Errorf("New with BatchSize %d: %v, want ErrInvalidConfig naming BatchSize", n, err)
		}
	}
	e, err := saga.New(pool, &saga.Config{Schema: schema, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	bad := []saga.AnyDefinition{
		saga.Define("c1", saga.Step[order]{Name: "a", Action: noop}).WithConcurrency(saga.ConcurrencyLimitMax + 1),
		saga.Define("c2", saga.Step[order]{Name: "a", Action: noop}).WithConcurrency(-1),
		saga.Define("c3", saga.Step[order]{Name: "a", Action: noop}).WithConcurrency(math.MaxInt),
		saga.Define("v1", saga.Step[order]{Name: "a", Action: noop}).WithVersion(saga.VersionMax + 1),
		saga.Define("v2", saga.Step[order]{Name: "a", Action: noop}).WithVersion(-1),
		saga.Define("v3", saga.Step[order]{Name: "a", Action: noop}).WithVersion(math.MaxInt),
		saga.Define("m1", saga.Step[order]{Name: "a", Action: noop, Retry: &saga.RetryPolicy{MaxAttempts: math.MinInt}}),
	}
	for _, d := range bad {
		if err := e.Register(d); err == nil {
			t.Errorf("Register accepted %s (version %d)", d.Name(), d.Version())
		}
	}
	ctx := context.Background()
	for _, lim := range []int{saga.ListLimitMax + 1, math.MaxInt, 1 << 31} {
		res, err := e.List(ctx, &saga.ListOpts{Limit: lim})
		if err == nil && res == nil {
			t.Errorf("List with Limit %d: nil result", lim)
		}
		if _, err := e.DeadMessages(ctx, &saga.DeadOpts{Limit: lim}); err != nil && !strings.Contains(err.Error(), "imit") {
			t.Errorf("DeadMessages with Limit %d: %v", lim, err)
		}
	}
	for _, m := range []int{saga.RequeueMaxLimit + 1, math.MaxInt} {
		if _, err := e.RequeueDead(ctx, &saga.RequeueOpts{All: true, Kind: saga.DeadOutbox, Max: m, DryRun: true}); err == nil {
			t.Errorf("RequeueDead with Max %d accepted", m)
		}
	}
}

// TestEngineNegativeDurations: PollInterval, RescueInterval,
// RetentionInterval, HandlerGrace, RescueSlack, UnknownSagaGrace and
// SagaGaugeInterval below zero are refused by New (ErrInvalidConfig naming
// the field) or work: the engine must not panic and must run a saga. A
// RescueInterval under a second is "at least a second". Run in a child.
func TestEngineNegativeDurations(t *testing.T) {
	if !isChild(t) {
		t.Parallel()
		out, err := inChild(t, 60*time.Second)
		if err != nil || strings.Contains(out, "panic:") {
			t.Fatalf("the child failed (%v):\n%s", err, tail(out, 40))
		}
		return
	}
	pool, schema := db(t)
	cases := map[string]func(c *saga.Config){
		"PollInterval":      func(c *saga.Config) { c.PollInterval = -time.Second },
		"RescueInterval":    func(c *saga.Config) { c.RescueInterval = -time.Second },
		"RetentionInterval": func(c *saga.Config) { c.RetentionInterval = -time.Second },
		"HandlerGrace":      func(c *saga.Config) { c.HandlerGrace = -time.Second },
		"RescueSlack":       func(c *saga.Config) { c.RescueSlack = -time.Hour },
		"UnknownSagaGrace":  func(c *saga.Config) { c.UnknownSagaGrace = -time.Hour },
		"SagaGaugeInterval": func(c *saga.Config) { c.SagaGaugeInterval = -time.Second },
		"RescueInterval1ns": func(c *saga.Config) { c.RescueInterval = time.Nanosecond },
		"Retention1ns":      func(c *saga.Config) { c.RetentionInterval = time.Nanosecond },
		"Workers":           func(c *saga.Config) { c.Workers = -1 },
		"RescueBatch":       func(c *saga.Config) { c.RescueBatch = -1 },
		"RetentionBatch":    func(c *saga.Config) { c.RetentionBatch = -1 },
		"MaxStateBytes":     func(c *saga.Config) { c.MaxStateBytes = -1 },
	}
	for name, mod := range cases {
		cfg := &saga.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: discard}
		mod(cfg)
		def := saga.Define("r30-neg-"+strings.ToLower(name), saga.Step[order]{Name: "a", Action: noop})
		e, err := saga.New(pool, cfg)
		if err != nil {
			t.Logf("%s: refused: %v", name, err)
			field := strings.TrimSuffix(strings.TrimSuffix(name, "1ns"), "Retention1ns")
			if !errors.Is(err, saga.ErrInvalidConfig) || !strings.Contains(err.Error(), field) && !strings.HasSuffix(name, "1ns") {
				t.Errorf("%s: refused without ErrInvalidConfig naming the field: %v", name, err)
			}
			continue
		}
		if err := e.Register(def); err != nil {
			t.Fatal(err)
		}
		if err := e.Start(context.Background()); err != nil {
			t.Errorf("%s: accepted by New; Start: %v", name, err)
			continue
		}
		st, err := saga.Start(context.Background(), e, def, order{ID: name}, nil)
		if err != nil {
			t.Errorf("%s: start saga: %v", name, err)
		} else {
			deadline := time.Now().Add(10 * time.Second)
			for {
				in, err := e.Get(context.Background(), st.ID)
				if err == nil && in.Status == saga.StatusCompleted {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("%s: accepted by New; the saga did not complete within 10 s (%v)", name, in.Status)
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
		sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if err := e.Stop(sctx); err != nil {
			t.Errorf("%s: stop: %v", name, err)
		}
		cancel()
		t.Logf("%s: accepted; a saga completed", name)
	}
}
