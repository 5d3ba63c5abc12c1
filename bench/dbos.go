package main

import (
	"context"
	"fmt"
	"time"

	"github.com/dbos-inc/dbos-transact-golang/dbos"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// dbosMaxConns bounds the pool DBOS Transact runs its system database on:
// the same bound as the raw baseline's, beyond which two cores only queue.
const dbosMaxConns = 32

// dbosSystem is DBOS Transact Go (v1.8.0, the served release) on the same
// PostgreSQL: a workflow of three checkpointed steps, each appending its
// name to the workflow's state, which is what the saga's handlers do. DBOS
// runs a workflow in the process that starts it, records its status row at
// the start and each step's output after the step, and its result at the
// end; that is its durability, as the engine's is a transition per step.
type dbosSystem struct {
	pool   *pgxpool.Pool
	schema string
	ctx    dbos.Context
	m      *meter
}

// dbosState is the workflow's state, as the saga's.
type dbosState struct {
	OrderID string   `json:"order_id"`
	Done    []string `json:"done,omitempty"`
}

// dbosChain is the benchmark's workflow: three durable steps in a row.
func dbosChain(ctx dbos.Context, in dbosState) (dbosState, error) {
	st := in
	for _, name := range [...]string{"a", "b", "c"} {
		next, err := dbos.RunAsStep(ctx, func(context.Context) (dbosState, error) {
			s := st
			s.Done = append(append([]string(nil), st.Done...), name)
			return s, nil
		}, dbos.WithStepName(name))
		if err != nil {
			return st, err
		}
		st = next
	}
	return st, nil
}

func newDBOS(ctx context.Context, o *runOpts) (*dbosSystem, error) {
	app := "bench-dbos-" + randomSuffix()
	pool, err := connect(ctx, app, min(max(o.Conc, 1)+4, dbosMaxConns))
	if err != nil {
		return nil, err
	}
	d := &dbosSystem{pool: pool, schema: "bench_dbos_" + randomSuffix(), m: &meter{pool: pool, app: app}}
	d.ctx, err = dbos.NewContext(ctx, dbos.Config{
		AppName:        "bench-dbos",
		SystemDBPool:   pool,
		DatabaseSchema: d.schema,
		Logger:         discard,
	})
	if err != nil {
		d.close()
		return nil, fmt.Errorf("dbos: %w", err)
	}
	dbos.RegisterWorkflow(d.ctx, dbosChain)
	if err := dbos.Launch(d.ctx); err != nil {
		d.close()
		return nil, fmt.Errorf("dbos launch: %w", err)
	}
	return d, nil
}

func (d *dbosSystem) run(ctx context.Context) error {
	h, err := dbos.RunWorkflow(d.ctx, dbosChain, dbosState{OrderID: "x"},
		dbos.WithWorkflowID(uuid.Must(uuid.NewV7()).String()))
	if err != nil {
		return err
	}
	out, err := h.GetResult()
	if err != nil {
		return err
	}
	if len(out.Done) != 3 {
		return fmt.Errorf("dbos: workflow ended after %d steps, want 3", len(out.Done))
	}
	return ctx.Err()
}

func (d *dbosSystem) meter() *meter { return d.m }
func (d *dbosSystem) note() string {
	return fmt.Sprintf("DBOS Transact Go v1.8.0, RunWorkflow in process, 3 RunAsStep steps, pool=%d", d.pool.Config().MaxConns)
}

func (d *dbosSystem) close() {
	if d.ctx != nil {
		_ = dbos.Shutdown(d.ctx, 20*time.Second)
	}
	// DBOS closes the pool it was given when it shuts down, so the schema
	// is dropped on a connection of the bench's own (on the pool, the drop
	// failed unseen and every run left its schema behind).
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, databaseURL()); err == nil {
		_, _ = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{d.schema}.Sanitize()+" CASCADE")
		_ = conn.Close(ctx)
	}
	d.pool.Close()
}
