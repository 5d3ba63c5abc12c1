package saga_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestScheduleRefusesSpecsCronCannotKeep(t *testing.T) {
	t.Parallel()
	e, err := saga.New(dummyPool(t), nil)
	require.NoError(t, err)
	def := saga.Define("every", saga.Step[order]{Name: "a", Action: noop})
	require.NoError(t, e.Register(def))
	for _, tc := range []struct{ spec, want string }{
		{"@every 0s", "the interval must be at least 1s"},
		{"@every -5s", "the interval must be at least 1s"},
		{"@every 500ms", "the interval must be at least 1s"},
		{"@every 1500ms", "the interval must be whole seconds"},
		{"@every soon", `time: invalid duration "soon"`},
		{"TZ=UTC", "a time zone must be followed by a spec"},
		{"", "empty spec"},
	} {
		err := saga.Schedule(e, tc.spec, def, order{}, &saga.ScheduleOpts{Name: tc.spec})
		require.ErrorContains(t, err, `saga: schedule "`+tc.spec+`": `+tc.want, tc.spec)
	}
	for _, spec := range []string{"@every 1s", "@every 1m30s", "*/5 * * * *", "TZ=Europe/Paris 0 3 * * *"} {
		require.NoError(t, saga.Schedule(e, spec, def, order{}, &saga.ScheduleOpts{Name: spec}), spec)
	}
}

func TestNegativeRetryLimitsAreRefused(t *testing.T) {
	t.Parallel()
	e, err := saga.New(dummyPool(t), nil)
	require.NoError(t, err)
	for _, tc := range []struct {
		step saga.Step[order]
		want string
	}{
		{saga.Step[order]{Name: "a", Action: noop, Retry: &saga.RetryPolicy{MaxAttempts: -1}},
			`saga "retries" step "a": Retry.MaxAttempts is -1`},
		{saga.Step[order]{Name: "a", Action: noop, Compensate: noop, CompensateRetry: &saga.RetryPolicy{MaxAttempts: -3}},
			`saga "retries" step "a": CompensateRetry.MaxAttempts is -3`},
	} {
		err := e.Register(saga.Define("retries", tc.step))
		require.ErrorIs(t, err, saga.ErrInvalidDefinition)
		require.ErrorContains(t, err, tc.want)
	}
}

func TestListRefusesUnknownStatuses(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "filtered", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	_, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)

	const valid = "running, compensating, completed, compensated, failed"
	_, err = b.engine.List(ctx, &saga.ListOpts{Statuses: []saga.Status{saga.StatusRunning, "runing"}})
	require.ErrorContains(t, err, `saga: list: unknown status "runing" (want one of `+valid+`)`)
	_, err = b.engine.ReplayBulk(ctx, saga.BulkReplayOpts{Statuses: []saga.Status{"FAILED"}, DryRun: true})
	require.ErrorContains(t, err, `saga: bulk replay: unknown status "FAILED" (want one of `+valid+`)`)

	res, err := b.engine.List(ctx, &saga.ListOpts{Statuses: []saga.Status{saga.StatusRunning}})
	require.NoError(t, err)
	require.Len(t, res.Sagas, 1)
	require.True(t, saga.StatusFailed.Valid())
	require.False(t, saga.Status("").Valid())
}
