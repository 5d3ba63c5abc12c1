package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Systems.
const (
	sysSagaflowPG     = "sagaflow-pg"     // the engine, Postgres-only mode
	sysSagaflowKafka  = "sagaflow-kafka"  // the engine, Kafka mode (relay + consumer group, in-process broker)
	sysSagaflowHybrid = "sagaflow-hybrid" // the engine, hybrid mode: step b remote (a participant over Kafka), a and c local
	// sysSagaflowHybrid2 is the hybrid mode with steps b and c remote, one
	// after the other (`bench run` only: not in bench compare's systems).
	sysSagaflowHybrid2 = "sagaflow-hybrid-2remote"
	sysRiver           = "river"          // River: a chain of 3 jobs
	sysTemporal        = "temporal"       // Temporal dev server: a workflow of 3 activities
	sysDBOS            = "dbos"           // DBOS Transact Go: a workflow of 3 checkpointed steps
	sysGoWorkflows     = "go-workflows"   // go-workflows on MySQL (MariaDB): a workflow of 3 activities
	sysRaw             = "raw"            // the SQL of a step, one transaction per step, pgx, no engine
	sysRawPipelined    = "raw-pipelined"  // the same, each step's transaction sent as one pipelined batch
	sysRelay           = "sagaflow-relay" // sagaflow's relay draining the outbox
	sysWatermill       = "watermill"      // Watermill's SQL subscriber + forwarder to Kafka
	sysKafkaGo         = "kafka-go"       // a raw kafka-go writer, no database
)

// Scenarios.
const (
	scenarioSteps    = "steps"    // closed loop, N sagas in flight
	scenarioHalfLoad = "halfload" // open loop at half of the system's peak
	scenarioHistory  = "history"  // sagaflow with finished sagas in its tables
	scenarioRelay    = "relay"    // drain a backlog (the standard size)
	scenarioDrain    = "drain"    // drain a large backlog
)

var sagaSystems = []string{sysSagaflowPG, sysSagaflowKafka, sysSagaflowHybrid, sysRiver, sysTemporal, sysDBOS, sysGoWorkflows, sysRaw, sysRawPipelined}
var relaySystems = []string{sysRelay, sysWatermill, sysKafkaGo}

// runOpts is one measured run.
type runOpts struct {
	System   string
	Scenario string
	Rep      int
	Conc     int
	Warmup   time.Duration
	// WarmupMax bounds a closed loop's warm-up, which lasts at least Warmup
	// and until every one of the Conc slots has finished a saga.
	WarmupMax time.Duration
	Window    time.Duration
	// WindowMax bounds a window stretched to one turn-over of the slots.
	WindowMax time.Duration
	// Rate is the offered load of an open-loop run, in sagas per second.
	Rate float64
	// Schema is an existing, migrated sagaflow schema to run in (the history
	// scenario's pre-filled tables); "" for a fresh one.
	Schema  string
	History int
	Backlog int
	// TimeBox bounds a drain; a drain still running then is reported as
	// partial, at the rate it reached.
	TimeBox     time.Duration
	TemporalBin string
	// TemporalPragmas are SQLite pragmas for the dev server
	// (--sqlite-pragma), comma-separated; "" for its defaults.
	TemporalPragmas string
	RiverCooldown   time.Duration
}

func (o *runOpts) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.System, "system", "", "system to measure")
	fs.StringVar(&o.Scenario, "scenario", scenarioSteps, "scenario")
	fs.IntVar(&o.Rep, "rep", 0, "repetition number (recorded only)")
	fs.IntVar(&o.Conc, "conc", 16, "sagas in flight")
	fs.DurationVar(&o.Warmup, "warmup", time.Second, "load before the measured window")
	fs.DurationVar(&o.WarmupMax, "warmup-max", 30*time.Second, "longest closed-loop warm-up")
	fs.DurationVar(&o.WindowMax, "window-max", 15*time.Second, "longest stretched window")
	fs.DurationVar(&o.Window, "window", 5*time.Second, "measured window")
	fs.Float64Var(&o.Rate, "rate", 0, "open-loop arrival rate, sagas/s (halfload)")
	fs.StringVar(&o.Schema, "schema", "", "existing sagaflow schema to run in")
	fs.IntVar(&o.History, "history", 0, "finished sagas in -schema (recorded only)")
	fs.IntVar(&o.Backlog, "backlog", 20000, "rows in the backlog (relay, drain)")
	fs.DurationVar(&o.TimeBox, "timebox", 10*time.Minute, "longest a drain may run")
	fs.StringVar(&o.TemporalBin, "temporal-bin", defaultTemporalBin(), "the temporal CLI")
	fs.StringVar(&o.TemporalPragmas, "temporal-sqlite-pragmas", "", "SQLite pragmas for the dev server, comma-separated (journal_mode=wal,...)")
	fs.DurationVar(&o.RiverCooldown, "river-fetch-cooldown", riverFetchCooldown, "River's FetchCooldown")
}

