package shop

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/examples/checkout/spantree"
	"github.com/sagaflow/sagaflow/idempotency"
)

// SchemaPrefixDefault starts the names of the schemas Demo creates.
const SchemaPrefixDefault = "checkout"

// DemoEscalationDefault is the demo's escalation: the 48 hours an order
// waits for its delivery in production (EscalationDefault), compressed so
// that the demo's lost parcel is cancelled and refunded while you watch.
const DemoEscalationDefault = 3 * time.Second

// serviceMaxConns is the least pool size of each service: its relay, its
// engine's workers and listener, and its consumers hold connections at once.
const serviceMaxConns = 12

// DemoOptions are what the checkout program runs on: one PostgreSQL
// database, in which each service gets a schema of its own (in production
// each would have its own database), and one Kafka cluster.
type DemoOptions struct {
	// DSN is the PostgreSQL connection string. Required.
	DSN string
	// Brokers are the Kafka brokers. Required unless Bus is set. The topics
	// in Topics must exist, or the cluster must create them.
	Brokers []string
	// Bus, when set, carries the messages instead of Kafka (NATSBus, whose
	// streams SetupNATS creates).
	Bus Bus
	// Dialer connects to the brokers (TLS, SASL: see package kafkaconfig).
	// Defaults to plain TCP.
	Dialer *kafka.Dialer
	// SchemaPrefix starts the schemas' names: prefix_<run>_orders,
	// prefix_<run>_inventory and so on, where <run> is random, so that runs
	// on one database do not meet. Defaults to SchemaPrefixDefault.
	SchemaPrefix string
	// Keep leaves the schemas in the database after the run, to look at;
	// by default they are dropped.
	Keep bool
	// Logger receives the services' logs. Defaults to a logger that drops
	// them.
	Logger *slog.Logger
	// Escalation is how long an order waits for the carrier's "delivered"
	// webhook before it is cancelled and refunded (Env.Escalation).
	// Defaults to DemoEscalationDefault.
	Escalation time.Duration
}

