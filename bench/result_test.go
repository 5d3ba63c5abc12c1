package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestGroupOneResultPerSystemAndScenario(t *testing.T) {
	samples := []Sample{
		{System: "a", Scenario: scenarioSteps, Conc: 16, Rep: 2, Rate: 300, P50Ms: 3, P99Ms: 9, Latency: 10, CPUPer1000: 1, PeakMemMB: 50},
		{System: "a", Scenario: scenarioSteps, Conc: 16, Rep: 1, Rate: 100, P50Ms: 1, P99Ms: 7, Latency: 10, CPUPer1000: 3, PeakMemMB: 40},
		{System: "a", Scenario: scenarioSteps, Conc: 1, Rep: 1, Rate: 50, Latency: 5},
		{System: "b", Scenario: scenarioSteps, Conc: 16, Rep: 1, Error: "boom"},
		{System: "a", Scenario: scenarioRelay, Backlog: 20000, Rep: 1, Rate: 9000},
		{System: "a", Scenario: scenarioHistory, Conc: 256, History: 1000000, Rep: 1, Rate: 10},
		{System: "a", Scenario: scenarioHalfLoad, OfferedRate: 1500.4, Rep: 1, Rate: 1490, Latency: 3},
	}
	res := group(samples)
	var keys []string
	for _, r := range res {
		keys = append(keys, r.System+"/"+r.Scenario)
	}
	if got, want := strings.Join(keys, " "), "a/steps b/steps a/relay a/history a/halfload"; got != want {
		t.Fatalf("results: got %s, want %s", got, want)
	}

	a := res[0]
	if a.Unit != "steps/s" || len(a.Points) != 2 || a.Points[0].Param != 1 || a.Points[1].Param != 16 {
		t.Fatalf("a/steps: %+v", a)
	}
	p := a.Points[1]
	if p.Rate != (Stat{Median: 200, Min: 100, Max: 300, Spread: 1, N: 2}) {
		t.Fatalf("rate: %+v", p.Rate)
	}
	if p.P99Ms.Median != 8 || p.CPUPer1000.Median != 2 || p.PeakMemMB.Max != 50 {
		t.Fatalf("point: %+v", p)
	}
	if p.Runs[0].Rep != 1 || p.Runs[1].Rep != 2 {
		t.Fatal("runs are not in repetition order")
	}
	if a.Best == nil || a.Best.Param != 16 || a.Best.Runs != nil {
		t.Fatalf("best: %+v", a.Best)
	}

	b := res[1]
	if b.Best != nil || b.Points[0].Rate.N != 0 || len(b.Points[0].Errors) != 1 {
		t.Fatalf("a failed run must count as no value and keep its error: %+v", b)
	}
	if res[2].Unit != "msgs/s" || res[2].Points[0].Param != 20000 {
		t.Fatalf("relay: %+v", res[2])
	}
	if res[3].Points[0].Param != 1000000 {
		t.Fatalf("history: %+v", res[3])
	}
	if res[4].Points[0].Param != 1500 {
		t.Fatalf("halfload: %+v", res[4])
	}
}

// TestJSONLinesShape pins the field names that docs and plots read.
func TestJSONLinesShape(t *testing.T) {
	res := group([]Sample{{System: "sagaflow-pg", Scenario: scenarioSteps, Conc: 16, Rep: 1, Rate: 100, P50Ms: 1, P99Ms: 2, Latency: 1}})
	var buf bytes.Buffer
	if err := writeJSONLines(&buf, res); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 {
		t.Fatalf("want one line per system and scenario, got %d", len(lines))
	}
	var obj map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &obj); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"system", "scenario", "unit", "param", "points", "best"} {
		if _, ok := obj[k]; !ok {
			t.Errorf("missing %q in %s", k, lines[0])
		}
	}
	pt := obj["points"].([]any)[0].(map[string]any)
	for _, k := range []string{"param", "rate", "p50_ms", "p99_ms", "cpu_s_per_1000", "peak_mem_mb", "runs"} {
		if _, ok := pt[k]; !ok {
			t.Errorf("missing points[0].%q", k)
		}
	}
	rate := pt["rate"].(map[string]any)
	for _, k := range []string{"median", "min", "max", "spread", "n"} {
		if _, ok := rate[k]; !ok {
			t.Errorf("missing rate.%q", k)
		}
	}
	run := pt["runs"].([]any)[0].(map[string]any)
	for _, k := range []string{"system", "scenario", "rep", "units", "rate", "cpu_proc_seconds", "cpu_postgres_seconds", "cpu_s_per_1000", "peak_mem_mb"} {
		if _, ok := run[k]; !ok {
			t.Errorf("missing runs[0].%q", k)
		}
	}
}

func TestRotate(t *testing.T) {
	l := []string{"a", "b", "c"}
	for k, want := range []string{"a b c", "b c a", "c a b", "a b c"} {
		if got := strings.Join(rotate(l, k), " "); got != want {
			t.Errorf("rotate %d: got %s, want %s", k, got, want)
		}
	}
	if rotate(nil, 3) != nil {
		t.Error("rotate of nothing")
	}
}

func TestSplitInts(t *testing.T) {
	got, err := splitInts("1, 16,,4096")
	if err != nil || len(got) != 3 || got[2] != 4096 {
		t.Fatalf("got %v, %v", got, err)
	}
	if _, err := splitInts("1,x"); err == nil {
		t.Fatal("want an error")
	}
}
