package review34_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// waitRig has an engine with three sagas: "pay" (one step named pay, ends
// completed at once), "slow" (a step that takes 1.5 s, then completed) and
// "park" (waits for a signal for a day: never ends in a test).
type waitRig struct {
	e            *saga.Engine
	pay, slow    *saga.Definition[order]
	park         *saga.Definition[order]
	done, parked uuid.UUID
}

func newWaitRig(t *testing.T) *waitRig {
	t.Helper()
	pool, schema := pgtest.Migrated(t)
	r := &waitRig{}
	r.pay = saga.Define("pay", saga.Step[order]{Name: "pay", Action: noop})
	r.slow = saga.Define("slow", saga.Step[order]{Name: "nap", Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
		select {
		case <-time.After(1500 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}})
	r.park = saga.Define("park", saga.Step[order]{Name: "hold", Wait: saga.OnSignal("go",
		func(context.Context, *saga.StepRun, *order, struct{}) error { return nil }).Timeout(24 * time.Hour)})
	r.e = engine(t, pool, &saga.Config{Schema: schema}, r.pay, r.slow, r.park)
	ctx := ctxT(t, 20*time.Second)
	st, err := saga.Start(ctx, r.e, r.pay, order{ID: "done"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.done = st.ID
	waitEnded(t, r.e, r.done, 15*time.Second)
	st, err = saga.Start(ctx, r.e, r.park, order{ID: "parked"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.parked = st.ID
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(timeline(get(t, r.e, r.parked)), "wait_started") {
		if time.Now().After(deadline) {
			t.Fatalf("the parked saga did not start waiting")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return r
}

func (r *waitRig) startSlow(t *testing.T) uuid.UUID {
	t.Helper()
	st, err := saga.Start(ctxT(t, 10*time.Second), r.e, r.slow, order{ID: uuid.NewString()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.ID
}

// holds reports whether the saga satisfies what the test waited for.
func endedOK(in *saga.Instance) bool { return in != nil && in.Status.Terminal() }

// TestWaitOptsAtTheirExtremes: a Poll or Timeout of zero, negative or huge
// must neither panic, hang nor let a wait return a saga that does not
// satisfy its condition.
func TestWaitOptsAtTheirExtremes(t *testing.T) {
	r := newWaitRig(t)

	// Whatever a wait does with odd options, when it returns without failing
	// the test, the saga must hold the condition.
	type tc struct {
		name  string
		id    func() uuid.UUID
		opts  *sagatest.WaitOpts
		limit time.Duration
		// mustFail: the condition cannot hold in time, so the wait must fail.
		mustFail bool
	}
	cases := []tc{
		{"zero opts, ended saga", func() uuid.UUID { return r.done }, &sagatest.WaitOpts{}, 10 * time.Second, false},
		{"timeout 0 (default), slow saga", func() uuid.UUID { return r.startSlow(t) }, &sagatest.WaitOpts{Timeout: 0}, 20 * time.Second, false},
		{"poll 1ns, slow saga", func() uuid.UUID { return r.startSlow(t) }, &sagatest.WaitOpts{Poll: 1}, 20 * time.Second, false},
		{"poll -1s, ended saga", func() uuid.UUID { return r.done }, &sagatest.WaitOpts{Poll: -time.Second}, 10 * time.Second, false},
		{"poll -1s, slow saga", func() uuid.UUID { return r.startSlow(t) }, &sagatest.WaitOpts{Poll: -time.Second}, 20 * time.Second, false},
		{"poll -1s, parked saga, timeout 1s", func() uuid.UUID { return r.parked }, &sagatest.WaitOpts{Poll: -time.Second, Timeout: time.Second}, 10 * time.Second, true},
		{"poll 1h, parked saga, timeout 1s", func() uuid.UUID { return r.parked }, &sagatest.WaitOpts{Poll: time.Hour, Timeout: time.Second}, 10 * time.Second, true},
		{"timeout 1ns, parked saga", func() uuid.UUID { return r.parked }, &sagatest.WaitOpts{Timeout: 1}, 10 * time.Second, true},
		{"timeout -1s, slow saga", func() uuid.UUID { return r.startSlow(t) }, &sagatest.WaitOpts{Timeout: -time.Second}, 35 * time.Second, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := c.id()
			f := newFake(t)
			var got *saga.Instance
			o := call(c.limit, func() { got = sagatest.WaitEnded(f, r.e, id, c.opts) })
			if o.hung {
				t.Fatalf("WaitEnded did not return within %v", c.limit)
			}
			if o.panicked != nil {
				t.Fatalf("WaitEnded panicked: %v", o.panicked)
			}
			t.Logf("took %v, failed %v: %.300s", o.took.Round(time.Millisecond), f.Failed(), f.messages())
			if !f.Failed() {
				if o.exited {
					t.Fatalf("WaitEnded ended its goroutine without failing the test")
				}
				if !endedOK(got) {
					t.Fatalf("WaitEnded passed and returned a saga that has not ended: %+v", got)
				}
				if c.mustFail {
					t.Fatalf("WaitEnded passed on a saga that cannot end")
				}
				return
			}
			// A failure must say which saga and what it waited for.
			if !strings.Contains(f.messages(), id.String()) {
				t.Errorf("the failure does not name the saga %s: %.500s", id, f.messages())
			}
			if !c.mustFail {
				// Failing on a saga that ends in 1.5 s is acceptable only for a
				// timeout the user set below that, and then it must say so.
				if c.opts.Timeout >= 0 && c.opts.Timeout != 1 {
					t.Errorf("WaitEnded failed on a saga that ends: %.500s", f.messages())
				}
			}
		})
	}
}

// slowGetter is a Getter whose reads take until their context ends.
type slowGetter struct{}

func (slowGetter) Get(ctx context.Context, _ uuid.UUID) (*saga.Instance, error) {
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(2 * time.Minute):
		return nil, errors.New("slowGetter: two minutes passed")
	}
}

// nilGetter returns no saga and no error.
type nilGetter struct{}

func (nilGetter) Get(context.Context, uuid.UUID) (*saga.Instance, error) { return nil, nil }

// otherGetter returns another saga than the one asked for.
type otherGetter struct {
	e     *saga.Engine
	other uuid.UUID
}

func (g otherGetter) Get(ctx context.Context, _ uuid.UUID) (*saga.Instance, error) {
	return g.e.Get(ctx, g.other)
}

// TestWaitGetterMisbehaves: a Getter that blocks (honouring its context)
// must not keep a wait past its Timeout; a Getter that returns (nil, nil)
// must fail the test, not panic.
func TestWaitGetterMisbehaves(t *testing.T) {
	r := newWaitRig(t)
	t.Run("blocking getter", func(t *testing.T) {
		f := newFake(t)
		o := call(20*time.Second, func() {
			sagatest.WaitEnded(f, slowGetter{}, r.done, &sagatest.WaitOpts{Timeout: time.Second})
		})
		mustFail(t, f, o, r.done.String())
		if o.took > 5*time.Second {
			t.Errorf("a wait with a 1 s Timeout took %v", o.took)
		}
	})
	t.Run("nil instance", func(t *testing.T) {
		f := newFake(t)
		o := call(10*time.Second, func() {
			sagatest.WaitEnded(f, nilGetter{}, r.done, &sagatest.WaitOpts{Timeout: time.Second})
		})
		mustFail(t, f, o, r.done.String())
	})
	t.Run("getter answers with another saga", func(t *testing.T) {
		// The Getter returns the ended saga r.done whatever it is asked: a
		// wait on the parked saga must not pass on it.
		f := newFake(t)
		var got *saga.Instance
		o := call(10*time.Second, func() {
			got = sagatest.WaitEnded(f, otherGetter{r.e, r.done}, r.parked, &sagatest.WaitOpts{Timeout: time.Second})
		})
		if o.panicked != nil || o.hung {
			t.Fatalf("panicked or hung: %+v", o)
		}
		if !f.Failed() {
			t.Fatalf("WaitEnded(parked saga %s) passed, returning saga %s (%s)", r.parked, got.ID, got.Status)
		}
	})
}

// TestEventMatchesOnlyWholeEntries: Event matches an entry "in the form of
// Timeline", so no near name may match an ended saga's entry; each wait
// must fail at once (the saga has ended).
func TestEventMatchesOnlyWholeEntries(t *testing.T) {
	r := newWaitRig(t)
	in := get(t, r.e, r.done)
	tl := sagatest.Timeline(in)
	want := []string{"saga_started", "step_completed:pay", "saga_completed"}
	if strings.Join(tl, "|") != strings.Join(want, "|") {
		t.Fatalf("timeline %q, want %q", tl, want)
	}
	for _, entry := range []string{
		"", ":", "pay", ":pay", "step_completed:", "step_completed:pa", "step_completed:pay.x",
		"step_completed:Pay", "STEP_COMPLETED:pay", "step_completed: pay", "step_completed:pay ",
		"step_completed:pay\x00", "step_completed:pay:", "step_completed:pay\n", "saga_completed:",
		"saga_completed:pay", "saga_started:pay", "step_completed:pay|saga_completed",
		"step_completed:pay\xff", "step_completed", "command_sent:pay", strings.Repeat("x", 10_000),
	} {
		f := newFake(t)
		o := call(15*time.Second, func() {
			sagatest.Wait(f, r.e, r.done, sagatest.Event(entry), &sagatest.WaitOpts{Timeout: 10 * time.Second})
		})
		mustFail(t, f, o, r.done.String())
		if o.took > 5*time.Second {
			t.Errorf("Event(%.40q) on an ended saga failed only after %v, not at once", entry, o.took)
		}
	}
	// The real entries match.
	for _, entry := range want {
		f := newFake(t)
		o := call(10*time.Second, func() {
			sagatest.Wait(f, r.e, r.done, sagatest.Event(entry), &sagatest.WaitOpts{Timeout: 5 * time.Second})
		})
		if f.Failed() || o.panicked != nil || o.hung {
			t.Errorf("Event(%q) failed on a saga whose timeline holds it: %+v %s", entry, o, f.messages())
		}
	}
}

// TestOddUntils: Step, Status and Cond given odd arguments.
func TestOddUntils(t *testing.T) {
	r := newWaitRig(t)
	cases := []struct {
		name string
		id   uuid.UUID
		u    sagatest.Until
		want []string
	}{
		{"Step of an empty name, ended saga", r.done, sagatest.Step(""), nil},
		{"Step pay, ended saga at pay", r.done, sagatest.Step("pay"), []string{"completed"}},
		{"Status bogus, ended saga", r.done, sagatest.Status("bogus"), []string{"bogus"}},
		{"Status empty, ended saga", r.done, sagatest.Status(""), nil},
		{"Status running, ended saga", r.done, sagatest.Status(saga.StatusRunning), []string{"running"}},
		{"Cond false, ended saga", r.done, sagatest.Cond("turn green", func(*saga.Instance) bool { return false }), []string{"turn green"}},
		{"Cond nil func, ended saga", r.done, sagatest.Cond("nil func", nil), nil},
		{"zero Until, ended saga", r.done, sagatest.Until{}, nil},
		{"Step of another step, parked saga", r.parked, sagatest.Step("pay"), []string{"pay"}},
		{"Cond nil func, parked saga", r.parked, sagatest.Cond("nil func", nil), nil},
		{"zero Until, parked saga", r.parked, sagatest.Until{}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFake(t)
			var got *saga.Instance
			o := call(15*time.Second, func() {
				got = sagatest.Wait(f, r.e, c.id, c.u, &sagatest.WaitOpts{Timeout: 2 * time.Second})
			})
			t.Logf("String()=%q took %v: %.300s", c.u.String(), o.took.Round(time.Millisecond), f.messages())
			if o.panicked != nil {
				t.Fatalf("Wait panicked: %v", o.panicked)
			}
			if o.hung {
				t.Fatalf("Wait hung")
			}
			if !f.Failed() {
				t.Fatalf("Wait(%s) passed on saga %s (%s at %s)", c.u, c.id, got.Status, got.Step)
			}
			for _, w := range c.want {
				if !strings.Contains(f.messages(), w) {
					t.Errorf("the failure does not name %q: %.500s", w, f.messages())
				}
			}
		})
	}
	// The Step of the parked saga holds.
	f := newFake(t)
	o := call(10*time.Second, func() {
		sagatest.Wait(f, r.e, r.parked, sagatest.Step("hold"), &sagatest.WaitOpts{Timeout: 5 * time.Second})
	})
	if f.Failed() || o.panicked != nil || o.hung {
		t.Fatalf("Step(hold) on a saga waiting at hold: %+v %s", o, f.messages())
	}
}

// TestWaitAfterTheEngineStopped: the kit reads sagas with a stopped engine,
// and a wait on a saga that can no longer move fails at its Timeout with its
// timeline.
func TestWaitAfterTheEngineStopped(t *testing.T) {
	r := newWaitRig(t)
	ctx := ctxT(t, 30*time.Second)
	if err := r.e.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// An ended saga is still read and passes.
	f := newFake(t)
	o := call(10*time.Second, func() { sagatest.WaitEnded(f, r.e, r.done, &sagatest.WaitOpts{Timeout: 2 * time.Second}) })
	if f.Failed() || o.panicked != nil || o.hung {
		t.Fatalf("WaitEnded of an ended saga after Stop: %+v %s", o, f.messages())
	}
	// A running one fails at its timeout, with its status and timeline.
	f = newFake(t)
	o = call(15*time.Second, func() { sagatest.WaitEnded(f, r.e, r.parked, &sagatest.WaitOpts{Timeout: time.Second}) })
	mustFail(t, f, o, r.parked.String(), "running", "wait_started")
	if o.took < time.Second || o.took > 6*time.Second {
		t.Errorf("a 1 s wait failed after %v", o.took)
	}
}

// TestRequireTimelineOddWants: wants that look like the timeline when
// printed must still fail.
func TestRequireTimelineOddWants(t *testing.T) {
	r := newWaitRig(t)
	in := get(t, r.e, r.done)
	for name, want := range map[string][]string{
		"joined with newline": {"saga_started\nstep_completed:pay", "saga_completed"},
		"all in one":          {"saga_started\nstep_completed:pay\nsaga_completed"},
		"extra empty entry":   {"saga_started", "step_completed:pay", "saga_completed", ""},
		"empty entry first":   {"", "saga_started", "step_completed:pay", "saga_completed"},
		"NUL after":           {"saga_started", "step_completed:pay\x00", "saga_completed"},
		"quoted":              {`"saga_started"`, `"step_completed:pay"`, `"saga_completed"`},
		"direction in entry":  {"saga_started", "step_completed:pay/forward", "saga_completed"},
		"duplicated last":     {"saga_started", "step_completed:pay", "saga_completed", "saga_completed"},
		"leading plus":        {"saga_started", "+step_completed:pay", "saga_completed"},
		"unicode lookalike ":  {"saga_started", "step_completed:p\u0430y", "saga_completed"},
		"nil want":            nil,
		"reordered":           {"step_completed:pay", "saga_started", "saga_completed"},
	} {
		f := newFake(t)
		o := call(10*time.Second, func() { sagatest.RequireTimeline(f, in, want...) })
		if o.panicked != nil || o.hung {
			t.Fatalf("%s: %+v", name, o)
		}
		if !f.Failed() {
			t.Errorf("%s: RequireTimeline passed with want %q against %q", name, want, sagatest.Timeline(in))
		}
		if !o.exited {
			t.Errorf("%s: RequireTimeline did not stop the test at once (the doc: fails the test at once)", name)
		}
	}
	f := newFake(t)
	o := call(10*time.Second, func() {
		sagatest.RequireTimeline(f, in, "saga_started", "step_completed:pay", "saga_completed")
	})
	if f.Failed() || o.panicked != nil {
		t.Fatalf("the right timeline failed: %s", f.messages())
	}
}

// TestTimelineOfOddEvents: Timeline and Describe of hand-built sagas with
// odd event names never panic, and an entry's step stays apart from its
// type: a type that holds ":" cannot pass for a step's entry in
// RequireTimeline without being reported.
func TestTimelineOfOddEvents(t *testing.T) {
	id := uuid.New()
	in := &saga.Instance{ID: id, Name: "odd\x00\xff", Status: saga.StatusCompleted, History: []saga.Event{
		{Type: "saga_started"},
		{Type: "", Step: ""},
		{Type: "step_completed", Step: "pay\nsaga_completed"},
		{Type: "custom:with:colons", Step: "x"},
		{Type: "saga_completed", Step: "leaked-step"},
		{Type: strings.Repeat("t", 10_000), Step: "\xff"},
	}}
	var tl []string
	o := call(5*time.Second, func() { tl = sagatest.Timeline(in); _ = sagatest.Describe(in) })
	if o.panicked != nil || o.hung {
		t.Fatalf("Timeline/Describe: %+v", o)
	}
	t.Logf("%.300q", tl)
	if len(tl) != len(in.History) {
		t.Fatalf("Timeline has %d entries for %d events", len(tl), len(in.History))
	}
	// The timeline written the way a careless reader would expect must not
	// match, since the step with a newline is not two entries.
	f := newFake(t)
	call(5*time.Second, func() {
		sagatest.RequireTimeline(f, in, "saga_started", "", "step_completed:pay", "saga_completed", "custom:with:colons:x",
			"saga_completed", strings.Repeat("t", 10_000)+":\xff")
	})
	if !f.Failed() {
		t.Fatalf("RequireTimeline took an entry with a newline for two entries")
	}
	// Empty and nil histories.
	for _, h := range [][]saga.Event{nil, {}} {
		f := newFake(t)
		o := call(5*time.Second, func() { sagatest.RequireTimeline(f, &saga.Instance{ID: id, History: h}) })
		if o.panicked != nil || f.Failed() {
			t.Errorf("an empty timeline against an empty want: %+v %s", o, f.messages())
		}
		f = newFake(t)
		call(5*time.Second, func() { sagatest.RequireTimeline(f, &saga.Instance{ID: id, History: h}, "saga_started") })
		if !f.Failed() {
			t.Errorf("an empty timeline passed for [saga_started]")
		}
	}
}
