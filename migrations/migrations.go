// Package migrations holds sagaflow's numbered SQL migrations, embedded into
// the binary. They are applied by [github.com/sagaflow/sagaflow/store.Migrate]
// or printed by [github.com/sagaflow/sagaflow/store.MigrationSQL] for teams that
// run their own migration tool.
//
// Each file is named NNN_name.up.sql. The placeholder {{schema}} stands for
// the quoted target schema and is replaced when a migration is applied or
// printed; the files are not meant to be run as they are.
package migrations

import "embed"

// FS holds the migration files.
//
//go:embed *.up.sql
var FS embed.FS
