// Command checkout runs sagaflow's checkout example: an order service that
// orchestrates a checkout saga over Kafka, and the inventory, payment and
// shipping services it calls, each with its own schema, outbox, inbox and
// relay, plus a fake payment provider honouring Idempotency-Key. It places
// orders that exercise every guarantee — success, a declined payment, out of
// stock, a provider blip, a duplicate POST, a participant crash, a failed
// saga replayed after its cause is fixed — prints each order's timeline and
// a summary, and exits 0 only if every order ended as expected.
//
// PostgreSQL: DATABASE_URL, else the local server, else a throwaway server
// (as the tests find one). Kafka: KAFKA_BROKERS (see package kafkaconfig;
// the topics in shop.Topics must exist), else an in-process broker.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/kafkaconfig"
)

func main() {
	os.Exit(run(os.Stdout))
}

func run(out io.Writer) int {
	ctx := context.Background()
	started := time.Now()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("SAGAFLOW_DEMO_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}

	var env shop.Env
	env.Logger = logger
	var cleanups []func()
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}()
	for _, d := range []*shop.DB{&env.Orders, &env.Inventory, &env.Payments, &env.Shipping} {
		pool, schema, cleanup := pgtest.ForExample()
		*d = shop.DB{Pool: pool, Schema: schema}
		cleanups = append(cleanups, cleanup)
	}

	kcfg, err := kafkaconfig.FromEnv(os.Getenv)
	if err != nil {
		fmt.Fprintln(out, "checkout:", err)
		return 2
	}
	if kcfg != nil {
		env.Brokers = kcfg.Brokers
		if env.Dialer, err = kcfg.Dialer(); err != nil {
			fmt.Fprintln(out, "checkout:", err)
			return 2
		}
		fmt.Fprintf(out, "Kafka: %v\n", kcfg.Brokers)
	} else {
		kc, err := kafkatest.Start(kafkatest.SeedTopics(3, shop.Topics...))
		if err != nil {
			fmt.Fprintln(out, "checkout: start the in-process Kafka:", err)
			return 1
		}
		cleanups = append(cleanups, kc.Close)
		env.Brokers = kc.Addrs()
		fmt.Fprintf(out, "Kafka: in-process broker at %v (set KAFKA_BROKERS for a real cluster)\n", kc.Addrs())
	}

	sys, err := shop.Start(ctx, env)
	if err != nil {
		fmt.Fprintln(out, "checkout:", err)
		return 1
	}
	cleanups = append(cleanups, sys.Stop)
	mw, err := idempotency.New(env.Orders.Pool, &idempotency.Config{Schema: env.Orders.Schema, Required: true, Logger: logger,
		// The demo has no authentication: its one client shares one set of keys.
		Identity: idempotency.SharedIdentity})
	if err != nil {
		fmt.Fprintln(out, "checkout:", err)
		return 1
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(out, "checkout:", err)
		return 1
	}
	srv := &http.Server{Handler: sys.Handler(mw.Wrap), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	cleanups = append(cleanups, func() { _ = srv.Close() })
	base := "http://" + ln.Addr().String()
	fmt.Fprintf(out, "Order service: %s (POST /orders, GET /orders/{id}); schemas: %s, %s, %s, %s\n",
		base, env.Orders.Schema, env.Inventory.Schema, env.Payments.Schema, env.Shipping.Schema)

	results, err := sys.Run(ctx, base, out)
	if err != nil {
		fmt.Fprintln(out, "checkout:", err)
		return 1
	}
	ok := shop.PrintSummary(out, results)
	fmt.Fprintf(out, "\n%d orders in %s: ", len(results), time.Since(started).Round(time.Millisecond))
	if !ok {
		fmt.Fprintln(out, "some ended unexpectedly")
		return 1
	}
	fmt.Fprintln(out, "every order ended as expected")
	return 0
}
