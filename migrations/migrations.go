// Package migrations owns sagaflow's tables: its numbered SQL migrations,
// embedded into the binary, and the calls that apply, print, export and check
// them.
//
//   - [Migrate] applies what a schema lacks, under an advisory lock.
//   - [Script] prints every migration as one script, and [Export] writes one
//     file per version, for teams that run goose, atlas, tern or their own
//     tool. Each script records its version, so [Check] and the engine see
//     the schema as migrated either way.
//   - [Check] tells whether a schema has everything this sagaflow needs.
//   - [Grants] prints the run-time grants for a role without DDL.
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
