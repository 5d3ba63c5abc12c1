package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cschleiden/go-workflows/backend"
	"github.com/cschleiden/go-workflows/backend/monoprocess"
	"github.com/cschleiden/go-workflows/backend/mysql"
	"github.com/cschleiden/go-workflows/backend/sqlite"
	"github.com/cschleiden/go-workflows/client"
	"github.com/cschleiden/go-workflows/worker"
	"github.com/cschleiden/go-workflows/workflow"
	_ "github.com/go-sql-driver/mysql" // the driver go-workflows' MySQL backend opens
	"github.com/google/uuid"
)

// go-workflows v1.2.0, the served release, has no PostgreSQL backend (its
// main branch has one, unreleased). Its MySQL backend cannot run on this
// machine's MariaDB 10.11: its task claim ends in "FOR UPDATE OF i SKIP
// LOCKED", MySQL 8 syntax that MariaDB refuses (error 1064), so no workflow
// ever starts. The benchmark therefore runs it on its SQLite backend (a file
// on disk in WAL mode, durable like the others) unless GOWORKFLOWS_MYSQL
// names a MySQL 8 server. Either way its figures compare engines on
// different databases, and the report's note says which.
const (
	gwVersion  = "v1.2.0"
	gwMaxConns = 32
)

// gwMySQL is the MySQL 8 server go-workflows runs on, GOWORKFLOWS_MYSQL
// (host:port, user root without a password); empty for SQLite.
func gwMySQL() (host string, port int, ok bool, err error) {
	addr := os.Getenv("GOWORKFLOWS_MYSQL")
	if addr == "" {
		return "", 0, false, nil
	}
	host, p, found := strings.Cut(addr, ":")
	n, err := strconv.Atoi(p)
	if !found || err != nil {
		return "", 0, false, fmt.Errorf("GOWORKFLOWS_MYSQL %q: want host:port", addr)
	}
	return host, n, true, nil
}

// gwState is the workflow's state, as the saga's.
type gwState struct {
	OrderID string   `json:"order_id"`
	Done    []string `json:"done,omitempty"`
}

// gwStep is the activity: it appends its step's name.
func gwStep(_ context.Context, st gwState, name string) (gwState, error) {
	st.Done = append(st.Done, name)
	return st, nil
}

// gwChain is the benchmark's workflow: three activities in a row, each
// recorded in the workflow's history before the next is scheduled.
func gwChain(ctx workflow.Context, st gwState) (gwState, error) {
	for _, name := range [...]string{"a", "b", "c"} {
		next, err := workflow.ExecuteActivity[gwState](ctx, workflow.DefaultActivityOptions, gwStep, st, name).Get(ctx)
		if err != nil {
			return st, err
		}
		st = next
	}
	return st, nil
}

type goWorkflowsSystem struct {
	db       string // MySQL database, or SQLite file
	mysql    bool
	admin    *sql.DB
	backend  backend.Backend
	worker   *worker.Worker
	client   *client.Client
	cancel   context.CancelFunc
	m        *meter
	pollers  int
	serverOK bool
}

