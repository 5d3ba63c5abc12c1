// Command checkout runs sagaflow's checkout example: an order service that
// orchestrates a checkout saga over Kafka, and the inventory, payment and
// shipping services it calls, each with its own schema, outbox, inbox and
// relay, plus a fake payment provider honouring Idempotency-Key. It places
// orders that exercise every guarantee — success, a declined payment, out of
// stock, a provider blip, a duplicate POST, a participant crash, a failed
// saga replayed after its cause is fixed, an order delivered (the
// warehouse's "picked" event from Kafka, the carrier's "delivered" webhook
// sent twice), a parcel that never arrives (cancelled and refunded by the
// escalation timer) — prints each order's timeline and a summary, and exits
// 0 only if every order ended as expected.
//
// After payment and shipment, the checkout saga waits: for the warehouse's
// event, then for the carrier's webhook, at most -escalation (48 hours in
// production; 3 seconds here, so that you can watch the escalation).
//
// It runs on the PostgreSQL and the Kafka cluster you give it:
//
//	go run ./examples/checkout -dsn postgres://localhost/shop -brokers kafka-1:9092,kafka-2:9092
//
// -dsn defaults to DATABASE_URL and -brokers to KAFKA_BROKERS; TLS and SASL
// come from the environment as package kafkaconfig reads it. Each service
// gets a schema of its own in that database, dropped after the run unless
// -keep is given. The topics in shop.Topics must exist, or the cluster must
// create them.
//
// `make demo` runs the same program with no setup: examples/checkout/cmd/demo
// finds or starts a PostgreSQL as sagaflow's tests do, and starts an
// in-process Kafka broker.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/kafkaconfig"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// run is the program with its arguments, environment and output; it returns
// the exit status.
func run(ctx context.Context, args []string, getenv func(string) string, out, errOut io.Writer) int {
	fs := flag.NewFlagSet("checkout", flag.ContinueOnError)
	fs.SetOutput(errOut)
	dsn := fs.String("dsn", getenv("DATABASE_URL"), "PostgreSQL connection string (default $DATABASE_URL)")
	brokers := fs.String("brokers", "", "Kafka brokers, comma-separated (default $KAFKA_BROKERS)")
	prefix := fs.String("schema-prefix", shop.SchemaPrefixDefault, "start of the services' schema names")
	keep := fs.Bool("keep", false, "keep the services' schemas after the run")
	escalation := fs.Duration("escalation", shop.DemoEscalationDefault,
		"how long an order waits for its delivery before it is cancelled and refunded (48h in production; compressed for the demo)")
	if err := fs.Parse(args); err != nil {
		return 2
	}

	if *escalation <= 0 {
		fmt.Fprintln(errOut, "checkout: -escalation must be positive")
		return 2
	}
	opts := shop.DemoOptions{DSN: *dsn, SchemaPrefix: *prefix, Keep: *keep, Escalation: *escalation}
	kcfg, err := kafkaconfig.FromEnv(getenv)
	if err != nil {
		fmt.Fprintln(errOut, "checkout:", err)
		return 2
	}
	if kcfg != nil {
		opts.Brokers = kcfg.Brokers
		if opts.Dialer, err = kcfg.Dialer(); err != nil {
			fmt.Fprintln(errOut, "checkout:", err)
			return 2
		}
	}
	if *brokers != "" {
		opts.Brokers = strings.Split(*brokers, ",")
	}
	if opts.DSN == "" || len(opts.Brokers) == 0 {
		fmt.Fprintln(errOut, "checkout: give a PostgreSQL (-dsn or DATABASE_URL) and Kafka brokers (-brokers or KAFKA_BROKERS),"+
			" or run `make demo`, which brings its own")
		return 2
	}
	if getenv("SAGAFLOW_DEMO_LOG") != "" {
		opts.Logger = slog.New(slog.NewTextHandler(errOut, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	fmt.Fprintf(out, "Kafka: %v\n", opts.Brokers)
	return shop.Main(ctx, out, opts)
}
