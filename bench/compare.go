package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

type compareOpts struct {
	reps        int
	systems     []string
	scenarios   []string
	concs       []int
	warmup      time.Duration
	window      time.Duration
	history     []int
	historyConc int
	relayRows   int
	drainRows   int
	drainReps   int
	drainBox    time.Duration
	temporalMax int
	jsonOut     bool
	out         string
	library     string
	run         runOpts // defaults passed to every child
}

var allScenarios = []string{scenarioSteps, scenarioHalfLoad, scenarioHistory, scenarioRelay, scenarioDrain}

func compareMain(args []string) error {
	fs := flag.NewFlagSet("compare", flag.ExitOnError)
	var (
		o                                           compareOpts
		quick                                       bool
		systems, scenarios, concs, history, command string
	)
	fs.BoolVar(&quick, "quick", false, "a short run (~4 min): 1 repetition, 16 and 256 in flight (Temporal 16 only), 3 s windows, 100,000 finished sagas, a 10,000-row relay backlog, no 1M drain")
	fs.IntVar(&o.reps, "reps", 3, "repetitions of each measurement")
	fs.StringVar(&systems, "systems", strings.Join(append(slices.Clone(sagaSystems), relaySystems...), ","), "systems to measure")
	fs.StringVar(&scenarios, "scenarios", strings.Join(allScenarios, ","), "scenarios to run")
	fs.StringVar(&concs, "conc", "1,16,256,4096", "sagas in flight (steps scenario)")
	fs.DurationVar(&o.warmup, "warmup", 2*time.Second, "load before each measured window")
	fs.DurationVar(&o.run.WindowMax, "window-max", 15*time.Second, "longest window of a closed loop stretched to one turn-over of its slots")
	fs.DurationVar(&o.run.WarmupMax, "warmup-max", 30*time.Second, "longest warm-up of a closed loop, which otherwise lasts until every in-flight slot has finished a saga")
	fs.DurationVar(&o.window, "window", 5*time.Second, "measured window of each saga run")
	fs.StringVar(&history, "history", "100000,1000000", "finished sagas pre-filled for the history scenario (0 is always measured)")
	fs.IntVar(&o.historyConc, "history-conc", 256, "sagas in flight in the history scenario")
	fs.IntVar(&o.relayRows, "relay-rows", 20000, "backlog of the relay scenario")
	fs.IntVar(&o.drainRows, "drain-rows", 1000000, "backlog of the drain scenario")
	fs.IntVar(&o.drainReps, "drain-reps", 1, "repetitions of the drain scenario")
	fs.DurationVar(&o.drainBox, "drain-timebox", 90*time.Second, "longest a drain may run; a system still draining then is reported at the rate it reached")
	fs.IntVar(&o.temporalMax, "temporal-max-conc", 256, "highest concurrency Temporal is run at (its dev server turns 4,096 in flight over in minutes, not seconds)")
	fs.StringVar(&o.library, "library", "", "describe the sagaflow build measured (default: the commit of ../ and whether its Go files differ)")
	fs.BoolVar(&o.jsonOut, "json", false, "print one JSON object per system and scenario on stdout (the table goes to stderr)")
	fs.StringVar(&o.out, "out", "results.json", "write the whole report (machine, results, every run) here; empty for none")
	fs.StringVar(&o.run.TemporalBin, "temporal-bin", defaultTemporalBin(), "the temporal CLI")
	fs.StringVar(&o.run.TemporalPragmas, "temporal-sqlite-pragmas", temporalPragmasDefault, "SQLite pragmas for Temporal's dev server, comma-separated; empty for its own")
	fs.DurationVar(&o.run.RiverCooldown, "river-fetch-cooldown", riverFetchCooldown, "River's FetchCooldown")
	_ = fs.Parse(args)
	command = "bench compare " + strings.Join(args, " ")
	if quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		def := func(name string, apply func()) {
			if !set[name] {
				apply()
			}
		}
		def("reps", func() { o.reps = 1 })
		def("conc", func() { concs = "16,256" })
		def("window", func() { o.window = 3 * time.Second })
		def("warmup", func() { o.warmup = time.Second })
		def("history", func() { history = "100000" })
		def("relay-rows", func() { o.relayRows = 10000 })
		def("temporal-max-conc", func() { o.temporalMax = 16 })
		def("scenarios", func() {
			scenarios = strings.Join([]string{scenarioSteps, scenarioHalfLoad, scenarioHistory, scenarioRelay}, ",")
		})
	}
	o.systems = splitList(systems)
	o.scenarios = splitList(scenarios)
	var err error
	if o.concs, err = splitInts(concs); err != nil {
		return fmt.Errorf("-conc: %w", err)
	}
	if o.history, err = splitInts(history); err != nil {
		return fmt.Errorf("-history: %w", err)
	}
	return compare(&o, command)
}

