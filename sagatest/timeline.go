package sagatest

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/sagaflow/sagaflow/saga"
)

// Timeline returns the saga's timeline in a compact form, one string per
// entry, oldest first: the event type, and ":" and the step for the events
// of a step. saga_started and the events that end a saga name no step:
//
//	[]string{"saga_started", "step_completed:reserve", "step_failed:charge",
//		"compensation_started:reserve", "compensation_completed:reserve", "saga_compensated"}
//
// The event types are saga's Event… constants.
func Timeline(in *saga.Instance) []string {
	if in == nil {
		return nil
	}
	out := make([]string, 0, len(in.History))
	for _, ev := range in.History {
		out = append(out, entry(ev))
	}
	return out
}

func entry(ev saga.Event) string {
	if ev.Step == "" || ev.Type == saga.EventSagaStarted {
		return ev.Type
	}
	return ev.Type + ":" + ev.Step
}

// RequireTimeline fails the test at once unless the saga's [Timeline] is
// want, entry for entry. The message shows the difference line by line
// (entries only in want with "-", only in the saga with "+"), the timeline
// as a Go literal to paste into the test once it is right, and the saga
// with every entry's error and detail.
func RequireTimeline(tb testing.TB, in *saga.Instance, want ...string) {
	tb.Helper()
	got := Timeline(in)
	if slices.Equal(got, want) {
		return
	}
	id := "<nil>"
	if in != nil {
		id = in.ID.String() + " (" + in.Name + ")"
	}
	tb.Fatalf("sagatest: timeline of saga %s is not the one wanted (- want, + got):\n%s\ngot, as Go:\n  %s\n%s",
		id, diff(want, got), literal(got), Describe(in))
}

// literal writes s as a Go string slice literal.
func literal(s []string) string {
	q := make([]string, len(s))
	for i, v := range s {
		q[i] = strconv.Quote(v)
	}
	return "[]string{" + strings.Join(q, ", ") + "}"
}

// diff renders a line diff of want and got: the longest common subsequence
// stays unmarked, the rest is marked "-" (want only) or "+" (got only).
func diff(want, got []string) string {
	// lcs[i][j] is the length of the longest common subsequence of want[i:]
	// and got[j:].
	lcs := make([][]int, len(want)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(got)+1)
	}
	for i := len(want) - 1; i >= 0; i-- {
		for j := len(got) - 1; j >= 0; j-- {
			if want[i] == got[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	var b strings.Builder
	i, j := 0, 0
	for i < len(want) || j < len(got) {
		switch {
		case i < len(want) && j < len(got) && want[i] == got[j]:
			fmt.Fprintf(&b, "    %s\n", want[i])
			i++
			j++
		case i < len(want) && (j == len(got) || lcs[i+1][j] >= lcs[i][j+1]):
			fmt.Fprintf(&b, "  - %s\n", want[i])
			i++
		default:
			fmt.Fprintf(&b, "  + %s\n", got[j])
			j++
		}
	}
	return strings.TrimSuffix(b.String(), "\n")
}