func newGoWorkflows(ctx context.Context, o *runOpts) (*goWorkflowsSystem, error) {
	host, port, useMySQL, err := gwMySQL()
	if err != nil {
		return nil, err
	}
	app := "bench-goworkflows-" + randomSuffix()
	pool, err := connect(ctx, app, 2) // only to meter PostgreSQL's background processes alike
	if err != nil {
		return nil, err
	}
	g := &goWorkflowsSystem{mysql: useMySQL, m: &meter{pool: pool, app: app}}
	// The configuration go-workflows' own benchmark uses: the monoprocess
	// wrapper (a worker in the same process is told of new tasks instead of
	// waiting for its next poll); and, as a user tuning one process for
	// throughput would, more pollers and SingleWorkerMode.
	logger := backend.WithLogger(discard)
	if useMySQL {
		g.db = "bench_gw_" + randomSuffix()
		g.admin, err = sql.Open("mysql", fmt.Sprintf("root@tcp(%s:%d)/?parseTime=true&interpolateParams=true", host, port))
		if err != nil {
			g.close()
			return nil, err
		}
		if _, err := g.admin.ExecContext(ctx, "CREATE DATABASE "+g.db); err != nil {
			g.close()
			return nil, fmt.Errorf("go-workflows: create database on %s:%d: %w", host, port, err)
		}
		g.backend = monoprocess.NewMonoprocessBackend(mysql.NewMysqlBackend(host, port, "root", "", g.db,
			mysql.WithApplyMigrations(true), mysql.WithBackendOptions(logger),
			mysql.WithMySQLOptions(func(db *sql.DB) { db.SetMaxOpenConns(gwMaxConns) })))
	} else {
		dir, err := os.MkdirTemp("", "bench-goworkflows-")
		if err != nil {
			g.close()
			return nil, err
		}
		g.db = filepath.Join(dir, "bench.sqlite")
		g.backend = monoprocess.NewMonoprocessBackend(sqlite.NewSqliteBackend(g.db, sqlite.WithBackendOptions(logger)))
	}
	if useMySQL {
		if pid, ok := mariadbPID(); ok {
			g.m.serverPID, g.serverOK = pid, true
		}
	}
	g.pollers = min(max(o.Conc, 2), 8)
	opts := worker.DefaultOptions
	opts.WorkflowPollers, opts.ActivityPollers = g.pollers, g.pollers
	opts.SingleWorkerMode = true
	g.worker = worker.New(g.backend, &opts)
	if err := g.worker.RegisterWorkflow(gwChain); err != nil {
		g.close()
		return nil, err
	}
	if err := g.worker.RegisterActivity(gwStep); err != nil {
		g.close()
		return nil, err
	}
	wctx, cancel := context.WithCancel(context.Background())
	g.cancel = cancel
	if err := g.worker.Start(wctx); err != nil {
		g.close()
		return nil, err
	}
	g.client = client.New(g.backend)
	return g, nil
}

func (g *goWorkflowsSystem) run(ctx context.Context) error {
	inst, err := g.client.CreateWorkflowInstance(ctx, client.WorkflowInstanceOptions{
		InstanceID: uuid.Must(uuid.NewV7()).String(),
	}, gwChain, gwState{OrderID: "x"})
	if err != nil {
		return err
	}
	out, err := client.GetWorkflowResult[gwState](ctx, g.client, inst, time.Minute)
	if err != nil {
		return err
	}
	if len(out.Done) != 3 {
		return fmt.Errorf("go-workflows: workflow ended after %d steps, want 3", len(out.Done))
	}
	return nil
}

func (g *goWorkflowsSystem) meter() *meter { return g.m }
func (g *goWorkflowsSystem) note() string {
	store := "SQLite file in WAL mode (the release has no PostgreSQL backend; its MySQL backend's claim is MySQL 8 syntax this machine's MariaDB refuses)"
	if g.mysql {
		store = fmt.Sprintf("MySQL (%d connections; the release has no PostgreSQL backend)", gwMaxConns)
		if !g.serverOK {
			store += "; mysqld not found locally, its CPU is not counted"
		}
	}
	return fmt.Sprintf("go-workflows %s on %s, monoprocess backend, SingleWorkerMode, %d workflow and %d activity pollers",
		gwVersion, store, g.pollers, g.pollers)
}

func (g *goWorkflowsSystem) close() {
	if g.cancel != nil {
		g.cancel()
	}
	if g.worker != nil {
		_ = g.worker.WaitForCompletion()
	}
	if g.backend != nil {
		_ = g.backend.Close()
	}
	if g.admin != nil {
		_, _ = g.admin.Exec("DROP DATABASE IF EXISTS " + g.db)
		_ = g.admin.Close()
	}
	if !g.mysql && g.db != "" {
		_ = os.RemoveAll(filepath.Dir(g.db))
	}
	g.m.pool.Close()
}

// mariadbPID finds the local MySQL or MariaDB server's process, to count its CPU as
// the Temporal dev server's is counted.
func mariadbPID() (int, bool) {
	procs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		if name := strings.TrimSpace(string(b)); name == "mariadbd" || name == "mysqld" {
			pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			if err == nil {
				return pid, true
			}
		}
	}
	return 0, false
}
