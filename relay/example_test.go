package relay_test

import (
	"context"
	"log"
	"os"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// A service writes its order and the order's event in one transaction; the
// relay publishes the event to Kafka once the transaction has committed.
// (Compiled, not run: it needs a PostgreSQL and a Kafka cluster.)
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.Migrate(ctx, pool, "sagaflow"); err != nil {
		log.Fatal(err)
	}

	w := relay.NewKafkaWriter(strings.Split(os.Getenv("KAFKA_BROKERS"), ","), nil)
	defer w.Close() // after Stop: the relay never closes its writer
	r, err := relay.New(pool, w, &relay.Config{Schema: "sagaflow"})
	if err != nil {
		log.Fatal(err)
	}
	if err := r.Start(ctx); err != nil { // returns at once
		log.Fatal(err)
	}
	defer r.Stop(context.WithoutCancel(ctx)) // publishes the batch in flight, then returns

	// In a request handler: the order and its event commit together.
	st, err := store.New("sagaflow")
	if err != nil {
		log.Fatal(err)
	}
	orderID := uuid.NewString()
	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO shop.orders (id) VALUES ($1)`, orderID); err != nil {
		log.Fatal(err)
	}
	if err := st.InsertMessage(ctx, tx, &store.Message{
		ID:          uuid.Must(uuid.NewV7()), // the sagaflow-message-id consumers deduplicate on
		Topic:       "orders",
		AggregateID: orderID, // the partition key
		Type:        "order.created",
		Payload:     []byte(`{"id":"` + orderID + `"}`),
		Headers:     map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	}); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
	r.Wake() // optional: publish now rather than at the next poll

	h, err := r.Health(ctx)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("pending %d (oldest %v), dead %d, published by this relay %d",
		h.Pending, h.OldestPendingAge, h.Dead, h.Published)
}
