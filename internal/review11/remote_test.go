package review11_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// A remote branch's branch command is its reply timeout. Lost, it is sent
// again "due when it was due" and "counts no attempt": not at once (the
// participant still has time), not a full Timeout later; once that time
// passes, the group fails and compensates, once.
func TestLostRemoteBranchTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	const timeout = time.Hour
	def := saga.Define("remote",
		saga.Step[order]{Name: "pre",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "pre") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "undo:pre") }},
		saga.Step[order]{Name: "fan", Parallel: &saga.Parallel[order]{Branches: append(branchesOf("fan", e.fx, newBehave(), nil, "a"),
			saga.Branch[order]{Name: "r", Timeout: timeout,
				Remote: &saga.RemoteBranch[order]{Topic: "review11.participant", Type: "do",
					Command: func(context.Context, *saga.StepRun, order) (any, error) { return map[string]string{"x": "y"}, nil }},
				Compensate: func(ctx context.Context, run *saga.StepRun, _ order, res json.RawMessage) error {
					return e.fx.Record(ctx, run, "undo:fan.r")
				}})}},
	)
	cfg := e.cfg()
	cfg.Kafka = &saga.KafkaConfig{NewReader: testkit.NewSilentReader}
	e.lose(t, "%/fan.r/%", "sagaflow.branch", "delete", 0, 1)
	g, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	st, err := saga.Start(ctx, g, def, order{ID: "o"}, nil)
	require.NoError(t, err)
	waitFor(t, "fan.a", func() bool { return e.fx.Count(t, st.ID, "fan.a") == 1 })
	require.Equal(t, 1, e.dropped(t, "%/fan.r/%"), "the remote branch's timeout command was lost\n%s", e.dump(t, st.ID))
	var started time.Time
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT started_at FROM `+e.Table("saga_branches")+` WHERE saga_id = $1 AND branch = 'r'`, st.ID).Scan(&started))

	require.NoError(t, e.clk.Advance(ctx, 2*slack))
	started = started.Add(-2 * slack)
	res := rescue(t, g)
	require.Equal(t, 1, res.Redriven, "%+v\n%s", res, e.dump(t, st.ID))
	var due time.Time
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT coalesce(paused_from, available_at) FROM `+e.Table("outbox")+`
		WHERE saga_id = $1 AND type = 'sagaflow.branch' AND step_key LIKE '%/fan.r/%' AND status = 'pending'`, st.ID).Scan(&due))
	require.WithinDuration(t, started.Add(timeout), due, 5*time.Second, "due when it was due: the group's start plus the branch's Timeout")
	require.Equal(t, 0, branch(t, g, st.ID, "fan", "r", 0).Attempts, "a timeout counts no attempt")
	in, err := g.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status)

	require.NoError(t, e.clk.Advance(ctx, timeout))
	in = testkit.WaitEnded(t, g, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, e.dump(t, st.ID))
	require.Equal(t, map[string]int{"pre": 1, "fan.a": 1, "undo:fan.a": 1, "undo:fan.r": 1, "undo:pre": 1}, e.fx.Counts(t, st.ID))
}
