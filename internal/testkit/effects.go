package testkit

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/saga"
)

// EffectsTable is the name of the table [NewEffects] creates.
const EffectsTable = "effects"

// Effects is a table of the side effects of a test's steps and handlers,
// written in their own transaction, so that "exactly once" is a count. It
// has no unique key: a doubled effect is a second row.
//
// Its columns: seq (an identity, in insert order), saga_id (null for an
// effect of no saga), what, tenant (null unless a test writes it), txid
// (the writing transaction's, by default) and at (clock_timestamp(), by
// default).
type Effects struct {
	db    *DB
	table string
}

// NewEffects creates the table [EffectsTable] in d's schema.
func NewEffects(tb testing.TB, d *DB) *Effects {
	tb.Helper()
	f := &Effects{db: d, table: d.Table(EffectsTable)}
	_, err := d.Pool.Exec(context.Background(), `CREATE TABLE `+f.table+` (
		seq bigint GENERATED ALWAYS AS IDENTITY,
		saga_id uuid,
		what text NOT NULL,
		tenant text,
		txid bigint DEFAULT txid_current(),
		at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	if err != nil {
		tb.Fatalf("testkit: create %s: %v", f.table, err)
	}
	return f
}

// Table is the qualified, quoted name of the table, for SQL.
func (f *Effects) Table() string { return f.table }

// Record records what for run's saga in run's transaction, so that the
// effect commits with the step or not at all.
func (f *Effects) Record(ctx context.Context, run *saga.StepRun, what string) error {
	_, err := run.Tx.Exec(ctx, `INSERT INTO `+f.table+` (saga_id, what) VALUES ($1, $2)`, run.SagaID, what)
	return err
}

// Count is how often saga id recorded what.
func (f *Effects) Count(tb testing.TB, id uuid.UUID, what string) int {
	tb.Helper()
	return f.db.Count(tb, `SELECT count(*) FROM `+f.table+` WHERE saga_id = $1 AND what = $2`, id, what)
}

// Counts is every effect of saga id, by what.
func (f *Effects) Counts(tb testing.TB, id uuid.UUID) map[string]int {
	tb.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT what, count(*) FROM `+f.table+` WHERE saga_id = $1 GROUP BY what`, id)
	if err != nil {
		tb.Fatalf("testkit: effects of %s: %v", id, err)
	}
	out := map[string]int{}
	var what string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&what, &n}, func() error { out[what] = n; return nil }); err != nil {
		tb.Fatalf("testkit: effects of %s: %v", id, err)
	}
	return out
}

// List is saga id's effects in insert order.
func (f *Effects) List(tb testing.TB, id uuid.UUID) []string {
	tb.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT what FROM `+f.table+` WHERE saga_id = $1 ORDER BY seq`, id)
	if err != nil {
		tb.Fatalf("testkit: effects of %s: %v", id, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		tb.Fatalf("testkit: effects of %s: %v", id, err)
	}
	return out
}
