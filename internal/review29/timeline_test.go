package review29_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// RequireTimeline must fail on every timeline that is not the saga's, with
// a line diff and the Go literal.
func TestRequireTimelineCannotBeFooled(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	d := declined("r29_declined", errors.New("card declined"))
	e := engine(t, pool, schema, d)
	in := sagatest.WaitEnded(t, e, start(t, e, d, "o-1"), nil)
	// The doc's example of Timeline omits compensation_started (O1).
	right := []string{"saga_started", "step_completed:reserve", "step_failed:charge",
		"compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"}
	got := sagatest.Timeline(in)
	if strings.Join(got, ",") != strings.Join(right, ",") {
		t.Fatalf("timeline %q, want %q", got, right)
	}
	expectPass(t, func(tb testing.TB) { sagatest.RequireTimeline(tb, in, right...) })

	wrong := map[string][]string{
		"prefix":        right[:5],
		"doc's example": {"saga_started", "step_completed:reserve", "step_failed:charge", "compensation_completed:reserve", "saga_compensated"},
		"one more":      append(append([]string{}, right...), "saga_compensated"),
		"swapped":       {"saga_started", "step_failed:charge", "step_completed:reserve", "compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"},
		"empty":         nil,
		"no step":       {"saga_started", "step_completed", "step_failed", "compensation_started", "compensation_completed", "saga_compensated"},
		"other step":    {"saga_started", "step_completed:reserve", "step_failed:charges", "compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"},
		"trailing ws":   {"saga_started ", "step_completed:reserve", "step_failed:charge", "compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"},
		"hostile bytes": {"saga_started\x00", "step_completed:reserve\xff", strings.Repeat("x", 10000), "compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"},
	}
	for name, want := range wrong {
		t.Run(name, func(t *testing.T) {
			msg := expectFail(t, 5*time.Second, func(tb testing.TB) { sagatest.RequireTimeline(tb, in, want...) },
				`[]string{"saga_started", "step_completed:reserve", "step_failed:charge", "compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"}`,
				"card declined")
			if !strings.Contains(msg, "+") && !strings.Contains(msg, "-") {
				t.Errorf("no diff in:\n%s", msg)
			}
		})
	}
	t.Run("diff marks", func(t *testing.T) {
		msg := expectFail(t, 5*time.Second, func(tb testing.TB) {
			sagatest.RequireTimeline(tb, in, "saga_started", "step_completed:reserve", "step_completed:charge", "saga_completed")
		})
		for _, w := range []string{"- step_completed:charge", "+ step_failed:charge", "- saga_completed", "+ saga_compensated"} {
			if !containsLoose(msg, w) {
				t.Errorf("the diff lacks %q:\n%s", w, msg)
			}
		}
	})
}

// containsLoose is strings.Contains ignoring the spaces after a diff mark.
func containsLoose(msg, want string) bool {
	squash := func(s string) string {
		for strings.Contains(s, "  ") {
			s = strings.ReplaceAll(s, "  ", " ")
		}
		s = strings.ReplaceAll(s, "-\t", "- ")
		return strings.ReplaceAll(s, "+\t", "+ ")
	}
	m := squash(msg)
	return strings.Contains(m, want) || strings.Contains(m, strings.Replace(want, " ", "", 1))
}

// A step's hostile error (NUL, invalid UTF-8, 10 kB) reaches Describe and
// RequireTimeline's message as something readable, and the kit neither
// panics nor loses the entry.
func TestDescribeHostileError(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	long := strings.Repeat("é", 5000) // 10 kB
	hostile := "nul\x00here bad\xffutf8 " + long
	d := declined("r29_hostile", steps.WithCode("c\x00de\xfe", errors.New(hostile)))
	e := engine(t, pool, schema, d)
	in := sagatest.WaitEnded(t, e, start(t, e, d, "o-1"), nil)
	if in.Status != saga.StatusCompensated {
		t.Fatalf("status %s", in.Status)
	}
	desc := sagatest.Describe(in)
	for _, w := range []string{"compensated", "step_failed", "charge", "nul", "here bad"} {
		if !strings.Contains(desc, w) {
			t.Errorf("Describe lacks %q:\n%.2000s", w, desc)
		}
	}
	if !strings.Contains(desc, strings.Repeat("é", 100)) {
		t.Errorf("Describe lost the long error:\n%.2000s", desc)
	}
	msg := expectFail(t, 5*time.Second, func(tb testing.TB) { sagatest.RequireTimeline(tb, in, "saga_started") },
		"step_failed:charge", "here bad")
	t.Logf("message is %d bytes", len(msg))
}

// Describe on a nil saga: undocumented; it must not be mistaken for a
// passing check.
func TestDescribeAndTimelineNil(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	_, p := run(t, f, func() { sagatest.RequireTimeline(f, nil, "saga_started") })
	t.Logf("RequireTimeline(nil): panic=%v failed=%t msg=%q", p, f.Failed(), f.messages())
	if p == nil && !f.Failed() {
		t.Fatal("RequireTimeline on a nil saga passed")
	}
	f2 := newFake(t)
	_, p = run(t, f2, func() { sagatest.RequireTimeline(f2, &saga.Instance{}) })
	if p != nil || f2.Failed() {
		t.Fatalf("an empty saga with an empty want: panic=%v msg=%q", p, f2.messages())
	}
}
