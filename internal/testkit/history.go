package testkit

import (
	"fmt"

	"github.com/sagaflow/sagaflow/saga"
)

// Timeline is a saga's history as one string per entry: its type, ":" and
// its step when it has one, and for a failure "#attempt(code)", as in
// "step_failed:act#2(step_timeout)". It makes a test's failure message
// readable and a whole history comparable with one assertion.
func Timeline(in *saga.Instance) []string {
	out := make([]string, 0, len(in.History))
	for _, e := range in.History {
		s := e.Type
		if e.Step != "" {
			s += ":" + e.Step
		}
		if e.ErrorCode != "" {
			s += fmt.Sprintf("#%d(%s)", e.Attempt, e.ErrorCode)
		}
		out = append(out, s)
	}
	return out
}

// Events counts the entries of a saga's history of type typ at step.
func Events(in *saga.Instance, typ, step string) int {
	n := 0
	for _, e := range in.History {
		if e.Type == typ && e.Step == step {
			n++
		}
	}
	return n
}
