package pgtest_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// preparer makes a small schema of its own kind: a table with an identity
// column, a table kept with its rows, an index, a function and a trigger,
// a table with a serial column and a foreign key, and a trigger that
// refuses deletes (emptying a schema fires no trigger). It counts its
// calls.
type preparer struct {
	kind  string
	calls atomic.Int32
}

func (p *preparer) prepare(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	p.calls.Add(1)
	q := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, fmt.Sprintf(`
		CREATE TABLE %[1]s.items (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text NOT NULL DEFAULT 'x');
		CREATE INDEX items_v ON %[1]s.items (v);
		CREATE TABLE %[1]s.versions (version int PRIMARY KEY);
		INSERT INTO %[1]s.versions VALUES (1), (2);
		CREATE FUNCTION %[1]s.upper_v() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.v := upper(NEW.v); RETURN NEW; END $$;
		CREATE TRIGGER items_upper BEFORE INSERT ON %[1]s.items FOR EACH ROW EXECUTE FUNCTION %[1]s.upper_v();
		CREATE TABLE %[1]s.children (id serial PRIMARY KEY, item bigint NOT NULL REFERENCES %[1]s.items (id));
		CREATE FUNCTION %[1]s.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no deletes'; END $$;
		CREATE TRIGGER items_kept BEFORE DELETE ON %[1]s.items FOR EACH ROW EXECUTE FUNCTION %[1]s.refuse();`, q))
	return err
}

// get runs a subtest that takes a schema of p's kind, checks that it is as
// prepared and empty, and runs use on it; it returns the schema's name.
func (p *preparer) get(t *testing.T, name string, use func(t *testing.T, pool *pgxpool.Pool, q string)) string {
	t.Helper()
	var schema string
	t.Run(name, func(t *testing.T) {
		pool, s := pgtest.PreparedSchema(t, p.kind, []string{"versions"}, p.prepare)
		schema = s
		q := pgx.Identifier{s}.Sanitize()
		ctx := context.Background()
		var items, versions int
		require.NoError(t, pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+q+".items), (SELECT count(*) FROM "+q+".versions)").Scan(&items, &versions))
		require.Zero(t, items, "no rows of an earlier test")
		require.Equal(t, 2, versions, "the kept table keeps the rows prepare wrote")
		var id int64
		var v string
		require.NoError(t, pool.QueryRow(ctx, "INSERT INTO "+q+".items (v) VALUES ('a') RETURNING id, v").Scan(&id, &v))
		require.Equal(t, int64(1), id, "the identity starts again")
		require.Equal(t, "A", v, "the trigger is there")
		var child int64
		require.NoError(t, pool.QueryRow(ctx, "INSERT INTO "+q+".children (item) VALUES ($1) RETURNING id", id).Scan(&child))
		require.Equal(t, int64(1), child, "the serial starts again")
		if use != nil {
			use(t, pool, q)
		}
	})
	return schema
}

func exists(t *testing.T, schema string) bool {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), pgtest.ConnString(t))
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var ok bool
	require.NoError(t, conn.QueryRow(context.Background(), "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", schema).Scan(&ok))
	return ok
}

