package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/google/uuid"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/log"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"
)

// temporalCLIVersion is the Temporal CLI the benchmark builds with go
// install (see install-temporal.sh): the newest release the module proxy
// serves that builds with go install (v1.9.1's go.mod has a replace
// directive, which go install refuses).
const temporalCLIVersion = "v1.5.1"

const temporalTaskQueue = "bench"

// temporalPragmasDefault puts the dev server's SQLite in WAL mode with
// normal synchronisation: what anyone running Temporal on SQLite for
// throughput sets. It leans in Temporal's favour: with synchronous=normal
// SQLite does not flush the WAL at each commit, where the PostgreSQL the
// other systems use does (synchronous_commit=on). The dev server's own
// defaults are available with -temporal-sqlite-pragmas "".
const temporalPragmasDefault = "journal_mode=wal,synchronous=normal"

// defaultTemporalBin is bench/.bin/temporal next to the sources, or
// temporal on PATH.
func defaultTemporalBin() string {
	if wd, err := os.Getwd(); err == nil {
		p := filepath.Join(wd, ".bin", "temporal")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("temporal"); err == nil {
		return p
	}
	return filepath.Join(".bin", "temporal")
}

// devServer is `temporal server start-dev`, its state in SQLite in a
// temporary file.
type devServer struct {
	cmd    *exec.Cmd
	dir    string
	addr   string
	stderr bytes.Buffer
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startDevServer(ctx context.Context, bin, pragmas string) (*devServer, error) {
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("temporal CLI not found at %s (build it with bench/install-temporal.sh): %w", bin, err)
	}
	dir, err := os.MkdirTemp("", "bench-temporal-")
	if err != nil {
		return nil, err
	}
	var ports [4]int
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return nil, err
		}
	}
	d := &devServer{dir: dir, addr: "127.0.0.1:" + strconv.Itoa(ports[0])}
	args := []string{"server", "start-dev",
		"--headless",
		"--ip", "127.0.0.1",
		"--port", strconv.Itoa(ports[0]),
		"--http-port", strconv.Itoa(ports[1]),
		"--metrics-port", strconv.Itoa(ports[2]),
		"--ui-port", strconv.Itoa(ports[3]),
		"--db-filename", filepath.Join(dir, "temporal.db"),
		"--log-level", "error",
	}
	for _, p := range splitList(pragmas) {
		args = append(args, "--sqlite-pragma", p)
	}
	d.cmd = exec.Command(bin, args...)
	d.cmd.Stdout = &d.stderr
	d.cmd.Stderr = &d.stderr
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	return d, nil
}

func (d *devServer) pid() int { return d.cmd.Process.Pid }

func (d *devServer) stop() {
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-done
	}
	_ = os.RemoveAll(d.dir)
}

// temporalStep is the workflow's activity: it appends its step's name.
func temporalStep(_ context.Context, st chainState, name string) (chainState, error) {
	st.Done = append(st.Done, name)
	return st, nil
}

// temporalSaga runs the three activities in order.
func temporalSaga(ctx workflow.Context, st chainState) (chainState, error) {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: time.Minute})
	for _, name := range []string{"a", "b", "c"} {
		if err := workflow.ExecuteActivity(ctx, "step", st, name).Get(ctx, &st); err != nil {
			return st, err
		}
	}
	return st, nil
}

type temporalSystem struct {
	server *devServer
	client client.Client
	worker worker.Worker
	m      *meter
	// pragmas given to the dev server's SQLite.
	pragmas string
	// pollers of each task type.
	pollers int
}

func newTemporal(ctx context.Context, o *runOpts) (*temporalSystem, error) {
	app := "bench-temporal-" + randomSuffix()
	pool, err := connect(ctx, app, 2) // only to meter PostgreSQL's background processes alike
	if err != nil {
		return nil, err
	}
	srv, err := startDevServer(ctx, o.TemporalBin, o.TemporalPragmas)
	if err != nil {
		pool.Close()
		return nil, err
	}
	t := &temporalSystem{server: srv, m: &meter{pool: pool, app: app, serverPID: srv.pid()}, pragmas: o.TemporalPragmas}
	logger := log.NewStructuredLogger(discard)
	deadline := time.Now().Add(90 * time.Second)
	for {
		c, err := client.Dial(client.Options{HostPort: srv.addr, Namespace: "default", Logger: logger})
		if err == nil {
			if _, err = c.CheckHealth(ctx, &client.CheckHealthRequest{}); err == nil {
				t.client = c
				break
			}
			c.Close()
		}
		if time.Now().After(deadline) || srv.cmd.ProcessState != nil {
			t.close()
			return nil, fmt.Errorf("temporal dev server not ready after 90s: %v; its output: %s", err, tail(srv.stderr.String(), 800))
		}
		if !sleepCtx(ctx, 200*time.Millisecond) {
			t.close()
			return nil, ctx.Err()
		}
	}
	// The worker as a Temporal engineer would set it for this load: the
	// SDK's default of 2 pollers per task type caps a worker's intake
	// (each poll is a long-poll round trip to the server), so the pollers
	// grow with the load in flight, up to 8 each; the executors' defaults
	// (1,000 concurrent tasks) are already far above it.
	t.pollers = min(max(o.Conc/2, 2), 8)
	t.worker = worker.New(t.client, temporalTaskQueue, worker.Options{
		MaxConcurrentWorkflowTaskPollers: t.pollers,
		MaxConcurrentActivityTaskPollers: t.pollers,
	})
	t.worker.RegisterWorkflowWithOptions(temporalSaga, workflow.RegisterOptions{Name: "saga"})
	t.worker.RegisterActivityWithOptions(temporalStep, activity.RegisterOptions{Name: "step"})
	if err := t.worker.Start(); err != nil {
		t.worker = nil
		t.close()
		return nil, err
	}
	// One workflow end to end before anything is measured: the namespace
	// and the task queue exist, the worker polls.
	if err := t.run(ctx); err != nil {
		t.close()
		return nil, fmt.Errorf("first workflow: %w", err)
	}
	return t, nil
}

func (t *temporalSystem) run(ctx context.Context) error {
	run, err := t.client.ExecuteWorkflow(ctx, client.StartWorkflowOptions{
		ID:        uuid.Must(uuid.NewV7()).String(),
		TaskQueue: temporalTaskQueue,
	}, "saga", chainState{SagaID: "x"})
	if err != nil {
		return err
	}
	var out chainState
	if err := run.Get(ctx, &out); err != nil {
		return err
	}
	if len(out.Done) != 3 {
		return errors.New("temporal: workflow ended without its three steps")
	}
	return nil
}

func (t *temporalSystem) meter() *meter { return t.m }
func (t *temporalSystem) note() string {
	n := fmt.Sprintf("temporal server start-dev %s (SQLite file), SDK worker with %d workflow and %d activity task pollers", temporalCLIVersion, t.pollers, t.pollers)
	if t.pragmas != "" {
		n += "; SQLite pragmas " + t.pragmas
	}
	return n
}

// serverPeakMB is the dev server's peak resident set.
func (t *temporalSystem) serverPeakMB() float64 {
	return float64(procStatusKB(t.server.pid(), "VmHWM")) / 1024
}

func (t *temporalSystem) close() {
	if t.worker != nil {
		t.worker.Stop()
	}
	if t.client != nil {
		t.client.Close()
	}
	t.server.stop()
	t.m.pool.Close()
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
