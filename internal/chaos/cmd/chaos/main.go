// Command chaos attacks a running sagaflow system and checks what survives:
// the crash-point matrix and the chaos soak of package internal/chaos, as
// `make chaos/matrix` and `make chaos` run them. Build it with
// -tags sagaflow_faults (the matrix needs it).
//
//	chaos soak   [-duration 5m] [-rate 15] [-engines 2] [-participants 2] [-seed 1] [-deadline 5m] [-bus kafka|nats]
//	chaos matrix [-seeds 3] [-parallel 2] [-points engine.after-commit,...] [-faults sigkill,...]
//
// Both end with the checkers' figures; the exit status is 1 when an
// invariant broke, 2 for bad usage.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sagaflow/sagaflow/internal/chaos"
	"github.com/sagaflow/sagaflow/internal/fault"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	switch os.Args[1] {
	case "node":
		os.Exit(node())
	case "soak":
		os.Exit(soak(os.Args[2:]))
	case "matrix":
		os.Exit(matrix(os.Args[2:]))
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: chaos soak|matrix [flags]   (chaos <command> -h for the flags)")
	os.Exit(2)
}

// nodeCmd runs this binary again as a node.
func nodeCmd() *exec.Cmd {
	self, err := os.Executable()
	if err != nil {
		self = os.Args[0]
	}
	return exec.Command(self, "node")
}

func node() int {
	cfg, err := chaos.NodeConfigFromEnv()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := chaos.RunNode(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "chaos node:", err)
		return 1
	}
	return 0
}

func workDir(dir string) (string, func(), error) {
	if dir != "" {
		return dir, func() {}, os.MkdirAll(dir, 0o755)
	}
	d, err := os.MkdirTemp("", "sagaflow-chaos-")
	return d, func() { _ = os.RemoveAll(d) }, err
}

func soak(args []string) int {
	fs := flag.NewFlagSet("soak", flag.ExitOnError)
	duration := fs.Duration("duration", 5*time.Minute, "how long the attacks go on")
	rate := fs.Float64("rate", 15, "sagas started per second")
	engines := fs.Int("engines", 2, "engine nodes")
	participants := fs.Int("participants", 2, "participant nodes")
	seed := fs.Uint64("seed", uint64(time.Now().UnixNano()), "random seed (printed, to rerun)")
	deadline := fs.Duration("deadline", 5*time.Minute, "after the attacks, how long every saga has to end")
	keep := fs.String("dir", "", "keep the nodes' logs in this directory")
	bus := fs.String("bus", chaos.BusKafka, "the bus: kafka (an in-process broker) or nats (a throwaway nats-server with JetStream)")
	_ = fs.Parse(args)
	if *bus != chaos.BusKafka && *bus != chaos.BusNATS {
		fmt.Fprintf(os.Stderr, "chaos soak: -bus must be %s or %s, not %q\n", chaos.BusKafka, chaos.BusNATS, *bus)
		return 2
	}
	if *duration <= 0 || *rate <= 0 || *engines < 1 || *participants < 1 || *deadline <= 0 {
		fmt.Fprintln(os.Stderr, "chaos soak: -duration, -rate, -deadline must be positive and -engines, -participants at least 1")
		return 2
	}
	dir, cleanup, err := workDir(*keep)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos soak:", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "chaos soak: %s of attacks over %s, %.0f sagas/s, %d engines, %d participants, seed %d, logs in %s\n",
		*duration, *bus, *rate, *engines, *participants, *seed, dir)
	res, err := chaos.RunSoak(context.Background(), dir, nodeCmd, chaos.SoakConfig{
		Duration: *duration, Rate: *rate, Engines: *engines, Participants: *participants, Seed: *seed, Deadline: *deadline, Bus: *bus,
		Logf: func(format string, args ...any) {
			fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
		},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos soak:", err)
		fmt.Fprint(os.Stderr, chaos.LogTails(dir, 30))
		return 1
	}
	rep := res.Report
	fmt.Printf("attacks: %s (in %s)\n", res.ActionsLine(), res.Duration.Round(time.Second))
	fmt.Println(rep.Detail())
	fmt.Println(rep.WaitLine())
	fmt.Println(rep.PoisonLine())
	for _, v := range rep.Violations {
		fmt.Println("  " + v)
	}
	for _, f := range rep.Failures {
		fmt.Println("  " + f)
	}
	for _, b := range rep.BusState {
		fmt.Println("  " + b)
	}
	fmt.Println(rep.Line())
	if !rep.OK() {
		fmt.Fprintf(os.Stderr, "chaos soak: invariants broken (logs kept in %s)\n", dir)
		return 1
	}
	cleanup()
	return 0
}

