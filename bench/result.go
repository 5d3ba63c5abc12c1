package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
)

// Sample is one measured run of one system in one scenario: what a child
// process (bench run) prints, completed by the driver with the child's peak
// memory.
type Sample struct {
	System   string `json:"system"`
	Scenario string `json:"scenario"`
	// Param is the scenario's variable: sagas in flight (steps, history,
	// halfload), finished sagas in the tables (history), rows in the
	// backlog (relay, drain).
	Conc    int `json:"conc,omitempty"`
	History int `json:"history,omitempty"`
	Backlog int `json:"backlog,omitempty"`
	Rep     int `json:"rep"`

	// Units counts what was done in the measured window: steps (3 per saga)
	// or messages.
	Units       int     `json:"units"`
	WallSeconds float64 `json:"wall_seconds"`
	// Rate is Units per second: steps/s or msgs/s.
	Rate float64 `json:"rate"`
	// OfferedRate is the arrival rate of an open-loop run (halfload), in
	// steps/s.
	OfferedRate float64 `json:"offered_rate,omitempty"`
	// Saga latency, start to the end of the third step, of the sagas that
	// ended in the window.
	P50Ms   float64 `json:"p50_ms,omitempty"`
	P99Ms   float64 `json:"p99_ms,omitempty"`
	Latency int     `json:"latency_samples,omitempty"`

	// CPU seconds in the window: this process, the PostgreSQL processes that
	// served it (its backends and the server's background processes), and a
	// server the run started (Temporal's dev server).
	CPUProcSeconds     float64 `json:"cpu_proc_seconds"`
	CPUPostgresSeconds float64 `json:"cpu_postgres_seconds"`
	CPUServerSeconds   float64 `json:"cpu_server_seconds,omitempty"`
	// CPUPer1000 is all of the above per 1,000 units.
	CPUPer1000 float64 `json:"cpu_s_per_1000"`
	// PeakMemMB is the child's peak resident set (its maxrss) plus the
	// started server's (VmHWM), in MiB.
	PeakMemMB     float64 `json:"peak_mem_mb"`
	ServerPeakMB  float64 `json:"server_peak_mb,omitempty"`
	Partial       bool    `json:"partial,omitempty"` // a time-boxed drain that did not finish
	Note          string  `json:"note,omitempty"`
	Error         string  `json:"error,omitempty"`
	SetupSeconds  float64 `json:"setup_seconds,omitempty"`
	WarmupSeconds float64 `json:"warmup_seconds,omitempty"`
	StartedAtUnix int64   `json:"started_at_unix,omitempty"`
}

// param returns the scenario's variable.
func (s *Sample) param() int {
	switch s.Scenario {
	case scenarioHistory:
		return s.History
	case scenarioRelay, scenarioDrain:
		return s.Backlog
	case scenarioHalfLoad:
		return int(math.Round(s.OfferedRate))
	default:
		return s.Conc
	}
}

// Point is the repetitions of one system at one value of a scenario's
// variable, summarised.
type Point struct {
	Param      int      `json:"param"`
	Conc       int      `json:"conc,omitempty"`
	Rate       Stat     `json:"rate"`
	P50Ms      Stat     `json:"p50_ms"`
	P99Ms      Stat     `json:"p99_ms"`
	CPUPer1000 Stat     `json:"cpu_s_per_1000"`
	PeakMemMB  Stat     `json:"peak_mem_mb"`
	Errors     []string `json:"errors,omitempty"`
	Runs       []Sample `json:"runs"`
}

// Result is what --json prints: one object per system and scenario, with a
// point per value of the scenario's variable.
type Result struct {
	System   string  `json:"system"`
	Scenario string  `json:"scenario"`
	Unit     string  `json:"unit"`  // steps/s or msgs/s
	Param    string  `json:"param"` // what Point.Param counts
	Points   []Point `json:"points"`
	// Best is the point with the highest median rate.
	Best *Point `json:"best,omitempty"`
}

