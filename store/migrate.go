package store

import (
	"context"
	"fmt"
	"hash/fnv"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/migrations"
)

// Migration is one numbered migration file.
type Migration struct {
	Version int    // the file's number, e.g. 1 for 001_core.up.sql
	Name    string // the file's name without number and suffix, e.g. "core"
	sql     string // the file's text, with the {{schema}} placeholder
}

// SQL returns the migration's statements for the given schema.
func (m Migration) SQL(schema string) (string, error) {
	if err := ValidateSchema(schema); err != nil {
		return "", err
	}
	return strings.ReplaceAll(m.sql, "{{schema}}", quoteSchema(schema)), nil
}

// Migrations returns the embedded migrations in order.
func Migrations() ([]Migration, error) {
	entries, err := fs.Glob(migrations.FS, "*.up.sql")
	if err != nil {
		return nil, fmt.Errorf("store: list migrations: %w", err)
	}
	out := make([]Migration, 0, len(entries))
	for _, name := range entries {
		num, rest, ok := strings.Cut(name, "_")
		if !ok {
			return nil, fmt.Errorf("store: migration %q: name must be NNN_name.up.sql", name)
		}
		v, err := strconv.Atoi(num)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("store: migration %q: bad number %q", name, num)
		}
		body, err := fs.ReadFile(migrations.FS, name)
		if err != nil {
			return nil, fmt.Errorf("store: read migration %q: %w", name, err)
		}
		out = append(out, Migration{Version: v, Name: strings.TrimSuffix(rest, ".up.sql"), sql: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i := 1; i < len(out); i++ {
		if out[i].Version == out[i-1].Version {
			return nil, fmt.Errorf("store: two migrations numbered %d", out[i].Version)
		}
	}
	return out, nil
}

// MigrationSQL returns every migration for schema as one script, for teams
// that apply migrations with their own tool. The script creates the schema
// and the version table and records each version, so [Migrate] later sees the
// schema as up to date.
func MigrationSQL(schema string) (string, error) {
	ms, err := Migrations()
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
		fmt.Fprintf(&b, "INSERT INTO %s.sagaflow_migrations (version, name) VALUES (%d, %s);\n",
			quoteSchema(schema), m.Version, quoteLiteral(m.Name))
	}
	return b.String(), nil
}

func bootstrapSQL(schema string) string {
	q := quoteSchema(schema)
	return "CREATE SCHEMA IF NOT EXISTS " + q + ";\n" +
		"CREATE TABLE IF NOT EXISTS " + q + ".sagaflow_migrations (\n" +
		"    version    integer     PRIMARY KEY,\n" +
		"    name       text        NOT NULL,\n" +
		"    applied_at timestamptz NOT NULL DEFAULT now()\n" +
		");\n"
}

func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// MigrateResult says what [Migrate] did.
type MigrateResult struct {
	Applied []Migration // migrations applied by this call, in order
	Version int         // the schema's version afterwards
}

// Migrate applies the embedded migrations that schema lacks, in order, each in
// its own transaction, while holding a session advisory lock so that
// concurrent callers apply each migration once. It creates the schema if
// needed. Running it again is a no-op.
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) (*MigrateResult, error) {
	if err := ValidateSchema(schema); err != nil {
		return nil, err
	}
	ms, err := Migrations()
	if err != nil {
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("store: migrate %s: acquire connection: %w", schema, err)
	}
	defer conn.Release()

	lockKey := migrateLockKey(schema)
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", lockKey); err != nil {
		return nil, fmt.Errorf("store: migrate %s: take advisory lock: %w", schema, err)
	}
	defer func() {
		// Unlock even when ctx is done; a broken connection drops the lock anyway.
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", lockKey)
	}()

	if _, err := conn.Exec(ctx, bootstrapSQL(schema)); err != nil {
		return nil, fmt.Errorf("store: migrate %s: create version table: %w", schema, err)
	}
	applied := map[int]bool{}
	rows, err := conn.Query(ctx, "SELECT version FROM "+quoteSchema(schema)+".sagaflow_migrations")
	if err != nil {
		return nil, fmt.Errorf("store: migrate %s: read versions: %w", schema, err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("store: migrate %s: read versions: %w", schema, err)
	}
	res := &MigrateResult{}
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
			_, err := tx.Exec(ctx, "INSERT INTO "+quoteSchema(schema)+".sagaflow_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		})
		if err != nil {
			return res, fmt.Errorf("store: migrate %s: apply %03d_%s: %w", schema, m.Version, m.Name, err)
		}
		res.Applied = append(res.Applied, m)
		res.Version = max(res.Version, m.Version)
	}
	return res, nil
}

// CheckSchema reports whether schema has every embedded migration. It
// returns an error wrapping [ErrSchemaNotMigrated] that names the schema, the
// version found (0 for a schema never migrated) and the version needed, when
// it lacks one; any other error means the check itself failed. A schema
// migrated further, by a newer version, passes. Give it a pool or a
// connection rather than a transaction you mean to go on with: on a schema
// never migrated, its query fails, and would abort the transaction.
func CheckSchema(ctx context.Context, db DBTX, schema string) error {
	if err := ValidateSchema(schema); err != nil {
		return err
	}
	ms, err := Migrations()
	if err != nil {
		return err
	}
	applied := map[int]bool{}
	found := 0
	rows, err := db.Query(ctx, "SELECT version FROM "+quoteSchema(schema)+".sagaflow_migrations")
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
		return fmt.Errorf("store: check schema %s: read versions: %w", schema, err)
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
	return fmt.Errorf("%w: schema %q is at migration version %d, and this sagaflow needs %d (missing %s): "+
		"run store.Migrate (the sagaflow migrate command), or apply store.MigrationSQL with your own tool",
		ErrSchemaNotMigrated, schema, found, ms[len(ms)-1].Version, strings.Join(missing, ", "))
}

// migrateLockKey is the advisory lock key that serialises migrations of one schema.
func migrateLockKey(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("sagaflow.migrate\x00" + schema))
	return int64(h.Sum64())
}
