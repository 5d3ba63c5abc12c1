package pgtest

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/migrations"
)

// reuseOffEnv, set to 0, makes PreparedSchema prepare a new schema for every
// test, as NewSchema does.
const reuseOffEnv = "PGTEST_REUSE"

// PreparedSchema is [NewSchema] for a schema that prepare fills (the
// migrations, say): it returns a pool and a schema that prepare has
// prepared and that holds no rows but those of keep. Preparing a schema
// costs the server far more than emptying one (applying sagaflow's
// migrations creates about 90 relations, functions and triggers), so a
// schema given back by an earlier test of this process, prepared for the
// same kind, is handed over instead of a new one when there is one.
//
// When the test ends, a cleanup closes the pool (as NewSchema's does) and
// gives the schema back, over a connection of its own, in one transaction:
// the relations, functions and procedures the test added to it are
// dropped, every table that prepare made is emptied (TRUNCATE … RESTART
// IDENTITY) except those named in keep, and the schema is kept for the next
// test only if then nothing of what prepare made differs from how prepare
// left it: relations, columns, defaults, constraints, indexes, triggers,
// functions (and their bodies), types, policies, privileges and owners,
// publications of its tables, and the rows of the keep tables. Otherwise,
// or when the test failed, or anything of that goes wrong, the schema is
// dropped, as NewSchema's is. The schemas still kept when the package's
// tests end are dropped by [Main]; a package whose TestMain does not call
// Main gets a new schema each time, dropped after its test.
//
// PGTEST_REUSE=0 turns the reuse off.
func PreparedSchema(tb testing.TB, kind string, keep []string,
	prepare func(ctx context.Context, pool *pgxpool.Pool, schema string) error) (*pgxpool.Pool, string) {
	tb.Helper()
	connStr := ConnString(tb)
	if !reuseOn() {
		pool, name := NewSchema(tb)
		if err := prepare(context.Background(), pool, name); err != nil {
			tb.Fatalf("pgtest: prepare schema %s: %v", name, err)
		}
		return pool, name
	}
	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	s, fresh := kept.take(kind)
	if fresh {
		name, err := randomSchemaName()
		if err != nil {
			tb.Fatalf("pgtest: name schema: %v", err)
		}
		s = &keptSchema{name: name}
	}
	cfg, err := pgxpool.ParseConfig(connStr)
	if err != nil {
		tb.Fatalf("pgtest: parse connection string: %v", err)
	}
	cfg.MaxConns = schemaPoolMaxConns
	withWidthCheck(tb, cfg.ConnConfig)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: create pool for schema %s: %v", s.name, err)
	}
	tb.Cleanup(func() {
		if err := closePool(pool, schemaTimeout); err != nil {
			tb.Errorf("pgtest: close pool of schema %s: %v", s.name, err)
		}
		if !tb.Failed() && s.print != "" {
			err := giveBack(connStr, s, keep)
			if err == nil {
				kept.put(kind, s)
				return
			}
			// Shown with -v or when the package fails: why a package's
			// tests stopped reusing schemas (and migrate each again).
			tb.Logf("pgtest: schema %s is dropped, not kept for the next test: %v", s.name, err)
		}
		if err := dropSchema(connStr, s.name); err != nil {
			tb.Errorf("pgtest: drop schema %s: %v", s.name, err)
		}
	})
	if !fresh {
		return pool, s.name
	}
	if err := whileServerFull(ctx, func() error {
		_, err := pool.Exec(ctx, "create schema "+pgx.Identifier{s.name}.Sanitize())
		return err
	}); err != nil {
		tb.Fatalf("pgtest: create schema %s: %v", s.name, err)
	}
	if err := prepare(ctx, pool, s.name); err != nil {
		tb.Fatalf("pgtest: prepare schema %s: %v", s.name, err)
	}
	if err := s.record(ctx, pool, keep); err != nil {
		tb.Logf("pgtest: schema %s will not be kept for another test: %v", s.name, err)
	}
	return pool, s.name
}

