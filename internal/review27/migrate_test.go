package review27_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/migrations"
)

// README: "`migrations.Script(schema)` (`sagaflow migrate --print`) is one
// script ... Every script records its version, so migrations.Check and the
// engine see the schema as migrated." `help migrate`: "Neither needs a
// database." The script is the same every time, applies cleanly to an empty
// schema, and `sagaflow migrate` then has nothing to do.
func TestMigratePrintIsStableAndApplies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t) // exists, empty
	// No database URL anywhere: --print needs none.
	r1 := runEnv(t, nil, 30e9, "--schema", schema, "migrate", "--print")
	want(t, r1, 0)
	r2 := runEnv(t, nil, 30e9, "migrate", "--print", "--schema", schema)
	want(t, r2, 0)
	if r1.stdout != r2.stdout || !strings.Contains(r1.stdout, `"`+schema+`"`) {
		t.Fatalf("migrate --print is not stable, or does not name the schema")
	}
	if _, err := pool.Exec(ctx, r1.stdout); err != nil {
		t.Fatalf("the printed script does not apply to an empty schema: %v", err)
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatalf("after the printed script: %v", err)
	}
	d := &testkit.DB{Pool: pool, Schema: schema}
	r := cli(t, d, "migrate")
	want(t, r, 0)
	if strings.Contains(r.stdout, "applied") {
		t.Fatalf("migrate after the printed script applied something:\n%s", r)
	}
	want(t, cli(t, d, "list"), 0)

	// A schema that does not exist yet: the script creates it.
	fresh := "r27_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+fresh+` CASCADE`) })
	r = runEnv(t, nil, 30e9, "--schema", fresh, "migrate", "--print")
	want(t, r, 0)
	if _, err := pool.Exec(ctx, r.stdout); err != nil {
		t.Fatalf("the printed script does not apply to a missing schema: %v", err)
	}
	if err := migrations.Check(ctx, pool, fresh); err != nil {
		t.Fatal(err)
	}
	// The documented counterpart: on a migrated schema the script fails
	// ("It is for a schema never migrated"), and `migrate` is a no-op.
	if _, err := pool.Exec(ctx, r.stdout); err == nil {
		t.Logf("note: the script applied twice without error")
	}
}

// `help migrate`: "--export dir  write one SQL file per migration version for
// --schema into dir ... (needs no database)"; migrations.Export "refuses to
// overwrite a file that exists with other content". Exporting twice gives the
// same files; applied in order they migrate an empty schema; a conflicting
// file is refused, not overwritten.
func TestMigrateExport(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	dir := filepath.Join(t.TempDir(), "db", "migrations")
	r := runEnv(t, nil, 30e9, "--schema", schema, "migrate", "--export", dir)
	want(t, r, 0)
	files, _ := filepath.Glob(filepath.Join(dir, "*.sql"))
	all, _ := migrations.All()
	if len(files) != len(all) || len(files) == 0 {
		t.Fatalf("export wrote %d files, want %d:\n%s", len(files), len(all), r)
	}
	first := map[string]string{}
	for _, f := range files {
		b, _ := os.ReadFile(f)
		first[f] = string(b)
	}
	r = runEnv(t, nil, 30e9, "--schema", schema, "migrate", "--export", dir)
	want(t, r, 0)
	for f, b := range first {
		if now, _ := os.ReadFile(f); string(now) != b {
			t.Fatalf("second export changed %s", f)
		}
	}
	slices.Sort(files)
	for _, f := range files {
		if _, err := pool.Exec(ctx, first[f]); err != nil {
			t.Fatalf("apply %s: %v", filepath.Base(f), err)
		}
	}
	if err := migrations.Check(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	// Another schema's export into the same dir: other content, refused.
	if err := os.WriteFile(files[0], []byte("-- mine\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r = runEnv(t, nil, 30e9, "--schema", schema, "migrate", "--export", dir)
	if r.code == 0 {
		t.Fatalf("export overwrote or ignored a conflicting file:\n%s", r)
	}
	if b, _ := os.ReadFile(files[0]); string(b) != "-- mine\n" {
		t.Fatalf("export overwrote a conflicting file")
	}
	t.Logf("conflicting export: exit %d: %s", r.code, r.stderr)
	// An export into a path that is a file.
	r = runEnv(t, nil, 30e9, "--schema", schema, "migrate", "--export", files[1])
	if r.code == 0 {
		t.Fatalf("export into a file path succeeded:\n%s", r)
	}
}

// `sagaflow migrate` on a fresh schema, three operators at once: each exits
// 0 and the schema ends at the current version ("under an advisory lock").
func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.NewSchema(t)
	d := &testkit.DB{Pool: pool, Schema: schema}
	var wg sync.WaitGroup
	res := make([]result, 3)
	for i := range res {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = cli(t, d, "migrate") }()
	}
	wg.Wait()
	applied := 0
	for _, r := range res {
		want(t, r, 0)
		applied += strings.Count(r.stdout, "applied ")
	}
	all, _ := migrations.All()
	if applied != len(all) {
		t.Fatalf("three concurrent migrates applied %d migrations in all, want each of %d once", applied, len(all))
	}
	if err := migrations.Check(context.Background(), pool, schema); err != nil {
		t.Fatal(err)
	}
	r := cli(t, d, "migrate", "--json")
	want(t, r, 0)
	jsonDoc(t, r)
}

// `migrate --print-grants ROLE`: the GRANTs for ROLE. A role name that needs
// quoting (a space, a quote, a statement) is either refused (exit 2) or
// quoted so that the grants apply to exactly that role and run nothing else.
func TestMigratePrintGrantsQuotesTheRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	for _, role := range []string{
		"orders_app",
		"Orders App",
		`r27"; DROP TABLE ` + d.Schema + `.saga_instances; --`,
		`r27'; DROP TABLE ` + d.Schema + `.outbox; --`,
		"r27\u202erole",
	} {
		r := runEnv(t, nil, 30e9, "--schema", d.Schema, "migrate", "--print-grants", role)
		if r.code == 2 {
			continue
		}
		want(t, r, 0)
		err := pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()); err != nil {
				return fmt.Errorf("create role: %w", err)
			}
			if _, err := tx.Exec(ctx, r.stdout); err != nil {
				return fmt.Errorf("apply grants: %w", err)
			}
			var ok bool
			if err := tx.QueryRow(ctx, `SELECT has_table_privilege($1, $2, 'SELECT,INSERT,UPDATE,DELETE')`, role, d.Schema+".saga_instances").Scan(&ok); err != nil || !ok {
				return fmt.Errorf("role has no privileges after the grants: %v %v", ok, err)
			}
			return errRollback
		})
		if err != errRollback {
			t.Fatalf("role %q: %v\n%s", role, err, r.stdout)
		}
		var n int
		if err := d.Pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name IN ('saga_instances','outbox')`, d.Schema).Scan(&n); err != nil || n != 2 {
			t.Fatalf("role %q: tables gone after applying the grants: %d %v", role, n, err)
		}
	}
	// Conflicting modes are not documented as refused; they are logged here
	// for FINDINGS.md (O-item): one flag silently wins.
	for _, args := range [][]string{
		{"migrate", "--print", "--print-grants", "orders_app"},
		{"migrate", "--print-grants", "orders_app", "--export", filepath.Join(t.TempDir(), "x")},
	} {
		r := runEnv(t, nil, 30e9, append([]string{"--schema", d.Schema}, args...)...)
		t.Logf("%v: exit %d, stdout starts %q", args, r.code, short(r.stdout))
	}
}

var errRollback = fmt.Errorf("rollback")
