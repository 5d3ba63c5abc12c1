package participant_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// service is one service's database schema with its relay.
type service struct {
	pool   *pgxpool.Pool
	schema string
}

// providers are the OpenTelemetry providers given to every engine, relay,
// consumer and participant of a system; nil fields mean the global ones.
type providers struct {
	tp trace.TracerProvider
	mp metric.MeterProvider
	// allSteps runs the engine in Kafka mode instead of the hybrid default.
	allSteps bool
}

func newService(t *testing.T, kc *kafkatest.Cluster, pv providers) *service {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.Migrated(t)
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: quiet,
		TracerProvider: pv.tp, MeterProvider: pv.mp})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() {
		require.NoError(t, r.Stop(context.Background()))
		require.NoError(t, w.Close())
	})
	return &service{pool: pool, schema: schema}
}

func (s *service) table(name string) string { return pgx.Identifier{s.schema, name}.Sanitize() }

func (s *service) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, s.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

type checkout struct {
	OrderID  string `json:"order_id"`
	Amount   int    `json:"amount"`
	ChargeID string `json:"charge_id,omitempty"`
}

type reserveCmd struct {
	OrderID string `json:"order_id"`
}

type chargeCmd struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

type charged struct {
	ChargeID string `json:"charge_id"`
}

// reserveTimeout is the reserve step's timeout (its reply's, too).
const reserveTimeout = 3 * time.Second

// system is an orchestrator with a checkout saga of two remote steps, and
// the inventory and payment services it calls, each with its own schema,
// outbox, inbox and relay, talking over Kafka only.
type system struct {
	kc                          *kafkatest.Cluster
	orders, inventory, payments *service
	engine                      *saga.Engine
	def                         *saga.Definition[checkout]
	inventoryDown               atomic.Bool                  // refuse releases
	releaseStalls               atomic.Int32                 // releases still to answer only after the reserve step's timeout
	releaseGate                 atomic.Pointer[testkit.Gate] // when set, a release waits until it is open
}

// newSystem builds the system; with a key, every service signs what it
// writes to the bus and verifies what it reads.
func newSystem(t *testing.T, paymentsRunning bool, key ...byte) *system {
	t.Helper()
	return buildSystem(t, paymentsRunning, providers{}, key...)
}

