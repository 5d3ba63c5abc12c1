// Package review10_test is a black-box review, written from the
// documentation only, of the rescue deadline kept in two columns
// (migration 013_deadline_room, CHANGELOG [Unreleased] "Changed", first
// bullet; docs/architecture.md "Time" and "The scheduler and the rescuer";
// saga/doc.go guarantee 9). See FINDINGS.md.
package review10_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// margin absorbs the real time that passes between reading the database's
// clock and the rescuer's own statements (milliseconds), in the checks of
// "never before the deadline" and "at once after it".
const margin = 300 * time.Millisecond

type env struct {
	*testkit.DB
	fx  *testkit.Effects
	clk *sagatest.Clock // no engines: the tests call RescueNow themselves
}

func newEnv(t *testing.T) *env {
	t.Helper()
	d := testkit.NewDB(t)
	e := &env{DB: d, fx: testkit.NewEffects(t, d), clk: sagatest.NewClock(d.Pool, d.Schema)}
	e.installLoss(t)
	return e
}

// cfg is an engine config whose own rescuer never runs during a test (the
// tests run it with RescueNow and count what it did).
func (e *env) cfg(slack time.Duration) *saga.Config {
	c := e.Config()
	c.RescueSlack = slack
	c.RescueInterval = time.Hour
	return c
}

// installLoss creates the table "lose" and a trigger that deletes, right
// after its insert, an outbox row of a saga whose step_key is LIKE a
// pattern of the table (or whose type is the pattern's after "type:") (after skipping "skip" matches, at most "drop" rows): a command
// lost at a chosen step, as an operator's DELETE or a bug would lose it.
func (e *env) installLoss(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	lose, out := e.Table("lose"), e.Table("outbox")
	fn := e.Table("lose_command")
	_, err := e.Pool.Exec(ctx, `CREATE TABLE `+lose+` (pattern text PRIMARY KEY, skip int NOT NULL DEFAULT 0, drop int NOT NULL DEFAULT 1, dropped int NOT NULL DEFAULT 0)`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE p text;
BEGIN
    SELECT l.pattern INTO p FROM `+lose+` l WHERE NEW.step_key LIKE l.pattern OR 'type:' || NEW.type = l.pattern FOR UPDATE;
    IF NOT FOUND THEN RETURN NULL; END IF;
    UPDATE `+lose+` SET skip = skip - 1 WHERE pattern = p AND skip > 0;
    IF FOUND THEN RETURN NULL; END IF;
    UPDATE `+lose+` SET drop = drop - 1, dropped = dropped + 1 WHERE pattern = p AND drop > 0;
    IF FOUND THEN DELETE FROM `+out+` WHERE id = NEW.id; END IF;
    RETURN NULL;
END $$`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `CREATE TRIGGER review10_lose AFTER INSERT ON `+out+` FOR EACH ROW WHEN (NEW.saga_id IS NOT NULL) EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)
}

// loseNext makes the trigger delete the next drop commands whose step key
// is LIKE pattern, after skipping skip of them.
func (e *env) loseNext(t *testing.T, pattern string, skip, drop int) {
	t.Helper()
	_, err := e.Pool.Exec(context.Background(), `INSERT INTO `+e.Table("lose")+` (pattern, skip, drop) VALUES ($1, $2, $3)`, pattern, skip, drop)
	require.NoError(t, err)
}

func (e *env) dropped(t *testing.T, pattern string) int {
	t.Helper()
	return e.Count(t, `SELECT coalesce(max(dropped), 0) FROM `+e.Table("lose")+` WHERE pattern = $1`, pattern)
}

// deleteCommands deletes every pending outbox row of saga id (its command
// is lost) and returns how many there were.
func (e *env) deleteCommands(t *testing.T, id uuid.UUID) int {
	t.Helper()
	tag, err := e.Pool.Exec(context.Background(), `DELETE FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND status = 'pending'`, id)
	require.NoError(t, err)
	return int(tag.RowsAffected())
}

