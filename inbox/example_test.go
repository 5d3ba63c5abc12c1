package inbox_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/wire"
)

// OrderCreated is the event the examples consume.
type OrderCreated struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

// Process runs a handler once per message id: a redelivered message is
// skipped, and the handler's writes commit with the record of its id.
func ExampleInbox_Process() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	invoices := pgx.Identifier{schema, "invoices"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+invoices+" (order_id text, amount int)"); err != nil {
		panic(err)
	}
	in, err := inbox.New(pool, &inbox.Config{Consumer: "billing", Schema: schema})
	if err != nil {
		panic(err)
	}
	invoice := func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		ev, err := inbox.DecodeJSON[OrderCreated](msg)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "INSERT INTO "+invoices+" VALUES ($1, $2)", ev.OrderID, ev.Amount)
		return err
	}

	msg := inbox.Message{ID: "0193a6f2-order-created-o-1", Type: "order.created", Value: []byte(`{"order_id":"o-1","amount":40}`)}
	for range 2 { // a delivery and its duplicate
		processed, err := in.Process(ctx, msg, invoice)
		if err != nil {
			panic(err)
		}
		fmt.Println("processed:", processed)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+invoices).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("invoices:", n)
	// Output:
	// processed: true
	// processed: false
	// invoices: 1
}

// A Consumer reads a topic in a consumer group, routes each message by type
// to its handler inside the inbox's transaction, and commits the offset only
// after that transaction committed. A duplicate is skipped; a message that
// no handler takes is dead-lettered and the partition moves on.
func ExampleInbox_NewConsumer() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	invoices := pgx.Identifier{schema, "invoices"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+invoices+" (order_id text, amount int)"); err != nil {
		panic(err)
	}
	kc, err := kafkatest.Start(kafkatest.SeedTopics(1, "orders")) // an in-process Kafka; in production, your brokers
	if err != nil {
		panic(err)
	}
	defer kc.Close()

	// What the order service's relay publishes: each message carries its
	// id in the sagaflow-message-id header (a UUID from its outbox; short
	// ids here) and its type in sagaflow-type. The third is the first one
	// again (a replay, say).
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	defer w.Close()
	event := func(id, typ, value string) kafka.Message {
		return kafka.Message{Topic: "orders", Value: []byte(value), Headers: []kafka.Header{
			{Key: wire.HeaderMessageID, Value: []byte(id)}, {Key: wire.HeaderType, Value: []byte(typ)}}}
	}
	err = w.WriteMessages(ctx,
		event("m-1", "order.created", `{"order_id":"o-1","amount":40}`),
		event("m-2", "order.created", `{"order_id":"o-2","amount":25}`),
		event("m-1", "order.created", `{"order_id":"o-1","amount":40}`),
		event("m-3", "order.shipped", `{"order_id":"o-1"}`),
		event("m-4", "order.created", `{"order_id":"o-3","amount":60}`),
	)
	if err != nil {
		panic(err)
	}

	in, err := inbox.New(pool, &inbox.Config{Consumer: "billing", Schema: schema, Logger: quiet})
	if err != nil {
		panic(err)
	}
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: "billing", Topic: "orders",
		StartOffset: kafka.FirstOffset, MaxWait: 100 * time.Millisecond})
	defer reader.Close()
	consumer, err := in.NewConsumer(reader, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{
		"order.created": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			ev, err := inbox.DecodeJSON[OrderCreated](msg)
			if err != nil {
				return err // permanent: the message is dead-lettered
			}
			_, err = tx.Exec(ctx, "INSERT INTO "+invoices+" VALUES ($1, $2)", ev.OrderID, ev.Amount)
			return err
		},
	}})
	if err != nil {
		panic(err)
	}
	if err := consumer.Start(ctx); err != nil { // returns at once; Run is the blocking form
		panic(err)
	}

	// The last message's invoice means every message before it was handled.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var last bool
		if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM "+invoices+" WHERE order_id = 'o-3')").Scan(&last); err != nil {
			panic(err)
		}
		if last {
			break
		}
		if time.Now().After(deadline) {
			panic("the consumer did not reach the last message in 30s")
		}
	}
	if err := consumer.Stop(ctx); err != nil { // lets the message in flight finish and commit
		panic(err)
	}

	rows, err := pool.Query(ctx, "SELECT order_id, amount FROM "+invoices+" ORDER BY order_id")
	if err != nil {
		panic(err)
	}
	for rows.Next() {
		var id string
		var amount int
		if err := rows.Scan(&id, &amount); err != nil {
			panic(err)
		}
		fmt.Println("invoice", id, amount)
	}
	if err := rows.Err(); err != nil {
		panic(err)
	}
	ops, err := saga.New(pool, &saga.Config{Schema: schema}) // an operator's view, as the CLI has
	if err != nil {
		panic(err)
	}
	dead, err := ops.DeadLetters(ctx, nil)
	if err != nil {
		panic(err)
	}
	for _, l := range dead.Letters {
		fmt.Printf("dead letter %s: %s\n", l.MessageID, l.Reason)
	}
	// Output:
	// invoice o-1 40
	// invoice o-2 25
	// invoice o-3 60
	// dead letter m-3: unknown message type "order.shipped" (handled: order.created)
}

// quiet is the logger of examples that dead-letter on purpose.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))
