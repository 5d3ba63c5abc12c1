package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	// schemaPoolMaxConns is the size of the pool NewSchema returns.
	schemaPoolMaxConns = 12
	// schemaTimeout bounds each of creating the schema, closing the pool
	// and dropping the schema.
	schemaTimeout = 30 * time.Second
)

// NewSchema creates a fresh, empty schema with a unique random name ("t_"
// and 12 lowercase hex digits) on the server of [ConnString], and returns a
// pool of at most 12 connections to that server together with the schema
// name. The pool's search_path is left alone: SQL must qualify names with
// the schema.
//
// When the test ends, a cleanup closes the pool and then drops the schema
// with CASCADE over a separate, short-lived connection. Closing the pool
// waits for every acquired connection to be released; the test fails if
// one is still held after 30 seconds.
func NewSchema(tb testing.TB) (*pgxpool.Pool, string) {
	tb.Helper()
	connStr := ConnString(tb)
	name, err := randomSchemaName()
	if err != nil {
		tb.Fatalf("pgtest: name schema: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(connStr)
	if err != nil {
		tb.Fatalf("pgtest: parse connection string: %v", err)
	}
	cfg.MaxConns = schemaPoolMaxConns

	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: create pool for schema %s: %v", name, err)
	}
	tb.Cleanup(func() {
		if err := closePool(pool, schemaTimeout); err != nil {
			tb.Errorf("pgtest: close pool of schema %s: %v", name, err)
		}
		if err := dropSchema(connStr, name); err != nil {
			tb.Errorf("pgtest: drop schema %s: %v", name, err)
		}
	})
	if err := whileServerFull(ctx, func() error {
		_, err := pool.Exec(ctx, "create schema "+pgx.Identifier{name}.Sanitize())
		return err
	}); err != nil {
		tb.Fatalf("pgtest: create schema %s: %v", name, err)
	}
	return pool, name
}

// whileServerFull runs f, and runs it again every 200 ms while it fails
// because the server has no connection slot left (SQLSTATE 53300: test
// packages run side by side, each with its pools, can use up a shared
// server's max_connections for a moment), until ctx ends.
func whileServerFull(ctx context.Context, f func() error) error {
	for {
		err := f()
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "53300" {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// randomSchemaName returns "t_" and 12 random lowercase hex digits.
func randomSchemaName() (string, error) {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "t_" + hex.EncodeToString(b[:]), nil
}

// closePool closes pool, giving up after timeout when a connection is
// still acquired (the Close then finishes in the background once it is
// released).
func closePool(pool *pgxpool.Pool, timeout time.Duration) error {
	done := make(chan struct{})
	go func() {
		pool.Close()
		close(done)
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-done:
		return nil
	case <-timer.C:
		return fmt.Errorf("a connection is still acquired after %v (a Conn, Rows or Tx was not released)", timeout)
	}
}

// dropSchema drops the schema name and everything in it, over its own
// connection.
func dropSchema(connStr, name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	var conn *pgx.Conn
	if err := whileServerFull(ctx, func() (err error) {
		conn, err = pgx.Connect(ctx, connStr)
		return err
	}); err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err := conn.Exec(ctx, "drop schema if exists "+pgx.Identifier{name}.Sanitize()+" cascade")
	return err
}
