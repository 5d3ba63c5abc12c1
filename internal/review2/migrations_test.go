package review2_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

func lastVersion(t *testing.T) int {
	t.Helper()
	all, err := migrations.All()
	require.NoError(t, err)
	require.NotEmpty(t, all)
	return all[len(all)-1].Version
}

// Docs: Migrate holds "a session advisory lock so that concurrent callers
// apply each migration once. It creates the schema if needed".
func TestConcurrentMigrateOnFreshSchema(t *testing.T) {
	t.Parallel()
	pool, base := pgtest.NewSchema(t)
	schema := freshSchemaName(t, pool, base, "_fresh")
	all, err := migrations.All()
	require.NoError(t, err)

	const callers = 6
	var wg sync.WaitGroup
	results := make([]*migrations.Result, callers)
	errs := make([]error, callers)
	start := make(chan struct{})
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			results[i], errs[i] = migrations.Migrate(context.Background(), pool, schema)
		}()
	}
	close(start)
	wg.Wait()
	applied := map[int]int{}
	for i := range callers {
		require.NoError(t, errs[i], "caller %d", i)
		require.Equal(t, lastVersion(t), results[i].Version, "caller %d", i)
		for _, m := range results[i].Applied {
			applied[m.Version]++
		}
	}
	require.Len(t, applied, len(all))
	for v, n := range applied {
		require.Equal(t, 1, n, "version %d applied %d times", v, n)
	}
	require.NoError(t, migrations.Check(context.Background(), pool, schema))
}

// Docs (Check): the error "names the schema, the version found (0 for a
// schema never migrated) and the version needed".
func TestCheckNamesSchemaAndVersions(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.NewSchema(t)
	ctx := context.Background()
	want := strconv.Itoa(lastVersion(t))
	err := migrations.Check(ctx, pool, schema)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.Contains(t, err.Error(), schema)
	require.Regexp(t, `\b0\b`, err.Error(), "the version found")
	require.Regexp(t, `\b`+want+`\b`, err.Error(), "the version needed")

	all, err := migrations.All()
	require.NoError(t, err)
	script, err := all[0].Script(schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, script)
	require.NoError(t, err)
	err = migrations.Check(ctx, pool, schema)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.Contains(t, err.Error(), schema)
	require.Contains(t, err.Error(), strconv.Itoa(all[0].Version))
	require.Contains(t, err.Error(), want)

	err = migrations.Check(ctx, pool, `no"such`)
	require.Error(t, err)
	require.NotErrorIs(t, err, migrations.ErrNotMigrated, "an invalid name is not an unmigrated schema")
}

// Docs (Migration.Script): "Run the versions in order, each once." and
// "Each script records its version, so Check and the engine see the schema as
// migrated either way." The worst user runs them out of order, twice, and
// then mixes them with Migrate.
func TestPerVersionScriptsOutOfOrderTwiceAndMixed(t *testing.T) {
	t.Parallel()
	pool, base := pgtest.NewSchema(t)
	ctx := context.Background()
	schema := freshSchemaName(t, pool, base, "_scripts")
	all, err := migrations.All()
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(all), 3)
	scripts := make([]string, len(all))
	for i, m := range all {
		scripts[i], err = m.Script(schema)
		require.NoError(t, err)
	}

	// Out of order: version 2 (a table of its own) before version 1 is
	// accepted by PostgreSQL; Check must still see version 1 missing.
	_, err = pool.Exec(ctx, scripts[1])
	t.Logf("version 2 applied before version 1: %v", err)
	err = migrations.Check(ctx, pool, schema)
	require.ErrorIs(t, err, migrations.ErrNotMigrated)
	require.Contains(t, err.Error(), "001_"+all[0].Name, "Check does not say what is missing")

	// Version 1, then version 1 again.
	_, err = pool.Exec(ctx, scripts[0])
	require.NoError(t, err)
	_, err = pool.Exec(ctx, scripts[0])
	t.Logf("version 1 applied a second time: %v", err)
	require.Error(t, err, "a version applied twice is not refused")
	var versions []int
	rows, err := pool.Query(ctx, "SELECT version FROM "+migrations.QuoteSchema(schema)+".sagaflow_migrations ORDER BY version")
	require.NoError(t, err)
	for rows.Next() {
		var v int
		require.NoError(t, rows.Scan(&v))
		versions = append(versions, v)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []int{all[0].Version, all[1].Version}, versions)

	// Migrate applies exactly what the scripts did not.
	res, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	var applied []int
	for _, m := range res.Applied {
		applied = append(applied, m.Version)
	}
	var rest []int
	for _, m := range all[2:] {
		rest = append(rest, m.Version)
	}
	require.Equal(t, rest, applied)
	require.NoError(t, migrations.Check(ctx, pool, schema))

	// The whole Script on a migrated schema: Migrate still sees it up to date.
	whole, err := migrations.Script(schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, whole)
	t.Logf("Script run on a migrated schema: %v", err)
	res, err = migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
}

// Docs (Script): "The script creates the schema and the version table and
// records each version, so Migrate later sees the schema as up to date."
func TestWholeScriptThenMigrate(t *testing.T) {
	t.Parallel()
	pool, base := pgtest.NewSchema(t)
	ctx := context.Background()
	schema := freshSchemaName(t, pool, base, "_whole")
	whole, err := migrations.Script(schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, whole)
	require.NoError(t, err)
	require.NoError(t, migrations.Check(ctx, pool, schema))
	res, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
	require.Equal(t, lastVersion(t), res.Version)
}

