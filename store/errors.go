package store

import "errors"

// ErrInvalidSchema is returned for a schema name that sagaflow refuses to use.
var ErrInvalidSchema = errors.New("store: invalid schema name")

// ErrNotFound is returned when a saga does not exist.
var ErrNotFound = errors.New("store: not found")
