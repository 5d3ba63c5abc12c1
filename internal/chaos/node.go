package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/transport/natsbus"
)

// Roles a node process can play.
const (
	RoleEngine        = "engine"         // the orders engine, in Kafka mode
	RoleParticipant   = "participant"    // the payments participant's consumer
	RoleRelayOrders   = "relay-orders"   // the relay of the orders outbox
	RoleRelayPayments = "relay-payments" // the relay of the payments outbox
	RoleSignals       = "signals"        // the signaller: sends the parcels' signals (needs RoleEngine)
)

// AllRoles is every role, for a node that runs the whole system.
var AllRoles = []string{RoleEngine, RoleParticipant, RoleRelayOrders, RoleRelayPayments, RoleSignals}

// SessionTimeout is the consumer groups' session timeout: how long a killed
// or paused node keeps its partitions.
const SessionTimeout = 2 * time.Second

// NodeConfig says what a node process runs and where.
type NodeConfig struct {
	DSN     string   `json:"dsn"`
	Brokers []string `json:"brokers"`
	Service string   `json:"service"` // base URL of the external service
	Roles   []string `json:"roles"`
	// Sabotage breaks the workload on purpose; empty for the real one.
	Sabotage string `json:"sabotage,omitempty"`
	// AllSteps runs the orders engine in Kafka mode instead of the hybrid
	// mode.
	AllSteps bool `json:"all_steps,omitempty"`
	// Bus is BusKafka (the default: Brokers) or BusNATS (NATSURL): the
	// relays write with natsbus.Writer, the engine's replies and the
	// participant's commands are read with natsbus.Reader.
	Bus     string `json:"bus,omitempty"`
	NATSURL string `json:"nats_url,omitempty"`
	// HeldFile, over NATS, is where the node keeps the list of the
	// messages its readers fetched and have not committed, for the
	// parent to kill it while it holds some.
	HeldFile string `json:"held_file,omitempty"`
}

// SabotageEffectsOutsideTx makes the local steps write their ledger rows
// outside the step's transaction, the classic dual write: a crash after the
// write and before the step commits runs the step again and doubles the
// effect. A negative control: the checkers must report it.
const SabotageEffectsOutsideTx = "effects-outside-tx"

// SabotageNoSigning runs the engine and the participant without signing:
// anyone who can write to a topic can then steer sagas, and the forged
// messages among the poison have effects. A negative control: the checkers
// must report forgeries that were not refused.
const SabotageNoSigning = "no-signing"

// SabotageLostWakeUp makes the signaller delete each signal's wake-up
// command in the signal's own transaction, as an engine that skipped the
// wake-up would. The rescuer wakes such a parcel again once its signal has
// been pending for RescueSlack (RescueResult.Woken): a positive control,
// the checkers must report none stuck.
const SabotageLostWakeUp = "lost-wake-up"

// SabotageLostSignal makes the signaller delete each signal, with its
// wake-up, in the signal's own transaction, as an engine that lost it
// would: a parcel that waits for it never gets it. A negative control: the
// checkers must report those parcels as stuck.
const SabotageLostSignal = "lost-signal"

// NodeEnv carries a node's NodeConfig, as JSON, to a node process.
const NodeEnv = "SAGAFLOW_CHAOS_NODE"

// NodeConfigFromEnv reads the NodeConfig a parent gave this process.
func NodeConfigFromEnv() (NodeConfig, error) {
	var c NodeConfig
	raw := os.Getenv(NodeEnv)
	if raw == "" {
		return c, fmt.Errorf("chaos: %s is not set", NodeEnv)
	}
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		return c, fmt.Errorf("chaos: %s: %w", NodeEnv, err)
	}
	return c, nil
}

// EngineConfig is the orders engine's configuration, the same in every node
// and in the parent (which only starts and cancels sagas with it): the
// hybrid mode, or Kafka mode with allSteps. Commands and replies are signed
// (see [SigningKey]).
func EngineConfig(brokers []string, log *slog.Logger, allSteps bool) *saga.Config {
	return &saga.Config{
		Schema: OrdersSchema, Workers: 2, PollInterval: 200 * time.Millisecond,
		RescueInterval: time.Second, RescueSlack: 500 * time.Millisecond, HandlerGrace: 2 * time.Second,
		UnknownSagaGrace: UnknownSagaGrace, Logger: log,
		Kafka: &saga.KafkaConfig{Brokers: brokers, SessionTimeout: SessionTimeout, SigningKey: SigningKey, AllSteps: allSteps},
	}
}

// NewPool connects to dsn with settings that notice a restarted server soon.
func NewPool(ctx context.Context, dsn string, size int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = size
	cfg.HealthCheckPeriod = time.Second
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	return pgxpool.NewWithConfig(ctx, cfg)
}

