package store

import "errors"

// ErrInvalidSchema is returned for a schema name that sagaflow refuses to use.
var ErrInvalidSchema = errors.New("store: invalid schema name")

// ErrNotFound is returned when a saga does not exist.
var ErrNotFound = errors.New("store: not found")

// ErrMalformedCursor is returned for a listing cursor that no listing wrote.
var ErrMalformedCursor = errors.New("store: malformed cursor")

// ErrSchemaNotMigrated is returned by [CheckSchema] for a schema that lacks
// migrations this version of sagaflow needs.
var ErrSchemaNotMigrated = errors.New("store: schema not migrated")
