// Package review12_test is a black-box review, written from the
// documentation only, of commit 82146a2: a participant's reply names the
// command it answers (wire.Reply.InReplyTo, JSON in_reply_to), and the
// engine drops as stale a refusal that names another command than the one
// its saga waits for. See FINDINGS.md.
package review12_test

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
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// wait bounds every poll.
const wait = 25 * time.Second

// stepTimeout is the reserve step's timeout (its compensation's reply's too).
// At 2 s a reserve whose reply was not late timed out on a loaded machine.
const stepTimeout = 4 * time.Second

const replyTopic = "sagaflow.commands.checkout.replies"

// service is a migrated schema with a relay publishing its outbox.
type service struct{ *testkit.DB }

func newService(t *testing.T, kc *kafkatest.Cluster) *service {
	t.Helper()
	ctx := context.Background()
	d := testkit.NewDB(t)
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, PollInterval: 50 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() {
		require.NoError(t, r.Stop(context.Background()))
		require.NoError(t, w.Close())
	})
	return &service{d}
}

type checkout struct {
	OrderID  string `json:"order_id"`
	Amount   int    `json:"amount"`
	ChargeID string `json:"charge_id,omitempty"`
}

type orderCmd struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

type charged struct {
	ChargeID string `json:"charge_id"`
}

// opts choose the system's shape.
type opts struct {
	key        []byte // signing key for every service
	pivot      bool   // reserve is the pivot (no compensation), charge is Retriable: a refused charge fails the saga
	noPayments bool   // no consumer on payments.commands
	// releaseAttempts is the reserve step's CompensateRetry.MaxAttempts (0: the default).
	releaseAttempts int
	allSteps        bool // the engine in Kafka mode instead of the hybrid default
}

// system: an orchestrator (hybrid mode) with a two-step checkout saga of
// remote steps, an inventory participant (reserve, release) and a payments
// participant (charge), each service with its own schema and relay.
type system struct {
	kc                          *kafkatest.Cluster
	orders, inventory, payments *service
	engine                      *saga.Engine
	def                         *saga.Definition[checkout]

	declineOver   atomic.Int64 // a charge of more than this is refused (card_declined)
	inventoryDown atomic.Bool  // releases are refused (warehouse_closed)
	refuseNext    atomic.Int32 // releases still to refuse after their gate (late_refusal)
	chargeGate    atomic.Pointer[testkit.Gate]
	releaseGate   atomic.Pointer[testkit.Gate]
	reserveGate   atomic.Pointer[testkit.Gate]
}

func checkoutDef(o opts, paymentsTopic string) *saga.Definition[checkout] {
	reserve := saga.Step[checkout]{Name: "reserve", Timeout: stepTimeout, Remote: &saga.Remote[checkout]{
		Topic: "inventory.commands", Type: "inventory.reserve", CompensateType: "inventory.release",
		Command: func(_ context.Context, _ *saga.StepRun, c *checkout) (any, error) {
			return orderCmd{OrderID: c.OrderID}, nil
		},
	}}
	if o.releaseAttempts > 0 {
		reserve.CompensateRetry = &saga.RetryPolicy{MaxAttempts: o.releaseAttempts}
	}
	charge := saga.Step[checkout]{Name: "charge", Timeout: 10 * time.Second, Remote: &saga.Remote[checkout]{
		Topic: paymentsTopic, Type: "payments.charge",
		Command: func(_ context.Context, _ *saga.StepRun, c *checkout) (any, error) {
			return orderCmd{OrderID: c.OrderID, Amount: c.Amount}, nil
		},
		OnReply: func(_ context.Context, _ *saga.StepRun, c *checkout, result json.RawMessage) error {
			var r charged
			if err := json.Unmarshal(result, &r); err != nil {
				return err
			}
			c.ChargeID = r.ChargeID
			return nil
		},
	}}
	if o.pivot {
		reserve.Remote.CompensateType = ""
		reserve.Pivot = true
		charge.Retriable = true
	}
	return saga.Define("checkout", reserve, charge)
}

