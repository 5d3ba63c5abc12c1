package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// The waits benchmark (issue #13), in one process, sagaflow-pg only:
//
//   - sleepers: steps/s of the 3-step saga with N sagas asleep in the same
//     schema (a 24 h Sleep) against an empty schema, interleaved;
//   - timers: sagas whose SleepUntil comes due at a steady rate, and how late
//     each timer_fired is;
//   - signals: the peak of signals/s (closed loop), then the latency from
//     Engine.Signal to the next step at half of that peak (open loop).

type waitsOpts struct {
	Reps     int
	Parts    string
	Sleepers int
	Conc     int
	Window   time.Duration
	// Timers.
	TimerRate float64
	TimerSpan time.Duration
	// Signals.
	SignalConcs  string
	SignalPool   int
	SignalRounds int
	HalfWindow   time.Duration
	Out          string
	// Workers of the engine in the timers and signals parts.
	Workers int
	// Vacuum runs VACUUM ANALYZE on both schemas' tables before
	// measuring: what autovacuum does in the minute or two after the fill.
	// false measures while autovacuum may still be at it, with the fill's
	// statistics.
	Vacuum bool
}

// WaitsReport is what `bench waits` writes with -out.
type WaitsReport struct {
	StartedAt string        `json:"started_at"`
	Opts      waitsOpts     `json:"opts"`
	Sleepers  []SleepersRun `json:"sleepers,omitempty"`
	Timers    []TimersRun   `json:"timers,omitempty"`
	Signals   []SignalsRun  `json:"signals,omitempty"`
	Notes     []string      `json:"notes,omitempty"`
}

// SleepersRun is one repetition of the sleepers part: the same closed loop
// against an empty schema and against the schema with the sleepers.
type SleepersRun struct {
	Rep             int     `json:"rep"`
	Sleepers        int     `json:"sleepers"`
	EmptyStepsPerS  float64 `json:"empty_steps_per_s"`
	SleepStepsPerS  float64 `json:"sleepers_steps_per_s"`
	Ratio           float64 `json:"ratio"`
	EmptyP99Ms      float64 `json:"empty_saga_p99_ms"`
	SleepP99Ms      float64 `json:"sleepers_saga_p99_ms"`
	FillSeconds     float64 `json:"fill_seconds,omitempty"`
	AsleepSeconds   float64 `json:"asleep_seconds,omitempty"`
	StillAsleep     int     `json:"still_asleep"`
	LoadAvgAtStart  string  `json:"loadavg"`
	EmptyFirst      bool    `json:"empty_first"`
	EmptyWallSecond float64 `json:"empty_window_s"`
	OldestXactS     float64 `json:"oldest_xact_s"`
	SleepWallSecond float64 `json:"sleepers_window_s"`
}

// TimersRun is one repetition of the timers part.
type TimersRun struct {
	Rep          int     `json:"rep"`
	Timers       int     `json:"timers"`
	Rate         float64 `json:"rate_per_s"`
	P50Ms        float64 `json:"late_p50_ms"`
	P99Ms        float64 `json:"late_p99_ms"`
	MaxMs        float64 `json:"late_max_ms"`
	EngineP99Ms  float64 `json:"late_ms_detail_p99"`
	StartedLate  int     `json:"wait_started_after_due"`
	FiredPerSec  float64 `json:"fired_per_s"`
	LoadAvg      string  `json:"loadavg"`
	InsertSecond float64 `json:"insert_s"`
	OldestXactS  float64 `json:"oldest_xact_s"`
}

// ConcPoint is a closed loop of signals at one load.
type ConcPoint struct {
	Conc   int     `json:"in_flight"`
	PerSec float64 `json:"signals_per_s"`
	P50Ms  float64 `json:"p50_ms"`
	P99Ms  float64 `json:"p99_ms"`
}