// buildSystem is newSystem with pv given to every part of the system. The
// engine runs in the hybrid mode (the default) unless pv.allSteps asks for
// Kafka mode.
func buildSystem(t *testing.T, paymentsRunning bool, pv providers, key ...byte) *system {
	t.Helper()
	ctx := context.Background()
	// The default reply topic, one per saga type (the checkout example sets
	// its own, so both paths are exercised).
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, "sagaflow.commands.checkout", "sagaflow.commands.checkout.replies",
		"inventory.commands", "payments.commands"))
	s := &system{kc: kc, orders: newService(t, kc, pv), inventory: newService(t, kc, pv), payments: newService(t, kc, pv)}

	// Inventory: reserve, and release as its compensation.
	_, err := s.inventory.pool.Exec(ctx, "CREATE TABLE "+s.inventory.table("stock_moves")+" (order_id text, move text, step_key text)")
	require.NoError(t, err)
	inv, err := participant.New(s.inventory.pool, &participant.Config{Consumer: "inventory", Schema: s.inventory.schema, Logger: quiet,
		SigningKey: key, TracerProvider: pv.tp, MeterProvider: pv.mp})
	require.NoError(t, err)
	move := func(kind string) func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
		return func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
			_, err := tx.Exec(ctx, "INSERT INTO "+s.inventory.table("stock_moves")+" VALUES ($1, $2, $3)", c.Command.OrderID, kind, c.Key.String())
			return struct{}{}, err
		}
	}
	require.NoError(t, participant.Handle(inv, "inventory.reserve", move("reserve")))
	require.NoError(t, participant.Handle(inv, "inventory.release", func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
		if s.inventoryDown.Load() {
			return struct{}{}, steps.Permanent(steps.WithCode("warehouse_closed", errors.New("the warehouse is closed")))
		}
		if g := s.releaseGate.Load(); g != nil {
			if err := g.Pass(ctx); err != nil {
				return struct{}{}, err
			}
		}
		if s.releaseStalls.Add(-1) >= 0 {
			time.Sleep(reserveTimeout + time.Second)
		}
		return move("release")(ctx, tx, c)
	}))
	testkit.Serve(t, kc.Addrs(), inv, "inventory.commands", "inventory", inbox.ConsumerConfig{TracerProvider: pv.tp, MeterProvider: pv.mp})

	// Payments: charge, refusing large amounts.
	_, err = s.payments.pool.Exec(ctx, "CREATE TABLE "+s.payments.table("charges")+" (order_id text, amount int, charge_id text)")
	require.NoError(t, err)
	pay, err := participant.New(s.payments.pool, &participant.Config{Consumer: "payments", Schema: s.payments.schema, Logger: quiet,
		SigningKey: key, TracerProvider: pv.tp, MeterProvider: pv.mp})
	require.NoError(t, err)
	require.NoError(t, participant.Handle(pay, "payments.charge", func(ctx context.Context, tx pgx.Tx, c participant.Call[chargeCmd]) (charged, error) {
		id := "ch_" + c.Command.OrderID
		if _, err := tx.Exec(ctx, "INSERT INTO "+s.payments.table("charges")+" VALUES ($1, $2, $3)", c.Command.OrderID, c.Command.Amount, id); err != nil {
			return charged{}, err
		}
		if c.Command.Amount > 100 {
			return charged{}, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
		}
		return charged{ChargeID: id}, nil
	}))
	if paymentsRunning {
		testkit.Serve(t, kc.Addrs(), pay, "payments.commands", "payments", inbox.ConsumerConfig{TracerProvider: pv.tp, MeterProvider: pv.mp})
	}

	// The orchestrator.
	s.def = saga.Define("checkout",
		saga.Step[checkout]{Name: "reserve", Timeout: reserveTimeout, Remote: &saga.Remote[checkout]{
			Topic: "inventory.commands", Type: "inventory.reserve", CompensateType: "inventory.release",
			Command: func(_ context.Context, _ *saga.StepRun, c *checkout) (any, error) {
				return reserveCmd{OrderID: c.OrderID}, nil
			},
		}},
		saga.Step[checkout]{Name: "charge", Timeout: 2 * time.Second, Remote: &saga.Remote[checkout]{
			Topic: "payments.commands", Type: "payments.charge",
			Command: func(_ context.Context, _ *saga.StepRun, c *checkout) (any, error) {
				return chargeCmd{OrderID: c.OrderID, Amount: c.Amount}, nil
			},
			OnReply: func(_ context.Context, _ *saga.StepRun, c *checkout, result json.RawMessage) error {
				var r charged
				if err := json.Unmarshal(result, &r); err != nil {
					return err
				}
				c.ChargeID = r.ChargeID
				return nil
			},
		}},
	)
	s.engine, err = saga.New(s.orders.pool, &saga.Config{Schema: s.orders.schema, Workers: 2, Logger: quiet,
		RescueInterval: time.Second, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), SigningKey: key, AllSteps: pv.allSteps},
		TracerProvider: pv.tp, MeterProvider: pv.mp, SagaGaugeInterval: time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, s.engine.Register(s.def))
	if pv.allSteps {
		require.Equal(t, []string{"sagaflow.commands.checkout", "sagaflow.commands.checkout.replies"}, s.engine.CommandTopics())
	} else {
		// Hybrid: only the replies travel over Kafka to the engine.
		require.Equal(t, []string{"sagaflow.commands.checkout.replies"}, s.engine.CommandTopics())
	}
	require.NoError(t, s.engine.Start(ctx))
	t.Cleanup(func() { require.NoError(t, s.engine.Stop(context.Background())) })
	return s
}

func (s *system) run(t *testing.T, c checkout) *saga.Instance {
	t.Helper()
	ctx := context.Background()
	st, err := saga.Start(ctx, s.engine, s.def, c, nil)
	require.NoError(t, err)
	return s.wait(t, st.ID)
}

