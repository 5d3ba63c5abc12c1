package migrations

import (
	"errors"
	"fmt"
	"strings"
	"unicode"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
)

// Grants returns the statements that give role what sagaflow needs at run
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
// (saga_history.id, dead_letters.id, saga_signals.seq) need none either.
func Grants(schema, role string) (string, error) {
	if err := ValidateSchema(schema); err != nil {
		return "", err
	}
	if err := validateRole(role); err != nil {
		return "", fmt.Errorf("migrations: grants: %w", err)
	}
	s, r := QuoteSchema(schema), pgx.Identifier{role}.Sanitize()
	return fmt.Sprintf(`GRANT USAGE ON SCHEMA %[1]s TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON %[1]s.saga_instances, %[1]s.saga_history, %[1]s.saga_cancel_requests,
	%[1]s.outbox, %[1]s.inbox, %[1]s.dead_letters, %[1]s.idempotency_keys, %[1]s.saga_signals TO %[2]s;
GRANT SELECT ON %[1]s.sagaflow_migrations TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON %[1]s.saga_concurrency_keys, %[1]s.saga_concurrency_queue, %[1]s.saga_pauses,
	%[1]s.saga_branches TO %[2]s;
`, s, r), nil
}

// validateRole refuses a role name that is not one role: empty, too long
// for PostgreSQL (which would silently cut it), with control characters, or
// PUBLIC, which means every role.
func validateRole(role string) error {
	switch {
	case role == "":
		return errors.New("role is empty")
	case len(role) > 63:
		return fmt.Errorf("role name is %d bytes; PostgreSQL keeps only 63", len(role))
	case safetext.Problem(role, 0) != "":
		return fmt.Errorf("role name %s", safetext.Problem(role, 0))
	case strings.ContainsFunc(role, func(r rune) bool { return unicode.IsControl(r) }):
		return fmt.Errorf("role name %q contains a control character", role)
	case strings.EqualFold(role, "public"):
		return errors.New(`role "public" is every role: grant to the service's own role`)
	case strings.HasPrefix(strings.ToLower(role), "pg_"):
		return fmt.Errorf("role %q: names starting with pg_ are PostgreSQL's own", role)
	}
	return nil
}
