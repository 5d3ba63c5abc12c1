package migrations

import (
	"context"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgerr"
)

// Migration is one numbered migration file.
type Migration struct {
	Version int    // the file's number, e.g. 1 for 001_core.up.sql
	Name    string // the file's name without number and suffix, e.g. "core"
	sql     string // the file's text, with the {{schema}} placeholder
}

// SQL returns the migration's statements for the given schema, without the
// bookkeeping: use [Migration.Script] for a file your own tool applies.
func (m Migration) SQL(schema string) (string, error) {
	if err := ValidateSchema(schema); err != nil {
		return "", err
	}
	return strings.ReplaceAll(m.sql, "{{schema}}", QuoteSchema(schema)), nil
}

// Script returns the migration as one file for a migration tool that applies
// each version on its own (goose, atlas, tern): it creates the schema when it
// does not exist and the version table, runs the migration's statements and
// records the version, so that [Check] and the engine see it applied. Run
// the versions in order, each once: unlike [Migrate], a script run a second
// time fails (on its CREATE statements or its version row).
func (m Migration) Script(schema string) (string, error) {
	body, err := m.SQL(schema)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("-- sagaflow migration %03d_%s for schema %s\n%s\n%s\n%s", m.Version, m.Name, schema,
		bootstrapSQL(schema), strings.TrimSpace(body), recordSQL(schema, m)), nil
}

// FileName is the migration's file name, e.g. 001_core.up.sql.
func (m Migration) FileName() string { return fmt.Sprintf("%03d_%s.up.sql", m.Version, m.Name) }

// recordSQL records m as applied; a second run of the same script fails here
// rather than apply it twice unnoticed.
func recordSQL(schema string, m Migration) string {
	return fmt.Sprintf("INSERT INTO %s.sagaflow_migrations (version, name) VALUES (%d, %s);\n",
		QuoteSchema(schema), m.Version, quoteLiteral(m.Name))
}

// Export writes each migration's [Migration.Script] for schema into dir, one
// file per version named as [Migration.FileName], and returns the paths in
// order. It creates dir when needed and refuses to overwrite a file that
// exists with other content; the files written before such a refusal stay.
// Each file appears whole or not at all (written aside, then renamed), so a
// tool reading dir meanwhile never sees half a file.
func Export(dir, schema string) ([]string, error) {
	ms, err := All()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("migrations: export: %w", err)
	}
	var paths []string
	for _, m := range ms {
		body, err := m.Script(schema)
		if err != nil {
			return paths, err
		}
		path := filepath.Join(dir, m.FileName())
		if old, err := os.ReadFile(path); err == nil && string(old) != body {
			return paths, fmt.Errorf("migrations: export: %s exists with other content; remove it or export into an empty directory", path)
		}
		if err := writeAtomically(dir, path, body); err != nil {
			return paths, fmt.Errorf("migrations: export: %w", err)
		}
		paths = append(paths, path)
	}
	return paths, nil
}

