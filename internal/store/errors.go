package store

import (
	"errors"

	"github.com/sagaflow/sagaflow/migrations"
)

// ErrInvalidSchema is returned for a schema name that sagaflow refuses to use.
var ErrInvalidSchema = migrations.ErrInvalidSchema

// ErrNotFound is returned when a saga does not exist.
var ErrNotFound = errors.New("store: not found")

// ErrMalformedCursor is returned for a listing cursor that no listing wrote.
var ErrMalformedCursor = errors.New("store: malformed cursor")
