package store

import (
	"fmt"

	"github.com/jackc/pgx/v5"
)

// GrantSQL returns the statements that give role what sagaflow needs at run
// time on schema, and nothing more: no DDL, no ownership. Apply them after
// the migrations, as the schema's owner. The role can then run engines,
// relays, participants, inbox consumers, the idempotency middleware and
// the operator CLI (all but `migrate`):
//
//   - USAGE on the schema;
//   - SELECT, INSERT, UPDATE and DELETE on sagaflow's tables (DELETE for
//     consumed commands, retention, applied cancel requests and expired
//     keys);
//   - SELECT on the migrations table, which Engine.Start checks.
//
// Advisory locks, LISTEN and NOTIFY need no grant. Identity columns
// (saga_history.id, dead_letters.id) need none either.
func GrantSQL(schema, role string) (string, error) {
	if err := ValidateSchema(schema); err != nil {
		return "", err
	}
	if role == "" {
		return "", fmt.Errorf("store: grants: role is empty")
	}
	s, r := quoteSchema(schema), pgx.Identifier{role}.Sanitize()
	return fmt.Sprintf(`GRANT USAGE ON SCHEMA %[1]s TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON %[1]s.saga_instances, %[1]s.saga_history, %[1]s.saga_cancel_requests,
	%[1]s.outbox, %[1]s.inbox, %[1]s.dead_letters, %[1]s.idempotency_keys TO %[2]s;
GRANT SELECT ON %[1]s.sagaflow_migrations TO %[2]s;
`, s, r), nil
}
