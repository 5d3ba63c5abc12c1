package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// serveUI serves the web UI (package ui) on addr over the order service's
// schema of the run whose schemas start with prefix, until interrupted, and
// then drops the run's schemas. Everything is shown and every action is
// allowed: it listens for the person running the demo.
func serveUI(pool *pgxpool.Pool, prefix, addr string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	defer dropSchemas(pool, prefix)
	var schema string
	err := pool.QueryRow(ctx, `SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1) AND nspname LIKE '%\_orders'`,
		prefix+"_").Scan(&schema)
	if err != nil {
		return fmt.Errorf("find the order service's schema: %w", err)
	}
	engine, err := saga.New(pool, &saga.Config{Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	h, err := ui.New(pool, engine, &ui.Config{Schema: schema,
		Authorize:     func(*http.Request, string) error { return nil },
		Actor:         func(*http.Request) string { return "the demo's operator" },
		Redact:        func(_ string, state []byte) []byte { return state },
		RedactPayload: func(_ string, p []byte) []byte { return p }})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	fmt.Printf("\nThe web UI shows the run's sagas (schema %s) on http://%s/ ; press Ctrl-C to stop it and drop the schemas.\n"+
		"The services are stopped: a resume or a cancel is recorded and waits for an engine.\n", schema, ln.Addr())
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// dropSchemas drops the run's schemas, which were kept for the UI.
func dropSchemas(pool *pgxpool.Pool, prefix string) {
	ctx := context.Background()
	rows, err := pool.Query(ctx, `SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)`, prefix+"_")
	if err != nil {
		fmt.Println("demo: list the run's schemas:", err)
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		fmt.Println("demo: list the run's schemas:", err)
		return
	}
	for _, n := range names {
		if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{n}.Sanitize()+" CASCADE"); err != nil {
			fmt.Println("demo: drop schema", n, err)
		}
	}
}
