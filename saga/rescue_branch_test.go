package saga_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// parkBranchOnce makes the first command of branch step (as "<step>.<branch>")
// that is written for saga id arrive parked as dead, as a command for a
// version no engine knows is parked during a rolling deploy. Its later
// copies are written as they are.
func (b *bundle) parkBranchOnce(t *testing.T, id uuid.UUID, step string) {
	t.Helper()
	ctx := context.Background()
	s := pgx.Identifier{b.schema}.Sanitize()
	fn := pgx.Identifier{b.schema, "park_" + step[len(step)-2:]}.Sanitize()
	_, err := b.pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.type = 'sagaflow.branch' AND NEW.saga_id = '`+id.String()+`' AND NEW.step_key LIKE '%/`+step+`/%'
				AND NOT EXISTS (SELECT 1 FROM `+s+`.outbox WHERE step_key = NEW.step_key AND status = 'dead') THEN
				NEW.status := 'dead';
				NEW.last_error := 'parked by the test';
			END IF;
			RETURN NEW;
		END $$`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `CREATE TRIGGER park_`+step[len(step)-2:]+` BEFORE INSERT ON `+s+`.outbox FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)
}

// branchesOf returns saga id's branches by name.
func branchesOf(t *testing.T, e *saga.Engine, id uuid.UUID) map[string]saga.BranchInfo {
	t.Helper()
	rows, err := e.Branches(context.Background(), id)
	require.NoError(t, err)
	out := make(map[string]saga.BranchInfo, len(rows))
	for _, r := range rows {
		out[r.Branch] = r
	}
	return out
}

// gatedFan is a saga of one parallel step "fan" with branches b1 and b2,
// each recording its effect and, compensated, a compensation effect; then a
// step "after". b2 of a saga in blocked waits for release before it runs.
type gatedFan struct {
	b       *bundle
	mu      sync.Mutex
	blocked map[uuid.UUID]bool
	started chan uuid.UUID
	release chan struct{}
}

func newGatedFan(b *bundle) *gatedFan {
	return &gatedFan{b: b, blocked: map[uuid.UUID]bool{}, started: make(chan uuid.UUID, 4), release: make(chan struct{})}
}

func (g *gatedFan) define(name string, b2 *saga.RetryPolicy) *saga.Definition[order] {
	branch := func(name string, retry *saga.RetryPolicy) saga.Branch[order] {
		return saga.Branch[order]{Name: name, Retry: retry,
			Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
				g.mu.Lock()
				blocked := g.blocked[run.SagaID] && name == "b2"
				g.mu.Unlock()
				if blocked {
					g.started <- run.SagaID
					select {
					case <-g.release:
					case <-ctx.Done():
						return nil, ctx.Err()
					}
				}
				return name, recordEffect(ctx, run, g.b.schema)
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ order, _ json.RawMessage) error {
				_, err := run.Tx.Exec(ctx, "INSERT INTO "+g.b.table("effects")+" (saga_id, step, direction) VALUES ($1, $2, 'compensate')",
					run.SagaID, "fan."+name)
				return err
			},
		}
	}
	return saga.Define(name,
		saga.Step[order]{Name: "fan", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{branch("b1", nil), branch("b2", b2)}}},
		saga.Step[order]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return recordEffect(ctx, run, g.b.schema)
		}},
	)
}

// A parallel step's saga waits without a deadline, and a branch has none
// of its own. When a branch's command is lost (parked as dead here, as
// during a rolling deploy), the rescuer sends it again under the same key
// once the saga has not moved for RescueSlack, counting the lost attempt;
// a branch that is running right now (its command pending and locked) is
// left alone (found by review10, F1).
func TestRescuerResendsALostBranchCommand(t *testing.T) {
	t.Parallel()
	const slack = 300 * time.Millisecond
	b := setup(t, &saga.Config{RescueSlack: slack})
	g := newGatedFan(b)
	def := g.define("lostbranch", fastRetry)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	lost, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	running, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	g.mu.Lock()
	g.blocked[running.ID] = true
	g.mu.Unlock()
	b.parkBranchOnce(t, lost.ID, "fan.b2")
	b.start(t)
	var once sync.Once
	releaseRunning := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(releaseRunning) // before the engine stops, if the test fails first

	require.Equal(t, running.ID, <-g.started, "the running saga's b2 runs and waits")
	waitFor(t, 10*time.Second, func() bool {
		return branchesOf(t, b.engine, lost.ID)["b1"].Status == "completed" &&
			b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND status = 'dead'", lost.ID) == 1
	}, "b1 to complete and b2's command to be parked")

	// Before RescueSlack has passed since the saga last moved, nothing is
	// sent. (Under load the wait above can take longer than that: the
	// check is made only while it can hold.)
	var idle time.Duration
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT now() - updated_at FROM "+b.table("saga_instances")+" WHERE id = $1", lost.ID).Scan(&idle))
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	first := res.Redriven
	if idle < slack/2 {
		require.Zero(t, first, "the group has not waited RescueSlack yet (idle %s)", idle)
	} else {
		// Idle past RescueSlack already (a loaded machine): this rescue may
		// send it, and the next must not send it again.
		t.Logf("the saga was idle %s before the first rescue: the not-yet check is skipped", idle)
	}
	time.Sleep(slack + 100*time.Millisecond)
	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, first+res.Redriven, "only the lost branch is sent again, once, not the one running: %d, then %+v", first, res)

	in := b.waitTerminal(t, lost.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.ElementsMatch(t, []string{"fan.b1/forward", "fan.b2/forward", "after/forward"}, b.effects(t, lost.ID))
	br := branchesOf(t, b.engine, lost.ID)["b2"]
	require.Equal(t, "completed", br.Status)
	require.Equal(t, 2, br.Attempts, "the lost attempt is counted")
	require.Contains(t, eventTypes(in), "saga_rescued:fan.b2")

	res, err = b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Redriven, "nothing is lost any more")
	releaseRunning()
	in = b.waitTerminal(t, running.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.ElementsMatch(t, []string{"fan.b1/forward", "fan.b2/forward", "after/forward"}, b.effects(t, running.ID))
	require.NotContains(t, eventTypes(in), "saga_rescued:fan.b2", "the running branch was not rescued")
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND status = 'dead'", running.ID))
}

