package store

import "github.com/sagaflow/sagaflow/migrations"

// SchemaDefault is the schema sagaflow uses when none is configured.
const SchemaDefault = migrations.SchemaDefault

// ValidateSchema reports whether name can be used as sagaflow's schema (see
// [migrations.ValidateSchema]).
func ValidateSchema(name string) error { return migrations.ValidateSchema(name) }

func quoteSchema(name string) string { return migrations.QuoteSchema(name) }
