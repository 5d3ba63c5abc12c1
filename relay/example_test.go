package relay_test

import (
	"context"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/wire"
)

// The relay publishes what transactions wrote to the outbox table, once they
// have committed. Here an engine in Kafka mode writes a saga's first command
// to the outbox; the relay publishes it to an in-process Kafka (in
// production, your brokers), where the engines' consumer group would pick
// it up.
func Example() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	kc, err := kafkatest.Start(kafkatest.SeedTopics(1, "sagaflow.commands.checkout"))
	if err != nil {
		panic(err)
	}
	defer kc.Close()

	type Order struct {
		ID string `json:"id"`
	}
	checkout := saga.Define("checkout", saga.Step[Order]{Name: "reserve",
		Action: func(context.Context, *saga.StepRun, *Order) error { return nil }})
	client, err := saga.New(pool, &saga.Config{Schema: schema, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true}})
	if err != nil {
		panic(err)
	}
	if err := client.Register(checkout); err != nil {
		panic(err)
	}
	st, err := saga.Start(ctx, client, checkout, Order{ID: "o-1"}, nil) // the engine is not started: nothing consumes
	if err != nil {
		panic(err)
	}

	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	defer w.Close() // after Stop: the relay never closes its writer
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	if err != nil {
		panic(err)
	}
	h, err := r.Health(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("before: pending", h.Pending)
	if err := r.Start(ctx); err != nil { // returns at once
		panic(err)
	}
	for deadline := time.Now().Add(30 * time.Second); h.Pending > 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			panic("the relay did not publish in 30s")
		}
		if h, err = r.Health(ctx); err != nil {
			panic(err)
		}
	}
	if err := r.Stop(ctx); err != nil { // publishes the batch in flight, then returns
		panic(err)
	}
	if h, err = r.Health(ctx); err != nil { // this relay's counters are final once it has stopped
		panic(err)
	}
	fmt.Println("after: pending", h.Pending, "published", h.Published)

	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), Topic: "sagaflow.commands.checkout", MaxWait: 100 * time.Millisecond})
	defer reader.Close()
	readCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	m, err := reader.ReadMessage(readCtx)
	if err != nil {
		panic(err)
	}
	fmt.Println("topic", m.Topic, "key is the saga id", string(m.Key) == st.ID.String())
	for _, h := range m.Headers {
		if h.Key == wire.HeaderType { // what the consumer routes on
			fmt.Println("type", string(h.Value))
		}
	}
	// Output:
	// before: pending 1
	// after: pending 0 published 1
	// topic sagaflow.commands.checkout key is the saga id true
	// type sagaflow.step
}
