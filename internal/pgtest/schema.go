package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
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
	withWidthCheck(tb, cfg.ConnConfig)

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

// dropSchema drops the schema name and everything in it, over a connection
// of its own (see withAdminConn).
func dropSchema(connStr, name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	return withAdminConn(ctx, connStr, func(conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, "drop schema if exists "+pgx.Identifier{name}.Sanitize()+" cascade")
		return err
	})
}

// admin is a small pool, kept while Main runs the tests, for dropping and
// emptying the tests' schemas: a new connection costs the server a backend
// (tens of milliseconds of CPU on a small virtual machine), once or twice
// per test otherwise.
var admin struct {
	mu   sync.Mutex
	main bool
	pool *pgxpool.Pool
}

// withAdminConn runs f on a connection of the admin pool while Main runs
// the tests, or on a connection of its own otherwise, which it closes.
func withAdminConn(ctx context.Context, connStr string, f func(conn *pgx.Conn) error) error {
	admin.mu.Lock()
	if admin.main && admin.pool == nil {
		cfg, err := pgxpool.ParseConfig(connStr)
		if err != nil {
			admin.mu.Unlock()
			return err
		}
		cfg.MaxConns = 4
		if admin.pool, err = pgxpool.NewWithConfig(context.WithoutCancel(ctx), cfg); err != nil {
			admin.mu.Unlock()
			return err
		}
	}
	pool := admin.pool
	admin.mu.Unlock()
	if pool != nil {
		var c *pgxpool.Conn
		if err := whileServerFull(ctx, func() (err error) {
			c, err = pool.Acquire(ctx)
			return err
		}); err != nil {
			return err
		}
		defer c.Release()
		return f(c.Conn())
	}
	var conn *pgx.Conn
	if err := whileServerFull(ctx, func() (err error) {
		conn, err = pgx.Connect(ctx, connStr)
		return err
	}); err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return f(conn)
}

// startAdmin lets withAdminConn keep its pool; stopAdmin closes it.
func startAdmin() {
	admin.mu.Lock()
	defer admin.mu.Unlock()
	admin.main = true
}

func stopAdmin() {
	admin.mu.Lock()
	defer admin.mu.Unlock()
	admin.main = false
	if admin.pool != nil {
		admin.pool.Close()
		admin.pool = nil
	}
}
