package review29_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type order struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
}

func noop(context.Context, *saga.StepRun, *order) error { return nil }

// twoSteps completes: reserve, charge.
func twoSteps(name string) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Action: noop},
	)
}

// declined compensates: charge fails for good with err.
func declined(name string, err error) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Action: func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(err)
		}},
	)
}

// napper sleeps two days between two steps.
func napper(name string) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "reserve", Action: noop},
		saga.Step[order]{Name: "nap", Wait: saga.Sleep[order](48 * time.Hour)},
		saga.Step[order]{Name: "ship", Action: noop},
	)
}

func start(t *testing.T, e *saga.Engine, d *saga.Definition[order], id string) uuid.UUID {
	t.Helper()
	st, err := saga.Start(context.Background(), e, d, order{ID: id}, nil)
	if err != nil {
		t.Fatalf("start saga: %v", err)
	}
	return st.ID
}

// expectFail runs fn against a fake TB and requires that it failed, within
// limit, with a message containing each of want.
func expectFail(t *testing.T, limit time.Duration, fn func(tb testing.TB), want ...string) string {
	t.Helper()
	f := newFake(t)
	took, p := run(t, f, func() { fn(f) })
	if p != nil {
		t.Fatalf("the helper panicked instead of failing the test: %v", p)
	}
	if !f.Failed() {
		t.Fatalf("the helper did not fail the test (took %s)", took)
	}
	if took > limit {
		t.Errorf("the helper took %s to fail, want at most %s", took, limit)
	}
	msg := f.messages()
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("failure message does not contain %q:\n%s", w, msg)
		}
	}
	return msg
}

// expectPass runs fn against a fake TB and requires that it did not fail.
func expectPass(t *testing.T, fn func(tb testing.TB)) {
	t.Helper()
	f := newFake(t)
	_, p := run(t, f, func() { fn(f) })
	if p != nil {
		t.Fatalf("the helper panicked: %v", p)
	}
	if f.Failed() {
		t.Fatalf("the helper failed the test:\n%s", f.messages())
	}
}

func TestWaitHappyPathAndTimelineShape(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := twoSteps("r29_ok")
	e := engine(t, pool, schema, d)
	id := start(t, e, d, "o-1")
	in := sagatest.WaitEnded(t, e, id, nil)
	if in.Status != saga.StatusCompleted {
		t.Fatalf("status %s", in.Status)
	}
	got := strings.Join(sagatest.Timeline(in), ",")
	if got != "saga_started,step_completed:reserve,step_completed:charge,saga_completed" {
		t.Fatalf("timeline %s", got)
	}
	sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve", "step_completed:charge", "saga_completed")
}

// A wait on an ended saga whose condition cannot hold any more must fail at
// once (not after 30 s), naming the status and the timeline.
func TestWaitFailsAtOnceOnEndedSaga(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := declined("r29_declined", steps.WithCode("card_declined", errors.New("card declined by issuer")))
	e := engine(t, pool, schema, d)
	id := start(t, e, d, "o-1")
	in := sagatest.WaitEnded(t, e, id, nil)
	if in.Status != saga.StatusCompensated {
		t.Fatalf("status %s", in.Status)
	}
	cases := map[string]sagatest.Until{
		"status completed":          sagatest.Status(saga.StatusCompleted),
		"event never happened":      sagatest.Event("step_completed:charge"),
		"event prefix":              sagatest.Event("step_completed:res"),
		"event type without a step": sagatest.Event("step_completed"),
		"step of an ended saga":     sagatest.Step("charge"),
		"cond":                      sagatest.Cond("charge the card", func(*saga.Instance) bool { return false }),
	}
	for name, u := range cases {
		t.Run(name, func(t *testing.T) {
			msg := expectFail(t, 10*time.Second, func(tb testing.TB) {
				sagatest.Wait(tb, e, id, u, &sagatest.WaitOpts{Timeout: 20 * time.Second})
			}, "compensated", "saga_compensated", "card declined by issuer")
			if name == "cond" && !strings.Contains(msg, "charge the card") {
				t.Errorf("the message does not say what was waited for:\n%s", msg)
			}
		})
	}
}