// SignalsRun is one repetition of the signals part.
type SignalsRun struct {
	Rep      int                `json:"rep"`
	Peak     map[string]float64 `json:"peak_signals_per_s_by_conc"`
	ByConc   []ConcPoint        `json:"closed_loop"`
	PeakRate float64            `json:"peak_signals_per_s"`
	PeakConc int                `json:"peak_conc"`
	Offered  float64            `json:"offered_signals_per_s"`
	Achieved float64            `json:"achieved_signals_per_s"`
	P50Ms    float64            `json:"p50_ms"`
	P99Ms    float64            `json:"p99_ms"`
	Count    int                `json:"signals"`
	// ScansPerSignal is index scans of outbox_direct_pending per signal
	// sent in the half-load run.
	ScansPerSignal float64 `json:"claim_index_scans_per_signal"`
	NotWaiting     int     `json:"signalled_before_wait"`
	LoadAvg        string  `json:"loadavg"`
	OldestXact     float64 `json:"oldest_xact_s"`
}

func waitsMain(args []string) error {
	fs := flag.NewFlagSet("waits", flag.ExitOnError)
	var o waitsOpts
	fs.IntVar(&o.Reps, "reps", 2, "repetitions of each part")
	fs.StringVar(&o.Parts, "parts", "sleepers,timers,signals", "parts to run")
	fs.IntVar(&o.Sleepers, "sleepers", 100_000, "sagas asleep in the sleepers part")
	fs.IntVar(&o.Conc, "conc", 256, "sagas in flight in the sleepers part (the peak load of bench compare)")
	fs.DurationVar(&o.Window, "window", 5*time.Second, "measured window of a closed loop")
	fs.Float64Var(&o.TimerRate, "timer-rate", 1000, "timers coming due per second")
	fs.DurationVar(&o.TimerSpan, "timer-span", 20*time.Second, "how long timers keep coming due")
	fs.BoolVar(&o.Vacuum, "vacuum", true, "VACUUM ANALYZE the tables after the fill, as autovacuum would soon (false: measure while it may still run)")
	fs.IntVar(&o.Workers, "workers", 8, "engine Workers in the timers and signals parts (bench compare's for 8 or more in flight)")
	fs.StringVar(&o.SignalConcs, "signal-conc", "1,16,64,256", "signals in flight tried for the peak")
	fs.IntVar(&o.SignalPool, "signal-pool", 2000, "waiting sagas the signals go to, round-robin")
	fs.IntVar(&o.SignalRounds, "signal-rounds", 40, "signal waits per saga")
	fs.DurationVar(&o.HalfWindow, "half-window", 10*time.Second, "measured window at half of the peak")
	fs.StringVar(&o.Out, "out", "", "write the report as JSON to this file")
	_ = fs.Parse(args)
	if o.Reps < 1 || o.Sleepers < 0 || o.Conc < 1 || o.TimerRate <= 0 || o.SignalPool < 1 || o.SignalRounds < 1 || o.Workers < 1 {
		return errors.New("waits: -reps, -conc, -timer-rate, -signal-pool, -signal-rounds and -workers must be positive")
	}
	ctx := context.Background()
	rep := WaitsReport{StartedAt: time.Now().UTC().Format(time.RFC3339), Opts: o}
	parts := strings.Split(o.Parts, ",")
	var err error
	if slices.Contains(parts, "sleepers") {
		rep.Sleepers, err = benchSleepers(ctx, &o)
		if err != nil {
			return fmt.Errorf("sleepers: %w", err)
		}
	}
	if slices.Contains(parts, "timers") {
		for r := range o.Reps {
			t, err := benchTimers(ctx, &o, r)
			if err != nil {
				return fmt.Errorf("timers: %w", err)
			}
			rep.Timers = append(rep.Timers, t)
		}
	}
	if slices.Contains(parts, "signals") {
		for r := range o.Reps {
			s, err := benchSignals(ctx, &o, r)
			if err != nil {
				return fmt.Errorf("signals: %w", err)
			}
			rep.Signals = append(rep.Signals, s)
		}
	}
	printWaits(os.Stdout, &rep)
	if o.Out != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		return os.WriteFile(o.Out, append(b, '\n'), 0o644)
	}
	return nil
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func progress(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "%s waits: %s\n", time.Now().UTC().Format("15:04:05"), fmt.Sprintf(format, a...))
}