// All returns the embedded migrations in order.
func All() ([]Migration, error) {
	entries, err := fs.Glob(FS, "*.up.sql")
	if err != nil {
		return nil, fmt.Errorf("migrations: list migrations: %w", err)
	}
	out := make([]Migration, 0, len(entries))
	for _, name := range entries {
		num, rest, ok := strings.Cut(name, "_")
		if !ok {
			return nil, fmt.Errorf("migrations: migration %q: name must be NNN_name.up.sql", name)
		}
		v, err := strconv.Atoi(num)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("migrations: migration %q: bad number %q", name, num)
		}
		body, err := fs.ReadFile(FS, name)
		if err != nil {
			return nil, fmt.Errorf("migrations: read migration %q: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: strings.TrimSuffix(rest, ".up.sql"), sql: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i := 1; i < len(out); i++ {
		if out[i].Version == out[i-1].Version {
			return nil, fmt.Errorf("migrations: two migrations numbered %d", out[i].Version)
		}
	}
	return out, nil
}

// Script returns every migration for schema as one script, for teams
// that apply migrations with their own tool. The script creates the schema
// and the version table and records each version, so [Migrate] later sees the
// schema as up to date. It is for a schema never migrated: on a migrated one
// it fails, where [Migrate] would do nothing.
func Script(schema string) (string, error) {
	ms, err := All()
	if err != nil {
		return "", err
	}
	if err := ValidateSchema(schema); err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- sagaflow migrations for schema %s\n", schema)
	b.WriteString(bootstrapSQL(schema))
	for _, m := range ms {
		body, _ := m.SQL(schema) // schema validated above
		fmt.Fprintf(&b, "\n-- %03d_%s\n%s\n", m.Version, m.Name, strings.TrimSpace(body))
		b.WriteString(recordSQL(schema, m))
	}
	return b.String(), nil
}

// createSchemaSQL creates schema only when it does not exist. CREATE SCHEMA
// IF NOT EXISTS would not do: PostgreSQL checks the CREATE privilege on the
// database before it looks for the schema, so a schema's owner without that
// privilege could not run it.
func createSchemaSQL(schema string) string {
	return "DO $sagaflow$ BEGIN\n" +
		"    IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = " + quoteLiteral(schema) + ") THEN\n" +
		"        EXECUTE " + quoteLiteral("CREATE SCHEMA "+QuoteSchema(schema)) + ";\n" +
		"    END IF;\n" +
		"END $sagaflow$;\n"
}

// versionTableSQL creates the table that records applied versions.
func versionTableSQL(schema string) string {
	return "CREATE TABLE IF NOT EXISTS " + QuoteSchema(schema) + ".sagaflow_migrations (\n" +
		"    version    integer     PRIMARY KEY,\n" +
		"    name       text        NOT NULL,\n" +
		"    applied_at timestamptz NOT NULL DEFAULT now()\n" +
		");\n"
}

func bootstrapSQL(schema string) string {
	return createSchemaSQL(schema) + versionTableSQL(schema)
}

func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// Result says what [Migrate] did.
type Result struct {
	Applied []Migration // migrations applied by this call, in order
	Version int         // the schema's version afterwards
}

// Migrate applies the embedded migrations that schema lacks, in order, each in
// its own transaction, while holding a session advisory lock so that
// concurrent callers apply each migration once. It creates the schema if
// needed, and only then: a schema's owner without CREATE on the database can
// migrate a schema that exists. Running it again is a no-op.
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) (*Result, error) {
	if err := ValidateSchema(schema); err != nil {
		return nil, err
	}
	ms, err := All()
	if err != nil {
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: migrate %s: acquire connection: %w", schema, err)
	}
	defer conn.Release()

	lockKey := migrateLockKey(schema)
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", lockKey); err != nil {
		return nil, fmt.Errorf("migrations: migrate %s: take advisory lock: %w", schema, err)
	}
	defer func() {
		// Unlock even when ctx is done; a broken connection drops the lock anyway.
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", lockKey)
	}()

	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", schema).Scan(&exists); err != nil {
		return nil, fmt.Errorf("migrations: migrate %s: look for the schema: %w", schema, err)
	}
	if !exists {
		if _, err := conn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+QuoteSchema(schema)); err != nil {
			return nil, fmt.Errorf("migrations: migrate %s: create schema: %w", schema, err)
		}
	}
	if _, err := conn.Exec(ctx, versionTableSQL(schema)); err != nil {
		return nil, fmt.Errorf("migrations: migrate %s: create version table: %w", schema, err)
	}
	applied := map[int]bool{}
	rows, err := conn.Query(ctx, "SELECT version FROM "+QuoteSchema(schema)+".sagaflow_migrations")
	if err != nil {
		return nil, fmt.Errorf("migrations: migrate %s: read versions: %w", schema, err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("migrations: migrate %s: read versions: %w", schema, err)
	}
	res := &Result{}
	for _, v := range versions {
		applied[v] = true
		res.Version = max(res.Version, v)
	}
	for _, m := range ms {
		if applied[m.Version] {
			continue
		}
		body, _ := m.SQL(schema)
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, body); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+QuoteSchema(schema)+".sagaflow_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		})
		if err != nil {
			return res, fmt.Errorf("migrations: migrate %s: apply %03d_%s: %w", schema, m.Version, m.Name, err)
		}
		res.Applied = append(res.Applied, m)
		res.Version = max(res.Version, m.Version)
	}
	return res, nil
}

// Check reports whether schema has every embedded migration. It
// returns an error wrapping [ErrNotMigrated] that names the schema, the
// version found (0 for a schema never migrated) and the version needed, when
// it lacks one; any other error means the check itself failed. A schema
// migrated further, by a newer version, passes. Give it a pool or a
// connection rather than a transaction you mean to go on with: on a schema
// never migrated, its query fails, and would abort the transaction.
func Check(ctx context.Context, db Querier, schema string) error {
	if err := ValidateSchema(schema); err != nil {
		return err
	}
	ms, err := All()
	if err != nil {
		return err
	}
	applied := map[int]bool{}
	found := 0
	rows, err := db.Query(ctx, "SELECT version FROM "+QuoteSchema(schema)+".sagaflow_migrations")
	if err == nil {
		var versions []int
		versions, err = pgx.CollectRows(rows, pgx.RowTo[int])
		for _, v := range versions {
			applied[v] = true
			found = max(found, v)
		}
	}
	if err != nil && !pgerr.Undefined(err) {
		// No version table, or no schema: nothing migrated.
		return fmt.Errorf("migrations: check schema %s: read versions: %w", schema, err)
	}
	var missing []string
	for _, m := range ms {
		if !applied[m.Version] {
			missing = append(missing, fmt.Sprintf("%03d_%s", m.Version, m.Name))
		}
	}
	if len(missing) == 0 {
		return nil
	}
	latest := ms[len(ms)-1].Version
	if found >= latest {
		// Later versions applied without earlier ones: scripts applied out
		// of order, or skipped.
		return fmt.Errorf("%w: schema %q has migration versions up to %d but lacks %s, applied out of order or "+
			"skipped: run migrations.Migrate (the sagaflow migrate command), which applies what is missing",
			ErrNotMigrated, schema, found, strings.Join(missing, ", "))
	}
	return fmt.Errorf("%w: schema %q is at migration version %d, and this sagaflow needs %d (missing %s): "+
		"run migrations.Migrate (the sagaflow migrate command), or apply migrations.Script with your own tool",
		ErrNotMigrated, schema, found, latest, strings.Join(missing, ", "))
}

// Querier runs a query: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// migrateLockKey is the advisory lock key that serialises migrations of one schema.
func migrateLockKey(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("sagaflow.migrate\x00" + schema))
	return int64(h.Sum64())
}

// writeAtomically writes body to path through a temporary file in dir and a
// rename.
func writeAtomically(dir, path, body string) error {
	f, err := os.CreateTemp(dir, ".sagaflow-export-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.WriteString(body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp, 0o644)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}
