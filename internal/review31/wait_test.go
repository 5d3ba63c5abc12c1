package review31_test

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

// counter counts calls per saga id.
type counter struct {
	mu sync.Mutex
	n  map[uuid.UUID]int
}

func (c *counter) step(_ context.Context, run *saga.StepRun, _ *order) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[uuid.UUID]int{}
	}
	c.n[run.SagaID]++
	return nil
}

func (c *counter) of(id uuid.UUID) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

// TestSleepsThatDoNotWait: "Sleep waits d ...; a zero or negative d does not
// wait", SleepFor likewise, and "SleepUntil ... A time already past does not
// wait": 0, -1 ns, time.Duration's most negative, 1 ns, the zero time.Time,
// the Unix epoch, an hour ago and a time before PostgreSQL's earliest
// timestamp (4713 BC) each let the saga go on at once, the step after the
// sleep running once, with no error logged.
func TestSleepsThatDoNotWait(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	lg := &logs{}
	var after counter
	waits := map[string]*saga.Wait[order]{
		"sleep-0":           saga.Sleep[order](0),
		"sleep-neg":         saga.Sleep[order](-1),
		"sleep-minint":      saga.Sleep[order](math.MinInt64),
		"sleep-1ns":         saga.Sleep[order](1),
		"sleepfor-minint":   saga.SleepFor(func(*order) time.Duration { return math.MinInt64 }),
		"sleepfor-0":        saga.SleepFor(func(*order) time.Duration { return 0 }),
		"until-zero":        saga.SleepUntil(func(*order) time.Time { return time.Time{} }),
		"until-epoch":       saga.SleepUntil(func(*order) time.Time { return time.Unix(0, 0) }),
		"until-hour-ago":    saga.SleepUntil(func(*order) time.Time { return time.Now().Add(-time.Hour) }),
		"until-before-pg":   saga.SleepUntil(func(*order) time.Time { return time.Date(-10000, 1, 1, 0, 0, 0, 0, time.UTC) }),
		"until-utc-minus12": saga.SleepUntil(func(*order) time.Time { return time.Now().Add(-time.Minute).In(time.FixedZone("x", -12*3600)) }),
	}
	var defs []saga.AnyDefinition
	byName := map[string]*saga.Definition[order]{}
	for name, w := range waits {
		d := saga.Define("r31-"+name,
			saga.Step[order]{Name: "before", Action: noop, Compensate: noop},
			saga.Step[order]{Name: "sleep", Wait: w},
			saga.Step[order]{Name: "after", Action: after.step})
		defs = append(defs, d)
		byName[name] = d
	}
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), defs...)
	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	for name, d := range byName {
		st, err := saga.Start(ctx, e, d, order{ID: name}, nil)
		if err != nil {
			t.Fatalf("%s: start: %v", name, err)
		}
		ids[name] = st.ID
	}
	for name, id := range ids {
		in := waitEnded(t, e, id, 15*time.Second)
		if in.Status != saga.StatusCompleted {
			t.Errorf("%s: saga ended %s:\n%s", name, in.Status, timeline(in))
			continue
		}
		if n := after.of(id); n != 1 {
			t.Errorf("%s: the step after the sleep ran %d times", name, n)
		}
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged errors: %q", errs[:min(3, len(errs))])
	}
}