// startMany starts n sagas of d with the states mk gives: 4 goroutines,
// each committing StartTx calls in transactions of 500. The engine need not
// be running.
func startMany[S any](ctx context.Context, pool *pgxpool.Pool, e *saga.Engine, d *saga.Definition[S], n int, mk func(i int) S) error {
	const perTx, goroutines = 500, 4
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for range goroutines {
		wg.Go(func() {
			for {
				from := int(next.Add(perTx)) - perTx
				if from >= n {
					return
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					for i := from; i < min(from+perTx, n); i++ {
						if _, err := saga.StartTx(ctx, e, tx, d, mk(i), nil); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// pollCount runs a counting query until it returns want (or more), at most
// limit.
func pollCount(ctx context.Context, pool *pgxpool.Pool, sql string, want int, limit time.Duration) (int, error) {
	deadline := time.Now().Add(limit)
	for {
		var n int
		if err := pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			return 0, err
		}
		if n >= want {
			return n, nil
		}
		if time.Now().After(deadline) {
			return n, fmt.Errorf("%d of %d after %s (%s)", n, want, limit, sql)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// --- sleepers -------------------------------------------------------------

type sleeper struct {
	N int `json:"n"`
}

func sleeperDef() *saga.Definition[sleeper] {
	return saga.Define("sleeper",
		saga.Step[sleeper]{Name: "sleep", Wait: saga.Sleep[sleeper](24 * time.Hour)},
		saga.Step[sleeper]{Name: "after", Action: func(context.Context, *saga.StepRun, *sleeper) error { return nil }},
	)
}

func benchSleepers(ctx context.Context, o *waitsOpts) ([]SleepersRun, error) {
	pool, err := connect(ctx, "bench-waits-setup-"+randomSuffix(), 16)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	empty, full := "bench_w0_"+randomSuffix(), "bench_wsleep_"+randomSuffix()
	defer dropSchema(context.Background(), pool, empty)
	defer dropSchema(context.Background(), pool, full)
	for _, sc := range []string{empty, full} {
		if _, err := migrations.Migrate(ctx, pool, sc); err != nil {
			return nil, err
		}
	}
	qs := pgx.Identifier{full}.Sanitize()
	// Fill: start the sleepers with no engine running, then let an engine
	// take each to its Sleep step.
	progress("starting %d sleepers in %s", o.Sleepers, full)
	fillStart := time.Now()
	def := sleeperDef()
	e, err := saga.New(pool, &saga.Config{Schema: full, Workers: 8, PollInterval: 50 * time.Millisecond, Logger: discard})
	if err != nil {
		return nil, err
	}
	if err := e.Register(def); err != nil {
		return nil, err
	}
	if err := startMany(ctx, pool, e, def, o.Sleepers, func(i int) sleeper { return sleeper{N: i} }); err != nil {
		return nil, err
	}
	fill := time.Since(fillStart)
	progress("started in %s; engine takes them to sleep", fill.Round(time.Millisecond))
	asleepStart := time.Now()
	if err := e.Start(ctx); err != nil {
		return nil, err
	}
	_, err = pollCount(ctx, pool, `SELECT count(*) FROM `+qs+`.saga_instances WHERE wait_kind = 'timer'`, o.Sleepers, 10*time.Minute)
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_ = e.Stop(stopCtx)
	cancel()
	if err != nil {
		return nil, err
	}
	asleep := time.Since(asleepStart)
	progress("all asleep after %s", asleep.Round(time.Millisecond))
	if o.Vacuum {
		for _, sc := range []string{empty, full} {
			q := pgx.Identifier{sc}.Sanitize()
			if _, err := pool.Exec(ctx, "VACUUM (ANALYZE) "+q+".outbox, "+q+".saga_instances, "+q+".saga_history, "+q+".inbox"); err != nil {
				return nil, err
			}
		}
		progress("vacuumed")
	}

	measure := func(schema string, rep int) (Sample, error) {
		ro := runOpts{System: sysSagaflowPG, Scenario: scenarioSteps, Rep: rep, Conc: o.Conc, Warmup: time.Second,
			WarmupMax: 30 * time.Second, Window: o.Window, WindowMax: 15 * time.Second, Schema: schema}
		s := Sample{System: ro.System, Scenario: "waits-sleepers", Rep: rep, Conc: o.Conc}
		sys, err := newSagaflowWith(ctx, &ro, false, []saga.AnyDefinition{sleeperDef()})
		if err != nil {
			return s, err
		}
		defer sys.close()
		err = closedLoop(ctx, &ro, sys.meter(), sys.run, &s)
		return s, err
	}
	var out []SleepersRun
	for r := range o.Reps {
		run := SleepersRun{Rep: r, Sleepers: o.Sleepers, EmptyFirst: r%2 == 0, LoadAvgAtStart: loadAvg()}
		if r == 0 {
			run.FillSeconds, run.AsleepSeconds = fill.Seconds(), asleep.Seconds()
		}
		xw := watchXacts(ctx, pool)
		order := []string{empty, full}
		if !run.EmptyFirst {
			order = []string{full, empty}
		}
		for _, sc := range order {
			s, err := measure(sc, r)
			if err != nil {
				return nil, fmt.Errorf("rep %d schema %s: %w", r, sc, err)
			}
			progress("rep %d %s: %.0f steps/s, saga p99 %.1f ms", r, sc, s.Rate, s.P99Ms)
			if sc == empty {
				run.EmptyStepsPerS, run.EmptyP99Ms, run.EmptyWallSecond = s.Rate, s.P99Ms, s.WallSeconds
			} else {
				run.SleepStepsPerS, run.SleepP99Ms, run.SleepWallSecond = s.Rate, s.P99Ms, s.WallSeconds
			}
		}
		run.OldestXactS = xw.end()
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+qs+`.saga_instances WHERE wait_kind = 'timer'`).Scan(&run.StillAsleep); err != nil {
			return nil, err
		}
		if run.EmptyStepsPerS > 0 {
			run.Ratio = run.SleepStepsPerS / run.EmptyStepsPerS
		}
		out = append(out, run)
	}
	return out, nil
}

// --- timers ---------------------------------------------------------------

type timed struct {
	// OffsetUS is when the timer comes due, in µs after the run's time zero.
	OffsetUS int64 `json:"offset_us"`
}

func benchTimers(ctx context.Context, o *waitsOpts, rep int) (TimersRun, error) {
	n := int(o.TimerRate * o.TimerSpan.Seconds())
	run := TimersRun{Rep: rep, Timers: n, Rate: o.TimerRate}
	app := "bench-waits-timers-" + randomSuffix()
	pool, err := connect(ctx, app, o.Workers+16)
	if err != nil {
		return run, err
	}
	defer pool.Close()
	schema := "bench_wtimer_" + randomSuffix()
	defer dropSchema(context.Background(), pool, schema)
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		return run, err
	}
	// Time zero is chosen once every saga is written, before the engine
	// starts: the due times are zero + offset, set when each saga reaches
	// its SleepUntil step, all after the engine started.
	var zero atomic.Int64
	def := saga.Define("timed",
		saga.Step[timed]{Name: "sleep", Wait: saga.SleepUntil(func(s *timed) time.Time {
			return time.UnixMicro(zero.Load() + s.OffsetUS)
		})},
		saga.Step[timed]{Name: "after", Action: func(context.Context, *saga.StepRun, *timed) error { return nil }},
	)
	e, err := saga.New(pool, &saga.Config{Schema: schema, Workers: o.Workers, PollInterval: 50 * time.Millisecond, Logger: discard})
	if err != nil {
		return run, err
	}
	if err := e.Register(def); err != nil {
		return run, err
	}
	ins := time.Now()
	err = startMany(ctx, pool, e, def, n, func(i int) timed {
		return timed{OffsetUS: int64(float64(i) / o.TimerRate * 1e6)}
	})
	if err != nil {
		return run, err
	}
	run.InsertSecond = time.Since(ins).Seconds()
	// Lead: time for the engine to take every saga to its wait (a few
	// thousand steps/s here), with room.
	lead := 5*time.Second + time.Duration(float64(n)/1500*float64(time.Second))
	z := time.Now().Add(lead)
	zero.Store(z.UnixMicro())
	progress("timers rep %d: %d sagas written in %.1fs; first timer due in %s", rep, n, run.InsertSecond, lead)
	run.LoadAvg = loadAvg()
	xw := watchXacts(ctx, pool)
	if err := e.Start(ctx); err != nil {
		xw.end()
		return run, err
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = e.Stop(c)
		cancel()
	}()
	qs := pgx.Identifier{schema}.Sanitize()
	if _, err := pollCount(ctx, pool, `SELECT count(*) FROM `+qs+`.saga_history WHERE event = 'timer_fired'`, n,
		lead+o.TimerSpan+5*time.Minute); err != nil {
		xw.end()
		return run, err
	}
	run.OldestXactS = xw.end()
	rows, err := pool.Query(ctx, `SELECT (s.state->>'offset_us')::int8, f.at, (f.detail->>'late_ms')::float8, w.at
		FROM `+qs+`.saga_history f
		JOIN `+qs+`.saga_instances s ON s.id = f.saga_id
		JOIN `+qs+`.saga_history w ON w.saga_id = f.saga_id AND w.event = 'wait_started'
		WHERE f.event = 'timer_fired'`)
	if err != nil {
		return run, err
	}
	var late, engineLate []time.Duration
	var first, last time.Time
	for rows.Next() {
		var off int64
		var fired, started time.Time
		var lateMs float64
		if err := rows.Scan(&off, &fired, &lateMs, &started); err != nil {
			return run, err
		}
		due := z.Add(time.Duration(off) * time.Microsecond)
		if started.After(due) {
			run.StartedLate++
			continue
		}
		late = append(late, fired.Sub(due))
		engineLate = append(engineLate, time.Duration(lateMs*float64(time.Millisecond)))
		if first.IsZero() || fired.Before(first) {
			first = fired
		}
		if fired.After(last) {
			last = fired
		}
	}
	if err := rows.Err(); err != nil {
		return run, err
	}
	if len(late) == 0 {
		return run, errors.New("no timer whose wait started before it was due")
	}
	slices.Sort(late)
	slices.Sort(engineLate)
	run.P50Ms, run.P99Ms, run.MaxMs = ms(percentile(late, 0.5)), ms(percentile(late, 0.99)), ms(late[len(late)-1])
	run.EngineP99Ms = ms(percentile(engineLate, 0.99))
	if d := last.Sub(first).Seconds(); d > 0 {
		run.FiredPerSec = float64(len(late)) / d
	}
	progress("timers rep %d: lateness p50 %.1f ms, p99 %.1f ms, max %.1f ms (%d started after due)", rep, run.P50Ms, run.P99Ms, run.MaxMs, run.StartedLate)
	return run, nil
}

// --- signals --------------------------------------------------------------

type signalled struct {
	Round int `json:"round"`
}

type ticket struct {
	id    uuid.UUID
	round int
}

// signalBench holds a pool of sagas, each awaiting signal "go" again and
// again; a signal's latency ends when the step after its wait starts.
type signalBench struct {
	e       *saga.Engine
	waiters sync.Map // ticket -> chan struct{}
	queue   chan ticket
	rounds  int
}

func (b *signalBench) signal(ctx context.Context) error {
	var t ticket
	select {
	case t = <-b.queue:
	default:
		return errors.New("the pool of waiting sagas is used up: raise -signal-pool or -signal-rounds")
	}
	ch := make(chan struct{})
	b.waiters.Store(t, ch)
	_, err := b.e.Signal(ctx, saga.Signal{SagaID: t.id, Name: "go", ID: fmt.Sprint(t.round)})
	if err != nil {
		b.waiters.Delete(t)
		return err
	}
	var werr error
	select {
	case <-ch:
	case <-ctx.Done():
		b.waiters.Delete(t)
		werr = ctx.Err()
	}
	// The signal was sent: the saga moves on to its next round either way.
	if t.round++; t.round < b.rounds {
		b.queue <- t
	}
	return werr
}

func benchSignals(ctx context.Context, o *waitsOpts, rep int) (SignalsRun, error) {
	run := SignalsRun{Rep: rep, Peak: map[string]float64{}, LoadAvg: loadAvg()}
	app := "bench-waits-signals-" + randomSuffix()
	pool, err := connect(ctx, app, o.Workers+16+4)
	if err != nil {
		return run, err
	}
	defer pool.Close()
	schema := "bench_wsig_" + randomSuffix()
	defer dropSchema(context.Background(), pool, schema)
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		return run, err
	}
	b := &signalBench{queue: make(chan ticket, o.SignalPool), rounds: o.SignalRounds}
	var steps []saga.Step[signalled]
	for r := range o.SignalRounds {
		steps = append(steps,
			saga.Step[signalled]{Name: fmt.Sprintf("wait-%d", r), Wait: saga.OnSignal("go",
				func(_ context.Context, _ *saga.StepRun, s *signalled, _ struct{}) error { s.Round = r; return nil })},
			saga.Step[signalled]{Name: fmt.Sprintf("next-%d", r), Action: func(_ context.Context, run *saga.StepRun, _ *signalled) error {
				if ch, ok := b.waiters.LoadAndDelete(ticket{run.SagaID, r}); ok {
					close(ch.(chan struct{}))
				}
				return nil
			}})
	}
	def := saga.Define("signalled", steps...)
	b.e, err = saga.New(pool, &saga.Config{Schema: schema, Workers: o.Workers, PollInterval: 50 * time.Millisecond, Logger: discard})
	if err != nil {
		return run, err
	}
	if err := b.e.Register(def); err != nil {
		return run, err
	}
	if err := startMany(ctx, pool, b.e, def, o.SignalPool, func(int) signalled { return signalled{} }); err != nil {
		return run, err
	}
	if err := b.e.Start(ctx); err != nil {
		return run, err
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = b.e.StopAndCancel(c)
		cancel()
	}()
	qs := pgx.Identifier{schema}.Sanitize()
	if _, err := pollCount(ctx, pool, `SELECT count(*) FROM `+qs+`.saga_instances WHERE wait_kind = 'signal'`, o.SignalPool, 5*time.Minute); err != nil {
		return run, err
	}
	rows, err := pool.Query(ctx, `SELECT id FROM `+qs+`.saga_instances`)
	if err != nil {
		return run, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return run, err
	}
	for _, id := range ids {
		b.queue <- ticket{id: id}
	}
	// settle waits until the previous load's signals are all handled: no
	// command is due.
	settle := func() error {
		_, err := pollCount(ctx, pool, `SELECT (count(*) = 0)::int FROM `+qs+`.outbox WHERE available_at <= now()`, 1, 2*time.Minute)
		return err
	}
	m := &meter{pool: pool, app: app}
	xw := watchXacts(ctx, pool)
	defer xw.end()
	for _, c := range strings.Split(o.SignalConcs, ",") {
		var conc int
		if _, err := fmt.Sscan(c, &conc); err != nil || conc < 1 {
			return run, fmt.Errorf("bad -signal-conc %q", o.SignalConcs)
		}
		ro := runOpts{Conc: conc, Warmup: time.Second, WarmupMax: 30 * time.Second, Window: o.Window, WindowMax: 15 * time.Second}
		var s Sample
		if err := settle(); err != nil {
			return run, err
		}
		if err := closedLoop(ctx, &ro, m, b.signal, &s); err != nil {
			return run, fmt.Errorf("peak at %d in flight: %w", conc, err)
		}
		rate := float64(s.Latency) / s.WallSeconds
		run.Peak[c] = rate
		run.ByConc = append(run.ByConc, ConcPoint{Conc: conc, PerSec: rate, P50Ms: s.P50Ms, P99Ms: s.P99Ms})
		progress("signals rep %d: %d in flight: %.0f signals/s, p50 %.1f ms, p99 %.1f ms", rep, conc, rate, s.P50Ms, s.P99Ms)
		if rate > run.PeakRate {
			run.PeakRate, run.PeakConc = rate, conc
		}
	}
	if err := settle(); err != nil {
		return run, err
	}
	ro := runOpts{Rate: run.PeakRate / 2, Warmup: 2 * time.Second, Window: o.HalfWindow}
	run.Offered = ro.Rate
	// Scans of the engine's claim index (claims and next-due look-ups) per
	// signal: the cost of waking every worker for each one.
	scans := func() int64 {
		var n int64
		_ = pool.QueryRow(ctx, `SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes
			WHERE schemaname = $1 AND indexrelname = 'outbox_direct_pending'`, schema).Scan(&n)
		return n
	}
	scans0 := scans()
	var s Sample
	if err := openLoop(ctx, &ro, m, b.signal, &s); err != nil {
		return run, fmt.Errorf("half of peak: %w", err)
	}
	time.Sleep(1500 * time.Millisecond) // backends report their statistics at most every second
	if s.Latency > 0 {
		run.ScansPerSignal = float64(scans()-scans0) / float64(run.Offered*(s.WarmupSeconds+s.WallSeconds))
	}
	run.Achieved = float64(s.Latency) / s.WallSeconds
	run.P50Ms, run.P99Ms, run.Count = s.P50Ms, s.P99Ms, s.Latency
	run.OldestXact = xw.end()
	// A signal that came before its saga was back at its wait: its
	// latency is not that of a waiting saga; count them.
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+qs+`.saga_signals g
		JOIN `+qs+`.saga_history w ON w.saga_id = g.saga_id AND w.event = 'wait_started' AND w.step_name = g.step_name
		WHERE g.created_at < w.at`).Scan(&run.NotWaiting); err != nil {
		return run, err
	}
	progress("signals rep %d: at %.0f/s offered (%.0f achieved): p50 %.1f ms, p99 %.1f ms, %d of all signals came before their wait started",
		rep, run.Offered, run.Achieved, run.P50Ms, run.P99Ms, run.NotWaiting)
	return run, nil
}

func printWaits(w io.Writer, r *WaitsReport) {
	fmt.Fprintf(w, "\nwaits benchmark, started %s, load average now %s\n", r.StartedAt, loadAvg())
	if len(r.Sleepers) > 0 {
		fmt.Fprintf(w, "\n| rep | sleepers | steps/s, empty | steps/s, with sleepers | ratio | saga p99 ms empty / sleepers | load avg | oldest xact s |\n|---:|---:|---:|---:|---:|---|---|---:|\n")
		for _, s := range r.Sleepers {
			fmt.Fprintf(w, "| %d | %d | %.0f | %.0f | %.2f | %.1f / %.1f | %s | %.0f |\n", s.Rep+1, s.Sleepers, s.EmptyStepsPerS, s.SleepStepsPerS, s.Ratio, s.EmptyP99Ms, s.SleepP99Ms, s.LoadAvgAtStart, s.OldestXactS)
		}
		var em, sl []float64
		for _, s := range r.Sleepers {
			em, sl = append(em, s.EmptyStepsPerS), append(sl, s.SleepStepsPerS)
		}
		me, msl := summarize(em), summarize(sl)
		if me.Median > 0 {
			fmt.Fprintf(w, "\nmedians over the repetitions: %.0f steps/s empty, %.0f with sleepers: ratio %.2f\n", me.Median, msl.Median, msl.Median/me.Median)
		}
		fmt.Fprintf(w, "\nfill: %.1f s to start, %.1f s until all asleep\n", r.Sleepers[0].FillSeconds, r.Sleepers[0].AsleepSeconds)
	}
	if len(r.Timers) > 0 {
		fmt.Fprintf(w, "\n| rep | timers | due per s | fired per s | late p50 ms | late p99 ms | late max ms | wait started after due | load avg | oldest xact s |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n")
		for _, t := range r.Timers {
			fmt.Fprintf(w, "| %d | %d | %.0f | %.0f | %.1f | %.1f | %.1f | %d | %s | %.0f |\n", t.Rep+1, t.Timers, t.Rate, t.FiredPerSec, t.P50Ms, t.P99Ms, t.MaxMs, t.StartedLate, t.LoadAvg, t.OldestXactS)
		}
	}
	if len(r.Signals) > 0 {
		fmt.Fprintf(w, "\n| rep | peak signals/s (in flight) | offered /s | achieved /s | p50 ms | p99 ms | signals in window | signalled before the wait (whole run) | claim-index scans per signal | load avg | oldest xact s |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n")
		var loops []string
		for _, s := range r.Signals {
			var cl []string
			for _, p := range s.ByConc {
				cl = append(cl, fmt.Sprintf("%d in flight: %.0f/s p50 %.1f p99 %.1f ms", p.Conc, p.PerSec, p.P50Ms, p.P99Ms))
			}
			loops = append(loops, fmt.Sprintf("rep %d closed loops: %s\n", s.Rep+1, strings.Join(cl, "; ")))
			fmt.Fprintf(w, "| %d | %.0f (%d) | %.0f | %.0f | %.1f | %.1f | %d | %d | %.1f | %s | %.0f |\n", s.Rep+1, s.PeakRate, s.PeakConc, s.Offered, s.Achieved, s.P50Ms, s.P99Ms, s.Count, s.NotWaiting, s.ScansPerSignal, s.LoadAvg, s.OldestXact)
		}
		fmt.Fprintf(w, "\n%s", strings.Join(loops, ""))
	}
}

// xactWatch samples, every second, the age of the oldest open transaction
// on the server, in any database. One open for long holds back the cleanup
// of every table: the outbox's consumed commands stay in its index, and
// each claim walks over them.
type xactWatch struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
	max  time.Duration
}

func watchXacts(ctx context.Context, pool *pgxpool.Pool) *xactWatch {
	w := &xactWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			var age time.Duration
			if err := pool.QueryRow(ctx, `SELECT coalesce(max(clock_timestamp() - xact_start), '0') FROM pg_stat_activity
				WHERE backend_xid IS NOT NULL OR backend_xmin IS NOT NULL`).Scan(&age); err == nil {
				w.max = max(w.max, age)
			}
			select {
			case <-w.stop:
				return
			case <-t.C:
			}
		}
	}()
	return w
}

// end stops the watch (once; later calls only read) and returns the
// oldest transaction's age seen, in seconds.
func (w *xactWatch) end() float64 {
	w.once.Do(func() { close(w.stop) })
	<-w.done
	return w.max.Seconds()
}
