package testkit

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

// DB is a migrated schema on the test database and a pool to reach it.
// The pool's search_path is left alone: SQL qualifies names with Schema
// (see [DB.Table]).
type DB struct {
	Pool   *pgxpool.Pool
	Schema string
}

// NewDB returns a migrated schema that holds no rows, with
// [pgtest.Migrated]: one that an earlier test of the package migrated and
// gave back emptied, or a new one, migrated here. Its pool is closed when
// the test ends, and the schema emptied for the next test or dropped.
func NewDB(tb testing.TB) *DB {
	tb.Helper()
	pool, schema := pgtest.Migrated(tb)
	return &DB{Pool: pool, Schema: schema}
}

// Migrate applies the migrations to schema, which the caller created (and
// drops), and returns it with pool.
func Migrate(tb testing.TB, pool *pgxpool.Pool, schema string) *DB {
	tb.Helper()
	if _, err := migrations.Migrate(context.Background(), pool, schema); err != nil {
		tb.Fatalf("testkit: migrate schema %s: %v", schema, err)
	}
	return &DB{Pool: pool, Schema: schema}
}

// Table is the table name qualified with the schema and quoted, for SQL.
func (d *DB) Table(name string) string { return pgx.Identifier{d.Schema, name}.Sanitize() }

// Count runs query, which must return one row of one integer, and returns
// the integer.
func (d *DB) Count(tb testing.TB, query string, args ...any) int {
	tb.Helper()
	var n int
	if err := d.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		tb.Fatalf("testkit: count: %v\n%s", err, query)
	}
	return n
}