func (e *env) pendingCommands(t *testing.T, id uuid.UUID) int {
	t.Helper()
	return e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND status = 'pending'`, id)
}

// row is what the saga row says about its deadline, read with the
// database's clock.
type row struct {
	check, due, deadline *time.Time
	now                  time.Time
	status, step         string
	attempt              int
	version              int64
	waitKind             *string
}

func (r row) String() string {
	f := func(p *time.Time) string {
		if p == nil {
			return "NULL"
		}
		return fmt.Sprintf("now%+.3fs", p.Sub(r.now).Seconds())
	}
	return fmt.Sprintf("{status=%s step=%s attempt=%d next_check_at=%s due_at=%s deadline=%s}", r.status, r.step, r.attempt, f(r.check), f(r.due), f(r.deadline))
}

// remaining is deadline - now; ok is false when the saga has no deadline.
func (r row) remaining() (time.Duration, bool) {
	if r.deadline == nil {
		return 0, false
	}
	return r.deadline.Sub(r.now), true
}

func (e *env) read(t *testing.T, id uuid.UUID) row {
	t.Helper()
	var r row
	err := e.Pool.QueryRow(context.Background(), `SELECT next_check_at, due_at, greatest(next_check_at, due_at), clock_timestamp(),
		status, step_name, attempt, version, wait_kind FROM `+e.Table("saga_instances")+` WHERE id = $1`, id).
		Scan(&r.check, &r.due, &r.deadline, &r.now, &r.status, &r.step, &r.attempt, &r.version, &r.waitKind)
	require.NoError(t, err)
	return r
}

// events counts saga id's history entries of event (at step, when step is
// not "").
func (e *env) events(t *testing.T, id uuid.UUID, event, step string) int {
	t.Helper()
	return e.Count(t, `SELECT count(*) FROM `+e.Table("saga_history")+` WHERE saga_id = $1 AND event = $2 AND ($3 = '' OR step_name = $3)`, id, event, step)
}

// eventAt is the time of saga id's last history entry of event.
func (e *env) eventAt(t *testing.T, id uuid.UUID, event string) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, e.Pool.QueryRow(context.Background(), `SELECT at FROM `+e.Table("saga_history")+` WHERE saga_id = $1 AND event = $2 ORDER BY id DESC LIMIT 1`, id, event).Scan(&at))
	return at
}

// requireTruth checks that Instance.NextCheckAt reports the deadline
// greatest(next_check_at, due_at) ("Instance.NextCheckAt reports that
// deadline").
func (e *env) requireTruth(t *testing.T, g *saga.Engine, id uuid.UUID, r row) {
	t.Helper()
	in, err := g.Get(context.Background(), id)
	require.NoError(t, err)
	if r.deadline == nil {
		require.Nil(t, in.NextCheckAt, "Instance.NextCheckAt of a saga without a deadline; row %s", r)
		return
	}
	require.NotNil(t, in.NextCheckAt, "Instance.NextCheckAt is nil, the row has a deadline: %s", r)
	require.WithinDuration(t, *r.deadline, *in.NextCheckAt, time.Millisecond,
		"Instance.NextCheckAt must report greatest(next_check_at, due_at); row %s", r)
}

// rescued is how many sagas a rescue touched (re-driven or failed over).
func rescued(res saga.RescueResult) int { return res.Redriven + res.FailedOver }

// stepToRescue advances the schema's clock by step at a time and runs the
// rescuer of g after each move, until it rescues saga id (the only saga of
// the schema whose command is lost). Before each run it reads the saga's
// deadline: the rescuer must leave the saga alone while the deadline is
// more than margin away, and must rescue it in the run that follows a read
// showing the deadline passed by more than margin ("rescues only sagas
// past greatest(next_check_at, due_at)"). It also checks that
// Instance.NextCheckAt tells the truth, and that a recheck never moves the
// deadline. It returns how much time it advanced and the last row read
// before the rescue.
func (e *env) stepToRescue(t *testing.T, g *saga.Engine, id uuid.UUID, step, limit time.Duration) (time.Duration, row) {
	t.Helper()
	ctx := context.Background()
	var advanced time.Duration
	for {
		before := e.read(t, id)
		e.requireTruth(t, g, id, before)
		left, has := before.remaining()
		res, err := g.RescueNow(ctx)
		require.NoError(t, err)
		after := e.read(t, id)
		if res.Rechecked > 0 && before.deadline != nil && after.deadline != nil && rescued(res) == 0 && res.Waiting == 0 {
			require.WithinDuration(t, *before.deadline, *after.deadline, time.Millisecond,
				"a recheck moved the deadline: before %s, after %s", before, after)
		}
		if rescued(res) > 0 {
			require.True(t, has, "rescued a saga that had no deadline: %s (%+v)", before, res)
			require.LessOrEqual(t, left, margin, "rescued %s before its deadline: %s (%+v)", left, before, res)
			return advanced, before
		}
		if has && left < -margin {
			t.Fatalf("deadline passed %s ago, yet the rescuer left the lost saga alone: %s (%+v, after %s)", -left, before, res, after)
		}
		if advanced >= limit {
			t.Fatalf("not rescued after advancing %s: %s (%+v)", advanced, before, res)
		}
		require.NoError(t, e.clk.Advance(ctx, step))
		advanced += step
	}
}

// waitFor polls cond (see testkit.WaitFor).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, 20*time.Second, what, cond)
}