// A lost branch command whose branch has no attempt left fails the group
// as its last failed attempt would: the completed branch is compensated,
// and the saga ends compensated, with the branch failed for good.
func TestRescuerFailsAGroupWhenALostBranchHasNoAttemptLeft(t *testing.T) {
	t.Parallel()
	const slack = 200 * time.Millisecond
	b := setup(t, &saga.Config{RescueSlack: slack})
	g := newGatedFan(b)
	def := g.define("lostlast", &saga.RetryPolicy{MaxAttempts: 1})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.parkBranchOnce(t, st.ID, "fan.b2")
	b.start(t)
	waitFor(t, 10*time.Second, func() bool { return branchesOf(t, b.engine, st.ID)["b1"].Status == "completed" },
		"b1 to complete")
	time.Sleep(slack + 100*time.Millisecond)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{FailedOver: 1}, res)

	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.ElementsMatch(t, []string{"fan.b1/forward", "fan.b1/compensate"}, b.effects(t, st.ID))
	br := branchesOf(t, b.engine, st.ID)["b2"]
	require.Equal(t, "failed", br.Status)
	require.NotNil(t, br.LastError)
	require.Equal(t, saga.CodeRescueExhausted, br.LastError.Code)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND type = 'sagaflow.branch' AND status = 'pending'", st.ID))
}

// A remote branch's command to its participant is followed by a branch
// command that is its timeout. When that one is lost and no reply comes,
// the rescuer sends it again due when the timeout would have fired, not
// later and not sooner: the branch then fails with reply_timeout and the
// group compensates, as if nothing had been lost.
func TestRescuerResendsALostRemoteBranchTimeout(t *testing.T) {
	t.Parallel()
	const slack = 200 * time.Millisecond
	const timeout = 5 * time.Second
	k := setupKafkaWith(t, 1, &saga.Config{RescueSlack: slack, Kafka: &saga.KafkaConfig{}},
		"payments.commands", saga.CommandTopicDefault+".losttimer.replies")
	b := k.bundle
	def := saga.Define("losttimer",
		saga.Step[order]{Name: "fan", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{
			{Name: "b1", Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
				return nil, recordEffect(ctx, run, b.schema)
			}, Compensate: func(ctx context.Context, run *saga.StepRun, _ order, _ json.RawMessage) error {
				_, err := run.Tx.Exec(ctx, "INSERT INTO "+b.table("effects")+" (saga_id, step, direction) VALUES ($1, 'fan.b1', 'compensate')", run.SagaID)
				return err
			}},
			{Name: "pay", Timeout: timeout, Remote: &saga.RemoteBranch[order]{Topic: "payments.commands", Type: "payments.authorize",
				Command: func(context.Context, *saga.StepRun, order) (any, error) { return map[string]int{"cents": 100}, nil }}},
		}}},
	)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	b.parkBranchOnce(t, st.ID, "fan.pay")
	b.start(t)
	waitFor(t, 10*time.Second, func() bool {
		return branchesOf(t, b.engine, st.ID)["b1"].Status == "completed" &&
			b.count(t, "SELECT count(*) FROM "+b.table("outbox")+" WHERE saga_id = $1 AND status = 'dead'", st.ID) == 1
	}, "b1 to complete and the timeout to be parked")
	started := branchesOf(t, b.engine, st.ID)["pay"].StartedAt
	time.Sleep(slack + 100*time.Millisecond)
	res, err := b.engine.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, saga.RescueResult{Redriven: 1}, res)
	var due time.Time
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT available_at FROM "+b.table("outbox")+
		" WHERE saga_id = $1 AND type = 'sagaflow.branch' AND status = 'pending'", st.ID).Scan(&due))
	require.WithinDuration(t, started.Add(timeout), due, 250*time.Millisecond,
		"the timeout is due when it was due before it was lost")
	if time.Since(started) < timeout-time.Second {
		require.Equal(t, "running", branchesOf(t, b.engine, st.ID)["pay"].Status, "no reply yet, and the timeout not yet due")
	}

	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.ElementsMatch(t, []string{"fan.b1/forward", "fan.b1/compensate"}, b.effects(t, st.ID))
	pay := branchesOf(t, b.engine, st.ID)["pay"]
	require.Equal(t, "failed", pay.Status)
	require.NotNil(t, pay.LastError)
	require.Equal(t, saga.CodeReplyTimeout, pay.LastError.Code)
	require.Zero(t, pay.Attempts-1, "a lost timer is not an attempt")
}
