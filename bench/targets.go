package main

import (
	"fmt"
	"io"
)

// Target is one of the issues' bars (#6, #17), computed from the medians of a
// report.
// Targets are recorded, not asserted: a missed one does not fail the run.
type Target struct {
	Name  string  `json:"name"`
	Want  string  `json:"want"`
	Got   float64 `json:"got"`
	Met   bool    `json:"met"`
	Basis string  `json:"basis"` // the figures the ratio is made of
	// Missing says why the target could not be computed (a system or a
	// scenario was not run, or failed).
	Missing string `json:"missing,omitempty"`
}

func findResult(results []Result, system, scenario string) *Result {
	for i := range results {
		if results[i].System == system && results[i].Scenario == scenario {
			return &results[i]
		}
	}
	return nil
}

func bestRate(results []Result, system, scenario string) (Point, bool) {
	r := findResult(results, system, scenario)
	if r == nil || r.Best == nil {
		return Point{}, false
	}
	return *r.Best, true
}

func pointAt(results []Result, system, scenario string, param int) (Point, bool) {
	r := findResult(results, system, scenario)
	if r == nil {
		return Point{}, false
	}
	for _, p := range r.Points {
		if p.Param == param && p.Rate.N > 0 {
			return p, true
		}
	}
	return Point{}, false
}

// ratioTarget compares a's rate with b's.
func ratioTarget(name string, factor float64, a, b Point, okA, okB bool, aName, bName, unit, where string) Target {
	t := Target{Name: name, Want: fmt.Sprintf("≥ %.1f×", factor)}
	switch {
	case !okA:
		t.Missing = aName + " has no successful run"
	case !okB:
		t.Missing = bName + " has no successful run"
	default:
		t.Got = a.Rate.Median / b.Rate.Median
		t.Met = t.Got >= factor
		t.Basis = fmt.Sprintf("%s %.0f %s (%s %d) ÷ %s %.0f %s (%s %d)", aName, a.Rate.Median, unit, where, a.Param, bName, b.Rate.Median, unit, where, b.Param)
	}
	return t
}

// computeTargets evaluates the targets on a report's results.
func computeTargets(results []Result) []Target {
	var out []Target
	sf, okSF := bestRate(results, sysSagaflowPG, scenarioSteps)
	for _, peer := range []struct {
		sys    string
		factor float64
	}{
		// Issue #17's bars: twice DBOS Transact (the closest peer), three
		// times the other engines, past the statement-by-statement raw
		// baseline, and 0.6 of the pipelined one (the physical ceiling).
		{sysDBOS, 2}, {sysRiver, 3}, {sysTemporal, 3}, {sysGoWorkflows, 3}, {sysRaw, 1.1}, {sysRawPipelined, 0.6},
	} {
		p, ok := bestRate(results, peer.sys, scenarioSteps)
		out = append(out, ratioTarget("sagaflow-pg ÷ "+peer.sys+", steps/s at each one's best concurrency",
			peer.factor, sf, p, okSF, ok, sysSagaflowPG, peer.sys, "steps/s", "in flight"))
	}
	hybrid, okH := bestRate(results, sysSagaflowHybrid, scenarioSteps)
	out = append(out, ratioTarget("sagaflow-hybrid (step 2 of 3 remote) ÷ sagaflow-pg (3 local steps), steps/s at each one's best concurrency",
		0.6, hybrid, sf, okH, okSF, sysSagaflowHybrid, sysSagaflowPG, "steps/s", "in flight"))
	kafka, okK := bestRate(results, sysSagaflowKafka, scenarioSteps)
	out = append(out, ratioTarget("sagaflow-kafka ÷ sagaflow-pg, steps/s at each one's best concurrency",
		0.5, kafka, sf, okK, okSF, sysSagaflowKafka, sysSagaflowPG, "steps/s", "in flight"))
	for _, sc := range []string{scenarioRelay, scenarioDrain} {
		r := findResult(results, sysRelay, sc)
		if r == nil {
			continue
		}
		for _, pt := range r.Points {
			for _, peer := range []struct {
				sys    string
				factor float64
			}{{sysWatermill, 2}, {sysKafkaGo, 0.7}} {
				p, ok := pointAt(results, peer.sys, sc, pt.Param)
				out = append(out, ratioTarget(fmt.Sprintf("relay ÷ %s, %d-row backlog", peer.sys, pt.Param),
					peer.factor, pt, p, pt.Rate.N > 0, ok, sysRelay, peer.sys, "msgs/s", "backlog"))
			}
		}
	}
	lat := Target{Name: "sagaflow-pg p99 saga latency (3 steps) at half of peak throughput", Want: "< 50 ms"}
	if r := findResult(results, sysSagaflowPG, scenarioHalfLoad); r != nil && len(r.Points) > 0 && r.Points[0].P99Ms.N > 0 {
		p := r.Points[0]
		lat.Got = p.P99Ms.Median
		lat.Met = lat.Got < 50
		lat.Basis = fmt.Sprintf("p99 %.1f ms (runs %.1f–%.1f), p50 %.1f ms, offered %d steps/s", p.P99Ms.Median, p.P99Ms.Min, p.P99Ms.Max, p.P50Ms.Median, p.Param)
	} else {
		lat.Missing = "the halfload scenario of sagaflow-pg has no successful run"
	}
	out = append(out, lat)

	hist := Target{Name: "sagaflow-pg steps/s with the largest finished history ÷ with an empty database", Want: "≥ 0.9×"}
	if r := findResult(results, sysSagaflowPG, scenarioHistory); r != nil {
		empty, okE := pointAt(results, sysSagaflowPG, scenarioHistory, 0)
		var full Point
		okF := false
		for _, p := range r.Points {
			if p.Param > full.Param && p.Rate.N > 0 {
				full, okF = p, true
			}
		}
		if okE && okF {
			hist.Got = full.Rate.Median / empty.Rate.Median
			hist.Met = hist.Got >= 0.9
			hist.Basis = fmt.Sprintf("%.0f steps/s with %d finished sagas ÷ %.0f steps/s empty (%d in flight)", full.Rate.Median, full.Param, empty.Rate.Median, full.Conc)
		} else {
			hist.Missing = "the history scenario lacks a successful empty or pre-filled run"
		}
	} else {
		hist.Missing = "the history scenario was not run"
	}
	return append(out, hist)
}

func printTargets(w io.Writer, ts []Target) {
	fmt.Fprintln(w, "\nTargets (issues #6 and #17; recorded, not asserted):")
	for _, t := range ts {
		switch {
		case t.Missing != "":
			fmt.Fprintf(w, "  [ ?? ] %s (want %s): not computed: %s\n", t.Name, t.Want, t.Missing)
		case t.Met:
			fmt.Fprintf(w, "  [ met] %s: %.2f (want %s) — %s\n", t.Name, t.Got, t.Want, t.Basis)
		default:
			fmt.Fprintf(w, "  [MISS] %s: %.2f (want %s) — %s\n", t.Name, t.Got, t.Want, t.Basis)
		}
	}
}