// A schema given back is handed to the next test emptied: its rows gone,
// the identity restarted, what the test added dropped, the kept table's
// rows kept; prepare runs once.
func TestPreparedSchemaIsHandedOverEmptied(t *testing.T) {
	p := &preparer{kind: "reuse-emptied"}
	first := p.get(t, "first", func(t *testing.T, pool *pgxpool.Pool, q string) {
		_, err := pool.Exec(context.Background(), `
			INSERT INTO `+q+`.items (v) SELECT 'b' FROM generate_series(1, 50);
			CREATE TABLE `+q+`.effects (id serial, note text);
			CREATE INDEX effects_note ON `+q+`.effects (note);
			CREATE VIEW `+q+`.notes AS SELECT note FROM `+q+`.effects;
			CREATE SEQUENCE `+q+`.loose;
			CREATE FUNCTION `+q+`.helper(int) RETURNS int LANGUAGE sql AS 'SELECT $1';
			CREATE INDEX items_extra ON `+q+`.items (id, v);
			CREATE FUNCTION `+q+`.noop() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;
			CREATE TRIGGER items_noop BEFORE UPDATE ON `+q+`.items FOR EACH ROW EXECUTE FUNCTION `+q+`.noop();`)
		require.NoError(t, err)
	})
	second := p.get(t, "second", func(t *testing.T, pool *pgxpool.Pool, q string) {
		var n int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND c.relname IN ('effects', 'effects_note', 'notes', 'loose', 'items_extra')`, q[1:len(q)-1]).Scan(&n))
		require.Zero(t, n, "what the first test added is gone")
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = $1 AND p.proname = 'helper'`, q[1:len(q)-1]).Scan(&n))
		require.Zero(t, n, "the first test's function is gone")
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
			JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND g.tgname = 'items_noop'`, q[1:len(q)-1]).Scan(&n))
		require.Zero(t, n, "the trigger of the first test's function went with it")
	})
	require.Equal(t, first, second, "the schema was handed over")
	// Thousands of rows across the foreign key: the next test finds the
	// tables as empty.
	big := p.get(t, "big", func(t *testing.T, pool *pgxpool.Pool, q string) {
		_, err := pool.Exec(context.Background(), `INSERT INTO `+q+`.items (v) SELECT repeat('b', 100) FROM generate_series(1, 5000);
			INSERT INTO `+q+`.children (item) SELECT id FROM `+q+`.items`)
		require.NoError(t, err)
	})
	after := p.get(t, "after big", nil)
	require.Equal(t, first, big)
	require.Equal(t, first, after)
	require.Equal(t, int32(1), p.calls.Load(), "prepared once")
	require.True(t, exists(t, first), "kept for the next test until Main ends")
}

// A schema whose prepared objects a test changed, or whose kept rows it
// changed, is dropped, not handed over.
func TestPreparedSchemaChangedIsDropped(t *testing.T) {
	changes := map[string]string{
		"column added":      "ALTER TABLE %s.items ADD COLUMN w int",
		"default changed":   "ALTER TABLE %s.items ALTER COLUMN v SET DEFAULT 'y'",
		"trigger disabled":  "ALTER TABLE %s.items DISABLE TRIGGER items_upper",
		"trigger dropped":   "DROP TRIGGER items_upper ON %s.items",
		"function replaced": "CREATE OR REPLACE FUNCTION %s.upper_v() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$",
		"index dropped":     "DROP INDEX %s.items_v",
		"grant":             "GRANT SELECT ON %s.items TO PUBLIC",
		"kept row deleted":  "DELETE FROM %s.versions WHERE version = 2",
		"storage option":    "ALTER TABLE %s.items SET (fillfactor = 50)",
		"type added":        "CREATE TYPE %s.mood AS ENUM ('ok')",
		"trigger added":     "CREATE TRIGGER items_upper2 BEFORE UPDATE ON %[1]s.items FOR EACH ROW EXECUTE FUNCTION %[1]s.upper_v()",
	}
	changes["nothing (control)"] = ""
	for what, stmt := range changes {
		t.Run(what, func(t *testing.T) {
			p := &preparer{kind: "reuse-changed-" + what}
			first := p.get(t, "first", func(t *testing.T, pool *pgxpool.Pool, q string) {
				if stmt != "" {
					_, err := pool.Exec(context.Background(), fmt.Sprintf(stmt, q))
					require.NoError(t, err)
				}
			})
			if stmt == "" {
				require.True(t, exists(t, first), "kept")
				require.Equal(t, first, p.get(t, "second", nil), "handed over")
				return
			}
			require.False(t, exists(t, first), "a changed schema is dropped")
			second := p.get(t, "second", nil)
			require.NotEqual(t, first, second)
			require.Equal(t, int32(2), p.calls.Load(), "prepared again")
		})
	}
}

// failedTB is a test that has failed, for PreparedSchema's cleanup.
type failedTB struct{ *testing.T }

func (failedTB) Failed() bool { return true }

// The schema of a test that failed is dropped: what it holds may be why.
func TestPreparedSchemaOfAFailedTestIsDropped(t *testing.T) {
	p := &preparer{kind: "reuse-failed"}
	var first string
	t.Run("first", func(t *testing.T) {
		_, first = pgtest.PreparedSchema(failedTB{t}, p.kind, []string{"versions"}, p.prepare)
	})
	require.False(t, exists(t, first))
	second := p.get(t, "second", nil)
	require.NotEqual(t, first, second)
}