// wait waits until the saga id has ended, for at most 30 s.
func (s *system) wait(t *testing.T, id uuid.UUID) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, s.engine, id, &sagatest.WaitOpts{Timeout: 30 * time.Second})
}

// A saga whose steps call two services completes in both modes: in the
// hybrid mode (the default) the engine's own step commands never touch
// Kafka, only the remote commands and their replies do; in Kafka mode every
// step command goes over its topic too.
func TestMultiServiceSagaCompletesOverKafka(t *testing.T) {
	t.Parallel()
	for _, allSteps := range []bool{false, true} {
		t.Run(map[bool]string{false: "hybrid", true: "kafka-mode"}[allSteps], func(t *testing.T) {
			t.Parallel()
			s := buildSystem(t, true, providers{allSteps: allSteps})
			in := s.run(t, checkout{OrderID: "o-1", Amount: 40})
			require.Equal(t, saga.StatusCompleted, in.Status)
			var state checkout
			require.NoError(t, in.DecodeState(&state))
			require.Equal(t, "ch_o-1", state.ChargeID, "the payment service's reply reached the saga's state")
			require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'reserve'"))
			require.Equal(t, 0, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"))
			require.Equal(t, 1, s.payments.count(t, "SELECT count(*) FROM "+s.payments.table("charges")))
			// The participants deduplicated by the step-scoped key.
			require.Equal(t, 1, s.payments.count(t, "SELECT count(*) FROM "+s.payments.table("inbox")+" WHERE consumer = 'payments/steps' AND key = $1",
				in.ID.String()+"/charge/forward/0"))

			onTopic, err := s.kc.ReadAll(context.Background(), "sagaflow.commands.checkout")
			require.NoError(t, err)
			relayed := s.orders.count(t, "SELECT count(*) FROM "+s.orders.table("outbox")+" WHERE delivery = 'relay' AND topic = 'sagaflow.commands.checkout'")
			if allSteps {
				require.NotEmpty(t, onTopic, "Kafka mode carries the step commands over their topic")
				require.Positive(t, relayed)
			} else {
				require.Empty(t, onTopic, "the hybrid mode claims the step commands from PostgreSQL")
				require.Zero(t, relayed)
			}
			require.Positive(t, s.orders.count(t, "SELECT count(*) FROM "+s.orders.table("outbox")+" WHERE delivery = 'relay' AND topic = 'payments.commands'"),
				"the remote commands went through the relay in both modes")
		})
	}
}

// With signing on in every service, commands, replies, refusals and remote
// compensations all verify on the wire: sagas complete and compensate as
// without it, and nothing is dead-lettered.
func TestSignedSagasRunAcrossServices(t *testing.T) {
	t.Parallel()
	s := newSystem(t, true, []byte("the services' shared key")...)
	require.Equal(t, saga.StatusCompleted, s.run(t, checkout{OrderID: "o-signed", Amount: 40}).Status)
	in := s.run(t, checkout{OrderID: "o-signed-declined", Amount: 200})
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, "card_declined", in.LastError.Code)
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"),
		"the remote compensation ran")
	for _, svc := range []*service{s.orders, s.inventory, s.payments} {
		require.Zero(t, svc.count(t, "SELECT count(*) FROM "+svc.table("dead_letters")), "nothing refused as unverified")
	}
}

func TestRefusedStepCompensatesAcrossServices(t *testing.T) {
	t.Parallel()
	s := newSystem(t, true)
	in := s.run(t, checkout{OrderID: "o-2", Amount: 500})
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, "card_declined", in.LastError.Code)
	require.Equal(t, "the card was declined", in.LastError.Message)
	// The refusal undid the payment service's own writes; inventory released.
	require.Equal(t, 0, s.payments.count(t, "SELECT count(*) FROM "+s.payments.table("charges")))
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'reserve'"))
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"))
}

func TestReplyTimeoutCompensates(t *testing.T) {
	t.Parallel()
	s := newSystem(t, false) // the payment service is down
	in := s.run(t, checkout{OrderID: "o-3", Amount: 40})
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeReplyTimeout, in.LastError.Code)
	require.Equal(t, "charge", in.LastError.Step)
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"))
}