func newSystem(t *testing.T, o opts) *system {
	t.Helper()
	ctx := context.Background()
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, replyTopic, "sagaflow.commands.checkout", "inventory.commands", "payments.commands", "payments-b.commands"))
	s := &system{kc: kc, orders: newService(t, kc), inventory: newService(t, kc), payments: newService(t, kc)}
	s.declineOver.Store(100)

	_, err := s.inventory.Pool.Exec(ctx, "CREATE TABLE "+s.inventory.Table("stock_moves")+" (order_id text, move text, step_key text)")
	require.NoError(t, err)
	inv, err := participant.New(s.inventory.Pool, &participant.Config{Consumer: "inventory", Schema: s.inventory.Schema, Logger: quiet, SigningKey: o.key})
	require.NoError(t, err)
	move := func(ctx context.Context, tx pgx.Tx, kind string, c participant.Call[orderCmd]) (struct{}, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+s.inventory.Table("stock_moves")+" VALUES ($1, $2, $3)", c.Command.OrderID, kind, c.Key.String())
		return struct{}{}, err
	}
	require.NoError(t, participant.Handle(inv, "inventory.reserve", func(ctx context.Context, tx pgx.Tx, c participant.Call[orderCmd]) (struct{}, error) {
		if g := s.reserveGate.Load(); g != nil {
			if err := g.Pass(ctx); err != nil {
				return struct{}{}, err
			}
		}
		return move(ctx, tx, "reserve", c)
	}))
	require.NoError(t, participant.Handle(inv, "inventory.release", func(ctx context.Context, tx pgx.Tx, c participant.Call[orderCmd]) (struct{}, error) {
		if s.inventoryDown.Load() {
			return struct{}{}, steps.Permanent(steps.WithCode("warehouse_closed", errors.New("the warehouse is closed")))
		}
		if g := s.releaseGate.Load(); g != nil {
			if err := g.Pass(ctx); err != nil {
				return struct{}{}, err
			}
		}
		if s.refuseNext.Add(-1) >= 0 {
			return struct{}{}, steps.Permanent(steps.WithCode("late_refusal", errors.New("refused after the timeout")))
		}
		return move(ctx, tx, "release", c)
	}))
	testkit.Serve(t, kc.Addrs(), inv, "inventory.commands", "inventory", inbox.ConsumerConfig{})

	_, err = s.payments.Pool.Exec(ctx, "CREATE TABLE "+s.payments.Table("charges")+" (order_id text, amount int, step_key text)")
	require.NoError(t, err)
	pay, err := participant.New(s.payments.Pool, &participant.Config{Consumer: "payments", Schema: s.payments.Schema, Logger: quiet, SigningKey: o.key})
	require.NoError(t, err)
	require.NoError(t, participant.Handle(pay, "payments.charge", func(ctx context.Context, tx pgx.Tx, c participant.Call[orderCmd]) (charged, error) {
		if g := s.chargeGate.Load(); g != nil {
			if err := g.Pass(ctx); err != nil {
				return charged{}, err
			}
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+s.payments.Table("charges")+" VALUES ($1, $2, $3)", c.Command.OrderID, c.Command.Amount, c.Key.String()); err != nil {
			return charged{}, err
		}
		if int64(c.Command.Amount) > s.declineOver.Load() {
			return charged{}, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
		}
		return charged{ChargeID: "ch_" + c.Command.OrderID}, nil
	}))
	if !o.noPayments {
		testkit.Serve(t, kc.Addrs(), pay, "payments.commands", "payments", inbox.ConsumerConfig{})
	}

	s.def = checkoutDef(o, "payments.commands")
	s.engine = newEngine(t, kc, s.orders, s.def, o.key, o.allSteps)
	// Last registered, first run: no gated handler outlives a failed test.
	t.Cleanup(func() {
		for _, g := range []*testkit.Gate{s.chargeGate.Load(), s.releaseGate.Load(), s.reserveGate.Load()} {
			if g != nil {
				g.Open()
			}
		}
	})
	return s
}

func newEngine(t *testing.T, kc *kafkatest.Cluster, svc *service, def *saga.Definition[checkout], key []byte, allSteps bool) *saga.Engine {
	t.Helper()
	e, err := saga.New(svc.Pool, &saga.Config{Schema: svc.Schema, Workers: 2, Logger: quiet, RescueInterval: time.Second,
		Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), SigningKey: key, AllSteps: allSteps}})
	require.NoError(t, err)
	require.NoError(t, e.Register(def))
	require.NoError(t, e.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, e.Stop(context.Background())) })
	return e
}

