package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// order is the saga's state, as in saga/bench_test.go: the handlers append
// their step's name.
type order struct {
	OrderID string   `json:"order_id"`
	Done    []string `json:"done,omitempty"`
}

// benchSagaName names the benchmark's saga (and, in Kafka mode, its topic).
const benchSagaName = "bench"

// sagaflowWorkers is the engine's Workers for a load of conc sagas in
// flight: saga/bench_test.go found 8 the best on this machine.
func sagaflowWorkers(conc int) int { return min(max(conc, 1), 8) }

// kafkaPartitions of the command topic in Kafka mode: one per worker.
const kafkaPartitions = 8

type sagaflowSystem struct {
	pool    *pgxpool.Pool
	schema  string
	fresh   bool
	engine  *saga.Engine
	def     *saga.Definition[order]
	done    sync.Map // saga id -> chan struct{}
	m       *meter
	workers int
	// Kafka mode.
	broker *broker
	relay  *relay.Relay
	writer interface{ Close() error }
}

func newSagaflow(ctx context.Context, o *runOpts, kafkaMode bool) (*sagaflowSystem, error) {
	return newSagaflowWith(ctx, o, kafkaMode, nil)
}

// newSagaflowWith is newSagaflow with more definitions registered beside the
// benchmark's saga (the sleepers of the waits benchmark), so that the
// engine knows every saga in its schema.
func newSagaflowWith(ctx context.Context, o *runOpts, kafkaMode bool, extra []saga.AnyDefinition) (*sagaflowSystem, error) {
	app := "bench-" + o.System + "-" + randomSuffix()
	workers := sagaflowWorkers(o.Conc)
	pool, err := connect(ctx, app, workers+min(max(o.Conc, 1), 16)+4)
	if err != nil {
		return nil, err
	}
	s := &sagaflowSystem{pool: pool, schema: o.Schema, m: &meter{pool: pool, app: app}, workers: workers}
	if s.schema == "" {
		s.schema, s.fresh = "bench_"+randomSuffix(), true
		if _, err := migrations.Migrate(ctx, pool, s.schema); err != nil {
			s.close()
			return nil, fmt.Errorf("migrate: %w", err)
		}
	}
	cfg := &saga.Config{
		Schema:       s.schema,
		Workers:      workers,
		PollInterval: 50 * time.Millisecond, // as saga/bench_test.go
		Logger:       discard,
	}
	if kafkaMode {
		s.broker, err = startBroker(ctx, kafkaPartitions, saga.CommandTopicDefault+"."+benchSagaName)
		if err != nil {
			s.close()
			return nil, err
		}
		cfg.Kafka = &saga.KafkaConfig{Brokers: s.broker.addrs, AllSteps: true} // Kafka mode
		w := relay.NewKafkaWriter(s.broker.addrs, nil)
		s.writer = w
		s.relay, err = relay.New(pool, w, &relay.Config{Schema: s.schema, PollInterval: 50 * time.Millisecond, Logger: discard})
		if err != nil {
			s.close()
			return nil, err
		}
	}
	s.engine, err = saga.New(pool, cfg)
	if err != nil {
		s.close()
		return nil, err
	}
	step := func(last bool) saga.StepFunc[order] {
		return func(_ context.Context, run *saga.StepRun, st *order) error {
			st.Done = append(st.Done, run.Step)
			if last {
				if ch, ok := s.done.LoadAndDelete(run.SagaID); ok {
					close(ch.(chan struct{}))
				}
			}
			return nil
		}
	}
	s.def = saga.Define(benchSagaName,
		saga.Step[order]{Name: "a", Action: step(false)},
		saga.Step[order]{Name: "b", Action: step(false)},
		saga.Step[order]{Name: "c", Action: step(true)},
	)
	if err := s.engine.Register(append([]saga.AnyDefinition{s.def}, extra...)...); err != nil {
		s.close()
		return nil, err
	}
	if s.relay != nil {
		if err := s.relay.Start(ctx); err != nil {
			s.close()
			return nil, err
		}
	}
	if err := s.engine.Start(ctx); err != nil {
		s.engine = nil
		s.close()
		return nil, err
	}
	return s, nil
}

func (s *sagaflowSystem) run(ctx context.Context) error {
	id := uuid.Must(uuid.NewV7())
	ch := make(chan struct{})
	s.done.Store(id, ch)
	if _, err := saga.Start(ctx, s.engine, s.def, order{OrderID: "x"}, &saga.StartOpts{ID: id}); err != nil {
		s.done.Delete(id)
		return err
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		s.done.Delete(id)
		return ctx.Err()
	}
}

func (s *sagaflowSystem) meter() *meter { return s.m }

func (s *sagaflowSystem) note() string {
	n := fmt.Sprintf("workers=%d batch=%d", s.workers, saga.BatchSizeDefault)
	if s.broker != nil {
		n += "; broker " + s.broker.kind() + " in this process (its CPU counts as the process's)"
	}
	return n
}

func (s *sagaflowSystem) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if s.engine != nil {
		_ = s.engine.StopAndCancel(ctx)
	}
	if s.relay != nil {
		_ = s.relay.StopAndCancel(ctx)
	}
	if s.writer != nil {
		_ = s.writer.Close()
	}
	if s.broker != nil {
		s.broker.close()
	}
	if s.fresh {
		dropSchema(ctx, s.pool, s.schema)
	}
	s.pool.Close()
}
