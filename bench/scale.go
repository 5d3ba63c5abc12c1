package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// The scale benchmark (issue #17, docs/scaling.md): how several engine
// processes share one database. A backlog of 3-step sagas is written to one
// schema; then 1, 2 or 4 engine processes (this binary, `bench scale-node`)
// are started on it at once, with the workers split between them, and the
// time until every saga has completed gives steps/s. Each count is run on a
// fresh schema, the counts interleaved over the repetitions.

type scaleOpts struct {
	Procs   string
	Sagas   int
	Workers int
	Reps    int
	Out     string
}

// ScalePoint is one drain by procs processes.
type ScalePoint struct {
	Procs       int     `json:"processes"`
	Rep         int     `json:"rep"`
	Sagas       int     `json:"sagas"`
	Seconds     float64 `json:"seconds"`
	StepsPerSec float64 `json:"steps_per_s"`
	// CPU of the engine processes (user + system), per 1,000 steps.
	CPUPerK float64 `json:"engine_cpu_s_per_1000_steps"`
	// CPU of every PostgreSQL process of the server during the drain, per
	// 1,000 steps, and the steps/s one core of it carries at that cost.
	PGCPUPerK      float64 `json:"postgres_cpu_s_per_1000_steps"`
	StepsPerPGCore float64 `json:"steps_per_s_per_postgres_core"`
	LoadAvg        string  `json:"load_avg_at_start"`
}

