// Package review11_test is a black-box review, written from the
// documentation only, of the rescuer's sweeps for sagas without a deadline
// (CHANGELOG [Unreleased], "Fixed": lost wake-ups and lost branch commands;
// migration 014_branch_rescue; saga/doc.go guarantee 9; docs/architecture.md
// "The scheduler and the rescuer"). See FINDINGS.md.
package review11_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// TestMain runs four tests at once unless -parallel says otherwise: the
// tests mostly wait on PostgreSQL and the engines' polls, not on the CPU, and
// with the default (GOMAXPROCS, 2 on CI) the package took about 50 s.
func TestMain(m *testing.M) { pgtest.MainParallel(m, 4) }

// slack is the RescueSlack of every engine here. Time passes with
// sagatest.Clock (or by moving updated_at by hand), never by sleeping.
const slack = time.Minute

// wait bounds every poll of a test.
const wait = 20 * time.Second

type env struct {
	*testkit.DB
	fx  *testkit.Effects
	clk *sagatest.Clock // no engines: tests call RescueNow themselves
}

func newEnv(t *testing.T) *env {
	t.Helper()
	return envOn(t, testkit.NewDB(t))
}

func envOn(t *testing.T, d *testkit.DB) *env {
	t.Helper()
	e := &env{DB: d, fx: testkit.NewEffects(t, d), clk: sagatest.NewClock(d.Pool, d.Schema)}
	e.installLoss(t)
	return e
}

// cfg is an engine config whose own rescuer never runs during a test: the
// tests run it with RescueNow and count what it did.
func (e *env) cfg() *saga.Config {
	c := e.Config()
	c.RescueSlack = slack
	c.RescueInterval = time.Hour
	c.Workers = 2
	return c
}

// installLoss creates the table "lose" and a trigger that loses, right
// after its insert, an outbox row of a saga whose "<step_key>|<type>" is LIKE a pattern
// of the table (after skipping "skip" matches, at most "drop" rows): mode
// 'delete' deletes it, mode 'dead' parks it as dead, as an operator's DELETE,
// a bug, or an engine that did not know the saga for UnknownSagaGrace would.
func (e *env) installLoss(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	lose, out := e.Table("lose"), e.Table("outbox")
	fn := e.Table("lose_command")
	_, err := e.Pool.Exec(ctx, `CREATE TABLE `+lose+` (pattern text PRIMARY KEY, typ text NOT NULL DEFAULT '%',
		mode text NOT NULL DEFAULT 'delete', skip int NOT NULL DEFAULT 0, drop int NOT NULL DEFAULT 1, dropped int NOT NULL DEFAULT 0)`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE p text; m text;
BEGIN
    SELECT l.pattern, l.mode INTO p, m FROM `+lose+` l WHERE coalesce(NEW.step_key, '') || '|' || NEW.type LIKE l.pattern AND NEW.type LIKE l.typ FOR UPDATE;
    IF NOT FOUND THEN RETURN NULL; END IF;
    UPDATE `+lose+` SET skip = skip - 1 WHERE pattern = p AND skip > 0;
    IF FOUND THEN RETURN NULL; END IF;
    UPDATE `+lose+` SET drop = drop - 1, dropped = dropped + 1 WHERE pattern = p AND drop > 0;
    IF FOUND THEN
        IF m = 'dead' THEN
            UPDATE `+out+` SET status = 'dead', last_error = 'review11: parked by the test' WHERE id = NEW.id;
        ELSE
            DELETE FROM `+out+` WHERE id = NEW.id;
        END IF;
    END IF;
    RETURN NULL;
END $$`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `CREATE TRIGGER review11_lose AFTER INSERT ON `+out+` FOR EACH ROW WHEN (NEW.saga_id IS NOT NULL) EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)
}

// lose makes the trigger lose the next drop outbox rows of type LIKE typ
// whose step key is LIKE pattern, after skipping skip of them.
func (e *env) lose(t *testing.T, pattern, typ, mode string, skip, drop int) {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `INSERT INTO `+e.Table("lose")+` (pattern, typ, mode, skip, drop) VALUES ($1, $2, $3, $4, $5)`,
		pattern, typ, mode, skip, drop)
	require.NoError(t, err)
}

// loseBranch loses the next command of branch "<step>.<branch>" (of any
// saga and epoch) after skipping skip of them.
func (e *env) loseBranch(t *testing.T, stepBranch string, skip int) {
	t.Helper()
	e.lose(t, "%/"+stepBranch+"/%", "sagaflow.branch", "delete", skip, 1)
}

func (e *env) dropped(t *testing.T, pattern string) int {
	t.Helper()
	return e.Count(t, `SELECT coalesce(max(dropped), 0) FROM `+e.Table("lose")+` WHERE pattern = $1`, pattern)
}