func matrix(args []string) int {
	fs := flag.NewFlagSet("matrix", flag.ExitOnError)
	seeds := fs.Int("seeds", 3, "seeds per cell")
	parallel := fs.Int("parallel", 2, "cells run at once")
	points := fs.String("points", strings.Join(fault.Points, ","), "fault points, comma-separated")
	faults := fs.String("faults", strings.Join(chaos.Faults, ","), "faults, comma-separated")
	_ = fs.Parse(args)
	if !fault.Enabled {
		fmt.Fprintln(os.Stderr, "chaos matrix: build with -tags sagaflow_faults")
		return 2
	}
	for _, p := range strings.Split(*points, ",") {
		if !slices.Contains(fault.Points, p) {
			fmt.Fprintf(os.Stderr, "chaos matrix: unknown point %q (known: %s)\n", p, strings.Join(fault.Points, ", "))
			return 2
		}
	}
	for _, f := range strings.Split(*faults, ",") {
		if !slices.Contains(chaos.Faults, f) {
			fmt.Fprintf(os.Stderr, "chaos matrix: unknown fault %q (known: %s)\n", f, strings.Join(chaos.Faults, ", "))
			return 2
		}
	}
	cells := chaos.MatrixCells(strings.Split(*points, ","), strings.Split(*faults, ","), *seeds)
	if *parallel < 1 || len(cells) == 0 {
		fmt.Fprintln(os.Stderr, "chaos matrix: nothing to run")
		return 2
	}
	type outcome struct {
		res *chaos.CellResult
		err error
		dir string
	}
	out := make([]outcome, len(cells))
	sem := make(chan struct{}, *parallel)
	var wg sync.WaitGroup
	for i, c := range cells {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			dir, err := os.MkdirTemp("", "sagaflow-cell-")
			if err != nil {
				out[i] = outcome{err: err}
				return
			}
			res, err := chaos.RunCell(context.Background(), dir, nodeCmd, c)
			out[i] = outcome{res, err, dir}
			status := "ok"
			if err != nil || !res.Report.OK() {
				status = "FAILED"
			} else {
				_ = os.RemoveAll(dir)
			}
			fmt.Fprintf(os.Stderr, "%-45s %s\n", c, status)
		}()
	}
	wg.Wait()
	failed, total := 0, chaos.Report{}
	fmt.Printf("%-45s %4s %8s  %s\n", "cell", "hit", "settled", "figures")
	for i, o := range out {
		if o.err != nil {
			failed++
			fmt.Printf("%-45s ERROR %v (logs in %s)\n", cells[i], o.err, o.dir)
			continue
		}
		r := o.res.Report
		fmt.Printf("%-45s %4d %7.1fs  %s %s %s\n", cells[i], o.res.Hit, o.res.Settle.Seconds(), r.Line(), r.Detail(), r.WaitLine())
		if !r.OK() {
			failed++
			fmt.Printf("  invariants broken (logs in %s):\n    %s\n", o.dir, strings.Join(slices.Concat(r.Violations, r.Failures), "\n    "))
		}
		total.Sagas += r.Sagas
		total.Terminal += r.Terminal
		total.Lost += r.Lost
		total.DBEffectsDoubled += r.DBEffectsDoubled
		total.ExternalCallsDeduped += r.ExternalCallsDeduped
		total.Stuck += r.Stuck
		total.DeadLettered += r.DeadLettered
		total.PoisonInjected += r.PoisonInjected
		total.PoisonProcessed += r.PoisonProcessed
		total.Foreign += r.Foreign
		total.ForeignParked += r.ForeignParked
		total.Held += r.Held
		total.Cancels += r.Cancels
		total.Cancelled += r.Cancelled
		total.CancelRefused += r.CancelRefused
		total.DBErrors += r.DBErrors
		total.Parcels += r.Parcels
		total.ParcelsCompleted += r.ParcelsCompleted
		total.ParcelsCompensated += r.ParcelsCompensated
		total.ParcelsStuck += r.ParcelsStuck
		total.TimersFired += r.TimersFired
		total.TimerLateMax = max(total.TimerLateMax, r.TimerLateMax)
		total.SignalsReceived += r.SignalsReceived
		total.ChildrenEnded += r.ChildrenEnded
		total.WaitsDoubled += r.WaitsDoubled
		total.SignalsSent += r.SignalsSent
		total.SignalDuplicates += r.SignalDuplicates
		total.SignalsRejected += r.SignalsRejected
	}
	fmt.Printf("cells=%d failed=%d poison_injected=%d poison_processed=%d foreign=%d foreign_parked=%d held=%d cancels=%d cancelled=%d cancel_refused=%d db_errors=%d\n%s\n",
		len(cells), failed, total.PoisonInjected, total.PoisonProcessed, total.Foreign, total.ForeignParked, total.Held,
		total.Cancels, total.Cancelled, total.CancelRefused, total.DBErrors, total.Line())
	fmt.Println(total.WaitLine())
	if failed > 0 {
		return 1
	}
	return 0
}
