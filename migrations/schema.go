package migrations

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// SchemaDefault is the schema sagaflow uses when none is configured.
const SchemaDefault = "sagaflow"

// schemaMaxLen keeps derived names (the notification channel is the schema
// name plus a suffix) under PostgreSQL's 63-byte identifier limit.
const schemaMaxLen = 48

var schemaPattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// ValidateSchema reports whether name can be used as sagaflow's schema: a
// letter or underscore followed by letters, digits or underscores, at most 48
// bytes, and not one of PostgreSQL's reserved pg_ names. Names are quoted in
// every statement as well; validation keeps them readable and portable.
func ValidateSchema(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrInvalidSchema)
	case len(name) > schemaMaxLen:
		return fmt.Errorf("%w: %q is longer than %d bytes", ErrInvalidSchema, name, schemaMaxLen)
	case !schemaPattern.MatchString(name):
		return fmt.Errorf("%w: %q must start with a letter or underscore and contain only letters, digits and underscores", ErrInvalidSchema, name)
	case len(name) >= 3 && (name[:3] == "pg_" || name[:3] == "PG_"):
		return fmt.Errorf("%w: %q uses the reserved pg_ prefix", ErrInvalidSchema, name)
	}
	return nil
}

// QuoteSchema returns the schema as a quoted SQL identifier.
func QuoteSchema(name string) string {
	return pgx.Identifier{name}.Sanitize()
}

// ErrInvalidSchema is returned for a schema name that sagaflow refuses to use.
var ErrInvalidSchema = errors.New("sagaflow: invalid schema name")

// ErrNotMigrated is returned by [Check] for a schema that lacks migrations
// this version of sagaflow needs.
var ErrNotMigrated = errors.New("sagaflow: schema not migrated")
