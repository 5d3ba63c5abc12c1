// Package pgerr classifies PostgreSQL errors by what retrying them can
// achieve, so that a message whose bytes PostgreSQL refuses is dead-lettered
// at once instead of being retried forever.
package pgerr

import (
	"errors"

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