// reuseOn reports whether PreparedSchema may hand a schema over: Main is
// running the tests (it drops the kept schemas after them), and
// PGTEST_REUSE is not 0.
func reuseOn() bool {
	kept.mu.Lock()
	defer kept.mu.Unlock()
	return kept.main && os.Getenv(reuseOffEnv) != "0"
}

// kept holds the schemas given back, by kind.
var kept keptSchemas

type keptSchemas struct {
	mu   sync.Mutex
	main bool // Main runs the tests
	free map[string][]*keptSchema
}

// keptSchema is a prepared schema and how prepare left it.
type keptSchema struct {
	name  string
	rels  map[string]bool // its relations' names
	funcs map[string]bool // its routines, as regprocedure text
	print string          // the fingerprint of all of it; "" if not taken
}

func (k *keptSchemas) take(kind string) (s *keptSchema, fresh bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	free := k.free[kind]
	if len(free) == 0 {
		return nil, true
	}
	s = free[len(free)-1]
	k.free[kind] = free[:len(free)-1]
	return s, false
}

func (k *keptSchemas) put(kind string, s *keptSchema) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.main {
		return
	}
	if k.free == nil {
		k.free = map[string][]*keptSchema{}
	}
	k.free[kind] = append(k.free[kind], s)
}

// startMain marks the tests as run by Main.
func (k *keptSchemas) startMain() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.main = true
}

// dropAll ends the reuse and drops every kept schema.
func (k *keptSchemas) dropAll() error {
	k.mu.Lock()
	k.main = false
	free := k.free
	k.free = nil
	k.mu.Unlock()
	if len(free) == 0 {
		return nil
	}
	connStr := discovery.connStr // a schema was kept: discovery found a server
	var errs []string
	for _, list := range free {
		for _, s := range list {
			if err := dropSchema(connStr, s.name); err != nil {
				errs = append(errs, fmt.Sprintf("drop kept schema %s: %v", s.name, err))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("pgtest: %s", strings.Join(errs, "; "))
	}
	return nil
}

// record takes note of what prepare made of s.
func (s *keptSchema) record(ctx context.Context, pool *pgxpool.Pool, keep []string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	rels, funcs, err := objects(ctx, conn.Conn(), s.name)
	if err != nil {
		return err
	}
	print, err := fingerprint(ctx, conn.Conn(), s.name, keep)
	if err != nil {
		return err
	}
	s.rels, s.funcs = map[string]bool{}, map[string]bool{}
	for _, r := range rels {
		s.rels[r.name] = true
	}
	for _, f := range funcs {
		s.funcs[f] = true
	}
	s.print = print
	return nil
}

// giveBack empties s for the next test, as PreparedSchema says, or returns
// why it cannot be kept.
func giveBack(connStr string, s *keptSchema, keep []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	return withAdminConn(ctx, connStr, func(conn *pgx.Conn) error { return emptyFor(ctx, conn, s, keep) })
}

// emptyFor empties s over conn, in one transaction, as giveBack says.
func emptyFor(ctx context.Context, conn *pgx.Conn, s *keptSchema, keep []string) error {
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// A session of the test still in a transaction on these tables
		// would hold the TRUNCATE up: then the schema is dropped instead.
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '5s'"); err != nil {
			return err
		}
		rels, funcs, err := objects(ctx, tx.Conn(), s.name)
		if err != nil {
			return err
		}
		// Tables first: what depends on them (their indexes, sequences,
		// views) goes with them.
		slices.SortStableFunc(rels, func(a, b relation) int { return cmp.Compare(dropOrder(a.kind), dropOrder(b.kind)) })
		for _, r := range rels {
			if s.rels[r.name] {
				continue
			}
			what := dropKind(r.kind)
			if what == "" {
				return fmt.Errorf("the test left %s (relkind %s), which is not dropped here", r.name, r.kind)
			}
			if _, err := tx.Exec(ctx, "DROP "+what+" IF EXISTS "+pgx.Identifier{s.name, r.name}.Sanitize()+" CASCADE"); err != nil {
				return err
			}
		}
		for _, f := range funcs {
			if !s.funcs[f] {
				if _, err := tx.Exec(ctx, "DROP ROUTINE IF EXISTS "+f+" CASCADE"); err != nil {
					return err
				}
			}
		}
		print, err := fingerprint(ctx, tx.Conn(), s.name, keep)
		if err != nil {
			return err
		}
		if print != s.print {
			return fmt.Errorf("the test changed what prepare made")
		}
		var tables []string
		for _, r := range rels {
			if s.rels[r.name] && (r.kind == "r" || r.kind == "p") && !slices.Contains(keep, r.name) {
				tables = append(tables, pgx.Identifier{s.name, r.name}.Sanitize())
			}
		}
		if len(tables) > 0 {
			if _, err := tx.Exec(ctx, "TRUNCATE "+strings.Join(tables, ", ")+" RESTART IDENTITY"); err != nil {
				return err
			}
		}
		return nil
	})
}