// TestLateCompensationReplyIsRetried: a remote compensation whose reply
// comes after the step's timeout is not given up on (the saga would be
// failed, for an operator): its command is sent again under the same step
// key, the participant answers the copy from what it recorded, and the saga
// ends compensated with the release done once.
func TestLateCompensationReplyIsRetried(t *testing.T) {
	t.Parallel()
	s := newSystem(t, true)
	s.releaseStalls.Store(1)
	in := s.run(t, checkout{OrderID: "o-5", Amount: 500}) // declined: compensates
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"))
	var resent int
	require.NoError(t, s.orders.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.orders.table("saga_history")+
		" WHERE saga_id = $1 AND event = 'command_sent' AND step_name = 'reserve' AND direction = 'compensate'", in.ID).Scan(&resent))
	require.Equal(t, 2, resent, "the release command was sent again after the timeout")
}

// TestRefusalIsNotRecordedSoAResumeRunsTheStep: a participant refuses (its
// cause: refunds are down), the saga is parked failed; the cause is fixed and
// the saga resumed with the same step key: the participant runs it.
func TestRefusalIsNotRecordedSoAResumeRunsTheStep(t *testing.T) {
	t.Parallel()
	s := newSystem(t, true)
	// Inventory refuses releases until mended; payments declines this order,
	// so the saga compensates, and its release is refused: failed.
	s.inventoryDown.Store(true)
	in := s.run(t, checkout{OrderID: "o-4", Amount: 500})
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, "warehouse_closed", in.LastError.Code)
	s.inventoryDown.Store(false)
	require.NoError(t, s.engine.Resume(context.Background(), in.ID, "warehouse open again"))
	require.Equal(t, saga.StatusCompensated, s.wait(t, in.ID).Status)
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"))
}

// A refusal is not recorded, so a copy of it (a redelivered command refused
// twice, a reply published twice) can reach the engine after the saga was
// resumed, while the participant carries out the command the resume sent
// again under the same step key. The copy names the command it answered
// (wire.Reply.InReplyTo), not the one the saga now waits for: it is dropped,
// and the saga ends as the participant's new answer says. Before, the copy
// failed the saga again, and the release that then happened was ignored.
func TestACopyOfARefusalFromBeforeAResumeIsStale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSystem(t, true)
	s.inventoryDown.Store(true)
	in := s.run(t, checkout{OrderID: "o-5", Amount: 500})
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, "warehouse_closed", in.LastError.Code)
	releaseKey := in.ID.String() + "/reserve/compensate/0"
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("outbox")+" WHERE step_key = $1 AND type = 'sagaflow.reply'", releaseKey))

	// The warehouse opens, but the resumed release waits in its handler
	// until the copy of the old refusal has reached the engine.
	gate := testkit.NewGate()
	t.Cleanup(gate.Open) // a failed assertion must not leave the handler waiting
	s.releaseGate.Store(gate)
	s.inventoryDown.Store(false)
	require.NoError(t, s.engine.Resume(ctx, in.ID, "warehouse open again"))
	stale := s.engine.Stats().StaleDiscarded
	testkit.CopyReplies(t, &testkit.DB{Pool: s.inventory.pool, Schema: s.inventory.schema}, releaseKey)
	require.Eventually(t, func() bool {
		cur, err := s.engine.Get(ctx, in.ID)
		require.NoError(t, err)
		return s.engine.Stats().StaleDiscarded > stale || cur.Status.Terminal()
	}, 20*time.Second, 10*time.Millisecond, "the copy of the refusal never reached the engine")
	cur, err := s.engine.Get(ctx, in.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompensating, cur.Status, "the copy of the old refusal failed the resumed saga: %+v", cur.LastError)

	gate.Open()
	require.Equal(t, saga.StatusCompensated, s.wait(t, in.ID).Status)
	require.Equal(t, 1, s.inventory.count(t, "SELECT count(*) FROM "+s.inventory.table("stock_moves")+" WHERE move = 'release'"))
}