// Docs (Export): "It creates dir when needed and refuses to overwrite a file
// that exists with other content."
func TestExportConflicts(t *testing.T) {
	t.Parallel()
	all, err := migrations.All()
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "a", "b")
	paths, err := migrations.Export(dir, "tenant_one")
	require.NoError(t, err)
	require.Len(t, paths, len(all))
	for i, p := range paths {
		require.Equal(t, filepath.Join(dir, all[i].FileName()), p)
		want, err := all[i].Script("tenant_one")
		require.NoError(t, err)
		got, err := os.ReadFile(p)
		require.NoError(t, err)
		require.Equal(t, want, string(got))
	}
	_, err = migrations.Export(dir, "tenant_one")
	require.NoError(t, err, "same content again")

	_, err = migrations.Export(dir, "tenant_two")
	require.Error(t, err, "another schema's scripts overwrote the first's")
	require.Contains(t, err.Error(), all[0].FileName())
	got, err := os.ReadFile(paths[0])
	require.NoError(t, err)
	require.Contains(t, string(got), `"tenant_one"`)

	// A conflict in the middle: nothing of this export is left half done.
	dir2 := t.TempDir()
	mid := filepath.Join(dir2, all[len(all)/2].FileName())
	require.NoError(t, os.WriteFile(mid, []byte("-- mine\n"), 0o600))
	_, err = migrations.Export(dir2, "tenant_one")
	require.Error(t, err)
	require.Contains(t, err.Error(), all[len(all)/2].FileName())
	got, err = os.ReadFile(mid)
	require.NoError(t, err)
	require.Equal(t, "-- mine\n", string(got))
	entries, err := os.ReadDir(dir2)
	require.NoError(t, err)
	t.Logf("files left by the refused export: %d", len(entries))

	// dir is a file; schema is invalid.
	file := filepath.Join(t.TempDir(), "f")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = migrations.Export(file, "tenant_one")
	require.Error(t, err)
	_, err = migrations.Export(t.TempDir(), "pg_bad")
	require.ErrorIs(t, err, migrations.ErrInvalidSchema)
}

// Docs (ValidateSchema): "a letter or underscore followed by letters, digits
// or underscores, at most 48 bytes, and not one of PostgreSQL's reserved pg_
// names. Names are quoted in every statement as well".
func TestValidateSchemaRules(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"a", "_", "Tenant_A", strings.Repeat("s", 48)} {
		require.NoError(t, migrations.ValidateSchema(ok), ok)
	}
	for _, bad := range []string{"", "1a", "a-b", "a b", `a"b`, "a\x00", strings.Repeat("s", 49), "pg_x", "PG_X"} {
		require.ErrorIs(t, migrations.ValidateSchema(bad), migrations.ErrInvalidSchema, "%q", bad)
	}
}

// A mixed-case schema is valid, so it must work end to end: quoted in every
// statement, its relay woken by its own notification channel (with a poll
// interval of a minute, only the notification can publish in time), and kept
// apart from its lower-case twin.
func TestMixedCaseSchemaEndToEnd(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewSchema(t)
	ctx := context.Background()
	var b [4]byte
	_, _ = rand.Read(b[:])
	suffix := hex.EncodeToString(b[:])
	upper := freshSchemaName(t, pool, "R2_Mixed_", suffix)
	lower := freshSchemaName(t, pool, "r2_mixed_", suffix)
	require.NoError(t, migrations.ValidateSchema(upper))
	for _, s := range []string{upper, lower} {
		_, err := migrations.Migrate(ctx, pool, s)
		require.NoError(t, err, s)
		require.NoError(t, migrations.Check(ctx, pool, s), s)
	}
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "mixed"))
	r := newRelay(t, pool, upper, kc, relay.Config{PollInterval: time.Minute})
	require.NoError(t, r.Start(ctx))
	time.Sleep(200 * time.Millisecond) // let it listen
	insert(t, pool, lower, msg("mixed", "lower", "T"))
	id := insert(t, pool, upper, msg("mixed", "upper", "T"))
	eventually(t, 10*time.Second, func() bool {
		return count(t, pool, upper, "SELECT count(*) FROM %s.outbox WHERE status = 'published'") == 1
	}, "the relay of a mixed-case schema was not woken by its insert")
	require.NoError(t, r.Stop(ctx))
	require.Equal(t, 1, count(t, pool, lower, "SELECT count(*) FROM %s.outbox WHERE status = 'pending'"), "the lower-case twin's row was published")
	got, err := kc.ReadAll(ctx, "mixed")
	require.NoError(t, err)
	require.Len(t, got, 1)
	v, _ := header(got[0], "sagaflow-message-id")
	require.Equal(t, id.String(), v)
}

// Two deploy jobs exporting the same scripts into one directory at once (a
// shared volume): the content is the same, so neither may be refused, and no
// file may be left partly written.
func TestConcurrentExportSameContent(t *testing.T) {
	t.Parallel()
	all, err := migrations.All()
	require.NoError(t, err)
	for round := range 5 {
		dir := t.TempDir()
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = migrations.Export(dir, "tenant_one")
			}()
		}
		wg.Wait()
		for i, err := range errs {
			// Was a finding: a file half written was taken for a conflict.
			require.NoError(t, err, "round %d, exporter %d", round, i)
		}
		for _, m := range all {
			want, err := m.Script("tenant_one")
			require.NoError(t, err)
			got, err := os.ReadFile(filepath.Join(dir, m.FileName()))
			require.NoError(t, err)
			require.Equal(t, want, string(got))
		}
	}
}