func scaleMain(args []string) error {
	fs := flag.NewFlagSet("scale", flag.ExitOnError)
	var o scaleOpts
	fs.StringVar(&o.Procs, "procs", "1,2,4", "engine processes to drain with")
	fs.IntVar(&o.Sagas, "sagas", 20000, "sagas in the backlog of each drain")
	fs.IntVar(&o.Workers, "workers", 8, "engine workers in all, split between the processes")
	fs.IntVar(&o.Reps, "reps", 2, "repetitions")
	fs.StringVar(&o.Out, "out", "", "write the points as JSON here")
	_ = fs.Parse(args)
	procs, err := splitInts(o.Procs)
	if err != nil || len(procs) == 0 || o.Sagas < 1 || o.Workers < 1 || o.Reps < 1 {
		return fmt.Errorf("scale: bad flags (procs %q, sagas %d, workers %d, reps %d)", o.Procs, o.Sagas, o.Workers, o.Reps)
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var points []ScalePoint
	for rep := range o.Reps {
		for _, n := range procs {
			p, err := scaleDrain(ctx, self, &o, n, rep)
			if err != nil {
				return fmt.Errorf("scale: %d processes: %w", n, err)
			}
			progress("scale rep %d: %d processes: %d sagas in %.1f s: %.0f steps/s, engine CPU %.2f s per 1000 steps",
				rep, n, p.Sagas, p.Seconds, p.StepsPerSec, p.CPUPerK)
			points = append(points, p)
		}
	}
	fmt.Println("\n| processes | workers each | rep | sagas | drain s | steps/s | engine CPU s / 1000 steps | PostgreSQL CPU s / 1000 steps | steps/s per PostgreSQL core | load avg at start |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
	for _, p := range points {
		fmt.Printf("| %d | %d | %d | %d | %.1f | %.0f | %.2f | %.2f | %.0f | %s |\n", p.Procs, max(o.Workers/p.Procs, 1), p.Rep+1, p.Sagas, p.Seconds,
			p.StepsPerSec, p.CPUPerK, p.PGCPUPerK, p.StepsPerPGCore, p.LoadAvg)
	}
	if o.Out != "" {
		b, _ := json.MarshalIndent(points, "", "  ")
		return os.WriteFile(o.Out, b, 0o644)
	}
	return nil
}

func scaleDrain(ctx context.Context, self string, o *scaleOpts, procs, rep int) (ScalePoint, error) {
	p := ScalePoint{Procs: procs, Rep: rep, Sagas: o.Sagas, LoadAvg: loadAvg()}
	app := "bench-scale-" + randomSuffix()
	pool, err := connect(ctx, app, 8)
	if err != nil {
		return p, err
	}
	defer pool.Close()
	schema := "bench_scale_" + randomSuffix()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		return p, err
	}
	defer dropSchema(context.Background(), pool, schema)
	// The starter registers the definition but is never started: the
	// backlog waits for the node processes.
	e, err := saga.New(pool, &saga.Config{Schema: schema, Logger: discard})
	if err != nil {
		return p, err
	}
	def := scaleDefinition()
	if err := e.Register(def); err != nil {
		return p, err
	}
	if err := startMany(ctx, pool, e, def, o.Sagas, func(int) order { return order{OrderID: "x"} }); err != nil {
		return p, err
	}
	workers := max(o.Workers/procs, 1)
	var cmds []*exec.Cmd
	defer func() {
		for _, c := range cmds {
			_ = c.Process.Signal(syscall.SIGTERM)
			_ = c.Wait()
		}
	}()
	pg0 := postgresTicks()
	began := time.Now()
	for range procs {
		c := exec.CommandContext(ctx, self, "scale-node", "-schema", schema, "-workers", strconv.Itoa(workers))
		c.Stdout, c.Stderr = io.Discard, os.Stderr
		c.Cancel = func() error { return c.Process.Signal(syscall.SIGTERM) }
		if err := c.Start(); err != nil {
			return p, err
		}
		cmds = append(cmds, c)
	}
	qs := pgx.Identifier{schema}.Sanitize()
	if _, err := pollCount(ctx, pool, `SELECT count(*) FROM `+qs+`.saga_instances WHERE status = 'completed'`, o.Sagas, 10*time.Minute); err != nil {
		return p, err
	}
	p.Seconds = time.Since(began).Seconds()
	if pgTicks := postgresTicks() - pg0; pgTicks > 0 {
		p.PGCPUPerK = float64(pgTicks) / clockTicks / float64(3*o.Sagas) * 1000
		p.StepsPerPGCore = 1000 / p.PGCPUPerK
	}
	p.StepsPerSec = float64(3*o.Sagas) / p.Seconds
	var ticks int64
	for _, c := range cmds {
		t, _ := procTicks(c.Process.Pid)
		ticks += t
	}
	p.CPUPerK = float64(ticks) / clockTicks / float64(3*o.Sagas) * 1000
	return p, nil
}

// scaleDefinition is the benchmark's 3-step saga without a completion
// callback: the drain is observed in the database.
func scaleDefinition() *saga.Definition[order] {
	step := func(_ context.Context, run *saga.StepRun, st *order) error {
		st.Done = append(st.Done, run.Step)
		return nil
	}
	return saga.Define(benchSagaName,
		saga.Step[order]{Name: "a", Action: step},
		saga.Step[order]{Name: "b", Action: step},
		saga.Step[order]{Name: "c", Action: step},
	)
}

// scaleNodeMain is one engine process of the scale benchmark: it runs the
// schema's sagas until SIGTERM.
func scaleNodeMain(args []string) error {
	fs := flag.NewFlagSet("scale-node", flag.ExitOnError)
	schema := fs.String("schema", "", "the schema to run")
	workers := fs.Int("workers", 8, "engine workers")
	_ = fs.Parse(args)
	if !strings.HasPrefix(*schema, "bench_scale_") {
		return errors.New("scale-node: -schema must be a scale benchmark's schema")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := connect(ctx, "bench-scale-node-"+randomSuffix(), *workers+4)
	if err != nil {
		return err
	}
	defer pool.Close()
	e, err := saga.New(pool, &saga.Config{Schema: *schema, Workers: *workers, PollInterval: 50 * time.Millisecond, Logger: discard})
	if err != nil {
		return err
	}
	if err := e.Register(scaleDefinition()); err != nil {
		return err
	}
	if err := e.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return e.Stop(sctx)
}

// postgresTicks sums the CPU ticks of every process named postgres on this
// machine (the server the benchmark uses must be local, and otherwise idle).
func postgresTicks() int64 {
	var sum int64
	procs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, c := range procs {
		b, err := os.ReadFile(c)
		if err != nil || strings.TrimSpace(string(b)) != "postgres" {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(c))); err == nil {
			if t, ok := procTicks(pid); ok {
				sum += t
			}
		}
	}
	return sum
}