type relation struct{ name, kind string }

// objects lists the relations and the routines of schema.
func objects(ctx context.Context, conn *pgx.Conn, schema string) ([]relation, []string, error) {
	rows, err := conn.Query(ctx, `SELECT c.relname, c.relkind::text FROM pg_class c
		JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1`, schema)
	if err != nil {
		return nil, nil, err
	}
	rels, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relation, error) {
		var r relation
		return r, row.Scan(&r.name, &r.kind)
	})
	if err != nil {
		return nil, nil, err
	}
	rows, err = conn.Query(ctx, `SELECT p.oid::regprocedure::text FROM pg_proc p
		JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1 AND p.prokind IN ('f', 'p')`, schema)
	if err != nil {
		return nil, nil, err
	}
	funcs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return rels, funcs, err
}

// dropOrder puts tables first, indexes last.
func dropOrder(kind string) int {
	switch kind {
	case "r", "p", "f":
		return 0
	case "v", "m":
		return 1
	case "S":
		return 2
	default:
		return 3
	}
}

// dropKind is the DROP statement's object kind for a relkind, or "" when
// giveBack does not drop it.
func dropKind(kind string) string {
	switch kind {
	case "r", "p":
		return "TABLE"
	case "f":
		return "FOREIGN TABLE"
	case "v":
		return "VIEW"
	case "m":
		return "MATERIALIZED VIEW"
	case "S":
		return "SEQUENCE"
	case "i", "I":
		return "INDEX"
	default:
		return ""
	}
}