func (s *system) start(t *testing.T, c checkout, so *saga.StartOpts) uuid.UUID {
	t.Helper()
	st, err := saga.Start(context.Background(), s.engine, s.def, c, so)
	require.NoError(t, err)
	return st.ID
}

func waitEnded(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: wait})
}

func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

// commandID is the id of the command saga id waits for
// (saga_instances.command_id, docs/protocol.md "Replies"), "" when none.
func commandID(t *testing.T, svc *service, id uuid.UUID) string {
	t.Helper()
	var c *string
	require.NoError(t, svc.Pool.QueryRow(context.Background(), "SELECT command_id::text FROM "+svc.Table("saga_instances")+" WHERE id = $1", id).Scan(&c))
	if c == nil {
		return ""
	}
	return *c
}

// waitAt waits until saga id runs step in direction dir and has sent its
// command (command_id set, and a command_sent event with that message id:
// before the send, command_id names the command a worker claims to send
// it), and returns that command's id.
func waitAt(t *testing.T, e *saga.Engine, svc *service, id uuid.UUID, step string, dir steps.Direction) string {
	t.Helper()
	var cmd string
	testkit.WaitFor(t, wait, "saga "+id.String()+" waiting at "+step+"/"+string(dir), func() bool {
		in := get(t, e, id)
		require.False(t, in.Status.Terminal(), "the saga ended early: %s %+v", in.Status, in.LastError)
		if in.Step != step || in.Direction != dir {
			return false
		}
		cmd = commandID(t, svc, id)
		if cmd == "" {
			return false
		}
		for _, ev := range in.History {
			var d struct {
				MessageID string `json:"message_id"`
			}
			if ev.Type == saga.EventCommandSent && ev.Step == step && ev.Direction == dir &&
				json.Unmarshal(ev.Detail, &d) == nil && d.MessageID == cmd {
				return true
			}
		}
		return false
	})
	return cmd
}

func stepKey(id uuid.UUID, step string, dir steps.Direction, epoch int) string {
	return wire.Key{SagaID: wire.UUID(id), Step: step, Direction: wire.Direction(dir), Epoch: epoch}.String()
}

// inject writes a reply onto the reply topic as a participant would (the
// saga id as Kafka key), with the headers of docs/protocol.md "Replies"
// unless hdrs is given.
func inject(t *testing.T, kc *kafkatest.Cluster, sagaID uuid.UUID, hdrs []kafka.Header, key string, payload []byte) {
	t.Helper()
	if hdrs == nil {
		hdrs = []kafka.Header{
			{Key: wire.HeaderMessageID, Value: []byte(uuid.NewString())},
			{Key: wire.HeaderType, Value: []byte(wire.TypeReply)},
			{Key: wire.HeaderSagaID, Value: []byte(sagaID.String())},
			{Key: wire.HeaderStepKey, Value: []byte(key)},
		}
	}
	// The relay's writer: its own transport, closed with it (a writer on
	// kafka-go's default transport leaves its connections running).
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Topic: replyTopic, Key: []byte(sagaID.String()), Value: payload, Headers: hdrs}))
}

// replyOnTopic returns the replies on the reply topic with step key key.
func replyOnTopic(t *testing.T, kc *kafkatest.Cluster, key string) []kafka.Message {
	t.Helper()
	msgs, err := kc.ReadAll(context.Background(), replyTopic)
	require.NoError(t, err)
	var out []kafka.Message
	for _, m := range msgs {
		for _, h := range m.Headers {
			if h.Key == wire.HeaderStepKey && string(h.Value) == key {
				out = append(out, m)
			}
		}
	}
	return out
}

// deadFor counts the dead letters of svc whose Kafka key is saga id.
func deadFor(t *testing.T, svc *service, id uuid.UUID, reasonLike string) int {
	t.Helper()
	return svc.Count(t, "SELECT count(*) FROM "+svc.Table("dead_letters")+" WHERE msg_key = convert_to($1, 'UTF8') AND reason LIKE $2",
		id.String(), reasonLike)
}
