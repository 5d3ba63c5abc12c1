package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// The hybrid workload: the same 3-step saga, whose second step is remote,
// served by a participant in another schema (another service) over Kafka;
// the first and third run locally. In the hybrid mode only the remote
// command and its reply cross the broker.
const (
	hybridTopic   = "bench.remote.commands"
	hybridCommand = "bench.remote.b"
	// hybridCommandC is step c's command when it is remote too
	// (sagaflow-hybrid-2remote).
	hybridCommandC = "bench.remote.c"
	// hybridParts partitions the participant's command topic and the
	// engine's reply topic.
	hybridParts = 8
)

type hybridSystem struct {
	pool      *pgxpool.Pool
	orders    string // the engine's schema
	service   string // the participant's schema
	engine    *saga.Engine
	def       *saga.Definition[order]
	done      sync.Map
	m         *meter
	workers   int
	broker    *broker
	relays    []*relay.Relay
	writers   []*kafka.Writer
	readers   []*kafka.Reader
	stopInbox context.CancelFunc
	inboxDone chan error
	remoteC   bool
}

// newHybrid starts the hybrid workload; with remoteC, step c is remote too,
// sent right after b's reply.
func newHybrid(ctx context.Context, o *runOpts, remoteC bool) (*hybridSystem, error) {
	app := "bench-" + o.System + "-" + randomSuffix()
	workers := sagaflowWorkers(o.Conc)
	pool, err := connect(ctx, app, 2*workers+min(max(o.Conc, 1), 16)+8)
	if err != nil {
		return nil, err
	}
	h := &hybridSystem{pool: pool, orders: "bench_" + randomSuffix(), service: "bench_svc_" + randomSuffix(),
		m: &meter{pool: pool, app: app}, workers: workers, remoteC: remoteC}
	fail := func(err error) (*hybridSystem, error) {
		h.close()
		return nil, err
	}
	for _, schema := range []string{h.orders, h.service} {
		if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
			return fail(fmt.Errorf("migrate: %w", err))
		}
	}
	replyTopic := saga.CommandTopicDefault + "." + benchSagaName + ".replies"
	if h.broker, err = startBroker(ctx, hybridParts, hybridTopic, replyTopic); err != nil {
		return fail(err)
	}
	// A relay per service: the engine's publishes the remote commands, the
	// participant's its replies.
	for _, schema := range []string{h.orders, h.service} {
		w := relay.NewKafkaWriter(h.broker.addrs, nil)
		h.writers = append(h.writers, w)
		r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: discard})
		if err != nil {
			return fail(err)
		}
		h.relays = append(h.relays, r)
	}
	// The participant: its handler runs in the inbox's transaction and
	// replies through its own outbox.
	p, err := participant.New(pool, &participant.Config{Consumer: "bench-svc", Schema: h.service, Logger: discard})
	if err != nil {
		return fail(err)
	}
	for _, typ := range []string{hybridCommand, hybridCommandC} {
		if err := participant.Handle(p, typ, func(_ context.Context, _ pgx.Tx, c participant.Call[order]) (order, error) {
			st := c.Command
			st.Done = append(st.Done, c.Key.Step)
			return st, nil
		}); err != nil {
			return fail(err)
		}
	}
	var consumers []*inbox.Consumer
	for range workers {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: h.broker.addrs, GroupID: "bench-svc", Topic: hybridTopic, MinBytes: 1,
			MaxBytes: 10 << 20, MaxWait: 250 * time.Millisecond, StartOffset: kafka.FirstOffset, CommitInterval: 0})
		h.readers = append(h.readers, r)
		c, err := p.Inbox().NewConsumer(r, &inbox.ConsumerConfig{Handlers: p.Handlers(), BatchSize: 16,
			Queued: func() int { return int(r.Stats().QueueLength) }})
		if err != nil {
			return fail(err)
		}
		consumers = append(consumers, c)
	}
	h.engine, err = saga.New(pool, &saga.Config{
		Schema: h.orders, Workers: workers, PollInterval: 50 * time.Millisecond, Logger: discard,
		Kafka: &saga.KafkaConfig{Brokers: h.broker.addrs}, // the hybrid mode
	})
	if err != nil {
		return fail(err)
	}
	local := func(last bool) saga.StepFunc[order] {
		return func(_ context.Context, run *saga.StepRun, st *order) error {
			st.Done = append(st.Done, run.Step)
			if last {
				if ch, ok := h.done.LoadAndDelete(run.SagaID); ok {
					close(ch.(chan struct{}))
				}
			}
			return nil
		}
	}
	remote := func(name, typ string, last bool) saga.Step[order] {
		return saga.Step[order]{Name: name, Remote: &saga.Remote[order]{Topic: hybridTopic, Type: typ,
			Command: func(_ context.Context, _ *saga.StepRun, st *order) (any, error) { return st, nil },
			OnReply: func(_ context.Context, run *saga.StepRun, st *order, result json.RawMessage) error {
				if len(result) == 0 {
					return errors.New("empty reply")
				}
				st.Done = append(st.Done, name)
				if last {
					if ch, ok := h.done.LoadAndDelete(run.SagaID); ok {
						close(ch.(chan struct{}))
					}
				}
				return nil
			}}}
	}
	c := saga.Step[order]{Name: "c", Action: local(true)}
	if remoteC {
		c = remote("c", hybridCommandC, true)
	}
	h.def = saga.Define(benchSagaName, saga.Step[order]{Name: "a", Action: local(false)}, remote("b", hybridCommand, false), c)
	if err := h.engine.Register(h.def); err != nil {
		return fail(err)
	}
	for _, r := range h.relays {
		if err := r.Start(ctx); err != nil {
			return fail(err)
		}
	}
	inboxCtx, stop := context.WithCancel(context.Background())
	h.stopInbox, h.inboxDone = stop, make(chan error, len(consumers))
	for _, c := range consumers {
		go func() { h.inboxDone <- c.Run(inboxCtx) }()
	}
	if err := h.engine.Start(ctx); err != nil {
		h.engine = nil
		return fail(err)
	}
	return h, nil
}

func (h *hybridSystem) run(ctx context.Context) error {
	id := uuid.Must(uuid.NewV7())
	ch := make(chan struct{})
	h.done.Store(id, ch)
	if _, err := saga.Start(ctx, h.engine, h.def, order{OrderID: "x"}, &saga.StartOpts{ID: id}); err != nil {
		h.done.Delete(id)
		return err
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		h.done.Delete(id)
		return ctx.Err()
	}
}

func (h *hybridSystem) meter() *meter { return h.m }

func (h *hybridSystem) note() string {
	steps := "steps a and c local, b remote"
	if h.remoteC {
		steps = "step a local, b and c remote"
	}
	return fmt.Sprintf("hybrid mode: %s (a participant in another schema, %d inbox consumers); workers=%d; two relays; broker %s in this process",
		steps, len(h.readers), h.workers, h.broker.kind())
}

func (h *hybridSystem) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if h.engine != nil {
		_ = h.engine.StopAndCancel(ctx)
	}
	if h.stopInbox != nil {
		h.stopInbox()
		for range h.readers {
			<-h.inboxDone
		}
	}
	for _, r := range h.readers {
		_ = r.Close()
	}
	for _, r := range h.relays {
		_ = r.StopAndCancel(ctx)
	}
	for _, w := range h.writers {
		_ = w.Close()
	}
	if h.broker != nil {
		h.broker.close()
	}
	dropSchema(ctx, h.pool, h.orders)
	dropSchema(ctx, h.pool, h.service)
	h.pool.Close()
}
