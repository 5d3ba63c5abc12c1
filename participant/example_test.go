package participant_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// The order service's saga state, and the payment service's contract.
type (
	Order struct {
		ID       string `json:"id"`
		Amount   int    `json:"amount"`
		ChargeID string `json:"charge_id,omitempty"`
	}
	ChargePayment struct {
		OrderID string `json:"order_id"`
		Amount  int    `json:"amount"`
	}
	PaymentCharged struct {
		ChargeID string `json:"charge_id"`
	}
)

// A saga's remote step calls a payment service over Kafka. The payment
// service is a participant: its handler runs once per saga step, in the
// transaction that records the step's key in its inbox, and its reply goes
// out through its own outbox. Each service has its own schema and relay.
func ExampleNew() {
	ctx := context.Background()
	ordersDB, ordersSchema, cleanupOrders := pgtest.ForExample()
	defer cleanupOrders()
	paymentsDB, paymentsSchema, cleanupPayments := pgtest.ForExample()
	defer cleanupPayments()
	for db, schema := range map[*pgxpool.Pool]string{ordersDB: ordersSchema, paymentsDB: paymentsSchema} {
		if _, err := migrations.Migrate(ctx, db, schema); err != nil {
			panic(err)
		}
	}
	charges := pgx.Identifier{paymentsSchema, "charges"}.Sanitize()
	if _, err := paymentsDB.Exec(ctx, "CREATE TABLE "+charges+" (order_id text PRIMARY KEY, amount int)"); err != nil {
		panic(err)
	}
	kc, err := kafkatest.Start() // an in-process Kafka; in production, your brokers
	if err != nil {
		panic(err)
	}
	defer kc.Close()
	brokers := kc.Addrs()

	// The payment service.
	payments, err := participant.New(paymentsDB, &participant.Config{Consumer: "payments", Schema: paymentsSchema})
	if err != nil {
		panic(err)
	}
	err = participant.Handle(payments, "payments.charge",
		func(ctx context.Context, tx pgx.Tx, call participant.Call[ChargePayment]) (PaymentCharged, error) {
			if call.Command.Amount > 100 {
				return PaymentCharged{}, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+charges+" VALUES ($1, $2)", call.Command.OrderID, call.Command.Amount)
			return PaymentCharged{ChargeID: "ch_" + call.Command.OrderID}, err
		})
	if err != nil {
		panic(err)
	}

	// The order service.
	pay := saga.Define("pay", saga.Step[Order]{Name: "charge", Timeout: 20 * time.Second, Remote: &saga.Remote[Order]{
		Topic: "payments.commands", Type: "payments.charge",
		Command: func(_ context.Context, _ *saga.StepRun, o *Order) (any, error) {
			return ChargePayment{OrderID: o.ID, Amount: o.Amount}, nil
		},
		OnReply: func(_ context.Context, _ *saga.StepRun, o *Order, result json.RawMessage) error {
			var charged PaymentCharged
			if err := json.Unmarshal(result, &charged); err != nil {
				return err
			}
			o.ChargeID = charged.ChargeID
			return nil
		},
	}})
	engine, err := saga.New(ordersDB, &saga.Config{Schema: ordersSchema, Logger: exampleLogs,
		Kafka: &saga.KafkaConfig{Brokers: brokers}})
	if err != nil {
		panic(err)
	}
	if err := engine.Register(pay); err != nil {
		panic(err)
	}
	for _, topic := range append(engine.CommandTopics(), "payments.commands") {
		if err := kc.CreateTopic(topic, 1); err != nil {
			panic(err)
		}
	}

	// Both services publish their outbox with a relay; the payment service
	// consumes its command topic with an inbox consumer.
	for db, schema := range map[*pgxpool.Pool]string{ordersDB: ordersSchema, paymentsDB: paymentsSchema} {
		w := relay.NewKafkaWriter(brokers, nil)
		defer w.Close()
		r, err := relay.New(db, w, &relay.Config{Schema: schema, Logger: exampleLogs})
		if err != nil {
			panic(err)
		}
		if err := r.Start(ctx); err != nil {
			panic(err)
		}
		defer r.Stop(ctx)
	}
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, GroupID: "payments", Topic: "payments.commands",
		StartOffset: kafka.FirstOffset, MaxWait: 100 * time.Millisecond})
	defer reader.Close()
	consumer, err := payments.Inbox().NewConsumer(reader, &inbox.ConsumerConfig{Handlers: payments.Handlers()})
	if err != nil {
		panic(err)
	}
	if err := consumer.Start(ctx); err != nil {
		panic(err)
	}
	defer consumer.Stop(ctx)
	if err := engine.Start(ctx); err != nil {
		panic(err)
	}
	defer engine.Stop(ctx)

	for _, o := range []Order{{ID: "o-1", Amount: 40}, {ID: "o-2", Amount: 400}} {
		st, err := saga.Start(ctx, engine, pay, o, &saga.StartOpts{BusinessKey: o.ID})
		if err != nil {
			panic(err)
		}
		in := waitEnded(ctx, engine, st)
		var state Order
		if err := in.DecodeState(&state); err != nil {
			panic(err)
		}
		fmt.Printf("%s: %s, charge %q", o.ID, in.Status, state.ChargeID)
		if in.LastError != nil {
			fmt.Printf(", %s at %s", in.LastError.Code, in.LastError.Step)
		}
		fmt.Println()
	}
	var n int
	if err := paymentsDB.QueryRow(ctx, "SELECT count(*) FROM "+charges).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("charges:", n)
	// Output:
	// o-1: completed, charge "ch_o-1"
	// o-2: compensated, charge "", card_declined at charge
	// charges: 1
}

// exampleLogs drops the logs of the example, whose second saga fails on
// purpose.
var exampleLogs = slog.New(slog.NewTextHandler(io.Discard, nil))

// waitEnded polls until the saga has ended. (In tests, sagatest.WaitEnded
// does this.)
func waitEnded(ctx context.Context, e *saga.Engine, st saga.Started) *saga.Instance {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		in, err := e.Get(ctx, st.ID)
		if err != nil {
			panic(err)
		}
		if in.Status.Terminal() {
			return in
		}
	}
	panic("the saga did not end in 30s")
}
