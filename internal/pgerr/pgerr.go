// Package pgerr classifies PostgreSQL errors by what retrying them can
// achieve, so that a message whose bytes PostgreSQL refuses is dead-lettered
// at once instead of being retried forever.
package pgerr

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Content reports whether err is PostgreSQL refusing the content of a
// value: a data exception (SQLSTATE class 22: a NUL byte or invalid UTF-8
// in text, a string too long for its column, bad JSON) or a program limit
// (class 54: an index row past the btree limit). The same bytes fail the
// same way on every retry.
func Content(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) != 5 {
		return false
	}
	switch pgErr.Code[:2] {
	case "22", "54":
		return true
	}
	return false
}

// Lock reports whether err is a lock that could not be had now (lock_not_available,
// a deadlock, a serialization failure): trying again later may succeed.
func Lock(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "55P03", "40P01", "40001":
		return true
	}
	return false
}

// Statement reports whether err came from PostgreSQL about a statement (the
// connection is still usable), as opposed to the connection itself.
func Statement(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr)
}

// Undefined reports whether err is PostgreSQL not finding a table or a
// schema (undefined_table, invalid_schema_name): sagaflow's schema is not
// migrated.
func Undefined(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000")
}

// Unique reports whether err is a unique_violation: the row's key is taken.
func Unique(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// Broken reports whether err says the connection it came on is gone (a
// server that restarted or crashed, a terminated backend, a network
// failure), as opposed to a statement PostgreSQL refused on a working
// connection: SQLSTATE class 08 (connection exception) and 57P01–57P03
// (the server shutting down or not yet up), or no server error at all but
// an I/O one. A read that fails so can go again on another connection.
func Broken(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "08") || pgErr.Code == "57P01" || pgErr.Code == "57P02" || pgErr.Code == "57P03"
	}
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, pgconn.ErrConnClosed) || errors.As(err, &netErr)
}

// ReadAttempts is how many times [RetryRead] runs a read whose connection
// broke: a pool can hold several connections that one server restart broke,
// and each is dropped once a query on it fails.
const ReadAttempts = 4

// RetryRead runs read, a query that changes nothing, again when it failed
// on a broken connection (see [Broken]), at most [ReadAttempts] times in
// all, and returns its last error. Health checks use it, so that the first
// probe after a database restart reports the database as it is, not the
// pooled connection the restart broke.
func RetryRead(ctx context.Context, read func(ctx context.Context) error) error {
	var err error
	for range ReadAttempts {
		if err = read(ctx); err == nil || !Broken(err) || ctx.Err() != nil {
			return err
		}
	}
	return err
}