// fingerprintSQL lists, one line each, what a schema is made of, and
// returns a digest of the lines.
const fingerprintSQL = `WITH n AS (SELECT oid, nspacl, nspowner FROM pg_namespace WHERE nspname = $1),
lines(l) AS (
	SELECT 'n ' || coalesce(nspacl::text, '') || ' ' || nspowner::regrole::text FROM n
	UNION ALL
	SELECT 'c ' || c.relname || ' ' || c.relkind::text || ' ' || c.relpersistence::text || ' ' || c.relreplident::text || ' '
		|| c.relrowsecurity || c.relforcerowsecurity || c.relispartition || ' ' || coalesce(c.relacl::text, '') || ' '
		|| coalesce(c.reloptions::text, '') || ' ' || c.relowner::regrole::text || ' '
		|| CASE WHEN c.relkind IN ('i', 'I') THEN pg_get_indexdef(c.oid)
			WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid) ELSE '' END
	FROM pg_class c JOIN n ON c.relnamespace = n.oid
	UNION ALL
	SELECT 'a ' || c.relname || ' ' || a.attnum || ' ' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || ' '
		|| a.attnotnull || ' ' || a.attidentity::text || ' ' || a.attgenerated::text || ' ' || a.attisdropped || ' '
		|| coalesce(a.attacl::text, '') || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
	FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN n ON c.relnamespace = n.oid
	LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
	WHERE a.attnum > 0
	UNION ALL
	SELECT 'k ' || coalesce(c.relname, '') || ' ' || k.conname || ' ' || pg_get_constraintdef(k.oid)
	FROM pg_constraint k JOIN n ON k.connamespace = n.oid LEFT JOIN pg_class c ON c.oid = k.conrelid
	UNION ALL
	SELECT 't ' || c.relname || ' ' || g.tgname || ' ' || g.tgenabled::text || ' ' || pg_get_triggerdef(g.oid)
	FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid JOIN n ON c.relnamespace = n.oid
	WHERE NOT g.tgisinternal
	UNION ALL
	SELECT 'f ' || p.oid::regprocedure::text || ' ' || md5(coalesce(p.prosrc, '')) || ' ' || p.prokind::text || ' '
		|| p.prosecdef || ' ' || p.provolatile::text || ' ' || coalesce(p.proconfig::text, '') || ' '
		|| coalesce(p.proacl::text, '') || ' ' || p.proowner::regrole::text || ' ' || p.prorettype::regtype::text
	FROM pg_proc p JOIN n ON p.pronamespace = n.oid
	UNION ALL
	SELECT 'y ' || t.typname || ' ' || t.typtype::text FROM pg_type t JOIN n ON t.typnamespace = n.oid
	WHERE t.typrelid = 0 AND t.typcategory <> 'A'
	UNION ALL
	SELECT 'p ' || c.relname || ' ' || pol.polname || ' ' || pol.polcmd::text || ' ' || pol.polpermissive || ' '
		|| coalesce(pg_get_expr(pol.polqual, pol.polrelid), '') || ' '
		|| coalesce(pg_get_expr(pol.polwithcheck, pol.polrelid), '') || ' ' || pol.polroles::text
	FROM pg_policy pol JOIN pg_class c ON c.oid = pol.polrelid JOIN n ON c.relnamespace = n.oid
	UNION ALL
	SELECT 'd ' || da.defaclobjtype::text || ' ' || coalesce(da.defaclacl::text, '')
	FROM pg_default_acl da JOIN n ON da.defaclnamespace = n.oid
	UNION ALL
	SELECT 'u ' || pub.pubname || ' ' || c.relname FROM pg_publication_rel pr
	JOIN pg_publication pub ON pub.oid = pr.prpubid JOIN pg_class c ON c.oid = pr.prrelid
	JOIN n ON c.relnamespace = n.oid
	UNION ALL
	SELECT 'U ' || pub.pubname FROM pg_publication_namespace pn
	JOIN pg_publication pub ON pub.oid = pn.pnpubid JOIN n ON pn.pnnspid = n.oid
	UNION ALL
	SELECT 'x ' || s.stxname FROM pg_statistic_ext s JOIN n ON s.stxnamespace = n.oid
	UNION ALL
	SELECT 'r ' || c.relname || ' ' || r.rulename FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class
	JOIN n ON c.relnamespace = n.oid WHERE c.relkind NOT IN ('v', 'm')
)
SELECT coalesce(md5(string_agg(l, E'\n' ORDER BY l)), '') FROM lines`

// fingerprint digests what schema is made of and the rows of its keep
// tables.
func fingerprint(ctx context.Context, conn *pgx.Conn, schema string, keep []string) (string, error) {
	var out strings.Builder
	var print string
	if err := conn.QueryRow(ctx, fingerprintSQL, schema).Scan(&print); err != nil {
		return "", err
	}
	out.WriteString(print)
	for _, t := range keep {
		var rows string
		if err := conn.QueryRow(ctx, "SELECT coalesce(md5(string_agg(t::text, E'\\n' ORDER BY t::text)), '') FROM "+
			pgx.Identifier{schema, t}.Sanitize()+" t").Scan(&rows); err != nil {
			return "", err
		}
		out.WriteString(" " + t + ":" + rows)
	}
	return out.String(), nil
}

// Migrated is [PreparedSchema] for a schema with sagaflow's migrations
// applied: a migrated schema that holds no rows but the record of the
// migrations, and a pool to reach it.
func Migrated(tb testing.TB) (*pgxpool.Pool, string) {
	tb.Helper()
	return PreparedSchema(tb, "migrated", []string{"sagaflow_migrations"}, func(ctx context.Context, pool *pgxpool.Pool, schema string) error {
		_, err := migrations.Migrate(ctx, pool, schema)
		return err
	})
}