// branchCommands counts saga id's outbox rows of type sagaflow.branch for
// "<step>.<branch>" in status st ("" for any).
func (e *env) branchCommands(t *testing.T, id uuid.UUID, stepBranch, st string) int {
	t.Helper()
	return e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND type = 'sagaflow.branch'
		AND step_key LIKE '%/' || $2 || '/%' AND ($3 = '' OR status = $3)`, id, stepBranch, st)
}

// age makes saga id look as if d had passed since it last moved: its
// updated_at, and its branch rows' started_at and ended_at, go back by d.
// It takes the saga's row with SKIP LOCKED, so it never waits for (or
// deadlocks with) a batch, and tries again until it could. It reports
// true, for require.True at call sites. (sagatest.Clock moves the outbox
// too, which waits for a running handler's claimed row.)
func (e *env) age(t *testing.T, id uuid.UUID, d time.Duration) bool {
	t.Helper()
	waitFor(t, "the saga row of "+id.String()+" free to age", func() bool {
		var n int64
		err := pgxBeginFunc(e.Pool, func(tx pgx.Tx) error {
			tag, err := tx.Exec(context.Background(), `UPDATE `+e.Table("saga_instances")+` SET updated_at = updated_at - $2::interval
				WHERE id = (SELECT id FROM `+e.Table("saga_instances")+` WHERE id = $1 FOR UPDATE SKIP LOCKED)`, id, d.String())
			if err != nil || tag.RowsAffected() == 0 {
				return err
			}
			n = tag.RowsAffected()
			_, err = tx.Exec(context.Background(), `UPDATE `+e.Table("saga_branches")+` SET started_at = started_at - $2::interval,
				ended_at = ended_at - $2::interval WHERE saga_id = $1`, id, d.String())
			return err
		})
		require.NoError(t, err)
		return n == 1
	})
	return true
}

func pgxBeginFunc(pool *pgxpool.Pool, f func(pgx.Tx) error) error {
	return pgx.BeginFunc(context.Background(), pool, f)
}

// events counts saga id's history entries of event (at step, when step is
// not "").
func (e *env) events(t *testing.T, id uuid.UUID, event, step string) int {
	t.Helper()
	return e.Count(t, `SELECT count(*) FROM `+e.Table("saga_history")+` WHERE saga_id = $1 AND event = $2 AND ($3 = '' OR step_name = $3)`, id, event, step)
}

// branch is saga id's branch "<step>.<branch>" of epoch ep, as
// Engine.Branches reads it.
func branch(t *testing.T, g *saga.Engine, id uuid.UUID, step, name string, ep int) saga.BranchInfo {
	t.Helper()
	bs, err := g.Branches(context.Background(), id)
	require.NoError(t, err)
	for _, b := range bs {
		if b.Step == step && b.Branch == name && b.Epoch == ep {
			return b
		}
	}
	t.Fatalf("saga %s has no branch %s.%s of epoch %d: %+v", id, step, name, ep, bs)
	return saga.BranchInfo{}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, wait, what, cond)
}

// rescue runs g's rescuer once.
func rescue(t *testing.T, g *saga.Engine) saga.RescueResult {
	t.Helper()
	res, err := g.RescueNow(context.Background())
	require.NoError(t, err)
	return res
}

// timeline is saga id's history as sagatest writes it.
func timeline(t *testing.T, g *saga.Engine, id uuid.UUID) []string {
	t.Helper()
	in, err := g.Get(context.Background(), id)
	require.NoError(t, err)
	return sagatest.Timeline(in)
}

// dump is every outbox row and branch row of saga id, for failure messages.
func (e *env) dump(t *testing.T, id uuid.UUID) string {
	t.Helper()
	var b strings.Builder
	rows, err := e.Pool.Query(context.Background(), `SELECT type, aggregatetype, coalesce(step_key, ''), status, available_at::text, coalesce(paused_from::text, '') FROM `+e.Table("outbox")+` WHERE saga_id = $1 ORDER BY created_at`, id)
	require.NoError(t, err)
	for rows.Next() {
		var typ, agg, key, st, at, pf string
		require.NoError(t, rows.Scan(&typ, &agg, &key, &st, &at, &pf))
		fmt.Fprintf(&b, "outbox %s %s %s %s at=%s paused_from=%s\n", typ, agg, key, st, at, pf)
	}
	rows.Close()
	rows, err = e.Pool.Query(context.Background(), `SELECT epoch, step, branch, status, attempt, coalesce(error_code, '') FROM `+e.Table("saga_branches")+` WHERE saga_id = $1 ORDER BY epoch, step, branch`, id)
	require.NoError(t, err)
	for rows.Next() {
		var ep, att int
		var step, br, st, code string
		require.NoError(t, rows.Scan(&ep, &step, &br, &st, &att, &code))
		fmt.Fprintf(&b, "branch %d %s.%s %s attempt=%d code=%s\n", ep, step, br, st, att, code)
	}
	rows.Close()
	return b.String()
}

// tenants makes two schemas whose names differ only in case
// ("rv11_<hex>" and "RV11_<hex>"), migrates both on one pool, and drops
// them when the test ends.
func tenants(t *testing.T) (*testkit.DB, *testkit.DB) {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ConnString(t))
	require.NoError(t, err)
	suffix := strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	lower, upper := "rv11_"+suffix, "RV11_"+suffix
	for _, s := range []string{lower, upper} {
		_, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{s}.Sanitize())
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		pool.Close()
		conn, err := pgx.Connect(context.Background(), pgtest.ConnString(t))
		if err != nil {
			t.Errorf("drop tenants: %v", err)
			return
		}
		defer conn.Close(context.Background())
		for _, s := range []string{lower, upper} {
			if _, err := conn.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{s}.Sanitize()+` CASCADE`); err != nil {
				t.Errorf("drop %s: %v", s, err)
			}
		}
	})
	return testkit.Migrate(t, pool, lower), testkit.Migrate(t, pool, upper)
}