// TestSleepsOfTheFarFuture: a sleep of time.Duration's longest (SleepFor
// too), and SleepUntil the year 9999, the year 300000 (past PostgreSQL's
// last timestamp, 294276 AD) and time.Time's far end, each waits: the saga
// runs with a timer wait whose Until is years ahead, the rescuer re-drives
// and fails over nothing, and a cancel compensates it.
func TestSleepsOfTheFarFuture(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	lg := &logs{}
	var after, undone counter
	waits := map[string]*saga.Wait[order]{
		"sleep-max":      saga.Sleep[order](math.MaxInt64),
		"sleepfor-max":   saga.SleepFor(func(*order) time.Duration { return math.MaxInt64 }),
		"until-9999":     saga.SleepUntil(func(*order) time.Time { return time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC) }),
		"until-300000":   saga.SleepUntil(func(*order) time.Time { return time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC) }),
		"until-time-end": saga.SleepUntil(func(*order) time.Time { return time.Unix(math.MaxInt64/2, 0) }),
	}
	byName := map[string]*saga.Definition[order]{}
	var defs []saga.AnyDefinition
	for name, w := range waits {
		d := saga.Define("r31-"+name,
			saga.Step[order]{Name: "before", Action: noop, Compensate: undone.step},
			saga.Step[order]{Name: "sleep", Wait: w},
			saga.Step[order]{Name: "after", Action: after.step})
		defs = append(defs, d)
		byName[name] = d
	}
	cfg := engineCfg(schema, lg.logger())
	cfg.RescueSlack = time.Millisecond
	e := startEngine(t, pool, cfg, defs...)
	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	for name, d := range byName {
		st, err := saga.Start(ctx, e, d, order{ID: name}, nil)
		if err != nil {
			t.Fatalf("%s: start: %v", name, err)
		}
		ids[name] = st.ID
	}
	bad := map[string]bool{}
	for name, id := range ids {
		var in *saga.Instance
		waitFor(t, 15*time.Second, name+" to wait or end", func() bool {
			in = get(t, e, id)
			return in.Wait != nil || in.Status.Terminal()
		})
		if in.Status != saga.StatusRunning || in.Wait == nil || in.Wait.Kind != "timer" {
			t.Errorf("%s: saga %s, wait %+v, last error %+v:\n%s", name, in.Status, in.Wait, in.LastError, timeline(in))
			bad[name] = true
			continue
		}
		if in.Wait.Until == nil || in.Wait.Until.Before(time.Now().Add(100*365*24*time.Hour)) {
			t.Errorf("%s: the wait ends %v, not centuries ahead", name, in.Wait.Until)
		}
	}
	time.Sleep(300 * time.Millisecond)
	res, err := e.RescueNow(ctx)
	if err != nil {
		t.Fatalf("RescueNow: %v", err)
	}
	if res.Redriven != 0 || res.FailedOver != 0 {
		t.Errorf("the rescuer took sleeping sagas: %+v", res)
	}
	for name, id := range ids {
		if bad[name] {
			continue
		}
		if in := get(t, e, id); in.Status != saga.StatusRunning || after.of(id) != 0 {
			t.Errorf("%s: after a rescue the saga is %s, the step after ran %d times:\n%s", name, in.Status, after.of(id), timeline(in))
			continue
		}
		if err := e.Cancel(ctx, id, "review31"); err != nil {
			t.Errorf("%s: cancel: %v", name, err)
			continue
		}
		in := waitEnded(t, e, id, 15*time.Second)
		if in.Status != saga.StatusCompensated || undone.of(id) != 1 {
			t.Errorf("%s: cancelled saga ended %s, before compensated %d times:\n%s", name, in.Status, undone.of(id), timeline(in))
		}
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged errors: %q", errs[:min(3, len(errs))])
	}
}