// RunNode runs the roles of cfg until ctx ends, then stops them.
func RunNode(ctx context.Context, cfg NodeConfig) error {
	if err := fault.Err(); err != nil {
		return err
	}
	level := slog.LevelWarn
	if os.Getenv("SAGAFLOW_CHAOS_DEBUG") != "" {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	pool, err := NewPool(ctx, cfg.DSN, 12)
	if err != nil {
		return err
	}
	defer pool.Close()
	pid := os.Getpid()
	x := External{URL: cfg.Service, Client: &http.Client{Timeout: 5 * time.Second}}
	var stops []func(context.Context) error
	if err := checkBus(cfg.Bus, cfg.AllSteps); err != nil {
		return err
	}
	var js jetstream.JetStream
	held := newHeldLog(cfg.HeldFile)
	if cfg.Bus == BusNATS {
		nc, j, err := ConnectNATS(cfg.NATSURL, fmt.Sprintf("chaos-node-%d", pid))
		if err != nil {
			return err
		}
		defer nc.Close()
		js = j
	}
	// newReader is a member of group consuming topics from the bus.
	newReader := func(group string, topics []string) busReader {
		if js == nil {
			return kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Brokers, GroupID: group, Topic: topics[0],
				MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 100 * time.Millisecond, StartOffset: kafka.FirstOffset,
				SessionTimeout: SessionTimeout, HeartbeatInterval: SessionTimeout / 10, CommitInterval: 0})
		}
		r, err := newNATSReader(js, group, topics)
		if err != nil {
			return failedReader{err}
		}
		return &heldReader{busReader: r, group: group, log: held}
	}

	for _, schema := range []string{OrdersSchema, PaymentsSchema} {
		role := RoleRelayOrders
		if schema == PaymentsSchema {
			role = RoleRelayPayments
		}
		if !slices.Contains(cfg.Roles, role) {
			continue
		}
		var w relay.Writer
		if js != nil {
			if w, err = natsbus.NewWriter(traceAcks(js, log), nil); err != nil {
				return err
			}
		} else {
			w = relay.NewKafkaWriter(cfg.Brokers, nil)
		}
		r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: 200 * time.Millisecond, Logger: log})
		if err != nil {
			return err
		}
		if err := r.Start(ctx); err != nil {
			return err
		}
		stops = append(stops, r.Stop, func(context.Context) error { return w.Close() })
	}
	key := SigningKey
	if cfg.Sabotage == SabotageNoSigning {
		key = nil
	}
	if slices.Contains(cfg.Roles, RoleEngine) {
		ecfg := EngineConfig(cfg.Brokers, log, cfg.AllSteps)
		ecfg.Kafka.SigningKey = key
		if js != nil {
			ecfg.Kafka.Brokers = nil
			ecfg.Kafka.NewReader = func(group string, topics []string) saga.KafkaReader { return newReader(group, topics) }
		}
		e, err := saga.New(pool, ecfg)
		if err != nil {
			return err
		}
		var broken *pgxpool.Pool
		switch cfg.Sabotage {
		case "", SabotageNoSigning, SabotageLostWakeUp, SabotageLostSignal:
		case SabotageEffectsOutsideTx:
			broken = pool
		default:
			return fmt.Errorf("chaos: unknown sabotage %q", cfg.Sabotage)
		}
		normal, slow := Definitions(x, pid, broken)
		parcel, label := ParcelDefinitions(pid, !cfg.AllSteps)
		if err := e.Register(normal, slow, parcel, label); err != nil {
			return err
		}
		if err := e.Start(ctx); err != nil {
			return err
		}
		stops = append(stops, e.Stop)
		if slices.Contains(cfg.Roles, RoleSignals) {
			sctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() {
				defer close(done)
				runSignaller(sctx, e, pool, log, cfg.Sabotage)
			}()
			stops = append(stops, func(context.Context) error {
				cancel()
				<-done
				return nil
			})
		}
	}
	if slices.Contains(cfg.Roles, RoleParticipant) {
		p, err := participant.New(pool, &participant.Config{Consumer: "payments", Schema: PaymentsSchema, Logger: log,
			SigningKey: key})
		if err != nil {
			return err
		}
		if err := Participant(p, x, pid); err != nil {
			return err
		}
		for _, topic := range []string{PaymentsTopic, SlowTopic} {
			r := newReader(participantGroup(topic), []string{topic})
			// Batches of what the reader holds ready (on Kafka; a NATS reader
			// runs one message at a time), so that the crash points around
			// the inbox's commit hit batches too.
			c, err := p.Inbox().NewConsumer(r, &inbox.ConsumerConfig{Handlers: p.Handlers(), BatchSize: 8})
			if err != nil {
				return err
			}
			cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
			done := make(chan error, 1)
			go func() { done <- c.Run(cctx) }()
			stops = append(stops, func(context.Context) error {
				cancel()
				return errors.Join(<-done, r.Close())
			})
		}
	}
	<-ctx.Done()
	stop, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var errs []error
	for i := len(stops) - 1; i >= 0; i-- {
		errs = append(errs, stops[i](stop))
	}
	return errors.Join(errs...)
}