// A wait that times out fails with the saga's state; it does not hang.
func TestWaitTimesOutWithAMessage(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := napper("r29_nap")
	e := engine(t, pool, schema, d)
	id := start(t, e, d, "o-1")
	sagatest.Wait(t, e, id, sagatest.Step("nap"), nil)
	expectFail(t, 20*time.Second, func(tb testing.TB) {
		sagatest.WaitEnded(tb, e, id, &sagatest.WaitOpts{Timeout: 300 * time.Millisecond})
	}, id.String(), "running", "step_completed:reserve")
}

// Misuse: an id that does not exist, a saga of another schema, a stopped
// engine, a nil getter.
func TestWaitMisuse(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := twoSteps("r29_ok")
	e := engine(t, pool, schema, d)
	id := start(t, e, d, "o-1")
	sagatest.WaitEnded(t, e, id, nil)

	t.Run("unknown id fails at once", func(t *testing.T) {
		missing := uuid.New()
		expectFail(t, 10*time.Second, func(tb testing.TB) {
			sagatest.WaitEnded(tb, e, missing, nil)
		}, missing.String())
	})
	t.Run("nil id fails at once", func(t *testing.T) {
		expectFail(t, 10*time.Second, func(tb testing.TB) {
			sagatest.WaitEnded(tb, e, uuid.Nil, nil)
		})
	})
	t.Run("another schema's engine cannot read it", func(t *testing.T) {
		pool2, schema2 := db(t)
		e2, err := saga.New(pool2, &saga.Config{Schema: schema2})
		if err != nil {
			t.Fatal(err)
		}
		expectFail(t, 10*time.Second, func(tb testing.TB) {
			sagatest.WaitEnded(tb, e2, id, nil)
		}, id.String())
	})
	t.Run("a stopped engine still reads", func(t *testing.T) {
		e3, err := saga.New(pool, &saga.Config{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		if err := e3.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := e3.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
		expectPass(t, func(tb testing.TB) {
			in := sagatest.WaitEnded(tb, e3, id, nil)
			if in == nil || in.Status != saga.StatusCompleted {
				tb.Errorf("got %+v", in)
			}
		})
	})
	t.Run("nil getter", func(t *testing.T) {
		// O2 (resolved): a nil Getter fails the test, naming it; it
		// panicked.
		f := newFake(t)
		took, p := run(t, f, func() { sagatest.WaitEnded(f, nil, id, &sagatest.WaitOpts{Timeout: time.Second}) })
		t.Logf("nil getter: failed=%t panic=%v took=%s msg=%q", f.Failed(), p, took, f.messages())
		if p != nil || !f.Failed() || !strings.Contains(fmt.Sprint(f.messages()), "Getter is nil") {
			t.Fatalf("a wait on a nil getter: want a failure naming the nil Getter, got panic=%v failed=%t %q", p, f.Failed(), f.messages())
		}
	})
	t.Run("nil *saga.Engine", func(t *testing.T) {
		var ne *saga.Engine
		f := newFake(t)
		took, p := run(t, f, func() { sagatest.WaitEnded(f, ne, id, &sagatest.WaitOpts{Timeout: time.Second}) })
		t.Logf("nil engine: failed=%t panic=%v took=%s msg=%q", f.Failed(), p, took, f.messages())
		if p == nil && !f.Failed() {
			t.Fatal("a wait on a nil engine passed")
		}
	})
}

// Until.String says what is waited for.
func TestUntilString(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		u    sagatest.Until
		want string
	}{
		{sagatest.Event("step_failed:charge"), "step_failed:charge"},
		{sagatest.Step("charge"), "charge"},
		{sagatest.Status(saga.StatusCompensated), "compensated"},
		{sagatest.Cond("ship it", func(*saga.Instance) bool { return true }), "ship it"},
	} {
		if !strings.Contains(c.u.String(), c.want) {
			t.Errorf("%q does not name %q", c.u.String(), c.want)
		}
	}
}