func (o *runOpts) args() []string {
	return []string{
		"-system", o.System, "-scenario", o.Scenario, "-rep", fmt.Sprint(o.Rep), "-conc", fmt.Sprint(o.Conc),
		"-warmup", o.Warmup.String(), "-warmup-max", o.WarmupMax.String(), "-window-max", o.WindowMax.String(), "-window", o.Window.String(), "-rate", fmt.Sprint(o.Rate),
		"-schema", o.Schema, "-history", fmt.Sprint(o.History), "-backlog", fmt.Sprint(o.Backlog),
		"-timebox", o.TimeBox.String(), "-temporal-bin", o.TemporalBin, "-temporal-sqlite-pragmas", o.TemporalPragmas,
		"-river-fetch-cooldown", o.RiverCooldown.String(),
	}
}

func runMain(args []string) error {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	var o runOpts
	o.flags(fs)
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the run (this process) here")
	_ = fs.Parse(args)
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.Warmup+o.WarmupMax+o.Window+o.WindowMax+o.TimeBox+5*time.Minute)
	defer cancel()
	s := Sample{System: o.System, Scenario: o.Scenario, Rep: o.Rep, History: o.History, StartedAtUnix: time.Now().Unix()}
	switch o.Scenario {
	case scenarioRelay, scenarioDrain:
		s.Backlog = o.Backlog
	default:
		s.Conc = o.Conc
	}
	err := runOne(ctx, &o, &s)
	if err != nil {
		s.Error = err.Error()
	}
	s.PeakMemMB = selfPeakMB() + s.ServerPeakMB
	if encErr := json.NewEncoder(os.Stdout).Encode(s); encErr != nil {
		return encErr
	}
	return err
}

func runOne(ctx context.Context, o *runOpts, s *Sample) error {
	switch o.System {
	case sysRelay, sysWatermill, sysKafkaGo:
		return runDrain(ctx, o, s)
	}
	setupStart := time.Now()
	sys, err := newSagaSystem(ctx, o)
	if err != nil {
		return err
	}
	defer sys.close()
	s.SetupSeconds = time.Since(setupStart).Seconds()
	s.Note = joinNote(s.Note, sys.note())
	m := sys.meter()
	if o.Scenario == scenarioHalfLoad {
		err = openLoop(ctx, o, m, sys.run, s)
	} else {
		err = closedLoop(ctx, o, m, sys.run, s)
	}
	if sp, ok := sys.(interface{ serverPeakMB() float64 }); ok {
		s.ServerPeakMB = sp.serverPeakMB()
	}
	return err
}

// sagaSystem runs the 3-step workload.
type sagaSystem interface {
	// run starts one saga and returns when its third step has run.
	run(ctx context.Context) error
	meter() *meter
	note() string
	close()
}

func newSagaSystem(ctx context.Context, o *runOpts) (sagaSystem, error) {
	switch o.System {
	case sysSagaflowPG:
		return newSagaflow(ctx, o, false)
	case sysSagaflowKafka:
		return newSagaflow(ctx, o, true)
	case sysSagaflowHybrid:
		return newHybrid(ctx, o, false)
	case sysSagaflowHybrid2:
		return newHybrid(ctx, o, true)
	case sysRaw:
		return newRaw(ctx, o, false)
	case sysRawPipelined:
		return newRaw(ctx, o, true)
	case sysRiver:
		return newRiver(ctx, o)
	case sysTemporal:
		return newTemporal(ctx, o)
	case sysDBOS:
		return newDBOS(ctx, o)
	case sysGoWorkflows:
		return newGoWorkflows(ctx, o)
	}
	return nil, fmt.Errorf("unknown system %q", o.System)
}

// recorder collects the sagas that ended in the measured window.
type recorder struct {
	mu       sync.Mutex
	from, to time.Time // the window; zero while not yet open
	lat      []time.Duration
	err      error
	failed   atomic.Bool
	// warmed counts the closed loop's slots that finished a saga.
	warmed atomic.Int64
}

func (r *recorder) add(start, end time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.from.IsZero() && !end.Before(r.from) && (r.to.IsZero() || !end.After(r.to)) {
		r.lat = append(r.lat, end.Sub(start))
	}
}

func (r *recorder) fail(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		r.err = err
	}
	r.failed.Store(true)
}

func (r *recorder) open(t time.Time) {
	r.mu.Lock()
	r.from = t
	r.mu.Unlock()
}

func (r *recorder) close(t time.Time) {
	r.mu.Lock()
	r.to = t
	r.mu.Unlock()
}

