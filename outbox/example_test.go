package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/wire"
)

// A service records a paid order and its OrderPaid event in one
// transaction; the relay publishes the event once the transaction has
// committed, and a rolled-back transaction publishes nothing.
func Example() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id text PRIMARY KEY, status text NOT NULL)"); err != nil {
		panic(err)
	}
	kc, err := kafkatest.Start(kafkatest.SeedTopics(1, "orders.events"))
	if err != nil {
		panic(err)
	}
	defer kc.Close()
	ob, err := outbox.New(pool, schema)
	if err != nil {
		panic(err)
	}

	pay := func(orderID string, commit bool) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			panic(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO "+orders+" (id, status) VALUES ($1, 'paid')", orderID); err != nil {
			panic(err)
		}
		if err := ob.InsertTx(ctx, tx, outbox.Message{
			Topic: "orders.events", Key: orderID, Type: "OrderPaid", Payload: []byte(`{"order_id":"` + orderID + `"}`),
		}); err != nil {
			panic(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				panic(err)
			}
		}
	}
	pay("o-1", true)
	pay("o-2", false) // rolled back: neither the order nor its event

	st, err := ob.Status(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("pending", st.Pending)

	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	defer w.Close()
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	if err != nil {
		panic(err)
	}
	if err := r.Start(ctx); err != nil {
		panic(err)
	}
	defer r.Stop(ctx)

	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), Topic: "orders.events", MaxWait: 100 * time.Millisecond})
	defer reader.Close()
	readCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	m, err := reader.ReadMessage(readCtx)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s %s %s\n", m.Key, header(m, wire.HeaderType), m.Value)

	// The operator's replay: publish it once more (consumers deduplicate it
	// by its message id), after a dry run.
	for deadline := time.Now().Add(30 * time.Second); st.Published == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			panic("not marked published in 30s")
		}
		if st, err = ob.Status(ctx); err != nil {
			panic(err)
		}
	}
	dry, err := ob.Replay(ctx, outbox.ReplayOpts{Filter: outbox.Filter{Key: "o-1"}, DryRun: true})
	if err != nil {
		panic(err)
	}
	fmt.Println("a replay would send", len(dry.Matched))
	// Output:
	// pending 1
	// o-1 OrderPaid {"order_id":"o-1"}
	// a replay would send 1
}

func header(m kafka.Message, name string) string {
	for _, h := range m.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}
