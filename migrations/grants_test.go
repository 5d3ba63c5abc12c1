package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
)

// The documented grants are enough for every statement sagaflow runs at run
// time, and give no DDL: a role with only them runs the store's writes and
// reads, and cannot create or drop anything in the schema.
func TestGrantSQLIsEnoughAndNoMore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	role := "rt_" + strings.ToLower(schema)
	_, err = pool.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN")
	if err != nil {
		t.Skipf("cannot create a role on this server (%v): the grants are not checked here", err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize()+"; DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	grants, err := migrations.Grants(schema, role)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, grants)
	require.NoError(t, err)

	cfg := pool.Config().Copy()
	cfg.ConnConfig.User = role
	cfg.ConnConfig.Password = ""
	rt, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer rt.Close()
	if err := rt.Ping(ctx); err != nil {
		t.Skipf("cannot log in as a new role on this server (%v): the grants are not checked here", err)
	}

	require.NoError(t, migrations.Check(ctx, rt, schema))
	q := pgx.Identifier{schema}.Sanitize()
	for _, stmt := range []string{
		`INSERT INTO %s.saga_instances (id, saga_name, status, step_index, step_name, direction, state) VALUES (gen_random_uuid(), 'g', 'running', 0, 's', 'forward', '{}')`,
		`UPDATE %s.saga_instances SET version = version + 1`,
		`INSERT INTO %s.saga_history (saga_id, event) SELECT id, 'e' FROM %[1]s.saga_instances`,
		`INSERT INTO %s.saga_cancel_requests (saga_id, epoch, reason) SELECT id, 0, 'r' FROM %[1]s.saga_instances`,
		`DELETE FROM %s.saga_cancel_requests`,
		`INSERT INTO %s.outbox (id, topic, aggregateid, type, payload) VALUES (gen_random_uuid(), 't', 'a', 'x', '\x00')`,
		`UPDATE %s.outbox SET status = 'published', published_at = now()`,
		`DELETE FROM %s.outbox`,
		`INSERT INTO %s.inbox (consumer, key) VALUES ('c', 'k')`,
		`DELETE FROM %s.inbox`,
		`INSERT INTO %s.dead_letters (consumer, reason) VALUES ('c', 'r')`,
		`UPDATE %s.dead_letters SET requeued_at = now()`,
		`INSERT INTO %s.idempotency_keys (scope, key, request_hash, status, expires_at) VALUES ('s', 'k', '\x00', 'in_flight', now())`,
		`DELETE FROM %s.idempotency_keys`,
		`INSERT INTO %s.saga_signals (target, name, signal_id, payload, status) VALUES ('t', 'n', 'i', '\x00', 'pending')`,
		`UPDATE %s.saga_signals SET status = 'delivered', delivered_at = now()`,
		`DELETE FROM %s.saga_signals`,
		`INSERT INTO %s.saga_pauses (kind, saga_id, saga_name, code, reason) SELECT 'saga', id, saga_name, 'operator', 'r' FROM %[1]s.saga_instances`,
		`INSERT INTO %s.outbox (id, topic, aggregateid, type, payload, saga_id, step_key) SELECT gen_random_uuid(), 't', 'a', 'x', '\x00', id, 'k' FROM %[1]s.saga_instances`,
		`DELETE FROM %s.saga_pauses`,
		`DELETE FROM %s.outbox`,
		`DELETE FROM %s.saga_history`,
		`DELETE FROM %s.saga_instances`,
		`SELECT pg_try_advisory_xact_lock(1), pg_notify('c', 'p') FROM %s.sagaflow_migrations LIMIT 1`,
	} {
		_, err := rt.Exec(ctx, fmt.Sprintf(stmt, q))
		require.NoError(t, err, stmt)
	}
	for _, ddl := range []string{
		`CREATE TABLE %s.mine (x int)`,
		`DROP TABLE %s.outbox`,
		`ALTER TABLE %s.outbox ADD COLUMN x int`,
		`TRUNCATE %s.inbox`,
		`INSERT INTO %s.sagaflow_migrations (version, name) VALUES (999, 'x')`,
	} {
		_, err := rt.Exec(ctx, fmt.Sprintf(ddl, q))
		require.Error(t, err, "the runtime role must not be able to: %s", ddl)
	}
}

func TestGrantSQLRefusesRolesThatAreNotOneRole(t *testing.T) {
	t.Parallel()
	for _, role := range []string{"", "public", "PUBLIC", "pg_monitor", "a\x1b[2Jb", "a\nb", "a\x00b", "a\xffb", strings.Repeat("r", 64)} {
		_, err := migrations.Grants("sagaflow", role)
		require.Error(t, err, "%q", role)
	}
	sql, err := migrations.Grants("sagaflow", `odd"name`)
	require.NoError(t, err)
	require.Contains(t, sql, `TO "odd""name";`, "quoted as an identifier")
}
