package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

func TestMigrate(t *testing.T) {
	t.Parallel()
	_, schema := pgtest.NewSchema(t) // empty: nothing migrated yet
	url := pgtest.ConnString(t)
	cli := func(args ...string) result {
		return runCLI(t, nil, append([]string{"--database-url", url, "--schema", schema}, args...)...)
	}

	ms, err := migrations.All()
	require.NoError(t, err)
	latest := strconv.Itoa(ms[len(ms)-1].Version)
	out := cli("migrate").ok(t)
	require.Contains(t, out, "applied 001_core\n")
	require.Contains(t, out, `schema "`+schema+`" is at version `+latest)

	out = cli("migrate").ok(t)
	require.Equal(t, `schema "`+schema+`" is up to date (version `+latest+`)`+"\n", out)

	type migrated struct {
		Schema  string
		Applied []struct{ Version int }
		Version int
	}
	m := decode[migrated](t, cli("migrate", "--json"))
	require.Equal(t, migrated{Schema: schema, Applied: []struct{ Version int }{}, Version: ms[len(ms)-1].Version}, m)
}

func TestMigratePrint(t *testing.T) {
	t.Parallel()
	// No database URL anywhere: --print does not need one.
	out := runCLI(t, nil, "--schema", "billing", "migrate", "--print").ok(t)
	require.Contains(t, out, `CREATE TABLE "billing".saga_instances`)
	require.Contains(t, out, `INSERT INTO "billing".sagaflow_migrations`)

	out = runCLI(t, map[string]string{"SAGAFLOW_SCHEMA": "from_env"}, "migrate", "--print").ok(t)
	require.Contains(t, out, `CREATE TABLE "from_env".saga_instances`)

	out = runCLI(t, nil, "migrate", "--print").ok(t)
	require.Contains(t, out, `CREATE TABLE "sagaflow".saga_instances`)

	doc := decode[struct{ Schema, SQL string }](t, runCLI(t, nil, "migrate", "--print", "--json"))
	require.Equal(t, "sagaflow", doc.Schema)
	require.Contains(t, doc.SQL, "CREATE TABLE")
}

func TestMigrateExport(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "out")
	out := runCLI(t, nil, "--schema", "billing", "migrate", "--export", dir).ok(t)
	files := strings.Fields(out)
	require.NotEmpty(t, files)
	require.Equal(t, filepath.Join(dir, "001_core.up.sql"), files[0])
	body, err := os.ReadFile(files[0])
	require.NoError(t, err)
	require.Contains(t, string(body), `CREATE TABLE "billing".saga_instances`)
	require.Contains(t, string(body), `INSERT INTO "billing".sagaflow_migrations (version, name) VALUES (1, 'core')`)

	doc := decode[struct{ Files []string }](t, runCLI(t, nil, "--schema", "billing", "migrate", "--export", dir, "--json"))
	require.Equal(t, files, doc.Files)
}

func TestMigrateBadSchema(t *testing.T) {
	t.Parallel()
	url := pgtest.ConnString(t)
	for _, args := range [][]string{
		{"--database-url", url, "--schema", "bad-name", "migrate"},
		{"--schema", "bad-name", "migrate", "--print"},
		{"--database-url", url, "migrate", "--schema", "pg_catalog"},
	} {
		msg := runCLI(t, nil, args...).failed(t, exitUsage)
		require.Contains(t, msg, "--schema", args)
		require.Contains(t, msg, "invalid schema name", args)
	}
	r := runCLI(t, nil, "--json", "--schema", "bad-name", "migrate", "--print")
	require.Equal(t, exitUsage, r.code)
	require.Empty(t, r.stderr)
	e := decode[jsonError](t, r)
	require.Equal(t, exitUsage, e.Code)
	require.Contains(t, e.Error, `"bad-name"`)
}

func TestMigratePrintGrants(t *testing.T) {
	t.Parallel()
	out := runCLI(t, nil, "--schema", "shop", "migrate", "--print-grants", "orders_app").ok(t)
	require.Contains(t, out, `GRANT USAGE ON SCHEMA "shop" TO "orders_app";`)
	require.Contains(t, out, `GRANT SELECT ON "shop".sagaflow_migrations TO "orders_app";`)
	require.NotContains(t, out, "CREATE")
	for _, role := range []string{"", "public", "a\x1b[2Jb"} {
		r := runCLI(t, nil, "--schema", "shop", "migrate", "--print-grants", role)
		require.Equal(t, exitUsage, r.code, "%q", role)
		require.NotContains(t, r.stderr, "\x1b", "escaped")
		require.Contains(t, r.stderr, "print-grants")
	}
	require.Contains(t, runCLI(t, nil, "help", "migrate").ok(t), "--print-grants")
}