// TestSignalWaitTimeoutsAtTheExtremes: "Timeout limits a signal or child
// wait to d: when nothing came by then, the step fails for good (code
// CodeWaitTimeout) and the saga compensates"; "TimeoutThen ... with fn
// nil, the saga simply goes on". With 1 ns the wait times out at once;
// with 0 and negative limits (not documented) Register may refuse, or the
// wait may time out at once or have no limit; none may hang, spin or
// lose the step.
func TestSignalWaitTimeoutsAtTheExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	lg := &logs{}
	var after, undone, handled counter
	handle := func(ctx context.Context, run *saga.StepRun, s *order, _ map[string]any) error {
		return handled.step(ctx, run, s)
	}
	mk := func(name string, w *saga.Wait[order]) *saga.Definition[order] {
		return saga.Define("r31-sig-"+name,
			saga.Step[order]{Name: "before", Action: noop, Compensate: undone.step},
			saga.Step[order]{Name: "await", Wait: w},
			saga.Step[order]{Name: "after", Action: after.step})
	}
	type tc struct {
		name string
		def  *saga.Definition[order]
		// want: "timeout" (compensated, wait_timeout), "on" (completed
		// without the signal), "any" (0 or negative: refused, timed out or
		// no limit).
		want string
	}
	cases := []tc{
		{"1ns", mk("1ns", saga.OnSignal("go", handle).Timeout(1)), "timeout"},
		{"1us", mk("1us", saga.OnSignal("go", handle).Timeout(time.Microsecond)), "timeout"},
		{"then-1ns", mk("then-1ns", saga.OnSignal("go", handle).TimeoutThen(1, nil)), "on"},
		{"0", mk("0", saga.OnSignal("go", handle).Timeout(0)), "any"},
		{"neg", mk("neg", saga.OnSignal("go", handle).Timeout(-1)), "any"},
		{"minint", mk("minint", saga.OnSignal("go", handle).Timeout(math.MinInt64)), "any"},
		{"then-minint", mk("then-minint", saga.OnSignal("go", handle).TimeoutThen(math.MinInt64, nil)), "any"},
	}
	var defs []saga.AnyDefinition
	for _, c := range cases {
		if c.want == "any" {
			// Register alone first: a refusal must name the problem.
			probe, err := saga.New(pool, engineCfg(schema, nil))
			if err != nil {
				t.Fatal(err)
			}
			if err := probe.Register(c.def); err != nil {
				t.Logf("%s: Register refused: %v", c.name, err)
				if !errors.Is(err, saga.ErrInvalidDefinition) {
					t.Errorf("%s: the refusal does not wrap ErrInvalidDefinition: %v", c.name, err)
				}
				continue
			}
		}
		defs = append(defs, c.def)
	}
	e := startEngine(t, pool, engineCfg(schema, lg.logger()), defs...)
	ctx := context.Background()
	for _, c := range cases {
		if _, ok := e.DefinitionSteps(c.def.Name()); !ok {
			continue
		}
		st, err := saga.Start(ctx, e, c.def, order{ID: c.name}, nil)
		if err != nil {
			t.Fatalf("%s: start: %v", c.name, err)
		}
		var in *saga.Instance
		waitFor(t, 15*time.Second, c.name+" to wait or end", func() bool {
			in = get(t, e, st.ID)
			return in.Status.Terminal() || (in.Wait != nil && in.Wait.Kind == "signal" && c.want == "any")
		})
		switch {
		case c.want == "timeout" || (c.want == "any" && in.Status == saga.StatusCompensated):
			if in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeWaitTimeout || undone.of(st.ID) != 1 || after.of(st.ID) != 0 {
				t.Errorf("%s: want compensated by wait_timeout, got %s %+v (undone %d, after %d):\n%s", c.name, in.Status, in.LastError, undone.of(st.ID), after.of(st.ID), timeline(in))
			}
		case c.want == "on" || (c.want == "any" && in.Status == saga.StatusCompleted):
			if in.Status != saga.StatusCompleted || after.of(st.ID) != 1 || handled.of(st.ID) != 0 {
				t.Errorf("%s: want completed past the wait, got %s (after %d, handled %d):\n%s", c.name, in.Status, after.of(st.ID), handled.of(st.ID), timeline(in))
			}
		default: // "any", waiting with no limit: a signal completes it.
			t.Logf("%s: waits with no limit (until %v)", c.name, in.Wait.Until)
			if in.Wait.Until != nil && in.Wait.Until.Before(time.Now()) {
				t.Errorf("%s: the wait's end %v has passed and the saga still waits", c.name, in.Wait.Until)
			}
			if _, err := e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: []byte(`{}`)}); err != nil {
				t.Fatalf("%s: signal: %v", c.name, err)
			}
			in = waitEnded(t, e, st.ID, 15*time.Second)
			if in.Status != saga.StatusCompleted || handled.of(st.ID) != 1 || after.of(st.ID) != 1 {
				t.Errorf("%s: after the signal: %s (handled %d, after %d):\n%s", c.name, in.Status, handled.of(st.ID), after.of(st.ID), timeline(in))
			}
		}
		if c.want != "any" {
			continue
		}
		t.Logf("%s: ended %s", c.name, in.Status)
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged errors: %q", errs[:min(3, len(errs))])
	}
}

// TestAKeptSignalBeatsATimeoutOfOneNanosecond: a signal that arrived before
// the saga reached its await is kept, and "Timeout limits a signal ...
// wait to d: when nothing came by then": something came, so with a
// limit of 1 ns the signal is delivered (its handler runs) rather than the
// wait timing out.
func TestAKeptSignalBeatsATimeoutOfOneNanosecond(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	release := make(chan struct{})
	var handled, after atomic.Int32
	def := saga.Define("r31-kept",
		saga.Step[order]{Name: "hold", Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}, Compensate: noop},
		saga.Step[order]{Name: "await", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, map[string]any) error {
			handled.Add(1)
			return nil
		}).Timeout(1)},
		saga.Step[order]{Name: "after", Action: func(context.Context, *saga.StepRun, *order) error { after.Add(1); return nil }})
	e := startEngine(t, pool, engineCfg(schema, nil), def)
	ctx := context.Background()
	st, err := saga.Start(ctx, e, def, order{ID: "kept"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: []byte(`{"a":1}`)}); err != nil {
		t.Fatalf("signal: %v", err)
	}
	close(release)
	in := waitEnded(t, e, st.ID, 15*time.Second)
	if in.Status != saga.StatusCompleted || handled.Load() != 1 || after.Load() != 1 {
		t.Fatalf("saga ended %s (handled %d, after %d), want completed by the kept signal:\n%s", in.Status, handled.Load(), after.Load(), timeline(in))
	}
}
