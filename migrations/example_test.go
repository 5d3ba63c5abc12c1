package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

// Migrate brings a schema up to date, under an advisory lock, at a
// service's start or in a deploy step. Running it again does nothing.
func ExampleMigrate() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()

	err := migrations.Check(ctx, pool, schema)
	fmt.Println("before: not migrated", errors.Is(err, migrations.ErrNotMigrated))

	res, err := migrations.Migrate(ctx, pool, schema)
	if err != nil {
		panic(err)
	}
	all, err := migrations.All()
	if err != nil {
		panic(err)
	}
	fmt.Println("applied every migration", len(res.Applied) == len(all), "version is the last", res.Version == all[len(all)-1].Version)
	fmt.Println("first:", res.Applied[0].FileName())

	again, err := migrations.Migrate(ctx, pool, schema)
	if err != nil {
		panic(err)
	}
	fmt.Println("again: applied", len(again.Applied))
	fmt.Println("after: check", migrations.Check(ctx, pool, schema))
	// Output:
	// before: not migrated true
	// applied every migration true version is the last true
	// first: 001_core.up.sql
	// again: applied 0
	// after: check <nil>
}

// Script is every migration as one script, for a team that applies SQL
// with its own tool (psql, a deploy pipeline). The script records the
// versions it applies, so the engine, Check and Migrate see the schema as
// up to date.
func ExampleScript() {
	script, err := migrations.Script("billing")
	if err != nil {
		panic(err)
	}
	for _, line := range strings.Split(script, "\n")[:6] {
		fmt.Println(line)
	}

	// Applied as it is, here through pgx, on a fresh schema:
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	script, err = migrations.Script(schema)
	if err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, script); err != nil {
		panic(err)
	}
	fmt.Println("check:", migrations.Check(ctx, pool, schema))
	res, err := migrations.Migrate(ctx, pool, schema)
	if err != nil {
		panic(err)
	}
	fmt.Println("migrate applied:", len(res.Applied))
	// Output:
	// -- sagaflow migrations for schema billing
	// DO $sagaflow$ BEGIN
	//     IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'billing') THEN
	//         EXECUTE 'CREATE SCHEMA "billing"';
	//     END IF;
	// END $sagaflow$;
	// check: <nil>
	// migrate applied: 0
}

// Export writes one file per version, for goose, atlas or tern: each file
// creates what it needs and records its version.
func ExampleExport() {
	dir, err := os.MkdirTemp("", "sagaflow-migrations-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)

	paths, err := migrations.Export(dir, "billing")
	if err != nil {
		panic(err)
	}
	all, err := migrations.All()
	if err != nil {
		panic(err)
	}
	fmt.Println("one file per version:", len(paths) == len(all))
	first, err := os.ReadFile(paths[0])
	if err != nil {
		panic(err)
	}
	fmt.Println(filepath.Base(paths[0]))
	fmt.Println("records its version:", strings.Contains(string(first),
		`INSERT INTO "billing".sagaflow_migrations (version, name) VALUES (1, 'core')`))
	// Output:
	// one file per version: true
	// 001_core.up.sql
	// records its version: true
}
