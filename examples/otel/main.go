// Command otel wires sagaflow to OpenTelemetry's SDK: traces to any OTLP
// collector (Jaeger, Tempo, the OpenTelemetry Collector) over HTTP, and
// metrics for Prometheus to scrape. It is a module of its own, so that
// sagaflow itself depends on OpenTelemetry's API only.
//
//	DATABASE_URL=postgres://localhost/shop go run . -listen :8080
//	curl -X POST localhost:8080/orders         # starts a checkout saga in a span
//	curl localhost:8080/metrics                # sagaflow.* metrics, Prometheus format
//	curl localhost:8080/healthz/readyz         # the engine's health
//
// The OTLP endpoint comes from the standard environment
// (OTEL_EXPORTER_OTLP_ENDPOINT, default http://localhost:4318); with no
// collector running the spans are dropped and the saga runs all the same.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// order is the checkout saga's state.
type order struct {
	OrderID string `json:"order_id"`
}

var checkout = saga.Define("checkout",
	saga.Step[order]{Name: "reserve", Action: logStep},
	saga.Step[order]{Name: "charge", Action: logStep},
	saga.Step[order]{Name: "ship", Action: logStep},
)

// logStep logs through the step's logger: the record carries the saga's
// attributes and the trace id.
func logStep(ctx context.Context, run *saga.StepRun, o *order) error {
	saga.Logger(ctx).InfoContext(ctx, "step ran", "order_id", o.OrderID)
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "otel:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", ":8080", "HTTP address for /orders, /metrics and /healthz/")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	res := resource.NewSchemaless(semconv.ServiceName("orders"))
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	prom, err := prometheus.New()
	if err != nil {
		return err
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(prom), sdkmetric.WithResource(res))
	defer func() {
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tp.Shutdown(shutdown)
		_ = mp.Shutdown(shutdown)
	}()
	// sagaflow uses the global providers unless its configs name others.
	otel.SetTracerProvider(tp)
	otel.SetMeterProvider(mp)

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	const schema = "sagaflow_otel"
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		return err
	}
	engine, err := saga.New(pool, &saga.Config{Schema: schema, Logger: slog.Default()})
	if err != nil {
		return err
	}
	if err := engine.Register(checkout); err != nil {
		return err
	}
	if err := engine.Start(ctx); err != nil {
		return err
	}
	defer func() { _ = engine.Stop(context.Background()) }()

	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.Handler())
	mux.Handle("/healthz/", health.Handler(engine.Health))
	tracer := tp.Tracer("example.com/orders")
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		ctx, span := tracer.Start(r.Context(), "POST /orders")
		defer span.End()
		id := fmt.Sprintf("o-%d", time.Now().UnixNano())
		st, err := saga.Start(ctx, engine, checkout, order{OrderID: id}, &saga.StartOpts{BusinessKey: id})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, "saga %s, trace %s\n", st.ID, span.SpanContext().TraceID())
	})
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Shutdown(context.Background())
	}()
	slog.Info("listening", "addr", *listen)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