// Report is the file that compare writes and plot reads.
type Report struct {
	Date    string   `json:"date"`
	Machine Machine  `json:"machine"`
	Command string   `json:"command"`
	Notes   []string `json:"notes,omitempty"`
	Results []Result `json:"results"`
	Targets []Target `json:"targets"`
}

// Machine describes where the figures were measured.
type Machine struct {
	CPU        string `json:"cpu"`
	Cores      int    `json:"cores"`
	MemoryGiB  int    `json:"memory_gib"`
	Kernel     string `json:"kernel"`
	Go         string `json:"go"`
	PostgreSQL string `json:"postgresql"`
	PGSettings string `json:"pg_settings"`
	Kafka      string `json:"kafka"`
	Temporal   string `json:"temporal"`
	// Library is the sagaflow commit measured (the module the replace
	// directive points to), and whether its Go files had uncommitted
	// changes.
	Library string `json:"library"`
}

func unitOf(scenario string) string {
	if scenario == scenarioRelay || scenario == scenarioDrain {
		return "msgs/s"
	}
	return "steps/s"
}

func paramOf(scenario string) string {
	switch scenario {
	case scenarioHistory:
		return "finished sagas in the tables"
	case scenarioRelay, scenarioDrain:
		return "rows in the backlog"
	case scenarioHalfLoad:
		return "offered steps/s (half of the system's peak)"
	default:
		return "sagas in flight"
	}
}

// group summarises samples into one Result per system and scenario, in the
// order systems and scenarios first appear, points by their variable.
func group(samples []Sample) []Result {
	type key struct{ system, scenario string }
	var order []key
	byKey := map[key]map[int][]Sample{}
	for _, s := range samples {
		k := key{s.System, s.Scenario}
		if byKey[k] == nil {
			byKey[k] = map[int][]Sample{}
			order = append(order, k)
		}
		byKey[k][s.param()] = append(byKey[k][s.param()], s)
	}
	out := make([]Result, 0, len(order))
	for _, k := range order {
		r := Result{System: k.system, Scenario: k.scenario, Unit: unitOf(k.scenario), Param: paramOf(k.scenario)}
		for param, runs := range byKey[k] {
			r.Points = append(r.Points, summarizePoint(param, runs))
		}
		slices.SortFunc(r.Points, func(a, b Point) int { return cmp.Compare(a.Param, b.Param) })
		for i := range r.Points {
			if r.Points[i].Rate.N > 0 && (r.Best == nil || r.Points[i].Rate.Median > r.Best.Rate.Median) {
				r.Best = &r.Points[i]
			}
		}
		if r.Best != nil {
			b := *r.Best
			b.Runs = nil // already under Points
			r.Best = &b
		}
		out = append(out, r)
	}
	return out
}

func summarizePoint(param int, runs []Sample) Point {
	slices.SortFunc(runs, func(a, b Sample) int { return cmp.Compare(a.Rep, b.Rep) })
	p := Point{Param: param, Conc: runs[0].Conc, Runs: runs}
	var rate, p50, p99, cpu, mem []float64
	for _, s := range runs {
		if s.Error != "" {
			p.Errors = append(p.Errors, fmt.Sprintf("rep %d: %s", s.Rep, s.Error))
			continue
		}
		rate = append(rate, s.Rate)
		p50 = append(p50, nanIfZero(s.P50Ms, s.Latency))
		p99 = append(p99, nanIfZero(s.P99Ms, s.Latency))
		cpu = append(cpu, s.CPUPer1000)
		mem = append(mem, s.PeakMemMB)
	}
	p.Rate, p.P50Ms, p.P99Ms, p.CPUPer1000, p.PeakMemMB = summarize(rate), summarize(p50), summarize(p99), summarize(cpu), summarize(mem)
	return p
}

// nanIfZero drops latency figures of runs that measured none.
func nanIfZero(v float64, samples int) float64 {
	if samples == 0 {
		return math.NaN()
	}
	return v
}

// writeJSONLines prints one object per system and scenario, one per line.
func writeJSONLines(w io.Writer, results []Result) error {
	enc := json.NewEncoder(w)
	for _, r := range results {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return nil
}

// readReport reads a report that bench compare wrote.
func readReport(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return &r, nil
}