func splitList(s string) []string {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func splitInts(s string) ([]int, error) {
	var out []int
	for _, f := range splitList(s) {
		v, err := strconv.Atoi(f)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

func compare(o *compareOpts, command string) error {
	ctx := context.Background()
	report := Report{Date: time.Now().UTC().Format(time.RFC3339), Command: command}
	report.Machine = describeMachine(ctx, o.run.TemporalBin)
	if o.library != "" {
		report.Machine.Library = o.library
	}
	has := func(list []string, v string) bool { return slices.Contains(list, v) }
	var saga, relays []string
	for _, s := range o.systems {
		switch {
		case has(sagaSystems, s):
			saga = append(saga, s)
		case has(relaySystems, s):
			relays = append(relays, s)
		default:
			return fmt.Errorf("unknown system %q (known: %s, %s)", s, strings.Join(sagaSystems, ","), strings.Join(relaySystems, ","))
		}
	}
	var samples []Sample
	progress := os.Stderr
	exec1 := func(r runOpts) Sample {
		s := spawn(ctx, r)
		samples = append(samples, s)
		fmt.Fprintln(progress, describeSample(&s))
		return s
	}
	base := o.run
	base.Warmup, base.Window = o.warmup, o.window

	// 1. Concurrency: every saga system at every load, round-robin over the
	// systems within a repetition (the order rotates between repetitions).
	if has(o.scenarios, scenarioSteps) {
		for rep := 1; rep <= o.reps; rep++ {
			for _, conc := range o.concs {
				for _, sys := range rotate(saga, rep-1) {
					if sys == sysTemporal && conc > o.temporalMax {
						continue
					}
					r := base
					r.System, r.Scenario, r.Rep, r.Conc = sys, scenarioSteps, rep, conc
					exec1(r)
				}
			}
		}
	}
	// 2. Latency at half of each system's peak, open loop.
	if has(o.scenarios, scenarioHalfLoad) {
		peaks := map[string]Point{}
		for _, res := range group(samples) {
			if res.Scenario == scenarioSteps && res.Best != nil {
				peaks[res.System] = *res.Best
			}
		}
		for rep := 1; rep <= o.reps; rep++ {
			for _, sys := range rotate(saga, rep-1) {
				peak, ok := peaks[sys]
				if !ok {
					continue // no steps run to take the peak from
				}
				r := base
				r.System, r.Scenario, r.Rep = sys, scenarioHalfLoad, rep
				r.Rate = peak.Rate.Median / 3 / 2
				r.Conc = peak.Conc // the peak's configuration (workers, pool)
				exec1(r)
			}
		}
	}
	// 3. Throughput with finished sagas in the tables (sagaflow, Postgres-only).
	if has(o.scenarios, scenarioHistory) && has(saga, sysSagaflowPG) {
		schemas, cleanup, err := prefillAll(ctx, o.history, &report)
		if err != nil {
			report.Notes = append(report.Notes, "history scenario not run: "+err.Error())
			fmt.Fprintln(progress, "history scenario not run:", err)
		} else {
			levels := append([]int{0}, o.history...)
			for rep := 1; rep <= o.reps; rep++ {
				for _, level := range levels {
					r := base
					r.System, r.Scenario, r.Rep, r.Conc, r.History, r.Schema = sysSagaflowPG, scenarioHistory, rep, o.historyConc, level, schemas[level]
					exec1(r)
				}
			}
		}
		cleanup()
	}
	// 4. and 5. The relay and its peers draining a backlog.
	for _, sc := range []struct {
		name       string
		rows, reps int
	}{{scenarioRelay, o.relayRows, o.reps}, {scenarioDrain, o.drainRows, o.drainReps}} {
		if !has(o.scenarios, sc.name) || sc.rows <= 0 {
			continue
		}
		for rep := 1; rep <= sc.reps; rep++ {
			for _, sys := range rotate(relays, rep-1) {
				r := base
				r.System, r.Scenario, r.Rep, r.Backlog = sys, sc.name, rep, sc.rows
				r.TimeBox = 10 * time.Minute
				if sys == sysWatermill {
					r.TimeBox = o.drainBox
				}
				exec1(r)
			}
		}
	}

	report.Results = group(samples)
	table := io.Writer(os.Stdout)
	if o.jsonOut {
		table = os.Stderr
		if err := writeJSONLines(os.Stdout, report.Results); err != nil {
			return err
		}
	}
	report.Targets = computeTargets(report.Results)
	printTable(table, report.Results)
	printTargets(table, report.Targets)
	if o.out != "" {
		b, err := json.MarshalIndent(report, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(o.out, append(b, '\n'), 0o644); err != nil {
			return err
		}
		fmt.Fprintln(os.Stderr, "wrote", o.out)
	}
	return nil
}

// rotate returns list starting at its k-th element, so that no system is
// always measured first.
func rotate(list []string, k int) []string {
	if len(list) == 0 {
		return nil
	}
	k %= len(list)
	return append(slices.Clone(list[k:]), list[:k]...)
}

// prefillAll fills one schema per history level; cleanup drops them.
func prefillAll(ctx context.Context, levels []int, report *Report) (map[int]string, func(), error) {
	schemas := map[int]string{0: ""}
	pool, err := connect(ctx, "bench-prefill", 2)
	if err != nil {
		return nil, func() {}, err
	}
	cleanup := func() {
		for _, s := range schemas {
			if s != "" {
				dropSchema(context.Background(), pool, s)
			}
		}
		pool.Close()
	}
	for _, n := range levels {
		if n <= 0 {
			continue
		}
		schema := fmt.Sprintf("bench_history_%d_%s", n, randomSuffix())
		schemas[n] = schema
		fmt.Fprintf(os.Stderr, "pre-filling %s with %d finished sagas...\n", schema, n)
		d, err := prefillHistory(ctx, pool, schema, n, historyShape{})
		if err != nil {
			return schemas, cleanup, err
		}
		report.Notes = append(report.Notes, fmt.Sprintf("pre-filled %d finished sagas (5 history rows each, inbox keys for the last 14 days) in %s", n, d.Round(time.Second)))
	}
	return schemas, cleanup, nil
}

// spawn runs one measurement in a child process and returns its sample.
func spawn(ctx context.Context, r runOpts) Sample {
	s := Sample{System: r.System, Scenario: r.Scenario, Rep: r.Rep, Conc: r.Conc, History: r.History}
	if r.Scenario == scenarioRelay || r.Scenario == scenarioDrain {
		s.Conc, s.Backlog = 0, r.Backlog
	}
	exe, err := os.Executable()
	if err != nil {
		s.Error = err.Error()
		return s
	}
	cctx, cancel := context.WithTimeout(ctx, r.Warmup+r.WarmupMax+r.Window+r.WindowMax+r.TimeBox+10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, exe, append([]string{"run"}, r.args()...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	runErr := cmd.Run()
	// The child prints its sample as the last line, error or not.
	var last []byte
	sc := bufio.NewScanner(&stdout)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if line := bytes.TrimSpace(sc.Bytes()); len(line) > 0 && line[0] == '{' {
			last = slices.Clone(line)
		}
	}
	if last != nil {
		var got Sample
		if err := json.Unmarshal(last, &got); err == nil {
			s = got
		}
	}
	if runErr != nil && s.Error == "" {
		s.Error = fmt.Sprintf("%v: %s", runErr, tail(strings.TrimSpace(stderr.String()), 600))
	}
	return s
}

func describeSample(s *Sample) string {
	head := fmt.Sprintf("%-9s %-15s", s.Scenario, s.System)
	switch s.Scenario {
	case scenarioRelay, scenarioDrain:
		head += fmt.Sprintf(" backlog=%-8d", s.Backlog)
	case scenarioHistory:
		head += fmt.Sprintf(" history=%-8d", s.History)
	case scenarioHalfLoad:
		head += fmt.Sprintf(" offered=%-6.0f", s.OfferedRate)
	default:
		head += fmt.Sprintf(" conc=%-5d", s.Conc)
	}
	head += fmt.Sprintf(" rep=%d: ", s.Rep)
	if s.Error != "" {
		return head + "ERROR " + s.Error
	}
	out := head + fmt.Sprintf("%8.0f %s  cpu %.2f s/1000  mem %.0f MiB", s.Rate, unitOf(s.Scenario), s.CPUPer1000, s.PeakMemMB)
	if s.Latency > 0 {
		out += fmt.Sprintf("  p50 %.1f ms  p99 %.1f ms", s.P50Ms, s.P99Ms)
	}
	if s.Partial {
		out += "  (partial: time-boxed)"
	}
	return out
}

// printTable prints each result's points: medians, and the spread of the
// rate.
func printTable(w io.Writer, results []Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tsystem\tparam\trate (median)\tmin–max\tp50 ms\tp99 ms\tCPU s/1000\tpeak MiB\treps\t")
	for _, r := range results {
		for _, p := range r.Points {
			lat := func(s Stat) string {
				if s.N == 0 {
					return "–"
				}
				return fmt.Sprintf("%.1f", s.Median)
			}
			rate := fmt.Sprintf("%.0f %s", p.Rate.Median, r.Unit)
			if p.Rate.N == 0 {
				rate = "failed"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%.0f–%.0f\t%s\t%s\t%.2f\t%.0f\t%d/%d\t\n",
				r.Scenario, r.System, p.Param, rate, p.Rate.Min, p.Rate.Max, lat(p.P50Ms), lat(p.P99Ms),
				p.CPUPer1000.Median, p.PeakMemMB.Median, p.Rate.N, len(p.Runs))
			for _, e := range p.Errors {
				fmt.Fprintf(tw, "\t\t\t%s\t\t\t\t\t\t\t\n", tail(e, 160))
			}
		}
	}
	_ = tw.Flush()
}

func describeMachine(ctx context.Context, temporalBin string) Machine {
	m := Machine{Cores: runtime.NumCPU(), Go: runtime.Version(), Kafka: "kfake (github.com/twmb/franz-go/pkg/kfake), in each run's process"}
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		m.Kafka = "KAFKA_BROKERS=" + env
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "model name"); ok {
				m.CPU = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		_, _ = fmt.Sscanf(string(b), "MemTotal: %d kB", &kb)
		m.MemoryGiB = int(math.Round(float64(kb) / (1 << 20)))
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = "Linux " + strings.TrimSpace(string(b))
	}
	if pool, err := connect(ctx, "bench-describe", 1); err == nil {
		var v, sb, sc, mc string
		_ = pool.QueryRow(ctx, "SELECT current_setting('server_version'), current_setting('shared_buffers'), current_setting('synchronous_commit'), current_setting('max_connections')").Scan(&v, &sb, &sc, &mc)
		m.PostgreSQL = v
		m.PGSettings = fmt.Sprintf("shared_buffers=%s synchronous_commit=%s max_connections=%s", sb, sc, mc)
		pool.Close()
	}
	m.Library = describeLibrary(ctx)
	if out, err := exec.CommandContext(ctx, temporalBin, "--version").Output(); err == nil {
		m.Temporal = strings.TrimSpace(string(out)) + "; server start-dev with a SQLite file"
	} else {
		m.Temporal = "not available: " + err.Error()
	}
	return m
}

// describeLibrary names the sagaflow commit under ../ and says whether its
// Go sources (outside bench/) differ from it.
func describeLibrary(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, "git", "-C", "..", "log", "-1", "--format=%h %cs %s").Output()
	if err != nil {
		return "unknown: " + err.Error()
	}
	lib := strings.TrimSpace(string(out))
	dirty, err := exec.CommandContext(ctx, "git", "-C", "..", "status", "--porcelain", "--", "*.go", "go.mod", ":!bench").Output()
	if err == nil && len(bytes.TrimSpace(dirty)) > 0 {
		lib += " (with uncommitted changes to its Go files)"
	}
	return lib
}
