package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// riverFetchCooldown is River's FetchCooldown in these runs. Its default
// (100 ms) caps how often a client fetches jobs and so a chain's pace; the
// minimum (1 ms) is what a user tuning it for throughput would choose.
const riverFetchCooldown = time.Millisecond

// riverMaxWorkers bounds the queue's MaxWorkers (and so the connections
// the job transactions hold).
const riverMaxWorkers = 32

// chainState is the River chain's state, carried in the job args: each job
// appends its step's name, as the saga's handlers do.
type chainState struct {
	SagaID string   `json:"saga_id"`
	Done   []string `json:"done,omitempty"`
}

type riverStepA struct{ chainState }
type riverStepB struct{ chainState }
type riverStepC struct{ chainState }

func (riverStepA) Kind() string { return "bench_step_a" }
func (riverStepB) Kind() string { return "bench_step_b" }
func (riverStepC) Kind() string { return "bench_step_c" }

// riverStep works job T: in one transaction it inserts the next job of the
// chain (if any) and completes this one, River's transactional completion.
type riverStep[T river.JobArgs] struct {
	river.WorkerDefaults[T]
	pool  *pgxpool.Pool
	name  string
	state func(T) chainState
	next  func(chainState) river.JobArgs // nil for the last step
	done  func(sagaID string)
}

func (w *riverStep[T]) Work(ctx context.Context, job *river.Job[T]) error {
	st := w.state(job.Args)
	st.Done = append(st.Done, w.name)
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if w.next != nil {
		if _, err := river.ClientFromContext[pgx.Tx](ctx).InsertTx(ctx, tx, w.next(st), nil); err != nil {
			return err
		}
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	if w.next == nil {
		w.done(st.SagaID)
	}
	return nil
}

type riverSystem struct {
	pool    *pgxpool.Pool
	schema  string
	client  *river.Client[pgx.Tx]
	done    sync.Map
	m       *meter
	workers int
	o       *runOpts
}

func newRiver(ctx context.Context, o *runOpts) (*riverSystem, error) {
	app := "bench-river-" + randomSuffix()
	workers := min(max(o.Conc, 1), riverMaxWorkers)
	pool, err := connect(ctx, app, workers+min(max(o.Conc, 1), 16)+4)
	if err != nil {
		return nil, err
	}
	r := &riverSystem{pool: pool, schema: "bench_river_" + randomSuffix(), m: &meter{pool: pool, app: app}, workers: workers, o: o}
	if err := createSchema(ctx, pool, r.schema); err != nil {
		pool.Close()
		return nil, err
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Schema: r.schema, Logger: discard})
	if err != nil {
		r.close()
		return nil, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		r.close()
		return nil, fmt.Errorf("river migrate: %w", err)
	}
	finish := func(id string) {
		if ch, ok := r.done.LoadAndDelete(id); ok {
			close(ch.(chan struct{}))
		}
	}
	workersReg := river.NewWorkers()
	river.AddWorker(workersReg, &riverStep[riverStepA]{pool: pool, name: "a",
		state: func(a riverStepA) chainState { return a.chainState },
		next:  func(s chainState) river.JobArgs { return riverStepB{s} }})
	river.AddWorker(workersReg, &riverStep[riverStepB]{pool: pool, name: "b",
		state: func(a riverStepB) chainState { return a.chainState },
		next:  func(s chainState) river.JobArgs { return riverStepC{s} }})
	river.AddWorker(workersReg, &riverStep[riverStepC]{pool: pool, name: "c",
		state: func(a riverStepC) chainState { return a.chainState },
		done:  finish})
	r.client, err = river.NewClient(riverpgxv5.New(pool), &river.Config{
		Schema:        r.schema,
		Queues:        map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: workers}},
		Workers:       workersReg,
		FetchCooldown: o.RiverCooldown,
		Logger:        discard,
	})
	if err != nil {
		r.close()
		return nil, err
	}
	if err := r.client.Start(ctx); err != nil {
		r.client = nil
		r.close()
		return nil, err
	}
	return r, nil
}

func (r *riverSystem) run(ctx context.Context) error {
	id := uuid.Must(uuid.NewV7()).String()
	ch := make(chan struct{})
	r.done.Store(id, ch)
	if _, err := r.client.Insert(ctx, riverStepA{chainState{SagaID: id}}, nil); err != nil {
		r.done.Delete(id)
		return err
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		r.done.Delete(id)
		return ctx.Err()
	}
}

func (r *riverSystem) meter() *meter { return r.m }
func (r *riverSystem) note() string {
	return fmt.Sprintf("MaxWorkers=%d FetchCooldown=%s", r.workers, r.o.RiverCooldown)
}

func (r *riverSystem) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if r.client != nil {
		_ = r.client.StopAndCancel(ctx)
	}
	dropSchema(ctx, r.pool, r.schema)
	r.pool.Close()
}