// finish fills the sample from the sagas recorded in the window.
func (r *recorder) finish(s *Sample) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	lat := slices.Clone(r.lat)
	slices.Sort(lat)
	s.Units = 3 * len(lat)
	s.Latency = len(lat)
	s.P50Ms, s.P99Ms = ms(percentile(lat, 0.50)), ms(percentile(lat, 0.99))
	setRates(s)
	if r.err != nil {
		return r.err
	}
	if len(lat) == 0 {
		return errors.New("no saga ended in the measured window")
	}
	return nil
}

// runOne runs one saga and records its latency. A failure, unless the loop
// was ending anyway, is recorded and stops the loop; runOne then reports
// false.
func (r *recorder) runOne(ctx context.Context, run func(context.Context) error, stop func()) bool {
	start := time.Now()
	if err := run(ctx); err != nil {
		if ctx.Err() == nil {
			r.fail(err)
			stop()
		}
		return false
	}
	r.add(start, time.Now())
	return true
}

// closedLoop keeps o.Conc sagas in flight: each of o.Conc goroutines starts
// a saga as soon as its previous one ended. After o.Warmup it measures
// o.Window.
func closedLoop(ctx context.Context, o *runOpts, m *meter, run func(context.Context) error, s *Sample) error {
	loopCtx, stop := context.WithCancel(ctx)
	defer stop()
	var rec recorder
	var wg sync.WaitGroup
	for range o.Conc {
		wg.Go(func() {
			for first := true; loopCtx.Err() == nil; first = false {
				if !rec.runOne(loopCtx, run, stop) {
					return
				}
				if first {
					rec.warmed.Add(1)
				}
			}
		})
	}
	// Warm up until every slot has turned over once: before that, the
	// latencies are those of the first wave, all started at once.
	warm := func() bool { return rec.warmed.Load() >= int64(o.Conc) }
	return measureWindow(ctx, o, m, &rec, stop, &wg, s, warm)
}

// openLoop starts sagas at o.Rate per second, whatever the system's
// progress (at most openLoopMaxInFlight at once), and measures their
// latency in the window.
func openLoop(ctx context.Context, o *runOpts, m *meter, run func(context.Context) error, s *Sample) error {
	if o.Rate <= 0 {
		return errors.New("halfload needs -rate")
	}
	s.OfferedRate = 3 * o.Rate
	loopCtx, stop := context.WithCancel(ctx)
	defer stop()
	var rec recorder
	var wg sync.WaitGroup
	sem := make(chan struct{}, openLoopMaxInFlight)
	wg.Go(func() {
		var inner sync.WaitGroup
		defer inner.Wait()
		begin := time.Now()
		for i := 0; loopCtx.Err() == nil; i++ {
			due := begin.Add(time.Duration(float64(i) / o.Rate * float64(time.Second)))
			if d := time.Until(due); d > 0 {
				select {
				case <-loopCtx.Done():
					return
				case <-time.After(d):
				}
			}
			select {
			case sem <- struct{}{}:
			case <-loopCtx.Done():
				return
			}
			inner.Go(func() {
				defer func() { <-sem }()
				rec.runOne(loopCtx, run, stop)
			})
		}
	})
	return measureWindow(ctx, o, m, &rec, stop, &wg, s, nil)
}

const openLoopMaxInFlight = 20000

// measureWindow warms up for o.Warmup and, when warm is set, until it
// holds (at most o.WarmupMax), then measures o.Window.
func measureWindow(ctx context.Context, o *runOpts, m *meter, rec *recorder, stop func(), wg *sync.WaitGroup, s *Sample, warm func() bool) error {
	began := time.Now()
	ok := sleepCtx(ctx, o.Warmup)
	for ok && warm != nil && !warm() && !rec.failed.Load() {
		if time.Since(began) > o.WarmupMax {
			s.Note = joinNote(s.Note, fmt.Sprintf("warm-up cut at %s: %d of %d slots had finished a saga", o.WarmupMax, rec.warmed.Load(), o.Conc))
			break
		}
		ok = sleepCtx(ctx, 50*time.Millisecond)
	}
	s.WarmupSeconds = time.Since(began).Seconds()
	if !ok || rec.failed.Load() {
		stop()
		waitTimeout(wg, 30*time.Second)
		return rec.finish(s)
	}
	// A closed loop whose slots took longer than the window to turn over
	// moves in waves: measure one turn at least.
	window := o.Window
	if warm != nil {
		window = max(window, min(time.Since(began), o.WindowMax))
	}
	m.start(ctx)
	rec.open(m.started)
	sleepCtx(ctx, window)
	end := time.Now()
	rec.close(end)
	m.stop(ctx, s)
	stop()
	waitTimeout(wg, 30*time.Second)
	return rec.finish(s)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func waitTimeout(wg *sync.WaitGroup, d time.Duration) {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
	}
}
