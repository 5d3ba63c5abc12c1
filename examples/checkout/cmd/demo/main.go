// Command demo is what `make demo` runs: the checkout program (see
// examples/checkout) on a PostgreSQL and a Kafka it provides itself, so that
// the demo needs no setup. It is the only part of the example that uses
// sagaflow's test harness, which users cannot import:
//
//   - PostgreSQL as the tests find it (internal/pgtest): DATABASE_URL, else
//     the local server on 127.0.0.1:5432, else a throwaway server run from the
//     PostgreSQL binaries installed on the machine, else a container;
//   - with -bus nats, NATS JetStream: -nats-url, else a throwaway
//     nats-server started from the binary on the machine;
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
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/kafkaconfig"
)

func main() {
	os.Exit(run())
}

func run() int {
	uiAddr := flag.String("ui", "", "after the run, serve the web UI on this `address` until interrupted")
	bus := flag.String("bus", "kafka", "the services' bus: kafka or nats")
	natsURL := flag.String("nats-url", "", "with -bus nats, the NATS server (with JetStream) to use; default: a throwaway nats-server")
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

	switch *bus {
	case "kafka":
	case "nats":
		b, stop, err := natsBus(*natsURL)
		if err != nil {
			fmt.Println("demo:", err)
			return 1
		}
		defer stop()
		opts.Bus = b
		fmt.Println("Bus:", b.Name())
		return runDemo(pool, opts, *uiAddr)
	default:
		fmt.Printf("demo: -bus %q: want kafka or nats\n", *bus)
		return 2
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
	return runDemo(pool, opts, *uiAddr)
}

// runDemo runs the program, then serves the UI when uiAddr is set.
func runDemo(pool *pgxpool.Pool, opts shop.DemoOptions, uiAddr string) int {
	if uiAddr == "" {
		return shop.Main(context.Background(), os.Stdout, opts)
	}
	opts.Keep = true
	opts.SchemaPrefix = fmt.Sprintf("%s_ui%d", shop.SchemaPrefixDefault, os.Getpid())
	code := shop.Main(context.Background(), os.Stdout, opts)
	if err := serveUI(pool, opts.SchemaPrefix, uiAddr); err != nil {
		fmt.Println("demo: web UI:", err)
		return 1
	}
	return code
}

// natsBus connects to url, or to a throwaway nats-server when url is "",
// and creates the demo's streams; stop closes it all.
func natsBus(url string) (shop.NATSBus, func(), error) {
	stop := func() {}
	if url == "" {
		dir, err := os.MkdirTemp("", "sagaflow-demo-nats-")
		if err != nil {
			return shop.NATSBus{}, stop, err
		}
		srv, err := natstest.StartServer(dir)
		if err != nil {
			_ = os.RemoveAll(dir)
			return shop.NATSBus{}, stop, fmt.Errorf("%w (or pass -nats-url with a NATS server that has JetStream)", err)
		}
		url = srv.URL()
		stop = func() { srv.Kill(); _ = os.RemoveAll(dir) }
	}
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second))
	if err != nil {
		stop()
		return shop.NATSBus{}, func() {}, fmt.Errorf("connect to NATS at %s: %w", url, err)
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = shop.SetupNATS(ctx, js)
		cancel()
	}
	if err != nil {
		nc.Close()
		stop()
		return shop.NATSBus{}, func() {}, fmt.Errorf("NATS at %s: %w", url, err)
	}
	prev := stop
	return shop.NATSBus{JS: js, URL: url}, func() { nc.Close(); prev() }, nil
}
