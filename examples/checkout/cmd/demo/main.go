// Command demo is what `make demo` runs: the checkout program (see
// examples/checkout) on a PostgreSQL and a Kafka it provides itself, so that
// the demo needs no setup. It is the only part of the example that uses
// sagaflow's test harness, which users cannot import:
//
//   - PostgreSQL as the tests find it (internal/pgtest): DATABASE_URL, else
//     the local server on 127.0.0.1:5432, else a throwaway server run from the
//     PostgreSQL binaries installed on the machine, else a container;
//   - Kafka: KAFKA_BROKERS (see package kafkaconfig; the topics in
//     shop.Topics must exist), else an in-process broker (internal/kafkatest,
//     franz-go's kfake) with those topics.
//
// Set SAGAFLOW_DEMO_LOG to see the services' warnings and errors. With
// -ui ADDR (make demo UI=127.0.0.1:8080), the demo keeps its schemas after
// the run and serves the web UI (package ui) on them until interrupted.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/kafkaconfig"
)

func main() {
	os.Exit(run())
}

func run() int {
	uiAddr := flag.String("ui", "", "after the run, serve the web UI on this `address` until interrupted")
	flag.Parse()
	// The harness finds or starts a server and gives a pool on a fresh
	// schema of its own; the program needs only the server's connection
	// string, and creates its own schemas.
	pool, _, cleanup := pgtest.ForExample()
	defer cleanup()
	opts := shop.DemoOptions{DSN: pool.Config().ConnString()}
	if os.Getenv("SAGAFLOW_DEMO_LOG") != "" {
		opts.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}

	kcfg, err := kafkaconfig.FromEnv(os.Getenv)
	if err != nil {
		fmt.Println("demo:", err)
		return 2
	}
	if kcfg != nil {
		opts.Brokers = kcfg.Brokers
		if opts.Dialer, err = kcfg.Dialer(); err != nil {
			fmt.Println("demo:", err)
			return 2
		}
		fmt.Printf("Kafka: %v\n", kcfg.Brokers)
	} else {
		kc, err := kafkatest.Start(kafkatest.SeedTopics(3, shop.Topics...))
		if err != nil {
			fmt.Println("demo: start the in-process Kafka:", err)
			return 1
		}
		defer kc.Close()
		opts.Brokers = kc.Addrs()
		fmt.Printf("Kafka: in-process broker at %v (set KAFKA_BROKERS for a real cluster)\n", kc.Addrs())
	}
	if *uiAddr == "" {
		return shop.Main(context.Background(), os.Stdout, opts)
	}
	opts.Keep = true
	opts.SchemaPrefix = fmt.Sprintf("%s_ui%d", shop.SchemaPrefixDefault, os.Getpid())
	code := shop.Main(context.Background(), os.Stdout, opts)
	if err := serveUI(pool, opts.SchemaPrefix, *uiAddr); err != nil {
		fmt.Println("demo: web UI:", err)
		return 1
	}
	return code
}