// Demo runs the checkout program: it creates a schema per service, starts
// the system and the order service's HTTP API (behind the idempotency
// middleware) on 127.0.0.1, places the demo's orders, prints their timelines
// and a summary to out, stops everything and drops the schemas (unless
// Keep). It returns every scenario's result; see PrintSummary for whether
// all passed.
func Demo(ctx context.Context, out io.Writer, opts DemoOptions) (results []Result, err error) {
	if opts.DSN == "" {
		return nil, errors.New("shop: no PostgreSQL connection string")
	}
	if len(opts.Brokers) == 0 && opts.Bus == nil {
		return nil, errors.New("shop: no Kafka brokers and no other bus")
	}
	if opts.SchemaPrefix == "" {
		opts.SchemaPrefix = SchemaPrefixDefault
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	run, err := randomHex(3)
	if err != nil {
		return nil, err
	}

	if opts.Escalation <= 0 {
		opts.Escalation = DemoEscalationDefault
	}
	// Every service's spans are recorded in memory, so that the summary can
	// draw one order's trace across the four services.
	spans := &spantree.Recorder{}
	env := Env{Brokers: opts.Brokers, Dialer: opts.Dialer, Bus: opts.Bus, Logger: opts.Logger, Escalation: opts.Escalation, Tracing: spans.Provider}
	for _, svc := range []struct {
		db   *DB
		name string
	}{{&env.Orders, "orders"}, {&env.Inventory, "inventory"}, {&env.Payments, "payments"}, {&env.Shipping, "shipping"}} {
		schema := opts.SchemaPrefix + "_" + run + "_" + svc.name
		pool, err := servicePool(ctx, opts.DSN)
		if err != nil {
			return nil, err
		}
		*svc.db = DB{Pool: pool, Schema: schema}
		defer func() {
			if !opts.Keep {
				_, dropErr := pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
				if dropErr != nil {
					err = errors.Join(err, fmt.Errorf("shop: drop schema %s: %w", schema, dropErr))
				}
			}
			pool.Close()
		}()
	}

	sys, err := Start(ctx, env) // migrations.Migrate creates the schemas
	if err != nil {
		return nil, err
	}
	defer sys.Stop()
	mw, err := idempotency.New(env.Orders.Pool, &idempotency.Config{Schema: env.Orders.Schema, Required: true, Logger: opts.Logger,
		// The demo has no authentication: its one client shares one set of keys.
		Identity: idempotency.SharedIdentity})
	if err != nil {
		return nil, err
	}
	ln, err := listen()
	if err != nil {
		return nil, fmt.Errorf("shop: order service: %w", err)
	}
	srv := &http.Server{Handler: traced(spans.Provider("orders"), sys.Handler(mw.Wrap)), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()
	fmt.Fprintf(out, "Order service: %s (POST /orders, GET /orders/{id}, POST %s); schemas: %s, %s, %s, %s\n",
		base, WebhookPath, env.Orders.Schema, env.Inventory.Schema, env.Payments.Schema, env.Shipping.Schema)
	fmt.Fprintf(out, "Time is compressed: an order waits %s for its delivery (%s in production) before it is cancelled and refunded.\n",
		opts.Escalation, EscalationDefault)
	if opts.Keep {
		fmt.Fprintln(out, "The schemas are kept after the run.")
	}
	results, err = sys.Run(ctx, base, out)
	if err == nil {
		drawOrderTrace(ctx, out, spans, env.Orders, results)
	}
	return results, err
}

// traced starts a span for every request to the order service, as an
// instrumented HTTP server would: an order's trace begins at POST /orders.
func traced(tp trace.TracerProvider, next http.Handler) http.Handler {
	tracer := tp.Tracer("checkout/http")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := r.Method + " " + r.URL.Path
		if strings.HasPrefix(r.URL.Path, "/orders/") {
			name = r.Method + " /orders/{id}"
		}
		ctx, span := tracer.Start(r.Context(), name, trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// drawOrderTrace prints the span tree of the first order that completed:
// its trace, from POST /orders through the inventory, payment and shipping
// services and back, with each span's service and duration.
func drawOrderTrace(ctx context.Context, out io.Writer, spans *spantree.Recorder, orders DB, results []Result) {
	for _, r := range results {
		if !r.OK || !strings.HasPrefix(r.Got, "completed") {
			continue
		}
		var tc *string
		err := orders.Pool.QueryRow(ctx, "SELECT trace_context FROM "+orders.table("saga_instances")+
			" WHERE saga_name = 'checkout' AND business_key = $1", r.OrderID).Scan(&tc)
		if err != nil || tc == nil {
			fmt.Fprintf(out, "\nNo trace for order %s: %v\n", r.OrderID, err)
			return
		}
		parts := strings.Split(strings.SplitN(*tc, "\n", 2)[0], "-")
		if len(parts) != 4 {
			return
		}
		id, err := trace.TraceIDFromHex(parts[1])
		if err != nil {
			return
		}
		// The last spans (the relay's marking, a consumer's commit) end a
		// moment after the saga does.
		time.Sleep(500 * time.Millisecond)
		fmt.Fprintf(out, "\nOrder %s (%s) as one trace:\n", r.OrderID, r.Scenario)
		spans.Draw(out, id)
		return
	}
}

// Main is the checkout program once it knows its PostgreSQL and Kafka: it
// runs Demo, prints the summary and returns the exit status, 0 when every
// order ended as expected.
func Main(ctx context.Context, out io.Writer, opts DemoOptions) int {
	started := time.Now()
	results, err := Demo(ctx, out, opts)
	ok := len(results) > 0 && PrintSummary(out, results)
	if err != nil {
		fmt.Fprintln(out, "checkout:", err)
		return 1
	}
	fmt.Fprintf(out, "\n%d orders in %s: ", len(results), time.Since(started).Round(time.Millisecond))
	if !ok {
		fmt.Fprintln(out, "some ended unexpectedly")
		return 1
	}
	fmt.Fprintln(out, "every order ended as expected")
	return 0
}

// servicePool connects one service's pool to dsn.
func servicePool(ctx context.Context, dsn string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("shop: parse the PostgreSQL connection string: %w", err)
	}
	cfg.MaxConns = max(cfg.MaxConns, serviceMaxConns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("shop: connect to PostgreSQL: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("shop: connect to PostgreSQL: %w", err)
	}
	return pool, nil
}

// randomHex returns n random bytes in hex.
func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("shop: name the run: %w", err)
	}
	return hex.EncodeToString(b), nil
}
